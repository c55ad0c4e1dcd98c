"""Predicted vs measured step time of our plans, pinned to the hand recipes and free.

    python -m benchmarks.plan_fidelity --hardware profile.json
        [--models mlp llama-tiny llama-small] [--nproc 2 4] [--steps 5] [--rounds 3]
        [--warmup 3] [--recipes free ddp fsdp tp free-twin recompute] [--no-torch]

``--pin-cores`` binds each rank to one core (``autoparallel.runtime.launch.pin_to_core``);
calibrate the profile with ``--pin-cores`` too.

``profile.json`` comes from ``autoparallel calibrate --nproc 2 --out profile.json`` on the same
machine (the default, the ``cpu`` preset, is not this machine). For every model and every
rank count, one set of gloo ranks plans the model under that hardware once per recipe (see
``benchmarks/workloads.py``: ``ddp``, ``fsdp``, ``tp`` pinned with node constraints on the
parameters, ``free`` the planner's choice, ``free-twin`` the free plan planned and built a
second time, ``recompute`` the free plan recomputing every layer) and builds torch's own DDP
and FSDP2 as a
yardstick; then it times them round-robin, ``--rounds`` rounds of ``--steps`` AdamW steps
each (after ``--warmup`` untimed ones), so a slow spell of this shared machine falls on all
of them, and takes each one's median step of the slowest rank
(:func:`autoparallel.measure_step`). Output: one JSON line per model and rank count, then a table per model:

* ``predicted``: the plan's ``totals.total_us``; ``measured``: the median step; ``error``:
  (predicted - measured) / measured;
* ``spearman``: rank correlation of our recipes ordered by prediction and by measurement
  (1.0: the planner orders them as the machine does);
* ``phases_ms``: per phase (forward with the loss, backward, optimizer step), the plan's
  predicted ms (``workloads.predicted_phase_ms``) and rank 0's median measured ms, so an
  error can be traced to the phase it comes from; the table prints them as
  ``predicted/measured`` under each variant;
* ``free/best``: the free plan's measured time over the fastest pinned recipe's (<= 1.05
  means the planner's choice is as good as the best hand recipe on our runtime), with
  ``best_pinned`` the recipe it is measured against and ``free_same_plan_as`` the pinned
  recipes whose plan is node for node the free one (same ``plan_key``): where the best
  pinned recipe is among them, the planner chose that very program and the ratio is the
  run's noise, as ``twin_spread`` is;
* ``skew`` (``rank_ms`` in the JSON: each rank's own median step): how far the measured
  step (the slowest rank's, step by step) lies above the largest of the ranks' own medians;
  the ranks' misalignment at their collectives (see ``autoparallel.measure_step``), which
  the plan does not price;
* ``twin_spread``: how far apart the free plan and its twin measured, over the faster: two
  builds of one plan in one run, so this is the resolution of the run's measurements (on a
  host whose ranks share cores, a coarse one).

Children's logs go to stderr. A variant that fails is reported with its error and the others
still run.

Every model and rank count is also appended to ``benchmarks/results/plan_fidelity.jsonl``
under the question ``<model>-<nproc>r`` (then ``-pinned`` with ``--pin-cores``, and
``-<preset>`` when priced on a preset rather than a calibrated profile), its figure each
recipe's predicted / measured ms; the run as a whole adds ``cells-within-20pct`` (how many
of our cells were predicted within 20 %).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoparallel.runtime.launch import run_distributed
from benchmarks.hardware_models import (
    AT,
    across_figure,
    across_hardware,
    calibrate_profiles,
    hardware_labels,
    variant_hardware,
)
from benchmarks.results import preset_suffix, record
from benchmarks.workloads import (
    PHASES,
    RECIPES,
    WORKLOADS,
    TimedRun,
    build_torch_ddp,
    build_torch_fsdp2,
    local_rows,
    make_optimizer,
    plan_ours,
    predicted_phase_ms,
    round_robin,
    training_step,
)

TORCH_VARIANTS = ("torch-ddp", "torch-fsdp2")


@dataclass
class _Variant:
    """One variant built on this rank, ready to step."""

    step: Callable[[], None]
    plan: Any
    losses: list[float]
    info: dict
    phase_ms: dict[str, list[float]]


TWIN = "free-twin"
"""The free plan, planned and built again: its distance from ``free`` is the noise floor."""

RECOMPUTE_EVERY_LAYER = {"memory_budget": 1e15, "activation_checkpointing": "all"}
"""The ``recompute`` variant: the free plan with every layer recomputed in the backward (a
budget that never binds), to set the price of recomputation beside its measured cost."""


def _build_variant(
    variant: str, workload_name: str, mesh: object, rank: int, world_size: int, hardware: str
) -> _Variant:
    """``variant`` is a recipe (priced on ``hardware``), ``recipe@label`` (priced on the
    hardware model of that label, see :func:`hardware_labels`) or one of torch's own."""
    workload = WORKLOADS[workload_name]
    variant = variant.split(AT)[0]
    info: dict = {}
    plan = None
    if variant == "torch-ddp":
        model = build_torch_ddp(workload)
    elif variant == "torch-fsdp2":
        model = build_torch_fsdp2(workload, mesh)
    else:
        planned = (
            plan_ours(workload, mesh, hardware=hardware, **RECOMPUTE_EVERY_LAYER)
            if variant == "recompute"
            else plan_ours(
                workload, mesh, recipe="free" if variant == TWIN else variant, hardware=hardware
            )
        )
        model, plan = planned.module, planned.plan
        info["planning_s"] = round(planned.planning_s, 2)
        info["placements"] = sorted({str(p) for p in plan.param_placements.values()})
        info["plan_key"] = plan_key(plan)
        info["totals_ms"] = {
            "compute": round(plan.totals.compute_us / 1e3, 3),
            "optimizer": round(plan.totals.optimizer_us / 1e3, 3),
            "comm": round(plan.totals.comm_us / 1e3, 3),
            "hidden_comm": round(plan.totals.hidden_comm_us / 1e3, 3),
            "transition": round(plan.totals.transition_us / 1e3, 3),
        }
    inputs, targets = workload.global_batch()
    inputs = local_rows(inputs, rank, world_size)
    targets = local_rows(targets, rank, world_size)
    losses: list[float] = []
    phase_ms: dict[str, list[float]] = {}
    scale = 1.0 / world_size if plan is not None else 1.0
    step = training_step(model, make_optimizer(model), inputs, targets, scale, losses, phase_ms)
    return _Variant(step, plan, losses, info, phase_ms)


