"""The GPU path end to end in one command: calibration, our module against the plain model,
two ranks training equal to one device, predictions against measurements.

    python -m benchmarks.gpu_check [--device cuda|cpu] [--out benchmarks/results/gpu_check]
        [--steps 10] [--rounds 3] [--no-record]

Made for a machine with one GPU, run briefly (under 8 minutes on one H100). ``--device cpu``
runs the same parts on the CPU with small models, so the script cannot rot unseen (CI runs
it so). Parts, each on fresh ranks, each recorded with its error if it fails (a broken part
does not lose the others' figures):

a. **calibrate**: ``autoparallel calibrate``'s measurements on the device (a group of one
   rank: the matmul table and FLOP/s per dtype, memory bandwidth, launch overhead, traced
   transformer blocks, whose attention is SDPA's fused kernel), written as a profile.
b. **one device**: a ~1.25 B LLaMA (LLaMA-tiny on a CPU) with the bf16/fp32 mixed-precision
   policy, our parallel module on a mesh of one device against the plain model under bf16
   autocast, both eager and both compiled (ours with ``autoparallel_backend()``, the plain
   one with Inductor), timed round-robin on the profile of (a).
c. **two ranks**: the tiny LLaMA planned on two gloo ranks sharing the one device (NCCL
   refuses two ranks on one GPU; gloo carries CUDA tensors), three AdamW steps eager and
   compiled, each step's global loss against the plain model on one device.
d. **predictions**: the plan's step (b, eager) and the compute it charges one layer, beside
   the measured step and that layer's forward and backward timed alone.
e. **memory**: the plan's peak per device beside ``torch.cuda.max_memory_allocated`` over
   three steps of (b) (CUDA only).

Writes ``<out>-<device>.json`` (every figure) and ``<out>-<device>.md`` (one table), prints
the table, and appends the headline figures to ``benchmarks/results/gpu_check.jsonl`` (the
source of ``docs/measurements.md``). Exits 1 if a part failed or (c) trained differently
from one device; the speed and fidelity goals are reported against their thresholds
(on the GPU) without failing the run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import gpu_check_parts as parts
from benchmarks.results import RESULTS_DIR, record

TWO_RANK_STEPS = 3
LOSS_TOLERANCE = {"cuda": 2e-2, "cpu": 1e-4}
"""Largest relative difference of a step's global loss from one device's: bf16-level on a
GPU (its kernels reduce in another order than the one-device run's), fp32-level on a CPU."""

GOALS = {
    "step_ratio": 1.03,  # ours / plain, eager and compiled
    "layer_error": 0.15,  # |predicted - measured| / measured compute of one layer
    "memory_error": 0.10,  # |predicted - measured| / measured peak
}


def calibration_settings(device: str) -> Any:
    """Small on a CPU (the path, not the figures); on a GPU the defaults but for the
    collectives, which a group of one rank does not exercise."""
    from autoparallel.calibrate.settings import KIB, MIB, CalibrationSettings

    if device == "cuda":
        return CalibrationSettings(device="cuda", max_bytes=1 * MIB, rounds=3)
    return CalibrationSettings(
        device="cpu",
        max_bytes=16 * KIB,
        repeats=3,
        rounds=2,
        matmul_sizes=(64, 128, 256),
        memory_probe_bytes=4 * MIB,
        optimizer_numel=1 << 14,
        optimizer_large_numel=1 << 16,
        runtime_parameters=(4, 16),
        matmul_grid=(16, 64),
        matmul_grid_calls=3,
    )


def _part(name: str, results: dict, run: Callable[[], Any]) -> Any:
    """Run one part; its figures, or its error, go to ``results[name]``."""
    print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
    try:
        value = run()
    except Exception as error:  # one broken part must not lose the others' figures
        results[name] = {"error": f"{type(error).__name__}: {error}"}
        print(traceback.format_exc(), file=sys.stderr)
        return None
    results[name] = value
    return value


def run_check(device: str, steps: int, rounds: int, workdir: Path) -> dict:
    from autoparallel.runtime.launch import run_distributed

    results: dict[str, Any] = {"device": device}
    profile = str(workdir / "profile.json")
    settings = calibration_settings(device)
    calibrated = _part(
        "calibrate",
        results,
        lambda: run_distributed(parts.calibrate_rank, 1, device, settings, profile, timeout_s=900)[
            0
        ],
    )
    hardware = profile if calibrated else ("h100" if device == "cuda" else "cpu")
    model = parts.LLAMA_1B if device == "cuda" else parts.LLAMA_TINY
    _part(
        "one_device",
        results,
        lambda: run_distributed(
            parts.one_device_rank, 1, device, model, hardware, steps, rounds, timeout_s=1200
        )[0],
    )
    reference = parts.one_device_losses(device, parts.LLAMA_TINY, TWO_RANK_STEPS)
    for mode, compiled in (("eager", False), ("compiled", True)):
        _part(
            f"two_ranks_{mode}",
            results,
            lambda compiled=compiled: _two_ranks(device, reference, compiled),
        )
    results["goals"] = goals(results)
    return results


def _two_ranks(device: str, reference: list[float], compiled: bool) -> dict:
    from autoparallel.runtime.launch import run_distributed

    losses = run_distributed(
        parts.two_rank_training,
        2,
        device,
        parts.LLAMA_TINY,
        TWO_RANK_STEPS,
        compiled,
        timeout_s=900,
    )[0]
    error = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    return {
        "losses": losses,
        "one_device": reference,
        "largest_relative_error": error,
        "equal": error <= LOSS_TOLERANCE[device],
    }


def goals(results: dict) -> dict:
    """Each goal's figure and whether it is met (None where its part failed)."""
    one = results.get("one_device") or {}
    step = one.get("step_ms") or {}
    figures: dict[str, float | None] = {
        "eager_ratio": _ratio(step.get("ours"), step.get("plain")),
        "compiled_ratio": _ratio(step.get("ours compiled"), step.get("plain compiled")),
        "step_error": _error(one.get("predicted_step_ms"), step.get("ours")),
        "layer_error": _error(
            (one.get("layer") or {}).get("predicted_compute_us"),
            (one.get("layer") or {}).get("measured_us"),
        ),
        "memory_error": _error(
            (one.get("memory") or {}).get("predicted_peak"),
            (one.get("memory") or {}).get("measured_peak"),
        ),
    }
    met = {
        "eager_ratio": _at_most(figures["eager_ratio"], GOALS["step_ratio"]),
        "compiled_ratio": _at_most(figures["compiled_ratio"], GOALS["step_ratio"]),
        "layer_error": _at_most(_abs(figures["layer_error"]), GOALS["layer_error"]),
        "memory_error": _at_most(_abs(figures["memory_error"]), GOALS["memory_error"]),
    }
    for mode in ("eager", "compiled"):
        met[f"two_ranks_{mode}"] = (results.get(f"two_ranks_{mode}") or {}).get("equal")
    return {"figures": figures, "met": met}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _error(predicted: float | None, measured: float | None) -> float | None:
    return (predicted - measured) / measured if predicted is not None and measured else None


def _abs(value: float | None) -> float | None:
    return abs(value) if value is not None else None


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None or math.isnan(value) else value <= limit


# ------------------------------------------------------------------------------ the report


def table(results: dict) -> str:
    device = results["device"]
    calibrate = results.get("calibrate") or {}
    one = results.get("one_device") or {}
    step = one.get("step_ms") or {}
    figures = results["goals"]["figures"]
    met = results["goals"]["met"]
    what = calibrate.get("device") or device
    lines = [
        f"gpu_check on {what} ({device})",
        "",
        "| part | figure | goal | met |",
        "|---|---|---|---|",
        _row("calibrate", _calibrate_text(calibrate), "", None),
        _row(
            "one device, eager",
            _steps_text(step.get("ours"), step.get("plain"), figures["eager_ratio"]),
            "ours <= 1.03x plain",
            met["eager_ratio"],
        ),
        _row(
            "one device, compiled",
            _steps_text(
                step.get("ours compiled"), step.get("plain compiled"), figures["compiled_ratio"]
            ),
            "ours <= 1.03x plain",
            met["compiled_ratio"],
        ),
    ]
    for mode in ("eager", "compiled"):
        part = results.get(f"two_ranks_{mode}") or {}
        text = part.get("error") or (
            f"largest loss difference {part['largest_relative_error']:.1e} over "
            f"{len(part['losses'])} steps"
        )
        lines.append(
            _row(
                f"two ranks on one device, {mode}",
                text,
                f"<= {LOSS_TOLERANCE[device]:.0e} relative",
                met[f"two_ranks_{mode}"],
            )
        )
    lines += [
        _row(
            "predicted step (eager)",
            _prediction_text(one.get("predicted_step_ms"), step.get("ours"), "ms")
            + f" on {one.get('priced_on', '?')}",
            "",
            None,
        ),
        _row(
            f"compute of {(one.get('layer') or {}).get('layer', 'a layer')}",
            _prediction_text(
                (one.get("layer") or {}).get("predicted_compute_us"),
                (one.get("layer") or {}).get("measured_us"),
                "us",
            ),
            "within 15 %",
            met["layer_error"],
        ),
        _row("peak memory", _memory_text(one), "within 10 %", met["memory_error"]),
    ]
    return "\n".join(lines) + "\n"


def _row(part: str, text: str, goal: str, met: bool | None) -> str:
    mark = {True: "yes", False: "**no**", None: "-"}[met]
    return f"| {part} | {text} | {goal} | {mark} |"


def _calibrate_text(calibrate: dict) -> str:
    if "error" in calibrate:
        return calibrate["error"]
    if not calibrate:
        return "not run"
    return (
        f"bf16 {calibrate['flops_bf16'] / 1e12:.2f} TFLOP/s, fp32 "
        f"{calibrate['flops_fp32'] / 1e12:.2f} TFLOP/s, memory "
        f"{calibrate['memory_bandwidth'] / 1e9:.0f} GB/s, launch "
        f"{calibrate['kernel_launch_us']:.1f} us"
    )


def _steps_text(ours: float | None, plain: float | None, ratio: float | None) -> str:
    if ours is None or plain is None or ratio is None:
        return "not measured"
    return f"ours {ours:.2f} ms, plain {plain:.2f} ms: {ratio:.3f}x"


def _prediction_text(predicted: float | None, measured: float | None, unit: str) -> str:
    if predicted is None or measured is None:
        return "not measured"
    return (
        f"predicted {predicted:.1f} {unit}, measured {measured:.1f} {unit} "
        f"({(predicted - measured) / measured:+.0%})"
    )


def _memory_text(one: dict) -> str:
    memory = one.get("memory") or {}
    predicted, measured = memory.get("predicted_peak"), memory.get("measured_peak")
    if predicted is None:
        return "not measured"
    if measured is None:
        return f"predicted {predicted / 2**20:.1f} MiB; {memory.get('why_none', 'no measurement')}"
    return _prediction_text(predicted / 2**20, measured / 2**20, "MiB")


def _records(results: dict) -> list[dict]:
    device = results["device"]
    what = (results.get("calibrate") or {}).get("device") or device
    figures = results["goals"]["figures"]
    records = []
    for key, unit, text in (
        ("eager_ratio", "x", "our step / the plain model's, one device, eager"),
        ("compiled_ratio", "x", "our step / the plain model's, one device, compiled"),
        ("layer_error", "relative", "predicted compute of one layer against measured"),
        ("memory_error", "relative", "predicted peak memory against max_memory_allocated"),
    ):
        if figures[key] is not None:
            records.append(
                {
                    "question": f"{device}-{key}",
                    "what": f"{text} ({what})",
                    "figure": round(figures[key], 4),
                    "unit": unit,
                }
            )
    for mode in ("eager", "compiled"):
        part = results.get(f"two_ranks_{mode}") or {}
        if "largest_relative_error" in part:
            records.append(
                {
                    "question": f"{device}-two-ranks-{mode}",
                    "what": f"two ranks on one device, {mode}: largest relative loss "
                    f"difference from one device over {TWO_RANK_STEPS} steps ({what})",
                    "figure": float(f"{part['largest_relative_error']:.2e}"),
                    "unit": "relative",
                }
            )
    return records


def failed(results: dict) -> list[str]:
    """The parts that failed, and the two-rank runs that trained differently."""
    found = [
        name for name, value in results.items() if isinstance(value, dict) and "error" in value
    ]
    found += [
        f"two_ranks_{mode} trained differently from one device"
        for mode in ("eager", "compiled")
        if results["goals"]["met"].get(f"two_ranks_{mode}") is False
    ]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default=str(RESULTS_DIR / "gpu_check"))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-record", action="store_true", help="append nothing to results/")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here; run with --device cpu to check the path on the CPU")
    with tempfile.TemporaryDirectory() as workdir:
        results = run_check(args.device, args.steps, args.rounds, Path(workdir))
    text = table(results)
    out = Path(f"{args.out}-{args.device}")
    out.with_suffix(".json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)
    if not args.no_record:
        record("gpu_check", _records(results), argv)
    broken = failed(results)
    for line in broken:
        print(f"[gpu_check] failed: {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
