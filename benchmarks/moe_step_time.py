"""Training-step time of the tiny mixture-of-experts model: ours against torch's FSDP2, with
and without expert parallelism written by hand.

    python -m benchmarks.moe_step_time [--nproc 4] [--steps 5] [--rounds 3] [--warmup 3]
        [--hardware profile.json]

The workload is ``workloads.MOE_TINY_WORKLOAD`` (``autoparallel.models.moe``, config
``moe-tiny``: 2 layers, 8 routed experts, top-2, a shared expert; batch 16 x 64 tokens),
trained with AdamW from the same init (seed 0), each rank feeding its local rows of the
global batch. ``--nproc`` ranks (even, default 4) on gloo; the variants:

* ``ours-free``: planned on the mesh ("dp", "ep") = (nproc / 2, 2), no memory constraint.
  The routed experts are split over ep as the model's ``local_map`` region says; the rest is
  the planner's choice.
* ``ours-memory``: the same with ``add_parameter_memory_constraint()``.
* ``fsdp2``: torch's ``fully_shard`` per layer and on the root, over all ranks (1-D). Every
  rank gathers every expert and routes its own tokens locally: no expert parallelism.
* ``fsdp2+ep``: expert parallelism by hand. Each rank keeps the experts of its ep coordinate
  (``num_experts / 2`` of them) as plain parameters. The model's own dispatch
  (``moe.routed_experts``: an all-to-all out and one back) runs on the real ep group. After
  the backward, each expert gradient is all-reduced over dp by hand. Every other parameter is
  ``fully_shard`` per layer over all ranks, with the experts as ``ignored_params``.

One set of ranks builds every variant, then times them round-robin: ``--rounds`` rounds of
``--steps`` steps, the first after ``--warmup`` untimed ones. The figure is each variant's
median step of the slowest rank (:func:`autoparallel.measure_step`). Prints one JSON line,
then a table:

* median step ms and its ratio to ``fsdp2``;
* ours' predicted step (``plan.totals.total_us``, priced on ``--hardware``);
* the global loss after the last step. It should agree across variants: they train the same
  model on the same data.

Each of ours is also appended to ``benchmarks/results/moe_step_time.jsonl`` under the
question ``moe-tiny-<nproc>r-<free|memory>`` (``-<preset>`` added when priced on a preset),
its figure its step over FSDP2's and over FSDP2 + EP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from typing import Any

from autoparallel import measure_step
from autoparallel.runtime.launch import run_distributed
from benchmarks.results import preset_suffix, record
from benchmarks.workloads import (
    LR,
    MOE_TINY_WORKLOAD,
    build_torch_fsdp2,
    local_rows,
    make_optimizer,
    plan_ours,
    training_step,
)

VARIANTS = ("ours-free", "ours-memory", "fsdp2", "fsdp2+ep")


def _build_expert_parallel(mesh_2d: Any, mesh_1d: Any) -> tuple[Any, Any]:
    """The tiny MoE with hand-written expert parallelism (see the module doc): the model and
    its optimizer. The optimizer has two parameter groups, because the experts are plain
    tensors and the rest are FSDP2's DTensors."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from autoparallel.regions.context import body_context

    model = MOE_TINY_WORKLOAD.build()
    model.init_weights(seed=0)
    ep_rank, ep_size = mesh_2d.get_local_rank("ep"), mesh_2d.size(1)
    dp_group, world_size = mesh_2d.get_group("dp"), mesh_2d.size()
    experts: list[nn.Parameter] = []

    def reduce_over_dp(param: torch.Tensor) -> None:
        # each rank's gradient is its ep group's tokens' share; the mean over every rank's loss
        dist.all_reduce(param.grad, group=dp_group)
        param.grad.div_(world_size)

    for layer in model.layers:
        stacks = layer.moe.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(stacks, name)
            local = full.shape[0] // ep_size
            kept = nn.Parameter(full.detach()[ep_rank * local : (ep_rank + 1) * local].clone())
            kept.register_post_accumulate_grad_hook(reduce_over_dp)
            setattr(stacks, name, kept)
            experts.append(kept)
    ignored = set(experts)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh_1d, ignored_params=ignored)
    fully_shard(model, mesh=mesh_1d, ignored_params=ignored)

    class ExpertParallel(nn.Module):
        """Runs the model with the 2-D mesh as the regions' mesh: the dispatch's
        all-to-alls go over the real ep group."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            with body_context(mesh_2d, balanced=False):
                return self.model(tokens)

    dense = [p for p in model.parameters() if p not in ignored]
    optimizer = torch.optim.AdamW([{"params": dense}, {"params": experts}], lr=LR, foreach=True)
    return ExpertParallel(), optimizer


def _build(variant: str, mesh_2d: Any, mesh_1d: Any, hardware: str) -> tuple[Any, Any, Any]:
    """(model, optimizer, plan or None) of one variant on this rank."""
    if variant == "fsdp2":
        model = build_torch_fsdp2(MOE_TINY_WORKLOAD, mesh_1d)
        return model, make_optimizer(model), None
    if variant == "fsdp2+ep":
        return (*_build_expert_parallel(mesh_2d, mesh_1d), None)
    planned = plan_ours(
        MOE_TINY_WORKLOAD,
        mesh_2d,
        hardware=hardware,
        memory_constraint=variant == "ours-memory",
    )
    return planned.module, make_optimizer(planned.module), planned.plan


def moe_rank(rank: int, world_size: int, args: dict) -> dict:
    """One rank: build every variant, time them round-robin, report this rank's view."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.dup2(2, 1)  # keep the parent's stdout for the report (HiGHS prints a banner)
    mesh_2d = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "ep"))
    mesh_1d = init_device_mesh("cpu", (world_size,))
    inputs, targets = MOE_TINY_WORKLOAD.global_batch()
    inputs, targets = local_rows(inputs, rank, world_size), local_rows(targets, rank, world_size)
    steps: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    losses: dict[str, list[float]] = {}
    results: dict[str, dict] = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        try:
            model, optimizer, plans[variant] = _build(variant, mesh_2d, mesh_1d, args["hardware"])
        except Exception as exc:  # a failing variant must not hide the others' figures
            traceback.print_exc()
            results[variant] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        losses[variant] = []
        # ours computes the global model: its gradients are those of the SUM of the ranks'
        # losses, so it scales each by 1/world_size (training_step's doc)
        scale = 1.0 / world_size if plans[variant] is not None else 1.0
        steps[variant] = training_step(model, optimizer, inputs, targets, scale, losses[variant])
    times: dict[str, list[float]] = {variant: [] for variant in steps}
    for round_index in range(args["rounds"]):
        warmup = args["warmup"] if round_index == 0 else 0
        for variant, step in steps.items():
            times[variant] += measure_step(step, steps=args["steps"], warmup=warmup).step_ms
    for variant in steps:
        loss = torch.tensor(losses[variant][-1], dtype=torch.float64)
        dist.all_reduce(loss)  # gloo has no ReduceOp.AVG
        plan = plans[variant]
        results[variant] = {
            "status": "ok",
            "measured_ms": round(statistics.median(times[variant]), 3),
            "predicted_ms": round(plan.totals.total_us / 1e3, 3) if plan is not None else None,
            "loss_last": loss.item() / world_size,
        }
        if plan is not None:
            results[variant]["expert_placements"] = sorted(
                {str(p) for name, p in plan.param_placements.items() if "experts" in name}
            )
    return {variant: results[variant] for variant in VARIANTS}


