"""Where a plan's step time goes, op by op: measured (torch.profiler) beside priced.

    python benchmarks/op_breakdown.py --hardware profile.json [--model llama-small]
        [--recipe free|ddp|fsdp|tp] [--nproc 2] [--steps 5] [--top 25]

One set of gloo ranks plans ``--model`` (``benchmarks/workloads.py``) pinned to ``--recipe``
under the profile, trains 3 untimed steps, then profiles ``--steps`` whole steps (zero_grad,
forward, loss, backward, AdamW) on every rank. Rank 0 prints, per ATen op name, the self CPU
time the profiler measured per step and how many calls, beside what the plan charges the
forward and backward nodes of that op (``NodePlan.compute_us``) and how many there are.
Ops the plan does not price per node show 0 there: the optimizer's ops (priced as a whole,
``plan.totals.optimizer_us``), the functional collectives and their waits (priced on the
edges: ``comm`` in the totals line), and the copies the runtime adds. The profiler adds a few
microseconds per op, so small ops read high.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import RECIPES, WORKLOADS, local_rows, make_optimizer, plan_ours, training_step

from autoparallel._testing.harness import run_distributed


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
    step = training_step(model, make_optimizer(model), inputs, targets, 1 / world_size, [])
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args["steps"]):
            dist.barrier()
            step()
    measured = {
        event.key: (event.self_cpu_time_total / args["steps"], event.count / args["steps"])
        for event in prof.key_averages()
        if event.key.startswith(("aten::", "_c10d_functional::"))
    }
    priced_us: Counter = Counter()
    priced_calls: Counter = Counter()
    for node in planned.plan.nodes.values():
        if node.phase in ("forward", "backward") and node.target.startswith("aten."):
            name = "aten::" + node.target.split(".")[1]
            priced_us[name] += node.compute_us
            priced_calls[name] += 1
    totals = planned.plan.totals
    return {
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
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("need --steps >= 1")
    settings = {
        "model": args.model,
        "recipe": args.recipe,
        "hardware": args.hardware,
        "steps": args.steps,
    }
    result = run_distributed(_breakdown_rank, args.nproc, settings, timeout_s=900)[0]
    print_breakdown(result, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
