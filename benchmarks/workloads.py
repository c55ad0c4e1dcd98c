"""The workloads the benchmarks train, and the recipes they compare, in one place.

A workload is a model from :mod:`autoparallel.models`, a fixed global batch and a loss. Every
variant of a benchmark trains the same workload from the same init (seed 0) with the same
optimizer (:func:`make_optimizer`), each rank feeding its LOCAL rows of the global batch.

Recipes pin our planner to a hand-written strategy on a 1-D mesh with node constraints on
the parameters (inputs and outputs stay split by rows, as the harness feeds them):

* ``ddp``: every parameter replicated;
* ``fsdp``: every parameter sharded on its first dim (replicated where the mesh does not
  divide it);
* ``tp``: Megatron on the linears (column-parallel ``wq wk wv w1 w3`` and the MLP's first
  linear sharded on dim 0, row-parallel ``wo w2`` on dim 1), everything else replicated;
* ``free``: no pin, the planner's own choice.

torch's own ``DistributedDataParallel`` and ``fully_shard`` (FSDP2, per layer for the LLaMA)
are built by :func:`build_torch_ddp` and :func:`build_torch_fsdp2`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoparallel import AutoParallel, Plan, measure_step
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.models.moe import MOE_TINY, MoETransformer
from autoparallel.runtime.timing import StepTiming

LR = 1e-3
RECIPES = ("free", "ddp", "fsdp", "tp")
COLUMN_LINEARS = ("wq", "wk", "wv", "w1", "w3")
ROW_LINEARS = ("wo", "w2")


@dataclass(frozen=True)
class Workload:
    """A model builder and its global batch; ``vocab`` is None for a regression model."""

    name: str
    build: Callable[[], nn.Module]
    batch: int
    seq: int | None = None  # tokens per row (language models)
    dim: int | None = None  # input features (the MLP)
    vocab: int | None = None

    def global_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(inputs, targets) of the whole global batch, the same on every rank."""
        generator = torch.Generator().manual_seed(0)
        if self.vocab is None:
            return torch.randn(self.batch, self.dim, generator=generator), None
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _llama(name: str) -> Callable[[], nn.Module]:
    return lambda: Llama(llama_config(name))


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", lambda: MLP(512, 2048), batch=64, dim=512),
    "llama-tiny": Workload(
        "llama-tiny", _llama("tiny"), batch=8, seq=32, vocab=llama_config("tiny").vocab_size
    ),
    "llama-small": Workload(
        "llama-small", _llama("small"), batch=4, seq=64, vocab=llama_config("small").vocab_size
    ),
}


MOE_TINY_WORKLOAD = Workload(
    "moe-tiny",
    lambda: MoETransformer(MOE_TINY),
    batch=16,
    seq=64,
    vocab=MOE_TINY.vocab_size,
)
"""The tiny mixture-of-experts model (``benchmarks/moe_step_time.py``); apart from
:data:`WORKLOADS`, whose 1-D benchmarks have no expert-parallel mesh dim."""


