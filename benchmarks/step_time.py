"""Training-step time of autoparallel's parallel module vs torch's FSDP2 and DDP, on gloo CPU.

    python -m benchmarks.step_time --model mlp|llama-tiny|llama-small --nproc 2 --steps 10 \
        --warmup 3 [--rounds 3 | --separate] [--compile]

Every variant trains the same workload (``benchmarks/workloads.py``: same init, seed 0), on
the same 1-D mesh of ``--nproc`` CPU ranks, with the same global batch split by rows (each
rank feeds its LOCAL slice), with AdamW (``foreach=True``, see ``make_optimizer``). A step is zero_grad + forward + loss + backward + optimizer step; its time is the
slowest rank's, and the figure reported is the median over ``--steps`` steps after
``--warmup`` untimed ones. A comparison's variants (ours, theirs, ours compiled) are built in
one set of processes and timed round-robin, ``--rounds`` rounds of ``--steps / --rounds``
steps each (every round starts each variant with one untimed step), so a slow spell of this
shared machine, and the build of a set of ranks, fall on both sides of a ratio alike: in
separate sets of ranks (``--separate``, where one failing or hanging variant does not take
the others down) a ratio also carries each set's own spells and builds, and moves from one
run of the same code to the next. ``--pin-cores`` binds each rank to one core (calibrate
the profile with ``--pin-cores`` too).

Comparisons, one JSON line each on stdout (children's output goes to stderr):

* ``memory``: ours planned with ``add_parameter_memory_constraint()`` vs ``fully_shard``.
* ``free``:   ours planned without a memory constraint vs ``DistributedDataParallel``.

``--mesh DPxTP`` (LLaMA models): one comparison on that (dp, tp) mesh instead, round-robin:
ours free and memory-constrained, ours within torch's styles run by our runtime and exported
as torch code (benchmarks/variants_2d.py), the 2-D recipe written by hand and FSDP2 alone; each
/ the hand recipe, exported / ours-styles, and ``first_losses_agree`` (one init, one batch).

``ratio`` is ours / theirs (below 1: ours is faster). Each line is also appended to
``benchmarks/results/step_time.jsonl``, its figure that ratio, under the question
``<model>-<nproc>r-<comparison>`` (then ``-pinned``, ``-separate`` where those flags are set,
and ``-<preset>`` when priced on a preset rather than a calibrated profile); with
``--compile`` a second record, ``...-compiled``, holds compiled ours / eager ours.

Every variant reports ``phase_ms``: the median milliseconds of the forward (with the loss),
the backward and the optimizer step, on rank 0's clock. Ours also reports
``exposed_comm_ms``, measured with the profiler over 5 more steps on rank 0: ``wait`` is
the time blocked waiting for collectives (what overlap did not hide) and ``launch`` the time
spent starting them; ``predicted_exposed_comm_ms`` is the plan's ``totals.exposed_comm_us``.

``--compile`` also times ours under ``torch.compile(parallel, backend=autoparallel_backend(),
fullgraph=True)`` (same plan, same steps) and adds it to each line: ``ours_compiled``,
``ratio_compiled_over_eager`` (compiled ours / eager ours) and ``ratio_compiled_over_theirs``.
Compilation happens in the first steps (the forward on the first call, the backward on the
first ``backward()``), which are warm-up steps and never timed: ``--compile`` needs
``--warmup`` >= 1; ``compiled_in_timed_steps`` (0 expected) counts graphs compiled after the
warm-up. Every variant reports ``first_step_ms``, its first (untimed) step: for ours that
includes tracing the local graphs, or compiling.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autoparallel import autoparallel_backend, measure_step
from autoparallel.cli.common import UsageError, parse_mesh
from autoparallel.runtime.launch import run_distributed
from benchmarks.results import preset_suffix, record
from benchmarks.variants_2d import (
    EXPORTED,
    HAND_2D,
    OURS_STYLES,
    VARIANTS,
    build_2d_variant,
    first_losses_agree,
)
from benchmarks.workloads import (
    ROUND_WARMUP,
    WORKLOADS,
    TimedRun,
    build_torch_ddp,
    build_torch_fsdp2,
    local_param_bytes,
    local_rows,
    make_optimizer,
    plan_ours,
    round_robin,
    training_step,
)

MODELS = tuple(WORKLOADS)
COMPILED = "+compile"
"""Suffix of the variants of ours run under torch.compile(..., backend=autoparallel_backend())."""

DP_TP = ("dp", "tp")


def _build_ours(
    model_name: str, mesh: Any, memory: bool, hardware: str | None
) -> tuple[nn.Module, dict]:
    rows = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)  # split over dp, whole over tp
    planned = plan_ours(
        WORKLOADS[model_name], mesh, hardware=hardware, memory_constraint=memory, rows=rows
    )
    plan = planned.plan
    placements = sorted({str(p) for p in plan.param_placements.values()})
    return planned.module, {
        "planning_s": round(planned.planning_s, 3),
        "predicted_ms": round(plan.totals.total_us / 1e3, 3),
        "predicted_exposed_comm_ms": round(plan.totals.exposed_comm_us / 1e3, 3),
        "priced_on": plan.priced_on,
        "param_placements": placements,
        "buckets": [f"{b.description} x{b.tensors}" for b in plan.buckets],
    }


@dataclass
class _Prepared:
    """One variant built on this rank: its step, and what the step records."""

    variant: str
    model: nn.Module
    step: Callable[[], None]
    losses: list[float]
    phase_ms: dict[str, list[float]]
    extra: dict
    compiles: _CompileCounter | None


def _prepare(
    rank: int,
    world_size: int,
    variant: str,
    model_name: str,
    hardware: str | None,
    mesh_shape: tuple[int, int] | None = None,
) -> _Prepared:
    """Build ``variant`` on this rank: the model, its AdamW and one training step. With
    ``mesh_shape`` (dp, tp), ours and the hand recipe run on that 2-D mesh, each rank
    feeding the rows of its dp coordinate; FSDP2 and DDP on all the ranks as one dim."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    flat = init_device_mesh("cpu", (world_size,))
    mesh = flat if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=DP_TP)
    on_all_ranks = mesh_shape is None or variant in ("fsdp2", "ddp")  # rows split 1-D
    row_splits, row = (
        (world_size, rank) if on_all_ranks else (mesh_shape[0], mesh.get_local_rank("dp"))
    )
    extra: dict = {}
    workload = WORKLOADS[model_name]
    if variant == "fsdp2":
        model = build_torch_fsdp2(workload, flat)
    elif variant == "ddp":
        model = build_torch_ddp(workload)
    elif variant in VARIANTS:  # the hand recipe; ours within torch's styles, run or exported
        model, extra = build_2d_variant(variant, model_name, mesh, hardware)
    else:
        memory = variant.startswith("ours-memory")
        model, extra = _build_ours(model_name, mesh, memory=memory, hardware=hardware)
    optimizer = make_optimizer(model)
    # Compiled variants: the first call compiles the forward, the first backward() the
    # backward, both inside the (untimed) warm-up steps.
    compiled = variant.endswith(COMPILED)
    run = (
        torch.compile(model, backend=autoparallel_backend(), fullgraph=True) if compiled else model
    )
    inputs, targets = workload.global_batch()
    inputs, targets = local_rows(inputs, row, row_splits), local_rows(targets, row, row_splits)
    losses: list[float] = []
    phase_ms: dict[str, list[float]] = {}
    scale = 1.0 / row_splits if variant.startswith("ours") else 1.0  # see training_step
    step = training_step(run, optimizer, inputs, targets, scale, losses, phase_ms)
    return _Prepared(
        variant, model, step, losses, phase_ms, extra, _CompileCounter() if compiled else None
    )