def plan_key(plan: Any) -> str:
    """A short digest of every node's chosen strategy and recomputed layer: two variants
    with one key run the same program, so their measured gap is the run's noise alone."""
    chosen = sorted((name, repr(node.strategy)) for name, node in plan.nodes.items())
    text = repr((chosen, sorted(plan.recompute)))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def fidelity_rank(rank: int, world_size: int, workload_name: str, args: dict) -> dict:
    """One rank: build every variant, then time them round-robin (``rounds`` rounds of
    ``steps`` steps each, ``workloads.round_robin``), so a slow spell of the machine falls
    on every variant alike."""
    from torch.distributed.device_mesh import init_device_mesh

    os.dup2(2, 1)  # keep the parent's stdout for the report (HiGHS prints a banner)
    mesh = init_device_mesh("cpu", (world_size,))
    built: dict[str, _Variant] = {}
    results: dict[str, dict] = {}
    for variant in args["variants"]:
        torch.manual_seed(0)
        try:
            built[variant] = _build_variant(
                variant, workload_name, mesh, rank, world_size, variant_hardware(variant, args)
            )
        except Exception as exc:  # a failing variant must not hide the others' figures
            traceback.print_exc()
            results[variant] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    runs = {variant: TimedRun(run.step, run.plan, run.phase_ms) for variant, run in built.items()}
    timings = round_robin(runs, args["rounds"], args["steps"], args["warmup"])
    times = {variant: [ms for t in timings[variant] for ms in t.step_ms] for variant in built}
    rank_medians = {variant: [t.rank_median_ms for t in timings[variant]] for variant in built}
    for variant, run in built.items():
        predicted = run.plan.totals.total_us / 1e3 if run.plan is not None else None
        results[variant] = {
            "status": "ok",
            "measured_ms": round(statistics.median(times[variant]), 3),
            "rank_ms": [round(statistics.median(r), 3) for r in zip(*rank_medians[variant])],
            "predicted_ms": round(predicted, 3) if predicted is not None else None,
            "priced_on": run.plan.priced_on if run.plan is not None else None,
            "loss_last": run.losses[-1],
            "phases_ms": _phases(run),
            **run.info,
        }
    del built
    gc.collect()
    return {variant: results[variant] for variant in args["variants"]}