def loss_of(output: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    if targets is None:
        return output.float().pow(2).mean()
    return F.cross_entropy(output.flatten(0, 1).float(), targets.flatten())


def local_rows(tensor: torch.Tensor | None, rank: int, world_size: int) -> torch.Tensor | None:
    if tensor is None:
        return None
    rows = tensor.shape[0] // world_size
    return tensor[rank * rows : (rank + 1) * rows]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the multi-tensor (foreach) kernels, for every variant alike.

    torch picks foreach by default on CUDA only; on CPU the default loop dispatches every op
    of every parameter separately, which for DTensor parameters (ours and FSDP2's) costs
    several times the step of plain tensors. ``foreach=True`` is what a CPU user should pass.
    """
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)


# ---------------------------------------------------------------------------------- ours


@dataclass(frozen=True)
class PlannedModel:
    module: nn.Module
    plan: Plan
    planning_s: float


def pin_recipe(autop: AutoParallel, recipe: str, world_size: int) -> None:
    """Constrain every parameter to ``recipe``'s placement (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard

    if recipe == "free":
        return
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {RECIPES}")
    optimizer = autop.sharding_optimizer
    for name, node in optimizer.problem.joint.params.items():
        shape = tuple(node.meta["val"].shape)
        placement = Replicate()
        if recipe == "fsdp" and shape[0] % world_size == 0:
            placement = Shard(0)
        elif recipe == "tp":
            placement = _megatron_placement(name, shape, world_size)
        optimizer.add_node_constraint(node, (placement,), name=f"recipe:{name}")


def _megatron_placement(name: str, shape: tuple[int, ...], world_size: int) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    module, _, kind = name.rpartition(".")
    linear = module.rpartition(".")[2]
    if linear in COLUMN_LINEARS and shape[0] % world_size == 0:
        return Shard(0)  # weight [out, in] and bias [out] of a column-parallel linear
    if linear in ROW_LINEARS and kind == "weight" and shape[1] % world_size == 0:
        return Shard(1)
    return Replicate()


def plan_ours(
    workload: Workload,
    mesh: Any,
    recipe: str = "free",
    hardware: str | None = None,
    memory_constraint: bool = False,
    memory_budget: float | None = None,
    activation_checkpointing: str = "off",
    mp_policy: Any = None,
    rows: tuple | None = None,
) -> PlannedModel:
    """Plan ``workload`` on ``mesh`` (pinned to ``recipe``; with the parameter memory
    constraint, or a peak ``memory_budget`` in bytes per device that may recompute layers
    as ``activation_checkpointing`` says; under ``mp_policy``, a MixedPrecisionPolicy),
    build and init the parallel module. ``rows``: the placements of the batch and the
    output (default: split by rows over every mesh dim)."""
    from torch.distributed.tensor import Shard

    with torch.device("meta"):
        model = workload.build()
    inputs, _ = workload.global_batch()
    start = time.perf_counter()
    with AutoParallel(model, lambda: inputs, mesh, mp_policy, hardware=hardware) as autop:
        rows = rows or tuple(Shard(0) for _ in range(mesh.ndim))
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        if memory_constraint:
            autop.add_parameter_memory_constraint()
        if memory_budget is not None:
            autop.add_memory_constraint(
                memory_budget, activation_checkpointing=activation_checkpointing
            )
        pin_recipe(autop, recipe, mesh.size())
        plan = autop.optimize_placement()
        check_same_plan(plan)
        parallel = autop.apply_placement(plan)
    planning_s = time.perf_counter() - start
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    return PlannedModel(parallel, plan, planning_s)


def check_same_plan(plan: Plan) -> None:
    """Every rank plans on its own: make sure they all chose the same placements."""
    mine = {name: str(p) for name, p in plan.param_placements.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(other != mine for other in everyone):
        raise RuntimeError(
            "ranks planned different parameter placements; the solve is not deterministic"
        )


# ---------------------------------------------------------------------------------- torch's


def build_torch_fsdp2(workload: Workload, mesh: Any) -> nn.Module:
    """``fully_shard`` per transformer layer (the LLaMA, the MoE) and on the root."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = workload.build()
    if isinstance(model, (Llama, MoETransformer)):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def build_torch_ddp(workload: Workload) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    model = workload.build()  # plain CPU tensors
    model.init_weights(seed=0)
    return DistributedDataParallel(model)


PHASES = ("forward", "backward", "optimizer")
"""The parts of a step :func:`training_step` times: forward + loss, backward, optimizer step."""


def predicted_phase_ms(plan: Plan) -> dict[str, float]:
    """The plan's predicted step split as :data:`PHASES` (ms): the forward's nodes (compute
    and communication) and the redistribution of each user output into its tangent's
    placement (priced on the tangent, but the runtime runs it as the output leaves the
    forward), the latency of the forward's parameter-gather buckets and the forward's share
    of the runtime's own work outside its graphs; the optimizer step; and the backward as
    the rest of the total (its nodes, the gradient reductions and their buckets, less the
    communication hidden, and the rest of the runtime's work)."""
    forward_us = sum(b.latency_us for b in plan.buckets if b.phase == "forward")
    forward_us += plan.totals.runtime_forward_us
    for node in plan.nodes.values():
        if node.phase == "forward":
            forward_us += node.compute_us + node.comm_us
        else:
            forward_us += sum(a.comm_us for a in node.arguments if a.kind == "output")
    optimizer_us = plan.totals.optimizer_us
    backward_us = plan.totals.total_us - forward_us - optimizer_us
    return {
        "forward": forward_us / 1e3,
        "backward": backward_us / 1e3,
        "optimizer": optimizer_us / 1e3,
    }


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor | None,
    loss_scale: float,
    losses: list[float],
    phase_ms: dict[str, list[float]] | None = None,
) -> Callable[[], None]:
    """One step: zero_grad, forward, loss, backward of ``loss * loss_scale``, optimizer step;
    appends each step's loss to ``losses`` and, given ``phase_ms``, the milliseconds of each
    of :data:`PHASES` to ``phase_ms[phase]`` (this rank's clock; on CPU every op is
    synchronous, so the split is exact up to the collectives a phase leaves running).

    Our module's gradients are those of the SUM of the ranks' losses (it computes the
    global model); torch's DDP/FSDP2 average: ``loss_scale`` 1/world_size for ours gives
    both the gradients of the global mean loss.
    """

    def step() -> None:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model(inputs), targets)
        forward_done = time.perf_counter()
        (loss * loss_scale).backward()
        backward_done = time.perf_counter()
        optimizer.step()
        optimizer_done = time.perf_counter()
        losses.append(loss.item())
        if phase_ms is not None:
            marks = (start, forward_done, backward_done, optimizer_done)
            for phase, begin, end in zip(PHASES, marks, marks[1:]):
                phase_ms.setdefault(phase, []).append((end - begin) * 1e3)

    return step


def local_param_bytes(model: nn.Module) -> int:
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


ROUND_WARMUP = 1
"""Untimed steps of each variant at the start of every round after the first: the variant
before it has just churned the caches and the allocator, which the first timed step would
pay."""


@dataclass
class TimedRun:
    """One variant to time round-robin: its training step (:func:`training_step`), the plan
    its prediction comes from (None for torch's own) and the step's per-phase record."""

    step: Callable[[], None]
    plan: Plan | None
    phase_ms: dict[str, list[float]]


def round_robin(
    runs: dict[str, TimedRun], rounds: int, steps: int, first_warmup: int
) -> dict[str, list[StepTiming]]:
    """Time ``runs`` in turn, ``rounds`` rounds of ``steps`` steps each (after
    ``first_warmup`` untimed steps in the first round and ``ROUND_WARMUP`` in the others),
    so a slow spell of the machine falls on every one alike; the same order on every rank.
    Each run's ``phase_ms`` keeps its timed steps only."""
    timings: dict[str, list[StepTiming]] = {name: [] for name in runs}
    for round_index in range(rounds):
        warmup = first_warmup if round_index == 0 else ROUND_WARMUP
        for name, run in runs.items():
            timings[name].append(measure_step(run.step, run.plan, steps=steps, warmup=warmup))
            if warmup:  # this round's untimed steps out of the phases
                for phase_times in run.phase_ms.values():
                    del phase_times[-(warmup + steps) : -steps]
    return timings
