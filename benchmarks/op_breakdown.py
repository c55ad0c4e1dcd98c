"""Where a plan's step time goes, op by op: measured (torch.profiler) beside priced.

    python -m benchmarks.op_breakdown --hardware profile.json [--model llama-small]
        [--recipe free|ddp|fsdp|tp] [--nproc 2] [--steps 5] [--top 25]
        [--phase step|forward|backward|optimizer]

One set of gloo ranks plans ``--model`` (``benchmarks/workloads.py``) pinned to ``--recipe``
under the profile, trains 3 untimed steps, then profiles ``--steps`` whole steps (zero_grad,
forward, loss, backward, AdamW) on every rank. Rank 0 prints, per ATen op name, the self CPU
time the profiler measured per step and how many calls, beside what the plan charges the
forward and backward nodes of that op (``NodePlan.compute_us``) and how many there are.
Ops the plan does not price per node show 0 there: the optimizer's ops (priced as a whole,
``plan.totals.optimizer_us``), the functional collectives and their waits (priced on the
edges: ``comm`` in the totals line), and the copies the runtime adds. The profiler adds a few
microseconds per op, so small ops read high.

``--phase forward`` (or ``backward``, ``optimizer``) profiles only that part of each step
(forward means the model and the loss, as ``plan_fidelity``'s phase split) and prices only
that phase's nodes; the last line then sets the phase's wall time per step beside the
profiled ops' summed self time and the plan's prediction for the phase
(``workloads.predicted_phase_ms``): wall minus ops is Python and dispatch between the ops.

That last line is also appended to ``benchmarks/results/op_breakdown.jsonl`` under the
question ``<model>-<recipe>-<phase>-<nproc>r`` (``-<preset>`` added when priced on a preset).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from autoparallel.runtime.launch import run_distributed
from benchmarks.results import preset_suffix, record
from benchmarks.workloads import (
    PHASES,
    RECIPES,
    WORKLOADS,
    local_rows,
    loss_of,
    make_optimizer,
    plan_ours,
    predicted_phase_ms,
)


def _breakdown_rank(rank: int, world_size: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    os.dup2(2, 1)  # keep the parent's stdout for the report (HiGHS prints a banner)
    mesh = init_device_mesh("cpu", (world_size,))
    workload = WORKLOADS[args["model"]]
    torch.manual_seed(0)
    planned = plan_ours(workload, mesh, recipe=args["recipe"], hardware=args["hardware"])
    inputs, targets = workload.global_batch()
    inputs = local_rows(inputs, rank, world_size)
    targets = local_rows(targets, rank, world_size)
    model = planned.module
    optimizer = make_optimizer(model)
    phase = args["phase"]
    steps = args["steps"]
    wall_s = {False: 0.0, True: 0.0}  # the phase's wall time, without and under the profiler
    events: list = []

    def run_part(part: str, run: Callable[[], Any], profiling: bool, timed: bool) -> Any:
        if phase not in ("step", part):
            return run()
        prof = profile(activities=[ProfilerActivity.CPU]) if profiling else nullcontext()
        with prof:
            start = time.perf_counter()
            result = run()
            wall_s[profiling] += (time.perf_counter() - start) * timed
        if profiling:
            events.extend(prof.key_averages())
        return result

    # 3 warmup steps, then `steps` timed ones without the profiler, then `steps` under it.
    for index in range(3 + 2 * steps):
        profiling, timed = index >= 3 + steps, index >= 3
        dist.barrier()
        optimizer.zero_grad(set_to_none=True)
        loss = run_part("forward", lambda: loss_of(model(inputs), targets), profiling, timed)
        run_part("backward", (loss / world_size).backward, profiling, timed)
        run_part("optimizer", optimizer.step, profiling, timed)
    measured_us: Counter = Counter()
    measured_calls: Counter = Counter()
    for event in events:
        if event.key.startswith(("aten::", "_c10d_functional::")):
            measured_us[event.key] += event.self_cpu_time_total / steps
            measured_calls[event.key] += event.count / steps
    measured = {name: (measured_us[name], measured_calls[name]) for name in measured_us}
    priced_us: Counter = Counter()
    priced_calls: Counter = Counter()
    for node in planned.plan.nodes.values():
        if node.phase not in ("forward", "backward") or phase not in ("step", node.phase):
            continue
        if node.target.startswith("aten."):
            name = "aten::" + node.target.split(".")[1]
            priced_us[name] += node.compute_us
            priced_calls[name] += 1
    totals = planned.plan.totals
    predicted = predicted_phase_ms(planned.plan)
    return {
        "phase": phase,
        "wall_ms": wall_s[False] * 1e3 / steps,
        "profiled_wall_ms": wall_s[True] * 1e3 / steps,
        "predicted_ms": totals.total_us / 1e3 if phase == "step" else predicted[phase],
        "measured": measured,
        "priced": {name: (priced_us[name], priced_calls[name]) for name in priced_us},
        "totals_ms": {
            "total": totals.total_us / 1e3,
            "compute": totals.compute_us / 1e3,
            "optimizer": totals.optimizer_us / 1e3,
            "comm": totals.comm_us / 1e3,
        },
    }


def print_breakdown(result: dict, top: int) -> None:
    measured, priced = result["measured"], result["priced"]
    names = sorted(
        set(measured) | set(priced),
        key=lambda name: -max(measured.get(name, (0, 0))[0], priced.get(name, (0, 0))[0]),
    )
    print(f"{'op':<48} {'measured ms':>12} {'calls':>7} {'priced ms':>10} {'nodes':>6}")
    for name in names[:top]:
        measured_us, calls = measured.get(name, (0.0, 0))
        priced_us, nodes = priced.get(name, (0.0, 0))
        print(
            f"{name[:48]:<48} {measured_us / 1e3:>12.2f} {calls:>7.0f} "
            f"{priced_us / 1e3:>10.2f} {nodes:>6}"
        )
    both = [name for name in priced if name in measured]
    print(
        "ops priced per node: measured "
        f"{sum(measured[n][0] for n in both) / 1e3:.2f} ms, priced "
        f"{sum(priced[n][0] for n in both) / 1e3:.2f} ms; plan totals (ms): "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["totals_ms"].items())
    )
    profiled_ms = sum(us for us, _ in measured.values()) / 1e3
    print(
        f"{result['phase']} per step: wall {result['wall_ms']:.2f} ms "
        f"({result['profiled_wall_ms']:.2f} under the profiler), "
        f"aten ops and collectives {profiled_ms:.2f} ms, predicted {result['predicted_ms']:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hardware", required=True, help="preset name or profile.json")
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="llama-small")
    parser.add_argument("--recipe", choices=RECIPES, default="free")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--phase",
        choices=("step",) + PHASES,
        default="step",
        help="profile only this part of each step (default: the whole step)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("need --steps >= 1")
    settings = {
        "model": args.model,
        "recipe": args.recipe,
        "hardware": args.hardware,
        "steps": args.steps,
        "phase": args.phase,
    }
    result = run_distributed(_breakdown_rank, args.nproc, settings, timeout_s=900)[0]
    print_breakdown(result, args.top)
    record("op_breakdown", _figure(args, result), argv)
    return 0


def _figure(args: argparse.Namespace, result: dict) -> dict:
    """The results record of a run: the phase's wall time, its ops' time, the prediction."""
    ops_ms = sum(us for us, _ in result["measured"].values()) / 1e3
    return {
        "question": f"{args.model}-{args.recipe}-{args.phase}-{args.nproc}r"
        + preset_suffix(args.hardware),
        "what": f"{'whole step' if args.phase == 'step' else args.phase}, wall / profiled ops / "
        f"predicted ms per step, {args.model}, "
        f"{args.recipe} plan, {args.nproc} gloo ranks, priced on {args.hardware}",
        "figure": f"{result['wall_ms']:.2f} / {ops_ms:.2f} / {result['predicted_ms']:.2f} ms",
        "unit": "",
        "wall_ms": round(result["wall_ms"], 3),
        "ops_ms": round(ops_ms, 3),
        "predicted_ms": round(result["predicted_ms"], 3),
        "totals_ms": result["totals_ms"],
    }


if __name__ == "__main__":
    sys.exit(main())