def _phases(run: _Variant) -> dict[str, dict[str, float | None]]:
    """Per phase, this rank's median measured ms and the plan's predicted ms (None for
    torch's own variants)."""
    predicted = predicted_phase_ms(run.plan) if run.plan is not None else {}
    return {
        phase: {
            "predicted": round(predicted[phase], 3) if predicted else None,
            "measured": round(statistics.median(run.phase_ms[phase]), 3),
        }
        for phase in PHASES
    }


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties get their mean rank); None for fewer than 2 points."""
    if len(xs) < 2:
        return None

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return round(cov / var, 3) if var else None


def summarize(results: dict) -> dict:
    """Spearman over our recipes, the free plan against the best pinned one, and how far
    apart the free plan and its twin measured."""
    ours = [
        (v, r)
        for v, r in results.items()
        if v in RECIPES and r["status"] == "ok" and r.get("predicted_ms") is not None
    ]
    summary: dict = {
        "spearman": spearman(
            [r["predicted_ms"] for _, r in ours], [r["measured_ms"] for _, r in ours]
        )
    }
    pinned = {v: r["measured_ms"] for v, r in ours if v != "free"}
    free = results.get("free", {})
    if pinned and free.get("status") == "ok":
        best = min(pinned, key=pinned.__getitem__)
        summary["free_over_best_pinned"] = round(free["measured_ms"] / pinned[best], 3)
        twins = [
            v for v, r in ours if v not in ("free", TWIN) and r["plan_key"] == free["plan_key"]
        ]
        if twins:
            summary["free_same_plan_as"] = twins
        summary["best_pinned"] = best
    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for _, r in ours]
    if errors:
        summary["max_abs_error"] = round(max(errors), 3)
    twin = results.get(TWIN, {})
    if free.get("status") == "ok" and twin.get("status") == "ok":
        both = (free["measured_ms"], twin["measured_ms"])
        summary["twin_spread"] = round((max(both) - min(both)) / min(both), 3)
    return summary


def print_table(model: str, nproc: int, results: dict, summary: dict) -> None:
    print(f"\n{model}, {nproc} ranks", file=sys.stderr)
    header = (
        f"{'variant':<12} {'predicted ms':>12} {'measured ms':>12} {'error':>8} {'skew':>6}  "
        "placements"
    )
    print(header, file=sys.stderr)
    for variant, r in results.items():
        if r["status"] != "ok":
            print(f"{variant:<12} {'failed: ' + r['error']}", file=sys.stderr)
            continue
        predicted = r.get("predicted_ms")
        error = (predicted - r["measured_ms"]) / r["measured_ms"] if predicted is not None else None
        skew = r["measured_ms"] / max(r["rank_ms"]) - 1 if r.get("rank_ms") else 0.0
        print(
            f"{variant:<12} {predicted if predicted is not None else '-':>12} "
            f"{r['measured_ms']:>12} {f'{100 * error:+.0f} %' if error is not None else '-':>8} "
            f"{f'{100 * skew:+.0f} %':>6}  {' '.join(r.get('placements', []))}",
            file=sys.stderr,
        )
        phases = r.get("phases_ms", {})
        print(
            f"{'':<12} "
            + ", ".join(
                f"{phase} {_ms(p['predicted'])}/{_ms(p['measured'])}" for phase, p in phases.items()
            ),
            file=sys.stderr,
        )
    print(
        "  " + ", ".join(f"{k} {v}" for k, v in summary.items() if k != "across_hardware"),
        file=sys.stderr,
    )
    across = summary.get("across_hardware")
    if across:
        print(f"  across hardware models: {json.dumps(across)}", file=sys.stderr)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=["mlp", "llama-tiny", "llama-small"],
    )
    parser.add_argument("--nproc", nargs="+", type=int, default=[2])
    parser.add_argument(
        "--recipes",
        nargs="+",
        choices=(*RECIPES, TWIN, "recompute"),
        default=[*RECIPES, TWIN],
    )
    parser.add_argument("--no-torch", action="store_true", help="skip torch's DDP and FSDP2")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="round-robin rounds over the variants"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--hardware",
        nargs="+",
        default=None,
        help="preset names or calibrated profile.json files (default: cpu); the first prices "
        "the bare recipes, every other one plans and prices them again as recipe@label",
    )
    parser.add_argument(
        "--calibrate",
        type=int,
        default=0,
        metavar="K",
        help="calibrate this machine K times first (autoparallel calibrate) and plan under "
        "each profile, then under any --hardware given: how far apart their predictions "
        "lie, and whether each one's free plan is as fast as the run's fastest plan",
    )
    parser.add_argument(
        "--profiles-dir",
        type=Path,
        default=None,
        help="where --calibrate writes its profiles (default: a new temporary directory)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per model and rank count"
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="bind each rank to one core (calibrate the profile with --pin-cores too)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error(
            "need --steps >= 1, --rounds >= 1 and --warmup >= 1 (the first step traces the local graphs)"
        )
    if args.calibrate < 0:
        parser.error("--calibrate needs K >= 0")
    calibrated = (
        calibrate_profiles(args.calibrate, args.nproc[0], args.pin_cores, args.profiles_dir)
        if args.calibrate
        else []
    )
    args.hardware = calibrated + (args.hardware or ([] if calibrated else ["cpu"]))
    if args.hardware == ["cpu"]:
        print(
            "[plan_fidelity] pricing on the 'cpu' preset; calibrate this machine first "
            "(autoparallel calibrate --nproc 2 --out profile.json) and pass --hardware profile.json",
            file=sys.stderr,
        )
    labels = list(hardware_labels(args.hardware).values())
    variants = (
        list(args.recipes)
        + [f"{recipe}{AT}{label}" for label in labels[1:] for recipe in args.recipes]
        + ([] if args.no_torch else list(TORCH_VARIANTS))
    )
    settings = {
        "rounds": args.rounds,
        "variants": variants,
        "steps": args.steps,
        "warmup": args.warmup,
        "hardware": args.hardware,
    }
    failed = False
    tables = []
    for model in args.models:
        for nproc in args.nproc:
            try:
                results = run_distributed(
                    fidelity_rank,
                    nproc,
                    model,
                    settings,
                    timeout_s=args.timeout,
                    pin_cores=args.pin_cores,
                )[0]
            except RuntimeError as exc:
                print(f"[plan_fidelity] {model} on {nproc} ranks failed:\n{exc}", file=sys.stderr)
                failed = True
                continue
            failed |= any(r["status"] != "ok" for r in results.values())
            summary = summarize(results)
            if len(labels) > 1:
                summary["across_hardware"] = across_hardware(
                    results, labels, (*RECIPES, TWIN, "recompute")
                )
            line = {
                "model": model,
                "nproc": nproc,
                "pin_cores": args.pin_cores,
                "hardware": args.hardware,
                "steps": args.steps,
                "variants": results,
                **summary,
            }
            print(json.dumps(line), flush=True)
            tables.append((model, nproc, results, summary))
    for table in tables:
        print_table(*table)
    if tables:
        record("plan_fidelity", _figures(args, tables), argv)
    return 1 if failed else 0


WITHIN = 0.2
"""A cell counts as predicted well when its error is within this share of the measurement."""


def _cell(result: dict) -> str:
    """``predicted/measured (error)`` of one variant, in ms."""
    if result["status"] != "ok":
        return "failed"
    measured, predicted = result["measured_ms"], result.get("predicted_ms")
    if predicted is None:
        return f"{measured:.3g}"
    return f"{predicted:.3g}/{measured:.3g} ({100 * (predicted - measured) / measured:+.0f} %)"


def _ranking(summary: dict) -> str:
    """The figure's tail: how the recipes ranked, and the free plan against the best pinned."""
    parts = [
        f"{label} {summary[key]}"
        for key, label in (("spearman", "Spearman"), ("free_over_best_pinned", "free/best pinned"))
        if summary.get(key) is not None
    ]
    return "; " + ", ".join(parts) if parts else ""


