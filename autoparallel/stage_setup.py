"""The pipeline stages' setup around the one-graph planner: the settings to try, the cut, a
stage's place in the pipeline and its price (pipeline_planning.py orchestrates them).

With a mesh dim named ``pp`` (the mesh's first), ``AutoParallel`` plans this rank's stage:

    a setting (``pipeline_settings``: microbatches, schedule)
        -> the model cut at its layer stack for it (``cut_model``, trace/stages.py; one
           export per microbatch shape, kept by the ``StageTracer``)
        -> this rank's stage (``StageCut.take``): its module, its example microbatch, the
           mesh without ``pp``
        -> the usual pipeline on that stage (trace ... solve), with the stage boundaries
           pinned (below), priced as one stage of the pipeline (``stage_price``)
        -> apply_placement: the stage's parallel module inside a torch.distributed.pipelining
           schedule (runtime/pipeline.py)

Ordering contract: the cut needs the setting (layers per stage, microbatches), so it is
fixed before the stage is traced; another setting is another cut and another trace.
Each rank plans its own stage; what two stages must agree on is only the layout of the
tensors they pass, so every tensor crossing a cut is pinned: split by rows over the first
mesh dim after ``pp`` when its dim 0 is the microbatch's rows (the hidden states), replicated
otherwise (tables computed once in the forward, such as a LLaMA's rotary cos/sin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoparallel._torch_internals import tree_flatten
from autoparallel.cost.pipeline import microbatches_in_flight, transfer_us
from autoparallel.cost.topology import Topology
from autoparallel.graph.layers import forward_layers
from autoparallel.trace.stages import StageModule, StageTracer
from autoparallel.types.graph import JointGraph
from autoparallel.types.pipeline import (
    INTERLEAVED,
    INTERLEAVED_STAGES_PER_RANK,
    PIPELINE_DIM,
    PipelineConfig,
    PipelineError,
    PipelinePlan,
    ScheduleName,
    StagePrice,
)
from autoparallel.types.plan import Plan


@dataclass(frozen=True)
class StageSetup:
    """This rank's stage and how it sits in the pipeline."""

    stage: StageModule
    stages: tuple[tuple[str, ...], ...]  # the layers of every stage, in order
    mesh: DeviceMesh  # the mesh without the pp dim: what the stage is planned on
    pp_mesh: DeviceMesh  # the 1-D mesh of this rank's pipeline (its group moves activations)
    config: PipelineConfig  # schedule and microbatches decided

    @property
    def microbatches(self) -> int:
        return self.config.microbatches

    @property
    def stages_per_rank(self) -> int:
        return self.config.stages_per_rank

    @property
    def in_flight(self) -> int:
        """Microbatches whose activations this stage holds at once under the schedule."""
        return microbatches_in_flight(
            self.config.schedule,
            self.stage.index,
            len(self.stages),
            self.microbatches,
            self.stages_per_rank,
        )

    @property
    def rank_stages(self) -> tuple[int, ...]:
        """The stages of this stage's pp rank, in order (this one among them)."""
        return self.pipeline_plan().rank_stages

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

    def pipeline_plan(self) -> PipelinePlan:
        """The pipeline this stage runs in, not priced yet."""
        return PipelinePlan(
            self.config.schedule,
            self.microbatches,
            self.stages,
            self.stage.index,
            stages_per_rank=self.stages_per_rank,
        )

    def input_fn(self) -> tuple[torch.Tensor, ...]:
        return self.stage.example_inputs