def _result(
    prepared: _Prepared, step_ms: list[float], first_step_ms: float | None, compiles_in_warmup: int
) -> dict:
    """What one variant reports, after its timed steps (``step_ms``, the slowest rank's)."""
    extra = dict(prepared.extra)
    extra["phase_ms"] = {
        phase: round(statistics.median(ms), 3) for phase, ms in prepared.phase_ms.items()
    }
    global_loss = torch.tensor(prepared.losses, dtype=torch.float64)  # every variant's steps
    dist.all_reduce(global_loss)  # gloo has no ReduceOp.AVG
    if prepared.variant.startswith(
        "ours"
    ):  # after the timed steps: the profiler slows what it watches
        extra["exposed_comm_ms"] = _exposed_comm_ms(prepared.step, PROFILED_STEPS)
    world_size = dist.get_world_size()
    if prepared.compiles is not None:  # a compile inside the timed steps would spoil the median
        extra["graphs_compiled"] = prepared.compiles.count
        extra["compiled_in_timed_steps"] = prepared.compiles.count - compiles_in_warmup
        prepared.compiles.close()
    return {
        "step_s": [ms / 1e3 for ms in step_ms],
        "first_step_ms": round(first_step_ms, 1) if first_step_ms is not None else None,
        "loss_first": global_loss[0].item() / world_size,
        "loss_last": global_loss[-1].item() / world_size,
        "param_bytes_per_rank": local_param_bytes(prepared.model),
        **extra,
    }


