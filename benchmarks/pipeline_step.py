"""Pipeline parallelism on gloo CPU ranks: its step time against the plan without stages,
and its losses against it.

    python -m benchmarks.pipeline_step --model llama-tiny --batch 16 --steps 10 --rounds 2
    python -m benchmarks.pipeline_step --layers 4 --variants 1f1b:4 interleaved-1f1b:4 auto

On 4 ranks, in one set of processes, timed round-robin (``workloads.round_robin``):

* ``dp``: ours on a 1-D mesh of 4, free plan, the batch split by rows over all 4;
* ``pp<S>-<schedule>-m<M>``: ours on a (pp, dp) = (S, 4 / S) mesh (pp alone for S = 4),
  the model cut into S stages at its layer stack, each stage planned on dp, run by
  torch.distributed.pipelining's schedule over M microbatches; ``pp<S>-auto``: the
  schedule, microbatches and cuts the planner chooses (``--variants``: ``[Sx]schedule:M``
  or ``[Sx]auto``; default 2 stages with 1f1b over 2 and 4, gpipe over 4, and auto);
  ``interleaved-1f1b`` runs two stages on each of the S pp ranks (``--layers``: a stack of
  at least 2S layers).

Every variant starts from the same init (seed 0, built on CPU: a stage cut from a meta
model cannot run ``init_weights`` yet, see docs/architecture.md) and trains the same global
batch with AdamW; their first steps' losses must agree (``--tolerance``), which the output
says. One record per pipeline variant: its median step over dp's (below 1: faster), the
question ``<model>-4r-<variant>``, with each variant's predicted step beside its
measured one (``predicted_ms``: the pipeline's ``plan.pipeline.cost.step_us``, dp's
``plan.totals``; priced on ``--hardware``, a preset or a calibrated profile), and the bytes
of activations held at once on the first stage's rank 0 and the last stage's last rank
(``measure_activation_peak`` over one more step, over all of the rank's stages) beside the
rank's predicted peak (``cost/pipeline.py``'s ``rank_activation_peak``: each stage's
microbatch bytes held from its forward to its backward in the schedule's order; with one
stage per rank, ``plan.pipeline.memory.activations``). The last stage's measurement also holds
what the loss saves, which is outside the model and not priced. On a 2-core host 4 ranks share 2 cores, and a
pipeline's bubble leaves ranks idle that other ranks can then use: read the ratio as this
host's, not a GPU cluster's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.cost.pipeline import rank_activation_peak
from autoparallel.models import Llama, llama_config
from autoparallel.runtime.launch import run_distributed
from autoparallel.runtime.memory import measure_activation_peak
from benchmarks.results import record
from benchmarks.workloads import (
    WORKLOADS,
    TimedRun,
    loss_of,
    make_optimizer,
    plan_ours,
    round_robin,
    training_step,
)

NPROC = 4
DEFAULT_VARIANTS = ("1f1b:2", "1f1b:4", "gpipe:4", "auto")


@dataclass(frozen=True)
class Variant:
    """``[<stages>x]<schedule>:<microbatches>`` or ``[<stages>x]auto`` (the planner chooses
    schedule, microbatches and cuts); 2 stages where not given."""

    stages: int
    schedule: str | None
    microbatches: int | None

    @classmethod
    def parse(cls, text: str) -> Variant:
        stages, _, rest = text.rpartition("x") if "x" in text else ("2", "", text)
        if rest == "auto":
            return cls(int(stages), None, None)
        schedule, microbatches = rest.split(":")
        return cls(int(stages), schedule, int(microbatches))

    @property
    def name(self) -> str:
        setting = "auto" if self.schedule is None else f"{self.schedule}-m{self.microbatches}"
        return f"pp{self.stages}-{setting}"


def _pipelined(workload: Any, variant: Variant, hardware: str) -> Any:
    dp = NPROC // variant.stages
    shape, names = ((variant.stages, dp), ("pp", "dp")) if dp > 1 else ((NPROC,), ("pp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = workload.build()
    model.init_weights(seed=0)
    inputs, _ = workload.global_batch()
    rows = (Replicate(), Shard(0)) if dp > 1 else (Replicate(),)
    with AutoParallel(model, lambda: inputs, mesh, hardware=hardware) as autop:
        if variant.schedule is not None:
            autop.add_pipeline_constraint(variant.schedule, variant.microbatches)
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        plan = autop.optimize_placement()
        pipe = autop.apply_placement(plan, loss_fn=lambda out, tgt: loss_of(out, tgt) / dp)
    return mesh, pipe, plan.pipeline


def _rank_activations(pipeline: Any) -> float:
    """The activation bytes this rank is predicted to hold at once over its stages."""
    per_microbatch = [m.activations / m.in_flight for m in pipeline.stage_memory]
    rank = pipeline.stage_index % pipeline.ranks
    return rank_activation_peak(
        pipeline.schedule,
        rank,
        pipeline.ranks,
        pipeline.stages_per_rank,
        pipeline.microbatches,
        per_microbatch,
    )


def _pipeline_step(pipe: Any, inputs: Any, targets: Any, losses: list[float]) -> Any:
    optimizer = make_optimizer(pipe)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        microbatch_losses: list[torch.Tensor] = []
        pipe.step(inputs, target=targets, losses=microbatch_losses)
        optimizer.step()
        # this rank's share of the step's loss (the last stage's; 0 on the first stage)
        mine = torch.stack(microbatch_losses).detach().mean() if microbatch_losses else None
        losses.append(0.0 if mine is None else float(mine))

    return step


def _workload(model: str, batch: int, layers: int | None) -> Any:
    workload = replace(WORKLOADS[model], batch=batch)
    if layers is None:
        return workload
    preset = model.removeprefix("llama-")
    return replace(workload, build=lambda: Llama(llama_config(preset, n_layers=layers)))


def _rank(rank: int, world_size: int, model: str, batch: int, args: dict[str, Any]) -> Any:
    workload = _workload(model, batch, args["layers"])
    inputs, targets = workload.global_batch()
    runs: dict[str, TimedRun] = {}
    losses: dict[str, list[float]] = {}
    activations: dict[str, tuple[Any, float]] = {}  # variant -> (module, predicted bytes)
    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ours = plan_ours(workload, flat, hardware=args["hardware"])
    predicted = {"dp": ours.plan.totals.total_us / 1e3}
    activations["dp"] = (ours.module, ours.plan.memory.activations)
    rows = batch // world_size
    local = slice(rank * rows, (rank + 1) * rows)
    losses["dp"] = []
    runs["dp"] = TimedRun(
        training_step(
            ours.module,
            make_optimizer(ours.module),
            inputs[local],
            targets[local],
            1.0 / world_size,  # gradients of the batch's mean loss, as the pipeline's
            losses["dp"],
        ),
        ours.plan,
        {},
    )
    chosen: dict[str, str] = {}
    for text in args["variants"]:
        variant = Variant.parse(text)
        mesh, pipe, pipeline = _pipelined(workload, variant, args["hardware"])
        dp_rank, dp = (mesh.get_local_rank("dp"), mesh.shape[1]) if mesh.ndim > 1 else (0, 1)
        share = batch // dp
        mine = slice(dp_rank * share, (dp_rank + 1) * share)
        name = variant.name
        chosen[name] = pipeline.describe().split(";")[0]
        predicted[name] = pipeline.cost.step_us / 1e3
        losses[name] = []
        runs[name] = TimedRun(
            _pipeline_step(pipe, inputs[mine], targets[mine], losses[name]), None, {}
        )
        activations[name] = (torch.nn.ModuleList(pipe.modules), _rank_activations(pipeline))
    timings = round_robin(runs, args["rounds"], args["steps"] // args["rounds"], args["warmup"])
    # the first step's loss of the whole batch: dp's ranks each hold their rows' mean, the
    # pipeline's last-stage ranks their share (already divided by dp), the others 0
    first = torch.tensor([values[0] for values in losses.values()], dtype=torch.float64)
    dist.all_reduce(first)
    first[0] /= world_size
    # one more step of each, counting the activations alive at once on this rank
    held = {
        name: (
            measure_activation_peak(runs[name].step, module),
            bytes_,
        )
        for name, (module, bytes_) in activations.items()
    }
    return {
        "activations": held,
        "all_ms": {
            name: [s for timing in t for s in timing.step_ms] for name, t in timings.items()
        },
        "first_loss": dict(zip(losses, first.tolist())),
        "predicted_ms": predicted,
        "chosen": chosen,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny", choices=["llama-tiny", "llama-small"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--layers", type=int, default=None, help="the LLaMA's layers (default: the preset's)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument(
        "--hardware", default="cpu", help="a preset or a profile from autoparallel calibrate"
    )
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    keys = ("variants", "rounds", "steps", "warmup", "hardware", "layers")
    settings = {k: getattr(args, k) for k in keys}
    results = run_distributed(
        _rank, NPROC, args.model, args.batch, settings, timeout_s=args.timeout
    )
    rank0 = results[0]
    steps = {name: statistics.median(rank0["all_ms"][name]) for name in rank0["all_ms"]}
    reference = rank0["first_loss"]["dp"]
    records = []
    model = args.model if args.layers is None else f"{args.model}-{args.layers}-layers"
    for name, step_ms in steps.items():
        if name == "dp":
            continue
        loss_gap = abs(rank0["first_loss"][name] - reference)
        line = {
            "variant": name,
            "step_ms": round(step_ms, 2),
            "dp_step_ms": round(steps["dp"], 2),
            "ratio": round(step_ms / steps["dp"], 3),
            "predicted_ms": round(rank0["predicted_ms"][name], 2),
            "dp_predicted_ms": round(rank0["predicted_ms"]["dp"], 2),
            "pipeline": rank0["chosen"][name],
            # the first stage (rank 0) and the last (the last rank): measured, predicted MiB
            "activations_mib": {
                where: [round(v / 2**20, 3) for v in results[r]["activations"][name]]
                for where, r in (("first stage", 0), ("last stage", NPROC - 1))
            },
            "dp_activations_mib": [round(v / 2**20, 3) for v in rank0["activations"]["dp"]],
            "hardware": args.hardware,
            "first_loss": rank0["first_loss"][name],
            "dp_first_loss": reference,
            "loss_agrees": loss_gap <= args.tolerance,
        }
        print(json.dumps(line))
        records.append(
            {
                "question": f"{model}-4r-{name}",
                "what": (
                    f"step time, ours as {line['pipeline']} on 4 ranks ({name}) / ours on "
                    f"4 dp ranks, {model}, batch {args.batch}, 4 gloo ranks on this "
                    "host, round-robin"
                ),
                "figure": line["ratio"],
                "unit": "x",
                **line,
            }
        )
    failed = [r["variant"] for r in records if not r["loss_agrees"]]
    if failed:
        print(f"first-step losses disagree with dp's: {', '.join(failed)}", file=sys.stderr)
    if not args.no_record:
        record("pipeline_step", records, argv)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