def is_pipeline_mesh(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` asks for pipeline stages; raises PipelineError for a ``pp`` dim that is
    not the first."""
    names = tuple(mesh.mesh_dim_names or ())
    if PIPELINE_DIM not in names:
        return False
    if names[0] != PIPELINE_DIM:
        raise PipelineError(
            f"the '{PIPELINE_DIM}' mesh dim must be the mesh's first, got mesh_dim_names={names}"
        )
    return True


def with_stage_dim(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh of ``pp`` alone as ``(pp, 1)``, named ``("pp", "dp")``: each stage is then
    planned on a mesh of its one device. Collective (it builds the new dims' groups): every
    rank calls it, as every rank constructs ``AutoParallel``."""
    if mesh.ndim > 1:
        return mesh
    return DeviceMesh(
        mesh.device_type, mesh.mesh.reshape(-1, 1), mesh_dim_names=(PIPELINE_DIM, "dp")
    )


@dataclass(frozen=True)
class StageCut:
    """The model cut into its stages for one pipeline setting (every stage: a process that
    plans several stages takes them all from one cut). ``config`` is the setting with its
    schedule and microbatches decided."""

    stages: tuple[StageModule, ...]
    config: PipelineConfig

    def take(self, mesh: DeviceMesh, index: int | None = None) -> StageSetup:
        """Stage ``index`` (default: this rank's first, its coordinate on ``mesh``'s pp
        dim)."""
        rest = mesh.mesh_dim_names[1:]
        return StageSetup(
            self.stages[mesh.get_local_rank(PIPELINE_DIM) if index is None else index],
            tuple(s.layers for s in self.stages),
            mesh[rest] if len(rest) > 1 else mesh[rest[0]],
            mesh[PIPELINE_DIM],
            self.config,
        )


def pipeline_settings(
    global_inputs: Any, mesh: DeviceMesh, config: PipelineConfig
) -> tuple[PipelineConfig, ...]:
    """The settings to plan, the user's fixed parts kept, the first the one planned first.

    Microbatches, where the user left them open: every count dividing the rows each rank of
    the mesh's first dim after ``pp`` gets, from the number of pp ranks up to four times it
    (fewer leave a stage idle for longer than it works; the planner prices each); where the
    batch has fewer rows than that, the largest count it has. Schedule: interleaved 1F1B
    with more than one stage per rank; else 1F1B where there are at least as many
    microbatches as stages, else GPipe (torch's 1F1B needs as many): 1F1B holds fewer
    microbatches' activations, and for stages of equal times both take the same time
    (cost/pipeline.py); GPipe is not priced beside it. (Two stages per rank are priced by
    the planner after these: pipeline_planning.py.)"""
    ranks, rows_over = mesh.shape[0], mesh.shape[1]
    batch = _batch_rows(*_as_args(global_inputs))
    if config.microbatches is not None:
        counts = [config.microbatches]
    else:
        local = batch // rows_over if batch % rows_over == 0 else batch
        divisors = [m for m in range(1, local + 1) if local % m == 0]
        counts = [m for m in divisors if ranks <= m <= 4 * ranks]
        counts = counts or [max(m for m in divisors if m < ranks)]
    per_rank = config.stages_per_rank or (
        INTERLEAVED_STAGES_PER_RANK if config.schedule == INTERLEAVED else 1
    )
    return tuple(
        PipelineConfig(
            config.schedule or _default_schedule(m, ranks, per_rank),
            m,
            config.stage_layers,
            per_rank,
        )
        for m in counts
    )


def _default_schedule(microbatches: int, ranks: int, stages_per_rank: int) -> ScheduleName:
    if stages_per_rank > 1:
        return INTERLEAVED
    return "1f1b" if microbatches >= ranks else "gpipe"


def check_setting(config: PipelineConfig, global_inputs: Any, mesh: DeviceMesh) -> None:
    """Raise PipelineError for a setting that cannot run: 1F1B with fewer microbatches than
    stages (torch's schedule refuses it), interleaved 1F1B with microbatches that do not
    come in whole rounds, microbatches that do not divide each rank's rows."""
    num_stages, rows_over = mesh.shape[0], mesh.shape[1]
    batch = _batch_rows(*_as_args(global_inputs))
    microbatches = config.microbatches
    if config.schedule == "1f1b" and microbatches < num_stages:
        raise PipelineError(
            f"1F1B needs at least as many microbatches as stages ({num_stages}), got "
            f"{microbatches}: give microbatches >= {num_stages}, or schedule='gpipe'"
        )
    rounds = max(1, microbatches // num_stages)
    if config.schedule == INTERLEAVED and microbatches % rounds:
        raise PipelineError(
            f"interleaved 1F1B runs the microbatches in rounds of {num_stages} (the pp "
            f"ranks): {microbatches} microbatches make {rounds} rounds that do not divide "
            f"them; give a multiple of {num_stages}"
        )
    if batch % (microbatches * rows_over):
        raise PipelineError(
            f"{microbatches} microbatches of the batch of {batch} split over "
            f"'{mesh.mesh_dim_names[1]}' ({rows_over} ways) do not divide it: choose "
            "microbatches dividing "
            f"{batch // rows_over if batch % rows_over == 0 else batch} per rank"
        )


def cut_model(
    tracer: StageTracer, global_inputs: Any, mesh: DeviceMesh, config: PipelineConfig
) -> StageCut:
    """Split the tracer's model for ``mesh``'s pp dim under ``config`` (one of
    ``pipeline_settings``: schedule and microbatches decided; checked by ``check_setting``).
    ``global_inputs``: what ``input_fn()`` returned (the global batch)."""
    check_setting(config, global_inputs, mesh)
    args, kwargs = _as_args(global_inputs)
    piece = _batch_rows(args, kwargs) // config.microbatches
    stages = tracer.split(
        tuple(_rows(a, piece) for a in args),
        {k: _rows(v, piece) for k, v in kwargs.items()},
        mesh.shape[0] * config.stages_per_rank,
        config.stage_layers,
    )
    return StageCut(tuple(stages), config)


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


def stage_price(
    setup: StageSetup, plan: Plan, joint: JointGraph, outputs: list[Any], whole: Topology
) -> StagePrice:
    """The stage's plan as the pipeline prices it: its step less the optimizer, split into
    forward and backward as its nodes' prices are, and its sends on the pp dim (its outputs
    forward, its inputs' gradients back), per microbatch; its memory (the plan's, which
    counts the microbatches in flight)."""
    ahead = [t for t in outputs if isinstance(t, torch.Tensor)] if not setup.is_last else []
    back = [] if setup.is_first else [t for t in setup.stage.example_inputs if t.requires_grad]
    ways = setup.mesh.shape[0]

    def sent_us(tensors: list[torch.Tensor]) -> float:
        local = (
            t.numel() * t.element_size() / (ways if setup.splits_rows(t) else 1) for t in tensors
        )
        return sum(transfer_us(nbytes, whole) for nbytes in local)

    totals, memory = plan.totals, plan.memory
    body, share = totals.total_us - totals.optimizer_us, _forward_share(plan)
    return StagePrice(
        microbatch_us=body,
        forward_us=body * share,
        optimizer_us=totals.optimizer_us,
        peak_bytes=None if memory is None else float(memory.peak),
        activation_bytes=None if memory is None else float(memory.activations),
        layer_us=_layer_us(plan, joint, setup.stage.layers, share),
        send_forward_us=sent_us(ahead),
        send_backward_us=sent_us(back),
    )


def _layer_us(
    plan: Plan, joint: JointGraph, layers: tuple[str, ...], forward_share: float
) -> float | None:
    """One of the stage's layers' forward and backward: the median over its layers of each
    one's forward nodes' prices (graph/layers.py's labels; the last layer's label also
    takes what follows it, a head), over the stage's forward share."""
    if not layers or forward_share <= 0:
        return None
    by_layer = dict.fromkeys(layers, 0.0)
    for node, label in forward_layers(joint).items():
        if label in by_layer and node.name in plan.nodes:
            by_layer[label] += _node_us(plan.nodes[node.name])
    forward = sorted(by_layer.values())[(len(by_layer) - 1) // 2]
    return forward / forward_share if forward > 0 else None


def _node_us(node: Any) -> float:
    return node.compute_us + node.comm_us + node.transition_us


def _forward_share(plan: Plan) -> float:
    """The forward's part of the plan's node prices (compute, comm, transitions)."""
    by_phase = {"forward": 0.0, "backward": 0.0}
    for node in plan.nodes.values():
        if node.phase in by_phase:
            by_phase[node.phase] += _node_us(node)
    total = sum(by_phase.values())
    return by_phase["forward"] / total if total > 0 else 0.0


def exchanged_prices(
    mine: list[StagePrice | None], setup: StageSetup
) -> list[StagePrice | None] | None:
    """Every stage's price, in stage order, from every rank of this rank's pipeline (``mine``:
    this rank's stages' prices, in order; None for a stage without a plan within the
    constraints); collective over the pp group. None where the mesh is fake: no peer plans
    the other stages, the caller plans them itself."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() == "fake":
        return None
    ranks = setup.pp_mesh.size()
    everyone: list[Any] = [None] * ranks
    dist.all_gather_object(everyone, mine, group=setup.pp_mesh.get_group())
    return [everyone[s % ranks][s // ranks] for s in range(len(setup.stages))]


def same_stage_graph(cut: StageCut, first: int, second: int) -> bool:
    """Whether two stages of ``cut`` plan alike: the same number of layers, neither the first
    nor the last (which hold the embedding and the head), inputs of the same shapes."""
    a, b = cut.stages[first], cut.stages[second]
    ends = {0, len(cut.stages) - 1}
    return (
        first not in ends
        and second not in ends
        and len(a.layers) == len(b.layers)
        and [t.shape for t in a.example_inputs] == [t.shape for t in b.example_inputs]
    )


def without_pipeline_dim(constraints: Any, what: str, stage_ndim: int) -> Any:
    """The user's placement tuples, written on the whole mesh, without their ``pp`` entry
    (which must be Replicate: the pipeline moves whole microbatches, it does not split a
    tensor over the stages); on a mesh of ``pp`` alone, the stage's one-device dim's
    Replicate (``with_stage_dim``)."""
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
        stripped.append(tuple(placements[1:]) or (Replicate(),) * stage_ndim)
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
