"""Training-step time of autoparallel's parallel module vs torch's FSDP2 and DDP, on gloo CPU.

    python benchmarks/step_time.py --model mlp|llama-tiny --nproc 2 --steps 10 --warmup 3 [--compile]

Every variant trains the same model (same init, seed 0), on the same 1-D mesh of ``--nproc``
CPU ranks, with the same global batch split by rows (each rank feeds its LOCAL slice), with
AdamW. A step is zero_grad + forward + loss + backward + optimizer step; its time is the
slowest rank's, and the figure reported is the median over ``--steps`` steps after
``--warmup`` untimed ones. Each variant runs in its own set of processes
(``autoparallel._testing.harness.run_distributed``), so one failing or hanging variant does not take
the others down.

Comparisons, one JSON line each on stdout (children's output goes to stderr):

* ``memory``: ours planned with ``add_parameter_memory_constraint()`` vs ``fully_shard``.
* ``free``:   ours planned without a memory constraint vs ``DistributedDataParallel``.

``ratio`` is ours / theirs (below 1: ours is faster). While ``AutoParallel.apply_placement``
does not exist, ours is reported as unavailable and the baselines are still timed.

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
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script from a checkout: make `autoparallel` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autoparallel import AutoParallel, autoparallel_backend
from autoparallel._testing.harness import run_distributed
from autoparallel.models import MLP, Llama, llama_config

MODELS = ("mlp", "llama-tiny")
COMPILED = "+compile"
"""Suffix of the variants of ours run under torch.compile(..., backend=autoparallel_backend())."""
MLP_DIM, MLP_HIDDEN, MLP_BATCH = 512, 2048, 64
LLAMA_BATCH, LLAMA_SEQ = 8, 32
LR = 1e-3


# ---------------------------------------------------------------------------------- workload


def build_model(model_name: str) -> nn.Module:
    """The uninitialized model, on the ambient default device (use under torch.device("meta"))."""
    if model_name == "mlp":
        return MLP(MLP_DIM, MLP_HIDDEN)
    return Llama(llama_config("tiny"))


def global_batch(model_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(inputs, targets) of the whole global batch, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    if model_name == "mlp":
        return torch.randn(MLP_BATCH, MLP_DIM, generator=generator), None
    vocab = llama_config("tiny").vocab_size
    tokens = torch.randint(0, vocab, (LLAMA_BATCH, LLAMA_SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def input_fn_for(model_name: str) -> Callable[[], torch.Tensor]:
    """GLOBAL example inputs for the planner."""
    return lambda: global_batch(model_name)[0]


def loss_of(output: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    if targets is None:
        return output.float().pow(2).mean()
    return F.cross_entropy(output.flatten(0, 1).float(), targets.flatten())


def local_rows(tensor: torch.Tensor | None, rank: int, world_size: int) -> torch.Tensor | None:
    if tensor is None:
        return None
    rows = tensor.shape[0] // world_size
    return tensor[rank * rows : (rank + 1) * rows]


# ---------------------------------------------------------------------------------- variants


def _build_ours(
    model_name: str, mesh: Any, memory: bool, hardware: str | None
) -> tuple[nn.Module, dict]:
    from torch.distributed.tensor import Shard

    with torch.device("meta"):
        model = build_model(model_name)
    start = time.perf_counter()
    with AutoParallel(model, input_fn_for(model_name), mesh, hardware=hardware) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        if memory:
            autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        _check_same_plan(plan)
        parallel = autop.apply_placement(plan)
    planning_s = time.perf_counter() - start
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    placements = sorted({str(p) for p in plan.param_placements.values()})
    return parallel, {
        "planning_s": round(planning_s, 3),
        "predicted_ms": round(plan.totals.total_us / 1e3, 3),
        "priced_on": autop.topology.hardware.name,
        "param_placements": placements,
        "buckets": [f"{b.description} x{b.tensors}" for b in plan.buckets],
    }


def _check_same_plan(plan: Any) -> None:
    """Every rank plans on its own: make sure they all chose the same placements."""
    mine = {name: str(p) for name, p in plan.param_placements.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(other != mine for other in everyone):
        raise RuntimeError(
            "ranks planned different parameter placements; the solve is not deterministic"
        )


def _build_fsdp2(model_name: str, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = build_model(model_name)
    if isinstance(model, Llama):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _build_ddp(model_name: str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(model_name)  # plain CPU tensors
    model.init_weights(seed=0)
    return DistributedDataParallel(model)


def _local_param_bytes(model: nn.Module) -> int:
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def time_variant(
    rank: int,
    world_size: int,
    variant: str,
    model_name: str,
    steps: int,
    warmup: int,
    hardware: str | None,
) -> dict:
    """One rank of one variant: build, train ``warmup + steps`` steps, return timings."""
    from torch.distributed.device_mesh import init_device_mesh

    os.dup2(2, 1)  # keep the parent's stdout for JSON lines (HiGHS prints a banner)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    extra: dict = {}
    if variant == "fsdp2":
        model = _build_fsdp2(model_name, mesh)
    elif variant == "ddp":
        model = _build_ddp(model_name)
    else:
        memory = variant.startswith("ours-memory")
        model, extra = _build_ours(model_name, mesh, memory=memory, hardware=hardware)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # Compiled variants: the first call compiles the forward, the first backward() the
    # backward, both inside the (untimed) warm-up steps.
    run = (
        torch.compile(model, backend=autoparallel_backend(), fullgraph=True)
        if variant.endswith(COMPILED)
        else model
    )
    compiles = _CompileCounter()
    inputs, targets = global_batch(model_name)
    inputs, targets = local_rows(inputs, rank, world_size), local_rows(targets, rank, world_size)
    times, losses = [], []
    for step in range(warmup + steps):
        if step == warmup:
            compiles_in_warmup = compiles.count
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(run(inputs), targets)
        # Our module's gradients are those of the SUM of the ranks' losses (it computes the
        # global model); FSDP2/DDP average. Scaling by 1/world_size gives both the same
        # gradients of the global mean loss.
        (loss / world_size if variant.startswith("ours") else loss).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    slowest = torch.tensor(times[warmup:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    global_loss = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(global_loss)  # gloo has no ReduceOp.AVG
    if variant.endswith(COMPILED):  # a compile inside the timed steps would spoil the median
        extra["graphs_compiled"] = compiles.count
        extra["compiled_in_timed_steps"] = compiles.count - compiles_in_warmup
    compiles.close()
    first = torch.tensor(times[:1], dtype=torch.float64)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    return {
        "step_s": slowest.tolist(),
        "first_step_ms": round(1e3 * first[0].item(), 1) if warmup else None,
        "loss_first": global_loss[0].item() / world_size,
        "loss_last": global_loss[-1].item() / world_size,
        "param_bytes_per_rank": _local_param_bytes(model),
        **extra,
    }


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
    """Time ``variant`` on ``args.nproc`` ranks; {"status": "ok", ...} or {"status": "error", ...}."""
    try:
        results = run_distributed(
            time_variant,
            args.nproc,
            variant,
            args.model,
            args.steps,
            args.warmup,
            args.hardware,
            timeout_s=args.timeout,
        )
    except RuntimeError as exc:
        print(f"[{variant}] failed:\n{exc}", file=sys.stderr)
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        return {"status": "error", "error": lines[-1] if lines else repr(exc)}
    result = results[0]
    return {
        "status": "ok",
        "median_ms": round(1e3 * statistics.median(result["step_s"]), 3),
        **result,
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
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.nproc < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --nproc >= 1")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first step compiles and must not be timed")

    ours_available = hasattr(AutoParallel, "apply_placement")
    comparisons = [("memory", "ours-memory", "fsdp2"), ("free", "ours-free", "ddp")]
    failed = False
    for comparison, ours_variant, theirs_variant in comparisons:
        if ours_available:
            ours = run_variant(ours_variant, args)
        else:
            ours = {
                "status": "unavailable",
                "reason": "AutoParallel.apply_placement does not exist yet",
            }
        theirs = run_variant(theirs_variant, args)
        failed |= ours["status"] == "error" or theirs["status"] == "error"
        ratio = _ratio(ours, theirs)
        compiled = None
        if args.compile:
            if ours_available:
                compiled = run_variant(ours_variant + COMPILED, args)
            else:
                compiled = {
                    "status": "unavailable",
                    "reason": "AutoParallel.apply_placement does not exist yet",
                }
            failed |= compiled["status"] == "error"
        line = {
            "model": args.model,
            "nproc": args.nproc,
            "comparison": comparison,
            "steps": args.steps,
            "warmup": args.warmup,
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
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
