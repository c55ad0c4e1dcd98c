"""The families of named user constraints, each a function from a Problem to rows.

Every family returns :class:`UserConstraint` objects (a name, a description, rows over the
problem's columns); the caller adds them with ``problem.add_constraint``, so any of them can
be listed, removed and re-solved, and an infeasible set is explained by name.

* placements of one node (``input:0``, ``output:0``, ``param:<fqn>``, ``node:<name>``);
* parameter memory per device (``parameter_memory``);
* mixed precision: gradients reduced in ``reduce_dtype`` (``mixed_precision:<fqn>``);
* ``with_sharding_constraint`` calls in the model (``with_sharding_constraint:<node>``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial

from autoparallel.graph.view_ops import passes_gradient_through
from autoparallel.trace.sharding_constraint import constraint_nodes, requested_placements
from autoparallel.types.placements import OutputPlacements, is_multi, placement_str
from autoparallel.types.problem import MIB, Problem, Row, UserConstraint
from autoparallel.types.strategies import Strategy
from autoparallel.types.tensors import local_shape

# ---------------------------------------------------------------------------- placements


def placement_constraint(
    problem: Problem, name: str, node: fx.Node, placements: OutputPlacements, what: str
) -> UserConstraint:
    """Force ``node`` to produce ``placements`` (raises if no strategy can)."""
    ns = problem.space[node]
    matching = [i for i, s in enumerate(ns.strategies) if s.output == tuple(placements)]
    if not matching:
        offered = ", ".join(placement_str(p) for p in ns.output_placements())
        raise ValueError(
            f"{what} cannot be {placement_str(tuple(placements))}: for shape "
            f"{tuple(node.meta['val'].shape)} on mesh {problem.space.mesh_shape} the possible placements are "
            f"{offered}"
        )
    columns = problem.node_columns[node][matching]
    row = Row(columns, np.ones(len(columns)), 1.0, 1.0)
    return UserConstraint(name, f"{what} = {placement_str(tuple(placements))}", [row])


def strategy_subset_constraint(
    problem: Problem, name: str, node: fx.Node, allowed: Callable[[Strategy], bool], what: str
) -> UserConstraint:
    """Let ``node`` take only the strategies ``allowed`` accepts (raises if none is)."""
    strategies = problem.space[node].strategies
    matching = [i for i, s in enumerate(strategies) if allowed(s)]
    if not matching:
        raise ValueError(f"{what}: none of {node.name}'s {len(strategies)} strategies is allowed")
    columns = problem.node_columns[node][matching]
    return UserConstraint(name, what, [Row(columns, np.ones(len(columns)), 1.0, 1.0)])


def same_choice_constraint(
    problem: Problem,
    name: str,
    pairs: Sequence[tuple[fx.Node, Callable[[Strategy], Any]]],
    values: Sequence[Any],
    what: str,
) -> UserConstraint:
    """Make every (node, key) of ``pairs`` choose a strategy of the same key, for each key in
    ``values``: one row per key and pair after the first, summing to equal shares."""
    (first, first_key), rest = pairs[0], pairs[1:]
    rows = []
    for value in values:
        left = _columns_where(problem, first, lambda s, value=value: first_key(s) == value)
        for node, key in rest:
            right = _columns_where(problem, node, lambda s, key=key, value=value: key(s) == value)
            columns = np.concatenate([left, right])
            signs = np.concatenate([np.ones(len(left)), -np.ones(len(right))])
            rows.append(Row(columns, signs, 0.0, 0.0).merged())
    return UserConstraint(name, what, rows)


def _columns_where(problem: Problem, node: fx.Node, allowed: Callable[[Strategy], bool]):
    strategies = problem.space[node].strategies
    matching = [i for i, s in enumerate(strategies) if allowed(s)]
    return problem.node_columns[node][matching]


# ---------------------------------------------------------------------------- parameter memory


def parameter_bytes(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(columns, local bytes) of every parameter strategy: per-device parameter memory."""
    columns, values = [], []
    mesh_shape = problem.space.mesh_shape
    for node in distinct_param_nodes(problem):
        value = node.meta["val"]
        itemsize = value.element_size()
        for column, strategy in zip(problem.node_columns[node], problem.space[node].strategies):
            numel = int(
                np.prod(local_shape(value.shape, strategy.output, mesh_shape), dtype=np.int64)
            )
            columns.append(column)
            values.append(float(numel * itemsize))
    return np.array(columns, dtype=np.int64), np.array(values)


