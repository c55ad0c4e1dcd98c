"""Stage 4: the optimization problem (one MIP) built from a StrategySpace and its CostTables.

Variables
    x[n, s]  binary, node n runs strategy s; exactly one per node.
    y[e, p]  continuous in [0, 1], edge e uses placement pair p = (src, dst).

Edges are priced on distinct placement pairs, not on strategy pairs: for each edge the
y's of one producer placement sum to the x's of the producer strategies with that output
placement, and the y's of one required placement sum to the x's of the consumer strategies
requiring it. With integral x both marginals are unit vectors, so y is integral too; that is
why y needs no integrality, and the problem stays small.

User constraints (input/output placements, node placements, parameter memory) are kept
apart from the structural rows, by name, so they can be listed, removed and re-solved, and so
an infeasible problem can be explained by the constraints in conflict.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from autoparallel.cost.tables import CostTables, EdgeCost
from autoparallel.shapes import local_shape
from autoparallel.solver.folding import Folding, no_folding
from autoparallel.strategies.types import OutputPlacements, StrategySpace, placement_str
from autoparallel.trace import JointGraph

logger = logging.getLogger(__name__)

MIB = float(1 << 20)


@dataclass
class Row:
    """One linear constraint ``lower <= sum(values * x[columns]) <= upper``."""

    columns: np.ndarray
    values: np.ndarray
    lower: float
    upper: float


@dataclass
class UserConstraint:
    """A named constraint the user asked for; ``rows`` are added to the structural ones."""

    name: str
    description: str
    rows: list[Row]


@dataclass
class Problem:
    joint: JointGraph
    space: StrategySpace
    tables: CostTables
    node_columns: dict[fx.Node, np.ndarray]
    edge_columns: list[np.ndarray]
    objective: np.ndarray
    integrality: np.ndarray
    rows: list[Row]
    folding: Folding | None = None
    user_constraints: dict[str, UserConstraint] = field(default_factory=dict)

    @property
    def num_variables(self) -> int:
        return len(self.objective)

    @property
    def num_constraints(self) -> int:
        return len(self.rows) + sum(len(c.rows) for c in self.user_constraints.values())

    # ------------------------------------------------------------------ user constraints

    def add_constraint(self, constraint: UserConstraint) -> str:
        if constraint.name in self.user_constraints:
            raise ValueError(f"a constraint named {constraint.name!r} already exists")
        self.user_constraints[constraint.name] = constraint
        return constraint.name

    def remove_constraints(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.user_constraints]
        if unknown:
            raise KeyError(f"no such constraints: {unknown}; existing: {sorted(self.user_constraints)}")
        for name in names:
            del self.user_constraints[name]

    def placement_constraint(self, name: str, node: fx.Node, placements: OutputPlacements, what: str) -> UserConstraint:
        """Force ``node`` to produce ``placements`` (raises if no strategy can)."""
        ns = self.space[node]
        matching = [i for i, s in enumerate(ns.strategies) if s.output == tuple(placements)]
        if not matching:
            offered = ", ".join(placement_str(p) for p in ns.output_placements())
            raise ValueError(
                f"{what} cannot be {placement_str(tuple(placements))}: for shape "
                f"{tuple(node.meta['val'].shape)} on mesh {self.space.mesh_shape} the possible placements are "
                f"{offered}"
            )
        columns = self.node_columns[node][matching]
        row = Row(columns, np.ones(len(columns)), 1.0, 1.0)
        return UserConstraint(name, f"{what} = {placement_str(tuple(placements))}", [row])

    def parameter_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """(columns, local bytes) of every parameter strategy: per-device parameter memory."""
        columns, values = [], []
        mesh_shape = self.space.mesh_shape
        for node in self._distinct_param_nodes():
            value = node.meta["val"]
            itemsize = value.element_size()
            for column, strategy in zip(self.node_columns[node], self.space[node].strategies):
                numel = int(np.prod(local_shape(value.shape, strategy.output, mesh_shape), dtype=np.int64))
                columns.append(column)
                values.append(float(numel * itemsize))
        return np.array(columns, dtype=np.int64), np.array(values)

    def _distinct_param_nodes(self) -> list[fx.Node]:
        """One placeholder per parameter tensor: tied names count once in memory."""
        duplicates = {name for group in self.joint.tied_params for name in group[1:]}
        return [node for name, node in self.joint.params.items() if name not in duplicates]

    def parameter_memory_range(self) -> tuple[float, float, float]:
        """(fully replicated, smallest achievable, 1/world-size) per-device parameter bytes."""
        columns, values = self.parameter_bytes()
        replicated = smallest = 0.0
        for node in self._distinct_param_nodes():
            node_values = values[np.isin(columns, self.node_columns[node])]
            replicated += float(node_values.max()) if len(node_values) else 0.0
            smallest += float(node_values.min()) if len(node_values) else 0.0
        world = float(np.prod(self.space.mesh_shape))
        return replicated, smallest, replicated / world

    def memory_constraint(self, name: str, low: float | None, high: float | None) -> UserConstraint:
        """Per-device parameter bytes within [low, high].

        Defaults: ``high`` is the smallest achievable per-device parameter memory (every
        parameter as sharded as its shape allows: 1/world-size for shardable parameters,
        replicated for ones too small or indivisible), so the constraint pushes toward
        1/world-size and is always feasible; ``low`` is 0.
        """
        columns, values = self.parameter_bytes()
        replicated, smallest, _ = self.parameter_memory_range()
        upper = smallest * (1 + 1e-9) + 1.0 if high is None else float(high)
        lower = 0.0 if low is None else float(low)
        if lower > upper:
            raise ValueError(f"parameter memory constraint has low={lower:.0f} B > high={upper:.0f} B")
        rows = [_aggregated(Row(columns, values / MIB, lower / MIB, upper / MIB))]
        if upper <= smallest * (1 + 1e-6) + 1.0:
            rows.extend(self._smallest_memory_rows(columns, values))
        description = (
            f"parameter memory per device in [{lower / MIB:.2f}, {upper / MIB:.2f}] MiB "
            f"(replicated {replicated / MIB:.2f} MiB, smallest possible {smallest / MIB:.2f} MiB)"
        )
        return UserConstraint(name, description, rows)

    def _smallest_memory_rows(self, columns: np.ndarray, values: np.ndarray) -> list[Row]:
        """When the bound equals the smallest achievable memory, every parameter must be at
        its own minimum. Saying so per parameter is the same constraint, but it spares the
        solver a knapsack row whose LP relaxation is weak (a 3-D mesh otherwise times out)."""
        rows = []
        for node in self._distinct_param_nodes():
            mask = np.isin(columns, self.node_columns[node])
            node_values = values[mask]
            wasteful = columns[mask][node_values > node_values.min() * (1 + 1e-9)]
            wasteful = np.unique(wasteful)  # folded parameters share columns
            if len(wasteful):
                rows.append(Row(wasteful, np.ones(len(wasteful)), 0.0, 0.0))
        return rows


def build_problem(
    joint: JointGraph, space: StrategySpace, tables: CostTables, folding: Folding | None = None
) -> Problem:
    """The MIP of the stage docstring; with ``folding``, each class of repeated nodes has
    one set of x columns, edges whose endpoints fold alike share their y columns, and a
    shared column's cost is the sum over the members it stands for."""
    folding = folding or no_folding(space)
    representative = folding.representative
    objective: list[float] = []
    integrality: list[bool] = []
    node_columns: dict[fx.Node, np.ndarray] = {}
    rows: list[Row] = []

    def new_columns(count: int, integral: bool) -> np.ndarray:
        start = len(objective)
        objective.extend([0.0] * count)
        integrality.extend([integral] * count)
        return np.arange(start, len(objective), dtype=np.int64)

    for node in space.nodes:
        rep = representative[node]
        if rep not in node_columns:
            node_columns[rep] = new_columns(len(space[rep].strategies), integral=True)
            rows.append(Row(node_columns[rep], np.ones(len(node_columns[rep])), 1.0, 1.0))
        columns = node_columns[node] = node_columns[rep]
        for column, cost in zip(columns, tables.compute_us[node]):
            objective[column] += cost

    edge_columns = []
    shared_edges: dict[tuple, np.ndarray] = {}
    for edge in tables.edges:
        key = (representative[edge.producer], representative[edge.consumer], edge.slot, edge.kind, id(edge.pairs))
        columns = shared_edges.get(key)
        if columns is None:
            columns = shared_edges[key] = new_columns(len(edge.pairs), integral=False)
            rows.extend(_marginal_rows(edge, columns, node_columns))
        for column, (_, _, comm, transition) in zip(columns, edge.pairs):
            objective[column] += comm + transition
        edge_columns.append(columns)

    for group in joint.tied_params:
        nodes = [joint.params[name] for name in group if name in joint.params]
        for other in nodes[1:]:
            if node_columns[nodes[0]] is not node_columns[other]:
                rows.extend(_same_placement_rows(space, node_columns, nodes[0], other))

    problem = Problem(
        joint=joint,
        space=space,
        tables=tables,
        node_columns=node_columns,
        edge_columns=edge_columns,
        objective=np.array(objective),
        integrality=np.array(integrality, dtype=bool),
        rows=rows,
        folding=folding,
    )
    logger.info(
        "problem: %d variables, %d constraints (%d nodes in %d classes)",
        problem.num_variables, problem.num_constraints, len(space.nodes), folding.num_classes,
    )
    return problem


