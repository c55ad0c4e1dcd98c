"""plan_fidelity's runs under several hardware models: the same recipes planned and
priced under each (calibrated profiles of one machine, presets), then measured together.

A variant of ours is a bare recipe (planned on the first hardware model) or
``recipe@label`` (on the model of that label). ``across_hardware`` says how far apart the
models' predictions of each recipe lie, and how the free plan each model chose measured
against the fastest plan of the run; ``calibrate_profiles`` makes the profiles of this
machine that ``--calibrate K`` compares.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

AT = "@"
"""Joins a recipe and the label of the hardware model it was planned and priced on, for
the models after the first (``free@profile-2``); the first model's variants are the bare
recipes."""


def hardware_labels(hardware: list[str]) -> dict[str, str]:
    """A short unique label per hardware model: a profile's file stem, a preset's name."""
    labels: dict[str, str] = {}
    for index, item in enumerate(hardware):
        label = Path(item).stem if item.endswith(".json") else item
        labels[item] = label if label not in labels.values() else f"{label}-{index + 1}"
    return labels


def variant_hardware(variant: str, settings: dict) -> str:
    """The hardware model a variant of ours is planned and priced on."""
    if AT not in variant:
        return settings["hardware"][0]
    label = variant.split(AT, 1)[1]
    return next(h for h, name in hardware_labels(settings["hardware"]).items() if name == label)


AGREE = 0.10
"""Hardware models of one machine agree when each recipe's predictions lie within this share."""
AS_FAST = 0.05
"""A free plan is as fast as the run's fastest plan when within this share of it."""


def across_hardware(results: dict, labels: list[str], recipes: Sequence[str]) -> dict:
    """How far apart the hardware models' predictions of each recipe lie ((max - min) / min
    over the models), and how the free plan each model chose measured against the fastest
    plan of ours in the run (any model's, any recipe's) and torch's DDP. ``labels``: the
    models in order, the first one's variants being the bare recipes; ``recipes``: the
    recipe names to compare."""

    def name(recipe: str, label: str) -> str:
        return recipe if label == labels[0] else f"{recipe}{AT}{label}"

    def ok(variant: str) -> bool:
        return results.get(variant, {}).get("status") == "ok"

    spread = {}
    for recipe in recipes:
        predicted = [
            results[name(recipe, label)]["predicted_ms"]
            for label in labels
            if ok(name(recipe, label))
        ]
        if len(predicted) >= 2:
            spread[recipe] = round(max(predicted) / min(predicted) - 1, 3)
    ours = {
        v: r["measured_ms"]
        for v, r in results.items()
        if r["status"] == "ok" and r.get("predicted_ms") is not None
    }
    summary: dict = {"prediction_spread": spread}
    if spread:
        summary["max_prediction_spread"] = max(spread.values())
        summary["models_agree"] = summary["max_prediction_spread"] <= AGREE
    if not ours:
        return summary
    fastest = min(ours, key=ours.__getitem__)
    free = {label: ours[name("free", label)] for label in labels if name("free", label) in ours}
    summary["fastest_plan"] = fastest
    summary["free_over_fastest"] = {
        label: round(ms / ours[fastest], 3) for label, ms in free.items()
    }
    summary["free_slower_than_fastest"] = [
        label for label, ratio in summary["free_over_fastest"].items() if ratio > 1 + AS_FAST
    ]
    if ok("torch-ddp"):
        ddp = results["torch-ddp"]["measured_ms"]
        summary["free_over_torch_ddp"] = {label: round(ms / ddp, 3) for label, ms in free.items()}
    return summary


def calibrate_profiles(
    count: int, nproc: int, pin_cores: bool, directory: Path | None
) -> list[str]:
    """``count`` profiles of this machine, one ``autoparallel calibrate`` after the other
    (``nproc`` ranks, as the measured runs): their paths."""
    directory = directory or Path(tempfile.mkdtemp(prefix="plan-fidelity-profiles-"))
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = directory / f"profile-{index + 1}.json"
        command = [sys.executable, "-m", "autoparallel.cli", "calibrate", "--nproc", str(nproc)]
        command += ["--out", str(path)] + (["--pin-cores"] if pin_cores else [])
        print(
            f"[plan_fidelity] calibration {index + 1} of {count}: {' '.join(command[1:])}",
            file=sys.stderr,
            flush=True,
        )
        subprocess.run(command, check=True, stdout=sys.stderr)
        paths.append(str(path))
    return paths


def across_figure(
    model: str, nproc: int, across: dict, count: int, pinned: str, where: str
) -> dict:
    """The record of one model and rank count planned under several hardware models."""
    spread = ", ".join(f"{r} {100 * v:.0f} %" for r, v in across["prediction_spread"].items())
    free = ", ".join(
        f"{label} {ratio}" for label, ratio in across.get("free_over_fastest", {}).items()
    )
    figure = f"prediction spread {spread}; free plan / fastest plan ({across.get('fastest_plan')}): {free}"
    return {
        "question": f"{model}-{nproc}r-{count}-hardware-models{pinned}",
        "what": f"how far apart {count} hardware models predict each recipe, and each one's "
        f"free plan measured against the fastest plan, {model}, {nproc} gloo ranks, {where}",
        "figure": figure,
        "unit": "",
        **across,
    }
