"""The Plan: what the solver chose, in plain data keyed by node and parameter names.

Every reader of a solution (the log, explain/diff/save/load, the JSON and the runtime) reads
this one type. It holds names and placements, never live torch objects, so it can be kept,
compared and sent to other ranks. :class:`Solution` is the solver's raw answer (a strategy
index per node) from which ``solver/plan.py`` builds the Plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autoparallel.types.kinds import (
    BucketKind,
    EdgeKind,
    NodePhase,
    ParameterOp,
    Phase,
    SolverMethod,
)
from autoparallel.types.memory import MemoryEstimate
from autoparallel.types.pipeline import PipelinePlan
from autoparallel.types.placements import OutputPlacements, Placements
from autoparallel.types.strategies import Strategy


@dataclass
class SolverStats:
    status: str
    objective: float
    bound: float
    gap: float
    time_s: float
    num_variables: int
    num_constraints: int
    method: SolverMethod = "mip"  # how the plan was reached (see SolverMethod)


@dataclass
class Solution:
    choice: dict[fx.Node, int]
    stats: SolverStats
    # values of the constraints' auxiliary columns by name (types/problem.AuxiliaryColumns)
    auxiliary: dict[str, float] = field(default_factory=dict)
    # the solver's basis at the relaxation's optimum (opaque, never saved): a re-solve of the
    # same rows and columns at other prices starts from it (ShardingOptimizer.resolve's refits)
    warm_start: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class ArgumentCost:
    """How one input slot of a node is fed: producer placement -> required placement."""

    producer: str
    slot: int
    kind: EdgeKind
    src: OutputPlacements
    dst: OutputPlacements
    comm_us: float
    transition_us: float
    # placements visited between src and dst, one mesh dim changing per step (the priced
    # route, which the runtime follows); () when src -> dst is a single step or no change
    route: tuple[OutputPlacements, ...] = ()

    @property
    def is_redistribution(self) -> bool:
        return self.src != self.dst

    @property
    def steps(self) -> list[tuple[OutputPlacements, OutputPlacements]]:
        """(from, to) of each step of the redistribution, in execution order."""
        states = [self.src, *self.route, self.dst]
        return [(a, b) for a, b in zip(states, states[1:]) if a != b]


@dataclass
class NodePlan:
    name: str
    target: str
    shape: tuple[int, ...] | None
    phase: NodePhase
    strategy: Strategy
    compute_us: float
    arguments: list[ArgumentCost] = field(default_factory=list)
    collectives_us: float = 0.0  # the node's own collectives: a local_map region's body's

    @property
    def comm_us(self) -> float:
        """The redistributions into the node and the collectives it issues itself."""
        return sum(a.comm_us for a in self.arguments) + self.collectives_us

    @property
    def transition_us(self) -> float:
        return sum(a.transition_us for a in self.arguments)


@dataclass(frozen=True)
class CostTotals:
    """One step's predicted time (us): total = compute + comm + transition - hidden.

    ``comm_us`` is all the step's communication; ``hidden_comm_us`` the part of it that runs
    behind compute (see :class:`OverlapCost`), so ``exposed_comm_us`` is what the step waits
    for. ``optimizer_us`` is the optimizer step's part of ``compute_us`` and ``runtime_us``
    the parallel module's own work outside its traced graphs (both 0 where the hardware does
    not price them: the presets), ``runtime_forward_us`` the part of it the forward does."""

    total_us: float
    comm_us: float
    compute_us: float
    transition_us: float
    optimizer_us: float = 0.0
    hidden_comm_us: float = 0.0
    runtime_us: float = 0.0
    runtime_forward_us: float = 0.0

    @property
    def exposed_comm_us(self) -> float:
        return self.comm_us - self.hidden_comm_us


@dataclass(frozen=True)
class BucketCost:
    """Collectives the runtime issues as one (a gradient-reduction bucket, a layer's
    parameter gathers): the fixed cost it pays once, and how many tensors share it."""

    kind: BucketKind
    description: str
    latency_us: float  # paid once per step (per phase, for a layer's gathers)
    tensors: int  # how many of the plan's moves it carries
    candidates: int  # how many could have joined (the objective shared the latency by these)
    phase: Phase = "backward"  # the phase that runs it ("forward": a layer's forward gathers)


@dataclass(frozen=True)
class OverlapCost:
    """Communication the runtime runs while some compute runs (problem/overlap.py): ``comm``
    hides behind ``during``, by ``hidden_us`` = the hardware's overlap fraction times the
    smaller of the two."""

    phase: Phase
    comm: str  # e.g. "gradient reductions of layers.3"
    during: str  # e.g. "backward of layers.2"
    comm_us: float
    compute_us: float
    hidden_us: float


@dataclass(frozen=True)
class ParameterUse:
    """Where the forward first reads a parameter, seen through its casts, views and
    transposes: the op (``node``, of kind ``op``) and the placement that op requires of the
    activation it combines the parameter with (``None`` where it takes none). A matmul's
    activation is its other operand; a norm's, the tensor it scales. ``feeds_output``: the
    op's result reaches a model output through views only (a language model's head);
    ``arrives``: the activation's placement as its producer left it.
    The torch-code export reads the plan's tensor-parallel styles from these."""

    op: ParameterOp
    node: str
    activation: Placements | None = None
    feeds_output: bool = False
    # the activation's placement where it enters the module, before the views and the
    # redistribution that bring it to ``activation`` (a sequence-parallel norm's output
    # arrives sequence-sharded and is gathered for the matmul)
    arrives: Placements | None = None
    # the parameter's placement where the forward first reads it: equal to its placement at
    # rest, or whole on a dim where the runtime gathers it first (FSDP's all-gather)
    at_use: Placements | None = None
    # the placement the op's result is read in by its first consumer, past the one view
    # that unflattens a linear's result (a column-parallel result gathered, a row-parallel
    # partial sum reduced); None where a model output takes it
    leaves: Placements | None = None
    # the nodes at the module's edges, where torch's styles move data: the view that
    # flattens a linear's input, the op itself, the view that unflattens its result
    boundary: tuple[str, ...] = ()
    # the parameter's placeholder node: where the backward reads it again (a re-gather)
    placeholder: str = ""


