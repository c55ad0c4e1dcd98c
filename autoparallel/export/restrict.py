"""Re-plan within what torch's own styles express, and say what that restriction costs.

A free plan often has no torch expression: on a small model it may shard a weight at rest on
the tensor-parallel dim and gather it for a replicated compute (ZeRO over that dim), or split
weights along different dims on each mesh dim. :func:`plan_in_torch_styles` adds named
constraints (``torch_styles:*``) that leave the solver only the choices torch's recipe words
can write, solves again, and returns the plan with the free plan's cost beside it:

* on the data dim, every parameter is sharded at rest (``fully_shard``; or whole, DDP) and
  gathered before its use; every linear, embedding and norm reads its activation split by
  batch;
* on the model dim, a linear's weight is split by output features with its input whole
  (``ColwiseParallel``), by input features with its input split the same way
  (``RowwiseParallel``), or whole with its input whole; an embedding's table is split by
  vocabulary or features or whole, with its indices whole; a norm's weight is whole, its
  input whole or split by sequence, the same for every norm (``SequenceParallel``); a weight
  is read as it is stored (never gathered on the model dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoparallel.problem.constraints import same_choice_constraint, strategy_subset_constraint
from autoparallel.solver.parameter_uses import OPS, RESHAPES, first_reader, op_name, use_path
from autoparallel.types.plan import Plan
from autoparallel.types.problem import Row, UserConstraint
from autoparallel.types.strategies import Strategy

if TYPE_CHECKING:
    from autoparallel.optimizer import ShardingOptimizer

PREFIX = "torch_styles:"
"""The names of the constraints :func:`plan_in_torch_styles` adds start so."""

DataParallelKind = Literal["fully_shard", "replicate"]


@dataclass(frozen=True)
class RestrictedPlan:
    """The plan within torch's styles, and the free plan's predicted step beside it."""

    plan: Plan
    free_step_us: float
    constraints: tuple[str, ...]

    @property
    def cost_ratio(self) -> float:
        """The restricted plan's predicted step over the free plan's (>= 1 up to the gap)."""
        return self.plan.totals.total_us / self.free_step_us


def plan_in_torch_styles(
    optimizer: ShardingOptimizer,
    free: Plan,
    data_dim: int | None,
    model_dim: int | None,
    data_parallel: DataParallelKind = "fully_shard",
    drop_parameter_memory: bool = False,
) -> RestrictedPlan:
    """Solve ``optimizer``'s problem again within torch's styles (the module docstring);
    ``free`` is its plan without them. ``drop_parameter_memory``: remove the parameter
    memory constraint first (its default 1/world-size minimum is out of reach where the
    styles keep norms whole on the model dim; ``fully_shard`` shards every parameter on the
    data dim anyway) and solve the free plan again without it, so the two compare under the
    same constraints. Raises InfeasibleConstraintsError naming the constraints that leave
    no plan."""
    if drop_parameter_memory and PARAMETER_MEMORY in optimizer.constraints():
        optimizer.remove_constraints([PARAMETER_MEMORY])
        free = optimizer.resolve()
    names = torch_style_constraints(optimizer, data_dim, model_dim, data_parallel)
    plan = optimizer.resolve()
    return RestrictedPlan(plan, free.totals.total_us, tuple(names))


PARAMETER_MEMORY = "parameter_memory"
"""The name of the parameter memory constraint (``add_parameter_memory_constraint``)."""


def torch_style_constraints(
    optimizer: ShardingOptimizer,
    data_dim: int | None,
    model_dim: int | None,
    data_parallel: DataParallelKind = "fully_shard",
) -> list[str]:
    """Add the ``torch_styles:*`` constraints to ``optimizer``'s problem (replacing earlier
    ones); returns their names."""
    problem = optimizer.problem
    problem.remove_constraints([n for n in problem.user_constraints if n.startswith(PREFIX)])
    joint = problem.joint
    added: list[str] = []
    norms: list[tuple[fx.Node, int]] = []
    boundaries: set[tuple[fx.Node, fx.Node]] = set()  # edges where a style may move data

    def add(name: str, node: fx.Node, allowed, what: str) -> None:
        constraint = strategy_subset_constraint(problem, PREFIX + name, node, allowed, what)
        added.append(problem.add_constraint(constraint))

    for fqn, placeholder in joint.params.items():
        path = use_path(placeholder, joint.forward_nodes)
        if path is None:
            continue
        use, via = path[-1], path[-2]
        kind = OPS.get(op_name(use), "other")
        rank = placeholder.meta["val"].dim()
        stored = _stored(kind, rank)
        add(
            f"param:{fqn}",
            placeholder,
            lambda s, stored=stored: _at_rest(s.output, data_dim, model_dim, data_parallel, stored),
            f"{fqn} stored as torch's styles store it",
        )
        reader = first_reader(placeholder, joint.forward_nodes)
        slot = problem.space[reader].input_nodes.index(placeholder)
        add(
            f"read:{fqn}",
            reader,
            lambda s, slot=slot: _gathered_on_data(s.inputs[slot], data_dim),
            f"{fqn} gathered on the data dim before its use",
        )
        inputs = problem.space[use].input_nodes
        operand = _activation_slot(use, inputs, via)
        if operand is None:
            continue
        if kind == "scale":
            norms.append((use, operand))
        if kind in ("linear", "embedding"):
            boundaries |= _module_boundaries(use, inputs[operand], joint.forward_nodes)
        weight = inputs.index(via)
        if op_name(use) == "addmm" and weight == 0:  # a bias: its weight's rule covers the op
            continue
        add(
            f"use:{use.name}",
            use,
            lambda s, v=weight, a=operand, k=kind: _use_allowed(s, k, v, a, data_dim, model_dim),
            f"{use.name} reads {fqn} as a torch style does",
        )
    if model_dim is not None and len(norms) > 1:
        added.append(
            problem.add_constraint(
                same_choice_constraint(
                    problem,
                    PREFIX + "sequence_parallel",
                    [(node, lambda s, a=a: s.inputs[a][model_dim]) for node, a in norms],
                    [Shard(1), Replicate()],
                    "every norm on sequence shards, or none",
                )
            )
        )
    if model_dim is not None:
        added.append(
            problem.add_constraint(_unmoved_inside_modules(problem, model_dim, boundaries))
        )
    return added


def _module_boundaries(use: fx.Node, activation: fx.Node, forward) -> set[tuple[fx.Node, fx.Node]]:
    """The edges where a linear's or an embedding's style moves data: into its input (past
    the one view a linear flattens it with) and out of its result (past the view that
    unflattens it)."""
    edges = {(activation, use)}
    if op_name(activation) in RESHAPES:
        edges |= {(source, activation) for source in activation.all_input_nodes}
    for user in use.users:
        if user not in forward:
            continue
        edges.add((use, user))
        if op_name(user) in RESHAPES:
            edges |= {(user, after) for after in user.users if after in forward}
    return edges


def _unmoved_inside_modules(
    problem, model_dim: int, boundaries: set[tuple[fx.Node, fx.Node]]
) -> UserConstraint:
    """Every other forward edge keeps its tensor's placement on the model dim: between two
    modules torch's styles run the model's own code on local shards, with no collective.
    The edge columns (placement pairs, or route steps) that change it are held at 0."""
    forward = problem.joint.forward_nodes
    banned: list[int] = []
    for index, edge in enumerate(problem.tables.edges):
        if edge.consumer not in forward or edge.kind == "output":
            continue
        if (edge.producer, edge.consumer) in boundaries:
            continue
        banned += [
            move.column
            for move in problem.edge_moves(index)
            if _project(move.src, model_dim) != _project(move.dst, model_dim)
        ]
    columns = np.unique(np.array(banned, dtype=np.int64))
    return UserConstraint(
        PREFIX + "inside_modules",
        "no move on the model dim between two modules' styles, nor on a weight's way to its use",
        [Row(columns, np.ones(len(columns)), 0.0, 0.0)] if len(columns) else [],
    )


def _project(placements, dim: int):
    """``placements`` on mesh dim ``dim`` (a tuple of them for a node of several outputs)."""
    if placements and (isinstance(placements[0], tuple) or placements[0] is None):
        return tuple(None if p is None else p[dim] for p in placements)
    return placements[dim]


def _stored(kind: str, rank: int) -> tuple:
    """The placements a parameter may have at rest on the model dim."""
    if kind in ("linear", "embedding") and rank == 2:
        return (Shard(0), Shard(1), Replicate())
    if kind == "linear" and rank == 1:  # a bias: split with a column-parallel weight
        return (Shard(0), Replicate())
    return (Replicate(),)


def _at_rest(output, data_dim, model_dim, data_parallel, stored) -> bool:
    if data_dim is not None:
        sharded = isinstance(output[data_dim], Shard)
        if sharded != (data_parallel == "fully_shard"):
            return False
    return model_dim is None or output[model_dim] in stored


def _gathered_on_data(placements, data_dim) -> bool:
    return data_dim is None or placements[data_dim] == Replicate()


def _activation_slot(use: fx.Node, inputs: list[fx.Node], via: fx.Node) -> int | None:
    for slot, node in enumerate(inputs):
        if node is via or (op_name(use) == "addmm" and slot == 0):
            continue
        return slot
    return None


_LINEAR_PAIRS = (
    (Replicate(), Shard(1)),  # column parallel: input whole, t(weight) split by output features
    (Shard(1), Shard(0)),  # row parallel: input split by features, t(weight) the same way
    (Replicate(), Replicate()),
)
_EMBEDDING_TABLES = (Shard(0), Shard(1), Replicate())


def _use_allowed(
    strategy: Strategy, kind: str, weight: int, activation: int, data_dim, model_dim
) -> bool:
    act, held = strategy.inputs[activation], strategy.inputs[weight]
    if data_dim is not None and act[data_dim] != Shard(0):
        return False
    if model_dim is None:
        return True
    if kind == "linear":
        return (act[model_dim], held[model_dim]) in _LINEAR_PAIRS
    if kind == "embedding":
        return act[model_dim] == Replicate() and held[model_dim] in _EMBEDDING_TABLES
    if kind == "scale":
        return act[model_dim] in (Replicate(), Shard(1)) and held[model_dim] == Replicate()
    return True