def time_variant(
    rank: int,
    world_size: int,
    variant: str,
    model_name: str,
    steps: int,
    warmup: int,
    hardware: str | None,
    mesh_shape: tuple[int, int] | None = None,
) -> dict:
    """One rank of one variant in its own set of ranks (``--separate``): build, train
    ``warmup + steps`` steps, return timings."""
    os.dup2(2, 1)  # keep the parent's stdout for JSON lines (HiGHS prints a banner)
    prepared = _prepare(rank, world_size, variant, model_name, hardware, mesh_shape)
    first, compiles = _warm_up(prepared, warmup)
    timed = measure_step(prepared.step, steps=steps, warmup=0)
    return _result(prepared, list(timed.step_ms), first, compiles)


def _warm_up(prepared: _Prepared, warmup: int) -> tuple[float | None, int]:
    """Run ``warmup`` untimed steps of ``prepared`` (a compiled variant compiles in them);
    returns the first one's time and the graphs compiled so far, and clears the phases."""
    warm = measure_step(prepared.step, steps=warmup, warmup=0) if warmup else None
    compiles = prepared.compiles.count if prepared.compiles is not None else 0
    prepared.phase_ms.clear()
    return (warm.step_ms[0] if warm is not None else None), compiles


def time_interleaved(
    rank: int,
    world_size: int,
    variants: list[str],
    model_name: str,
    steps: int,
    warmup: int,
    rounds: int,
    hardware: str | None,
    mesh_shape: tuple[int, int] | None = None,
) -> dict[str, dict]:
    """One rank of every variant of a comparison in one set of ranks: build them all, warm
    each up, then time them round-robin, ``rounds`` rounds of ``steps / rounds`` steps
    (each round starts each variant with ``workloads.ROUND_WARMUP`` untimed steps), so a slow spell
    of the machine, and the build of a set of ranks, fall on all of them alike."""
    os.dup2(2, 1)  # keep the parent's stdout for JSON lines (HiGHS prints a banner)
    built = [
        _prepare(rank, world_size, variant, model_name, hardware, mesh_shape)
        for variant in variants
    ]
    warmed = {prepared.variant: _warm_up(prepared, warmup) for prepared in built}
    runs = {p.variant: TimedRun(p.step, None, p.phase_ms) for p in built}
    timings = round_robin(runs, rounds, -(-steps // rounds), ROUND_WARMUP)
    return {
        prepared.variant: _result(
            prepared,
            [ms for timing in timings[prepared.variant] for ms in timing.step_ms],
            *warmed[prepared.variant],
        )
        for prepared in built
    }


PROFILED_STEPS = 5
"""Steps run under the profiler, after the timed ones, to measure ours' exposed comm."""


def _exposed_comm_ms(step: Any, steps: int) -> dict[str, float]:
    """This rank's milliseconds per step on the critical path of communication, from the
    profiler: ``wait`` blocked in functional collectives' ``wait_tensor`` (comm that compute
    did not hide) and ``launch`` in starting collectives (copies into and out of the
    coalesced buffers included). Only ours: DDP's and FSDP2's waits happen inside C++
    hooks and streams that the CPU profiler does not attribute."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wait_us = launch_us = 0.0
    for event in prof.key_averages():
        if event.key == "_c10d_functional::wait_tensor":
            wait_us += event.self_cpu_time_total
        elif event.key.startswith(("_c10d_functional::", "c10d::")):
            launch_us += event.self_cpu_time_total
    return {"wait": round(wait_us / 1e3 / steps, 3), "launch": round(launch_us / 1e3 / steps, 3)}


class _CompileCounter(logging.Handler):
    """Counts the graphs autoparallel_backend() compiles (it logs one INFO line per graph)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0
        self.logger = logging.getLogger("autoparallel.runtime.compile")
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1

    def close(self) -> None:
        self.logger.removeHandler(self)
        super().close()


# ---------------------------------------------------------------------------------- driver


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    """Time ``variant`` on ``args.nproc`` ranks of its own; {"status": "ok", ...} or
    {"status": "error", ...}."""
    return _run(
        lambda: {
            variant: run_distributed(
                time_variant,
                args.nproc,
                variant,
                args.model,
                args.steps,
                args.warmup,
                args.hardware,
                args.mesh,
                timeout_s=args.timeout,
                pin_cores=args.pin_cores,
            )[0]
        },
        [variant],
    )[variant]


def run_interleaved(variants: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Time ``variants`` round-robin in one set of ``args.nproc`` ranks (see
    ``time_interleaved``); each {"status": "ok", ...}, or all {"status": "error", ...}."""
    return _run(
        lambda: run_distributed(
            time_interleaved,
            args.nproc,
            variants,
            args.model,
            args.steps,
            args.warmup,
            args.rounds,
            args.hardware,
            args.mesh,
            timeout_s=args.timeout * len(variants),
            pin_cores=args.pin_cores,
        )[0],
        variants,
    )


def _run(launch: Callable[[], dict[str, dict]], variants: list[str]) -> dict[str, dict]:
    try:
        results = launch()
    except RuntimeError as exc:
        print(f"[{', '.join(variants)}] failed:\n{exc}", file=sys.stderr)
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        error = {"status": "error", "error": lines[-1] if lines else repr(exc)}
        return {variant: dict(error) for variant in variants}
    return {
        variant: {"status": "ok", "median_ms": round(1e3 * statistics.median(r["step_s"]), 3), **r}
        for variant, r in results.items()
    }


def _summary(result: dict) -> dict:
    keep = (
        "median_ms",
        "first_step_ms",
        "loss_first",
        "loss_last",
        "param_bytes_per_rank",
        "planning_s",
        "predicted_ms",
        "phase_ms",
        "exposed_comm_ms",
        "predicted_exposed_comm_ms",
        "priced_on",
        "param_placements",
        "buckets",
        "graphs_compiled",
        "compiled_in_timed_steps",
        "error",
        "reason",
    )
    return {key: result[key] for key in keep if key in result}


def _ratio(a: dict, b: dict) -> float | None:
    if a["status"] == "ok" and b["status"] == "ok":
        return round(a["median_ms"] / b["median_ms"], 3)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--nproc", type=int, default=2, help="number of gloo CPU ranks (1-D mesh)")
    parser.add_argument(
        "--mesh",
        default=None,
        help="DPxTP, e.g. 2x2: ours (free and memory-constrained) and the hand-written 2-D "
        "recipe on that (dp, tp) mesh, FSDP2 on all its ranks, in one comparison",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--hardware", default="cpu", help="hardware preset the planner prices for")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per variant before giving up"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time ours under torch.compile(backend=autoparallel_backend())",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="round-robin rounds over a comparison's variants, in one set of ranks",
    )
    parser.add_argument(
        "--separate",
        action="store_true",
        help="time each variant in its own set of ranks instead (no round-robin)",
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="bind each rank to one core (calibrate the profile with --pin-cores too)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.nproc < 1 or args.rounds < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --nproc >= 1, --rounds >= 1")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first step compiles and must not be timed")
    if args.mesh is not None:
        try:
            args.mesh = parse_mesh(args.mesh)
        except UsageError as error:
            parser.error(str(error))
        if len(args.mesh) != 2:
            parser.error(f"--mesh takes DPxTP, e.g. 2x2, got {'x'.join(map(str, args.mesh))}")
        if args.model not in HAND_RECIPE_MODELS:
            parser.error(
                f"--mesh compares with the hand LLaMA recipe: --model {HAND_RECIPE_MODELS}"
            )
        if args.compile or args.separate:
            parser.error("--mesh runs one round-robin comparison: no --compile, no --separate")
        args.nproc = args.mesh[0] * args.mesh[1]
        return _compare_2d(args, argv)

    comparisons = [("memory", "ours-memory", "fsdp2"), ("free", "ours-free", "ddp")]
    failed = False
    for comparison, ours_variant, theirs_variant in comparisons:
        variants = [ours_variant, theirs_variant] + (
            [ours_variant + COMPILED] if args.compile else []
        )
        if args.separate:
            results = {variant: run_variant(variant, args) for variant in variants}
        else:
            results = run_interleaved(variants, args)
        ours, theirs = results[ours_variant], results[theirs_variant]
        compiled = results.get(ours_variant + COMPILED)
        failed |= any(result["status"] == "error" for result in results.values())
        ratio = _ratio(ours, theirs)
        line = {
            "model": args.model,
            "nproc": args.nproc,
            "comparison": comparison,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": None if args.separate else args.rounds,
            "pin_cores": args.pin_cores,
            "ours_status": ours["status"],
            "ours": _summary(ours),
            "theirs_name": theirs_variant,
            "theirs_status": theirs["status"],
            "theirs": _summary(theirs),
            "ratio_ours_over_theirs": ratio,
        }
        if compiled is not None:
            line.update(
                {
                    "ours_compiled_status": compiled["status"],
                    "ours_compiled": _summary(compiled),
                    "ratio_compiled_over_eager": _ratio(compiled, ours),
                    "ratio_compiled_over_theirs": _ratio(compiled, theirs),
                }
            )
        print(json.dumps(line), flush=True)
        record("step_time", _figures(args, comparison, line), argv)
    return 1 if failed else 0


HAND_RECIPE_MODELS = ("llama-tiny", "llama-small")
VARIANTS_2D = ("ours-free", "ours-memory", OURS_STYLES, EXPORTED, HAND_2D, "fsdp2")


def _compare_2d(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Ours (free, memory-constrained) against the hand 2-D recipe and FSDP2 alone, one set
    of ranks, round-robin; one JSON line, and ours / hand recorded for both of ours."""
    results = run_interleaved(list(VARIANTS_2D), args)
    hand = results[HAND_2D]
    line = {
        "model": args.model,
        "mesh": list(args.mesh),
        "mesh_dim_names": list(DP_TP),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "pin_cores": args.pin_cores,
        **{variant: {"status": r["status"], **_summary(r)} for variant, r in results.items()},
        **{f"ratio_{v}_over_hand": _ratio(results[v], hand) for v in VARIANTS_2D if v != HAND_2D},
        "ratio_exported_over_ours_styles": _ratio(results[EXPORTED], results[OURS_STYLES]),
        "first_losses_agree": first_losses_agree(results),
    }
    print(json.dumps(line), flush=True)
    mesh = "x".join(str(n) for n in args.mesh)
    setting = f"{args.model}, ({mesh}) dp x tp on {args.nproc} gloo ranks, {args.steps} steps"
    figures = [
        {
            "question": f"{args.model}-{mesh}-{ours.removeprefix('ours-')}-vs-hand"
            + preset_suffix(args.hardware),
            "what": f"step time, {label} / the hand 2-D recipe (TP+SP, FSDP2 per layer), {setting}",
            "figure": line[f"ratio_{ours}_over_hand"],
            "unit": "x",
            **line,
        }
        for ours, label in (
            ("ours-free", "ours (free)"),
            ("ours-memory", "ours (parameter memory constraint)"),
        )
    ] + [
        {
            "question": f"{args.model}-{mesh}-exported-vs-ours" + preset_suffix(args.hardware),
            "what": f"step time, the plan within torch's styles as exported torch code / the "
            f"same plan run by our runtime, {setting}",
            "figure": line["ratio_exported_over_ours_styles"],
            "unit": "x",
            **line,
        }
    ]
    record("step_time", figures, argv)
    failed = any(r["status"] == "error" for r in results.values())
    return 1 if failed or not line["first_losses_agree"] else 0


THEIRS = {"memory": ("ours (parameter memory constraint)", "FSDP2"), "free": ("ours (free)", "DDP")}


def _figures(args: argparse.Namespace, comparison: str, line: dict) -> list[dict]:
    """The results records of one comparison: ours / theirs, and compiled / eager ours."""
    key = f"{args.model}-{args.nproc}r-{comparison}"
    key += "-pinned" if args.pin_cores else ""
    key += "-separate" if args.separate else ""
    key += preset_suffix(args.hardware)
    ours, theirs = THEIRS[comparison]
    setting = f"{args.model}, {args.nproc} gloo ranks, {args.steps} steps" + (
        ", each rank on one core" if args.pin_cores else ""
    )
    figures = [
        {
            "question": key,
            "what": f"step time, {ours} / torch {theirs}, {setting}",
            "figure": line["ratio_ours_over_theirs"],
            "unit": "x",
            **line,
        }
    ]
    if "ratio_compiled_over_eager" in line:
        figures.append(
            {
                "question": key + "-compiled",
                "what": f"step time, {ours} compiled / eager, {setting}",
                "figure": line["ratio_compiled_over_eager"],
                "unit": "x",
                "ratio_compiled_over_theirs": line["ratio_compiled_over_theirs"],
            }
        )
    return figures


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