def print_table(results: dict) -> None:
    baseline = results.get("fsdp2", {}).get("measured_ms")
    print(f"{'variant':<12} {'measured ms':>12} {'/ fsdp2':>8} {'predicted ms':>13} {'loss':>10}")
    for variant, result in results.items():
        if result["status"] != "ok":
            print(f"{variant:<12} failed: {result['error']}")
            continue
        measured = result["measured_ms"]
        ratio = f"{measured / baseline:.2f}" if baseline else "-"
        predicted = result["predicted_ms"]
        print(
            f"{variant:<12} {measured:>12.2f} {ratio:>8} "
            f"{predicted if predicted is not None else '-':>13} {result['loss_last']:>10.6f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks (even)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the first")
    parser.add_argument("--hardware", default="cpu", help="preset name or profile.json")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.nproc % 2 or args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("need an even --nproc >= 2, --steps >= 1, --rounds >= 1, --warmup >= 0")
    settings = {
        "hardware": args.hardware,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
    }
    results = run_distributed(moe_rank, args.nproc, settings, timeout_s=args.timeout)[0]
    line = {"model": MOE_TINY_WORKLOAD.name, "nproc": args.nproc, **settings, "variants": results}
    print(json.dumps(line), flush=True)
    print_table(results)
    record("moe_step_time", _figures(args, line), argv)
    return 1 if any(r["status"] != "ok" for r in results.values()) else 0


def _figures(args: argparse.Namespace, line: dict) -> list[dict]:
    """The results records of a run: each of ours against FSDP2 and FSDP2 + EP."""
    results = line["variants"]
    theirs = {
        name: results[name]["measured_ms"]
        for name in ("fsdp2", "fsdp2+ep")
        if results[name]["status"] == "ok"
    }
    figures = []
    for variant, setting in (("ours-free", "free"), ("ours-memory", "memory")):
        ours = results[variant]
        if ours["status"] != "ok":
            continue
        ratios = [f"{ours['measured_ms'] / ms:.2f}x {name.upper()}" for name, ms in theirs.items()]
        figures.append(
            {
                "question": f"{line['model']}-{args.nproc}r-{setting}"
                + preset_suffix(args.hardware),
                "what": f"step time of {variant} over torch's, {line['model']}, "
                f"{args.nproc} gloo ranks, mesh (dp, ep), priced on {args.hardware}",
                "figure": ", ".join(ratios).replace("FSDP2+EP", "FSDP2 + EP"),
                "unit": "",
                "measured_ms": ours["measured_ms"],
                "predicted_ms": ours["predicted_ms"],
                "theirs_ms": theirs,
            }
        )
    return figures


if __name__ == "__main__":
    sys.exit(main())
