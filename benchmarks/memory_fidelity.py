"""Predicted vs measured memory per device of our plans, component by component.

    python -m benchmarks.memory_fidelity [--models mlp llama-tiny] [--nproc 2]
        [--recipes free ddp fsdp tp budget recompute] [--mixed-precision]

For every model, one set of gloo ranks plans it once per recipe (``benchmarks/workloads.py``;
``budget`` is the free plan under a peak budget of 60 % of the free plan's predicted peak,
``recompute`` under 45 % of it with ``activation_checkpointing="auto"``: the solver picks
the layers the backward recomputes),
trains one AdamW step, and measures on each rank, from the tensors themselves
(:func:`autoparallel.measure_memory`), the bytes of the parameters, the gradients, the
optimizer state and the activations the forward saves for the backward. With
``--mixed-precision`` every plan runs under a bf16/fp32 MixedPrecisionPolicy (bf16
parameters and compute, gradients reduced in fp32).

It prints one table per model with the plan's prediction (``plan.memory``) beside the
largest rank's measurement and the relative error, and one JSON line per model. The
predicted ``peak`` has no measurement on CPU (no allocator statistics); on a CUDA machine,
``torch.cuda.max_memory_allocated`` is the figure to put beside it.

Each model's line is also appended to ``benchmarks/results/memory_fidelity.jsonl`` under the
question ``<model>-<nproc>r-<fp32|bf16>``, its figure how many of the measured components
were predicted to the byte and the largest error of the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from autoparallel import measure_memory
from autoparallel.runtime.launch import run_distributed
from autoparallel.runtime.memory import COMPONENTS
from benchmarks.results import record
from benchmarks.workloads import WORKLOADS, local_rows, loss_of, make_optimizer, plan_ours

RECIPES = ("free", "ddp", "fsdp", "tp", "budget", "recompute")
BUDGET_SHARE = {"budget": 0.6, "recompute": 0.45}
"""The budgeted recipes' peak budget, as a share of the free plan's predicted peak."""


def memory_rank(
    rank: int, world_size: int, model_name: str, recipes: list[str], mixed_precision: bool
) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    os.dup2(2, 1)  # keep the parent's stdout for the report (HiGHS prints a banner)
    mesh = init_device_mesh("cpu", (world_size,))
    workload = WORKLOADS[model_name]
    inputs, targets = workload.global_batch()
    # a rank owns its rows only (a slice would keep the whole batch's storage alive)
    inputs = local_rows(inputs, rank, world_size).clone()
    targets = local_rows(targets, rank, world_size)
    results: dict[str, dict] = {}
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else None
    )
    free_peak = None
    for recipe in recipes:
        torch.manual_seed(0)
        try:
            budget = None
            if recipe in BUDGET_SHARE:
                if free_peak is None:
                    free_peak = plan_ours(workload, mesh, mp_policy=mp_policy).plan.memory.peak
                budget = BUDGET_SHARE[recipe] * free_peak
            planned = plan_ours(
                workload,
                mesh,
                recipe="free" if recipe in BUDGET_SHARE else recipe,
                memory_budget=budget,
                activation_checkpointing="auto" if recipe == "recompute" else "off",
                mp_policy=mp_policy,
            )
        except Exception as exc:  # one failing recipe must not hide the others' figures
            traceback.print_exc()
            results[recipe] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        memory = planned.plan.memory
        if recipe == "free":
            free_peak = memory.peak
        measured = measure_memory(
            planned.module,
            make_optimizer(planned.module),
            inputs,
            lambda output: loss_of(output, targets) / world_size,
        )
        largest = torch.tensor([getattr(measured, c) for c in COMPONENTS], dtype=torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        results[recipe] = {
            "status": "ok",
            "placements": sorted({str(p) for p in planned.plan.param_placements.values()}),
            "predicted": {c: getattr(memory, c) for c in COMPONENTS}
            | {"peak": memory.peak, "budget": memory.budget, "recomputed": memory.recomputed},
            "measured": dict(zip(COMPONENTS, largest.tolist())),
        }
    return results


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:9.3f}"


def _table(model: str, nproc: int, results: dict[str, dict], policy: str) -> list[str]:
    lines = [
        f"{model}, {nproc} gloo ranks, {policy} (MiB per device; measured: the largest rank)",
        f"{'recipe':<8} {'component':<16} {'predicted':>10} {'measured':>10} {'error':>8}",
    ]
    for recipe, result in results.items():
        if result["status"] != "ok":
            lines.append(f"{recipe:<8} error: {result['error']}")
            continue
        for component in COMPONENTS:
            predicted = result["predicted"][component]
            measured = result["measured"][component]
            error = f"{100 * (predicted - measured) / measured:+7.1f}%" if measured else "      -"
            lines.append(
                f"{recipe:<8} {component:<16} {_mib(predicted):>10} {_mib(measured):>10} {error:>8}"
            )
        peak, budget = result["predicted"]["peak"], result["predicted"]["budget"]
        within = "" if budget is None else f" (budget {_mib(budget).strip()})"
        recomputed = result["predicted"].get("recomputed") or ()
        if recomputed:
            within += f", recomputing {', '.join(recomputed)}"
        lines.append(f"{recipe:<8} {'peak':<16} {_mib(peak):>10} {'-':>10}{within}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", choices=sorted(WORKLOADS), default=["mlp", "llama-tiny"]
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="plan and train under a bf16/fp32 MixedPrecisionPolicy",
    )
    args = parser.parse_args(argv)
    policy = "bf16/fp32 policy" if args.mixed_precision else "fp32"
    failed = False
    for model in args.models:
        try:
            results = run_distributed(
                memory_rank,
                args.nproc,
                model,
                args.recipes,
                args.mixed_precision,
                timeout_s=args.timeout,
            )[0]
        except RuntimeError as exc:
            print(f"[{model}] failed:\n{exc}", file=sys.stderr)
            failed = True
            continue
        failed |= any(r["status"] != "ok" for r in results.values())
        line = {"model": model, "nproc": args.nproc, "policy": policy, "results": results}
        print(json.dumps(line), flush=True)
        print("\n".join(_table(model, args.nproc, results, policy)), flush=True)
        record("memory_fidelity", _figure(args, line), argv)
    return 1 if failed else 0


def _figure(args: argparse.Namespace, line: dict) -> dict:
    """The results record of one model: components predicted to the byte, largest error."""
    errors = [
        (result["predicted"][c] - result["measured"][c]) / result["measured"][c]
        for result in line["results"].values()
        if result["status"] == "ok"
        for c in COMPONENTS
        if result["measured"][c]
    ]
    exact = sum(error == 0 for error in errors)
    largest = max((abs(error) for error in errors), default=0.0)
    dtype = "bf16" if args.mixed_precision else "fp32"
    return {
        "question": f"{line['model']}-{args.nproc}r-{dtype}",
        "what": f"memory per device predicted vs measured, {line['model']}, "
        f"{args.nproc} gloo ranks, {line['policy']}, recipes {' '.join(args.recipes)}",
        "figure": f"{exact} of {len(errors)} components to the byte, largest error "
        f"{100 * largest:.1f} %",
        "unit": "",
        **line,
    }


if __name__ == "__main__":
    sys.exit(main())
