"""Orchestration of pipeline parallelism around the one-graph planner (no algorithm here).

With a mesh dim named ``pp`` (the mesh's first), ``AutoParallel`` plans this rank's stage:

    split the model at its layer stack (trace/stages.py)
        -> this rank's stage: its module, its example microbatch, the mesh without ``pp``
        -> the usual pipeline on that stage (trace ... solve), with the stage boundaries
           pinned (below)
        -> apply_placement: the stage's parallel module inside a torch.distributed.pipelining
           schedule (runtime/pipeline.py)

Ordering contract: the split needs the pipeline settings (layers per stage, microbatches), so
they are fixed before the stage is traced (``add_pipeline_constraint`` re-plans from here).
Each rank plans its own stage; what two stages must agree on is only the layout of the
tensors they pass, so every tensor crossing a cut is pinned: split by rows over the first
mesh dim after ``pp`` when its dim 0 is the microbatch's rows (the hidden states), replicated
otherwise (tables computed once in the forward, such as a LLaMA's rotary cos/sin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoparallel._torch_internals import tree_flatten
from autoparallel.cost.pipeline import (
    microbatches_in_flight,
    pipeline_cost,
    stage_memory,
    transfer_us,
)
from autoparallel.cost.topology import Topology
from autoparallel.trace.stages import StageModule, split_stages
from autoparallel.types.pipeline import (
    PIPELINE_DIM,
    PipelineConfig,
    PipelineCost,
    PipelineError,
    PipelinePlan,
    StageMemory,
)
from autoparallel.types.plan import Plan


@dataclass(frozen=True)
class StageSetup:
    """This rank's stage and how it sits in the pipeline."""

    stage: StageModule
    stages: tuple[tuple[str, ...], ...]  # the layers of every stage, in order
    mesh: DeviceMesh  # the mesh without the pp dim: what the stage is planned on
    pp_mesh: DeviceMesh  # the 1-D mesh of this rank's pipeline (its group moves activations)
    config: PipelineConfig
    microbatches: int

    @property
    def is_first(self) -> bool:
        return self.stage.index == 0

    @property
    def is_last(self) -> bool:
        return self.stage.index == len(self.stages) - 1

    @property
    def microbatch_rows(self) -> int:
        """Rows of a global microbatch: dim 0 of the stage's first input."""
        return int(self.stage.example_inputs[0].shape[0])

    def splits_rows(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor crossing a cut travels split by rows over the stage mesh's first
        dim (its dim 0 is the microbatch's rows) rather than replicated."""
        return tensor.ndim > 0 and tensor.shape[0] == self.microbatch_rows

    def pipeline_plan(
        self, cost: PipelineCost | None = None, memory: StageMemory | None = None
    ) -> PipelinePlan:
        return PipelinePlan(
            self.config.schedule, self.microbatches, self.stages, self.stage.index, cost, memory
        )

    def input_fn(self) -> tuple[torch.Tensor, ...]:
        return self.stage.example_inputs


def is_pipeline_mesh(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` asks for pipeline stages; raises PipelineError for a ``pp`` dim that is
    not the first or that is the only one."""
    names = tuple(mesh.mesh_dim_names or ())
    if PIPELINE_DIM not in names:
        return False
    if names[0] != PIPELINE_DIM:
        raise PipelineError(
            f"the '{PIPELINE_DIM}' mesh dim must be the mesh's first, got mesh_dim_names={names}"
        )
    if len(names) < 2:
        raise PipelineError(
            f"a '{PIPELINE_DIM}' mesh needs at least one more dim to plan each stage on: e.g. "
            f"init_device_mesh(..., ({mesh.shape[0]}, 1), mesh_dim_names=('pp', 'dp'))"
        )
    return True


def set_up_stage(
    model: nn.Module, global_inputs: Any, mesh: DeviceMesh, config: PipelineConfig
) -> StageSetup:
    """Split ``model`` for ``mesh``'s pp dim and take this rank's stage (see the module
    docstring). ``global_inputs``: what ``input_fn()`` returned (the global batch)."""
    args, kwargs = _as_args(global_inputs)
    num_stages = mesh.shape[0]
    rest = mesh.mesh_dim_names[1:]
    stage_mesh = mesh[rest] if len(rest) > 1 else mesh[rest[0]]
    rows_over = mesh.shape[1]
    batch = _batch_rows(args, kwargs)
    microbatches = config.microbatches or num_stages
    if config.schedule == "1f1b" and microbatches < num_stages:
        raise PipelineError(
            f"1F1B needs at least as many microbatches as stages ({num_stages}), got "
            f"{microbatches}: give microbatches >= {num_stages}, or schedule='gpipe'"
        )
    if batch % (microbatches * rows_over):
        raise PipelineError(
            f"{microbatches} microbatches of the batch of {batch} split over "
            f"'{rest[0]}' ({rows_over} ways) do not divide it: choose microbatches dividing "
            f"{batch // rows_over if batch % rows_over == 0 else batch} per rank"
        )
    piece = batch // microbatches
    stages = split_stages(
        model,
        tuple(_rows(a, piece) for a in args),
        {k: _rows(v, piece) for k, v in kwargs.items()},
        num_stages,
        config.stage_layers,
    )
    index = mesh.get_local_rank(PIPELINE_DIM)
    return StageSetup(
        stages[index],
        tuple(s.layers for s in stages),
        stage_mesh,
        mesh[PIPELINE_DIM],
        config,
        microbatches,
    )


def boundary_placements(
    setup: StageSetup, tensors: list[Any], ndim: int
) -> list[tuple[Placement, ...] | None]:
    """The pinned layout of each tensor crossing a cut (see the module docstring); ``tensors``
    are the stage's example inputs or outputs (None where not a tensor)."""
    split = (Shard(0),) + (Replicate(),) * (ndim - 1)
    replicated = (Replicate(),) * ndim
    return [
        None if not isinstance(t, torch.Tensor) else split if setup.splits_rows(t) else replicated
        for t in tensors
    ]


def priced_pipeline(
    setup: StageSetup, plan: Plan, outputs: list[Any], whole: Topology
) -> PipelinePlan:
    """The pipeline of ``plan`` with its predicted step (cost/pipeline.py): this stage's
    microbatch time is its plan's step less the optimizer, plus its sends on the pp dim (its
    outputs forward, its inputs' gradients back); the stages' times are exchanged over the pp
    group. Collective over the pp group on a real mesh; on a fake one (one process plans one
    stage) the other stages are unknown and the cost is None."""
    sends = [t for t in outputs if isinstance(t, torch.Tensor)] if not setup.is_last else []
    if not setup.is_first:
        sends += [t for t in setup.stage.example_inputs if t.requires_grad]
    ways = setup.mesh.shape[0]
    local = [t.numel() * t.element_size() / (ways if setup.splits_rows(t) else 1) for t in sends]
    mine = (
        plan.totals.total_us
        - plan.totals.optimizer_us
        + sum(transfer_us(nbytes, whole) for nbytes in local),
        plan.totals.optimizer_us,
    )
    in_flight = microbatches_in_flight(
        setup.config.schedule, setup.stage.index, len(setup.stages), setup.microbatches
    )
    memory = None if plan.memory is None else stage_memory(plan.memory, in_flight)
    everyone = _gathered(mine, setup.pp_mesh)
    if everyone is None:
        return setup.pipeline_plan(memory=memory)
    cost = pipeline_cost([t for t, _ in everyone], [o for _, o in everyone], setup.microbatches)
    return setup.pipeline_plan(cost, memory)


def _gathered(mine: tuple[float, float], pp_mesh: DeviceMesh) -> list[Any] | None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() == "fake":
        return None
    everyone: list[Any] = [None] * pp_mesh.size()
    dist.all_gather_object(everyone, mine, group=pp_mesh.get_group())
    return everyone


def check_materialized(setup: StageSetup) -> None:
    """Refuse to build a stage cut from a meta-device model: the stage is a GraphModule
    without the model's ``init_weights``, and its non-persistent buffers (a LLaMA's rotary
    tables) are in no state dict, so nothing could give them their values and the stage
    would train on garbage. Planning such a stage is fine (a fake mesh plans a cluster)."""
    on_meta = [
        name
        for name, tensor in (
            *setup.stage.module.named_parameters(),
            *setup.stage.module.named_buffers(),
        )
        if tensor.is_meta
    ]
    if on_meta:
        raise PipelineError(
            f"stage {setup.stage.index} was cut from a model on the meta device "
            f"({', '.join(on_meta[:3])}{', ...' if len(on_meta) > 3 else ''}): a pipeline "
            "stage cannot be initialized after to_empty yet; build the model on CPU (or "
            "load its weights) before AutoParallel, or plan without a 'pp' dim"
        )


def without_pipeline_dim(constraints: Any, what: str) -> Any:
    """The user's placement tuples, written on the whole mesh, without their ``pp`` entry
    (which must be Replicate: the pipeline moves whole microbatches, it does not split a
    tensor over the stages)."""
    if not isinstance(constraints, (list, tuple)):
        return constraints  # the planner's own check names the problem
    stripped = []
    for index, placements in enumerate(constraints):
        if placements is None or not isinstance(placements, (list, tuple)) or not placements:
            stripped.append(placements)
            continue
        if not isinstance(placements[0], Replicate):
            raise PipelineError(
                f"{what} {index}: the placement on the '{PIPELINE_DIM}' mesh dim must be "
                f"Replicate(), got {placements[0]!r} (stages pass whole microbatches)"
            )
        stripped.append(tuple(placements[1:]))
    return stripped


def _as_args(global_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(global_inputs, dict):
        return (), dict(global_inputs)
    if isinstance(global_inputs, (tuple, list)):
        return tuple(global_inputs), {}
    return (global_inputs,), {}


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.ndim > 0]
    if not tensors:
        raise PipelineError("pipeline stages need a batched tensor input (rows along dim 0)")
    return int(tensors[0].shape[0])


def _rows(value: Any, count: int) -> Any:
    return value[:count] if isinstance(value, torch.Tensor) and value.ndim > 0 else value