def _aggregated(row: Row) -> Row:
    """Merge repeated columns (folded nodes share them) by summing their coefficients."""
    columns, inverse = np.unique(row.columns, return_inverse=True)
    values = np.zeros(len(columns))
    np.add.at(values, inverse, row.values)
    return Row(columns, values, row.lower, row.upper)


def _same_placement_rows(
    space: StrategySpace, node_columns: dict[fx.Node, np.ndarray], first: fx.Node, second: fx.Node
) -> list[Row]:
    """Two placeholders of one tied parameter take the same placement."""
    rows = []
    for placements in space[first].output_placements():
        first_cols = [c for c, s in zip(node_columns[first], space[first].strategies) if s.output == placements]
        second_cols = [c for c, s in zip(node_columns[second], space[second].strategies) if s.output == placements]
        columns = np.array(first_cols + second_cols, dtype=np.int64)
        values = np.concatenate([np.ones(len(first_cols)), -np.ones(len(second_cols))])
        rows.append(Row(columns, values, 0.0, 0.0))
    return rows


def _marginal_rows(edge: EdgeCost, columns: np.ndarray, node_columns: dict[fx.Node, np.ndarray]) -> list[Row]:
    """sum of y over pairs with src a == sum of producer x with output a; same for dst."""
    rows = []
    sides = (
        (0, edge.src_options, edge.src_of_strategy, node_columns[edge.producer]),
        (1, edge.dst_options, edge.dst_of_strategy, node_columns[edge.consumer]),
    )
    for position, options, of_strategy, strategy_columns in sides:
        of_strategy_array = np.asarray(of_strategy)
        pair_option = np.array([pair[position] for pair in edge.pairs], dtype=np.int64)
        for option in range(len(options)):
            pair_cols = columns[pair_option == option]
            node_cols = strategy_columns[of_strategy_array == option]
            row_columns = np.concatenate([pair_cols, node_cols])
            row_values = np.concatenate([np.ones(len(pair_cols)), -np.ones(len(node_cols))])
            rows.append(Row(row_columns, row_values, 0.0, 0.0))
    return rows
