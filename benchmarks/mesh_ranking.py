"""Does the mesh search rank meshes as the machine does? Every candidate mesh of the ranks,
planned as ``search_mesh`` plans it, built, and timed.

    python -m benchmarks.mesh_ranking [--model llama-small] [--nproc 4] [--hardware cpu]
        [--steps 5] [--rounds 3] [--warmup 3]

On ``--nproc`` gloo ranks, each candidate of ``autoparallel.mesh_search.candidate_shapes``
(all ranks on one node: ``(4,)`` dp, ``(2, 2)`` dp x tp, ``(4,)`` tp for 4 ranks) gets a
real mesh, is planned under the search's constraints (``constrain_candidate``: the batch
sharded over dp, replicated over tp; the parameter memory constraint), applied, and trained
with AdamW on this rank's rows; the meshes are then timed round-robin (as
``benchmarks/plan_fidelity.py`` times recipes), so a slow spell of the machine falls on all.
Prints each mesh's predicted and measured step, both orders and their Spearman correlation,
and appends one record to ``benchmarks/results/mesh_ranking.jsonl``.

On torch's default gloo groups (two worker threads each) this run aborted on the (2, 2)
mesh in 7 of 8 runs: the heap corruption runtime/gloo.py explains; its ranks now start
``serial_gloo`` groups (one worker each), as ``run_distributed`` does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from autoparallel import AutoParallel
from autoparallel.mesh_search import candidate_shapes, constrain_candidate
from autoparallel.runtime.launch import run_distributed
from benchmarks.plan_fidelity import spearman
from benchmarks.results import preset_suffix, record
from benchmarks.workloads import (
    WORKLOADS,
    TimedRun,
    check_same_plan,
    make_optimizer,
    round_robin,
    training_step,
)


def ranking_rank(rank: int, world_size: int, workload_name: str, args: dict) -> dict:
    """One rank: build every candidate mesh's parallel module, then time them round-robin."""
    from torch.distributed.device_mesh import init_device_mesh

    os.dup2(2, 1)  # keep the parent's stdout for the report (HiGHS prints a banner)
    workload = WORKLOADS[workload_name]
    inputs, targets = workload.global_batch()
    runs: dict[str, TimedRun] = {}
    for shape, names in candidate_shapes(world_size, world_size):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        label = f"{'x'.join(map(str, shape))} ({', '.join(names)})"
        with torch.device("meta"):
            model = workload.build()
        with AutoParallel(model, lambda: inputs, mesh, hardware=args["hardware"]) as autop:
            constrain_candidate(autop, int(inputs.shape[0]), names)
            plan = autop.optimize_placement()
            check_same_plan(plan)
            parallel = autop.apply_placement(plan)
        parallel.to_empty(device="cpu")
        parallel.init_weights(seed=0)
        dp = shape[0] if names[0] == "dp" else 1
        row = mesh.get_local_rank("dp") if dp > 1 else 0
        local_inputs = inputs.chunk(dp)[row]
        local_targets = None if targets is None else targets.chunk(dp)[row]
        phase_ms: dict[str, list[float]] = {}
        step = training_step(
            parallel,
            make_optimizer(parallel),
            local_inputs,
            local_targets,
            1.0 / world_size,
            [],
            phase_ms,
        )
        runs[label] = TimedRun(step, plan, phase_ms)
    timings = round_robin(runs, args["rounds"], args["steps"], args["warmup"])
    return {
        label: {
            "predicted_ms": round(run.plan.totals.total_us / 1e3, 3),
            "measured_ms": round(
                statistics.median(ms for t in timings[label] for ms in t.step_ms), 3
            ),
        }
        for label, run in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="llama-small")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--hardware", default="cpu", help="preset name or profile.json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args(argv)
    settings = {
        "hardware": args.hardware,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
    }
    results = run_distributed(
        ranking_rank, args.nproc, args.model, settings, timeout_s=args.timeout
    )[0]
    labels = list(results)
    predicted = [results[label]["predicted_ms"] for label in labels]
    measured = [results[label]["measured_ms"] for label in labels]
    by_prediction = sorted(labels, key=lambda label: results[label]["predicted_ms"])
    by_measurement = sorted(labels, key=lambda label: results[label]["measured_ms"])
    correlation = spearman(predicted, measured)
    print(f"{'mesh':<16} {'predicted ms':>12} {'measured ms':>12}")
    for label in labels:
        r = results[label]
        print(f"{label:<16} {r['predicted_ms']:>12} {r['measured_ms']:>12}")
    print(f"predicted order: {' < '.join(by_prediction)}")
    print(f"measured order:  {' < '.join(by_measurement)}")
    print(f"Spearman: {correlation}")
    record(
        "mesh_ranking",
        {
            "question": f"{args.model}-{args.nproc}r{preset_suffix(args.hardware)}",
            "what": f"the candidate meshes of {args.nproc} gloo ranks planned as search_mesh "
            f"plans them, {args.model}, priced on {args.hardware}: predicted vs measured order",
            "figure": f"predicted {' < '.join(by_prediction)}; measured "
            f"{' < '.join(by_measurement)}; Spearman {correlation}",
            "unit": "",
            "meshes": results,
        },
        argv,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