def distinct_param_nodes(problem: Problem) -> list[fx.Node]:
    """One placeholder per parameter tensor: tied names count once in memory."""
    duplicates = {name for group in problem.joint.tied_params for name in group[1:]}
    return [node for name, node in problem.joint.params.items() if name not in duplicates]


def parameter_memory_range(problem: Problem) -> tuple[float, float, float]:
    """(fully replicated, smallest achievable, 1/world-size) per-device parameter bytes."""
    columns, values = parameter_bytes(problem)
    replicated = smallest = 0.0
    for node in distinct_param_nodes(problem):
        node_values = values[np.isin(columns, problem.node_columns[node])]
        replicated += float(node_values.max()) if len(node_values) else 0.0
        smallest += float(node_values.min()) if len(node_values) else 0.0
    world = float(np.prod(problem.space.mesh_shape))
    return replicated, smallest, replicated / world


def byte_count(value: Any, what: str) -> float:
    """``value`` as a number of bytes: TypeError naming ``what`` for anything but a real
    number (a string such as "1GB" included), ValueError for NaN or a negative count."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of bytes, got {value!r}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{what} must be a non-negative number of bytes, got {value!r}")
    return float(value)


def parameter_memory_constraint(
    problem: Problem, name: str, low: float | None, high: float | None
) -> UserConstraint:
    """Per-device parameter bytes within [low, high].

    Defaults: ``high`` is the smallest achievable per-device parameter memory (every
    parameter as sharded as its shape allows: 1/world-size for shardable parameters,
    replicated for ones too small or indivisible), so the constraint pushes toward
    1/world-size and is always feasible; ``low`` is 0. Bounds go through :func:`byte_count`;
    ValueError when ``low > high``.
    """
    lower = 0.0 if low is None else byte_count(low, "parameter memory low")
    upper_given = None if high is None else byte_count(high, "parameter memory high")
    columns, values = parameter_bytes(problem)
    replicated, smallest, _ = parameter_memory_range(problem)
    upper = smallest * (1 + 1e-9) + 1.0 if upper_given is None else upper_given
    if lower > upper:
        raise ValueError(f"parameter memory constraint has low={lower:.0f} B > high={upper:.0f} B")
    rows = [Row(columns, values / MIB, lower / MIB, upper / MIB).merged()]
    if upper <= smallest * (1 + 1e-6) + 1.0:
        rows.extend(_smallest_memory_rows(problem, columns, values))
    description = (
        f"parameter memory per device in [{lower / MIB:.2f}, {upper / MIB:.2f}] MiB "
        f"(replicated {replicated / MIB:.2f} MiB, smallest possible {smallest / MIB:.2f} MiB)"
    )
    return UserConstraint(name, description, rows)


def _smallest_memory_rows(problem: Problem, columns: np.ndarray, values: np.ndarray) -> list[Row]:
    """When the bound equals the smallest achievable memory, every parameter must be at
    its own minimum. Saying so per parameter is the same constraint, but it spares the
    solver a knapsack row whose LP relaxation is weak (a 3-D mesh otherwise times out)."""
    rows = []
    for node in distinct_param_nodes(problem):
        mask = np.isin(columns, problem.node_columns[node])
        node_values = values[mask]
        wasteful = columns[mask][node_values > node_values.min() * (1 + 1e-9)]
        wasteful = np.unique(wasteful)  # folded parameters share columns
        if len(wasteful):
            rows.append(Row(wasteful, np.ones(len(wasteful)), 0.0, 0.0))
    return rows


# ---------------------------------------------------------------------------- mixed precision


def gradient_chain_edges(grad_node: fx.Node, reduce_dtype: torch.dtype) -> list[fx.Node]:
    """Consumers whose (single) input edge must not reduce, walking back from ``grad_node``.

    From the parameter-gradient output back through casts and layout ops, every edge whose
    tensor is not yet in ``reduce_dtype`` belongs to the un-reduced part of the gradient.
    The walk stops at the op that computed the gradient (a matmul, a sum, ...).
    """
    consumers: list[fx.Node] = []
    node = grad_node
    while passes_gradient_through(node):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            break
        producer = inputs[0]
        value = producer.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype != reduce_dtype:
            consumers.append(node)
        if len(producer.users) != 1:
            break
        node = producer
    return consumers


def reduction_dtype_constraints(
    problem: Problem, policy: MixedPrecisionPolicy
) -> list[UserConstraint]:
    """Keep each parameter gradient unreduced until it is in the policy's reduction dtype
    (``reduce_dtype``, else ``param_dtype``), and reduced before it leaves that dtype.

    On each edge of :func:`gradient_chain_edges`, and on the gradient's boundary edge when
    the gradient leaves in another dtype (bf16 reduced, fp32 stored), the placement pairs
    that would reduce (``Partial`` on a mesh dim at the producer, not at the consumer) are
    forbidden: one row holding their pair variables at zero, which the solver's presolve
    removes outright. This holds whatever the prices say (a coalesced fp32 reduction at the
    boundary can be cheaper than a bf16 one inside the graph). Returns one named constraint
    per parameter that needs one.
    """
    reduce_dtype = policy.reduce_dtype or policy.param_dtype
    if reduce_dtype is None:
        return []
    index_of = {id(edge): index for index, edge in enumerate(problem.tables.edges)}
    boundary = {
        edge.producer: index_of[id(edge)]
        for edge in problem.tables.edges
        if edge.kind == "param_grad"
    }
    constraints = []
    for name, grad_node in problem.joint.param_grads.items():
        forbidden = [
            _reducing_columns(problem, index_of[id(edge)])
            for consumer in gradient_chain_edges(grad_node, reduce_dtype)
            for edge in problem.tables.incoming.get(consumer, [])
            if edge.kind == "arg"
        ]
        value = grad_node.meta.get("val")
        if grad_node in boundary and getattr(value, "dtype", reduce_dtype) != reduce_dtype:
            forbidden.append(_reducing_columns(problem, boundary[grad_node]))
        columns = np.concatenate(forbidden) if forbidden else np.zeros(0, dtype=np.int64)
        if len(columns):
            row = Row(columns.astype(np.int64), np.ones(len(columns)), 0.0, 0.0)
            description = f"gradient of {name} reduced in {reduce_dtype}"
            constraints.append(UserConstraint(f"mixed_precision:{name}", description, [row]))
    return constraints


def _reducing_columns(problem: Problem, edge_index: int) -> np.ndarray:
    """Columns of an edge (placement pairs or route steps) that sum a Partial placement."""
    reducing = [
        move.column
        for move in problem.edge_moves(edge_index)
        if any(
            _partial_at(move.src, d) and not _partial_at(move.dst, d)
            for d in range(len(move.src or ()))
        )
    ]
    return np.array(reducing, dtype=np.int64)


def _partial_at(placements: Any, mesh_dim: int) -> bool:
    if placements is None or is_multi(placements):
        return False
    return isinstance(placements[mesh_dim], Partial)


# ---------------------------------------------------------------------------- sharding constraints


def sharding_constraints(problem: Problem, mesh_shape: Sequence[int]) -> list[UserConstraint]:
    """One named placement constraint per constraint node of the problem's graph."""
    constraints = []
    forward = problem.joint.forward_nodes
    for node in constraint_nodes(problem.joint.graph):
        tensor = node.all_input_nodes[0].name
        what = f" on {tensor}" + ("" if node in forward else " (gradient)")
        placements = requested_placements(node, mesh_shape, what)
        name = f"with_sharding_constraint:{node.name}"
        constraints.append(
            placement_constraint(problem, name, node, placements, f"with_sharding_constraint{what}")
        )
    return constraints