@dataclass
class Plan:
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    nodes: dict[str, NodePlan]
    param_placements: dict[str, Placements]
    buffer_placements: dict[str, Placements]
    input_placements: list[Placements]
    output_placements: list[Placements | None]
    totals: CostTotals
    solver: SolverStats
    fallbacks: list[str]
    # coalesced collectives: their latency is in totals.comm_us, not in any argument's
    buckets: list[BucketCost] = field(default_factory=list)
    # communication hidden behind compute: totals.hidden_comm_us is their sum
    overlaps: list[OverlapCost] = field(default_factory=list)
    # the Hardware's name the prices come from (a preset, or the profile's name)
    priced_on: str = ""
    # predicted bytes per device of a training step (problem/memory.py)
    memory: MemoryEstimate | None = None
    # numbered layers (``"layers.3"``) whose forward the backward recomputes instead of
    # keeping its activations (activation checkpointing, graph/layers.py)
    recompute: tuple[str, ...] = ()
    # with a "pp" mesh dim: the schedule, microbatches and stages (this plan is the
    # placements of ``pipeline.stage_index``'s stage on the mesh's other dims)
    pipeline: PipelinePlan | None = None
    # parameter name -> the op of the forward that reads it (see ParameterUse)
    parameter_uses: dict[str, ParameterUse] = field(default_factory=dict)

    def redistributions(self) -> list[tuple[str, ArgumentCost]]:
        """Every (consumer node name, argument) where a collective or local reshard happens."""
        return [
            (name, arg)
            for name, node in self.nodes.items()
            for arg in node.arguments
            if arg.is_redistribution
        ]