def _errors(results: dict) -> list[float]:
    return [
        (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        for r in results.values()
        if r["status"] == "ok" and r.get("predicted_ms") is not None
    ]


def _figures(args: argparse.Namespace, tables: list) -> list[dict]:
    """The results records of a run: one per model and rank count, and the run's count of
    cells within ``WITHIN``."""
    pinned = ("-pinned" if args.pin_cores else "") + preset_suffix(args.hardware[0])
    where = f"priced on {', '.join(args.hardware)}" + (
        ", each rank on one core" if args.pin_cores else ""
    )
    figures = []
    for model, nproc, results, summary in tables:
        across = summary.get("across_hardware")
        if across:
            figures.append(across_figure(model, nproc, across, len(args.hardware), pinned, where))
        figures.append(
            {
                "question": f"{model}-{nproc}r{pinned}",
                "what": f"predicted/measured step ms per recipe, {model}, {nproc} gloo ranks, {where}",
                "figure": ", ".join(f"{v} {_cell(r)}" for v, r in results.items())
                + _ranking(summary),
                "unit": "",
                **summary,
                "variants": results,
            }
        )
    errors = [e for _, _, results, _ in tables for e in _errors(results)]
    within = sum(abs(e) <= WITHIN for e in errors)
    figures.append(
        {
            "question": f"cells-within-20pct{pinned}",
            "what": f"our cells predicted within 20 % of measured, {where}",
            "figure": f"{within} of {len(errors)}",
            "unit": "",
            "models": [model for model, *_ in tables],
            "nproc": args.nproc,
        }
    )
    return figures


if __name__ == "__main__":
    sys.exit(main())
