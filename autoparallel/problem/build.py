"""Stage 4: the optimization problem (one MIP) built from a StrategySpace and its CostTables.

Variables
    x[n, s]  binary, node n runs strategy s; exactly one per node.
    y[e, p]  continuous in [0, 1], edge e uses placement pair p = (src, dst)  ("pairs"), or
    f[e, a]  continuous in [0, 1], edge e's route takes single-step arc a     ("routes").

Pairs: edges are priced on distinct placement pairs, not on strategy pairs: for each edge the
y's of one producer placement sum to the x's of the producer strategies with that output
placement, and the y's of one required placement sum to the x's of the consumer strategies
requiring it. With integral x both marginals are unit vectors, so y is integral too; that is
why y needs no integrality.

Routes: when every option of an edge is a state of its tensor's route table (see
``cost/routes.py``) and the table's arcs are fewer than half the pairs, the edge is a flow
instead: per state, the arcs leaving it minus the arcs entering it equal the producer x's
with that output minus the consumer x's requiring it. With integral x one unit flows from
the producer's placement to the required one, and the cheapest flow is the cheapest route:
exactly the pair price, since pairs are priced as cheapest routes. On a 3-D mesh an
activation has ~200 placements, so ~40 000 pairs against ~3 000 arcs.

User constraints (input/output placements, node placements, parameter memory) are kept
apart from the structural rows, by name, so they can be listed, removed and re-solved, and so
an infeasible problem can be explained by the constraints in conflict.
"""

from __future__ import annotations

import logging

import numpy as np
import torch.fx as fx

from autoparallel.problem.buckets import add_buckets
from autoparallel.problem.folding import no_folding
from autoparallel.problem.overlap import add_overlap
from autoparallel.types.costs import CostTables, EdgeCost
from autoparallel.types.graph import JointGraph
from autoparallel.types.problem import Folding, Problem, Row
from autoparallel.types.strategies import StrategySpace

logger = logging.getLogger(__name__)

MIB = float(1 << 20)


def build_problem(
    joint: JointGraph,
    space: StrategySpace,
    tables: CostTables,
    folding: Folding | None = None,
    use_routes: bool = True,
    price_buckets: bool = True,
    price_overlap: bool = True,
) -> Problem:
    """The MIP of the stage docstring; with ``folding``, each class of repeated nodes has
    one set of x columns, edges whose endpoints fold alike share their y (f) columns, and a
    shared column's cost is the sum over the members it stands for. ``use_routes=False``
    prices every edge on pairs (same optimum, larger problem). ``price_buckets`` prices the
    collectives the runtime coalesces as their buckets (problem/buckets.py); False prices
    each on its own, latency included. ``price_overlap`` charges the communication the
    runtime overlaps with compute only for the part left exposed, at the hardware's
    ``overlap_fraction`` (problem/overlap.py); False charges all of it.

    Built with numpy per distinct price list (lists are shared between repeated layers), so
    the work grows with the number of edges, not with their pairs: an 80-layer model on a
    3-D mesh has ~10^8 pairs before folding.
    """
    folding = folding or no_folding(space)
    representative = folding.representative
    num_columns = 0
    integral_ranges: list[tuple[int, int]] = []
    node_columns: dict[fx.Node, np.ndarray] = {}
    rows: list[Row] = []
    contributions: list[tuple[np.ndarray, np.ndarray]] = []  # (columns, costs), added in order
    arrays: dict[int, np.ndarray] = {}  # id(price list) -> its numpy costs

    def new_columns(count: int, integral: bool) -> np.ndarray:
        nonlocal num_columns
        start = num_columns
        num_columns += count
        if integral:
            integral_ranges.append((start, num_columns))
        return np.arange(start, num_columns, dtype=np.int64)

    def as_array(values: list, convert) -> np.ndarray:
        found = arrays.get(id(values))
        if found is None:
            found = arrays[id(values)] = convert(values)
        return found

    for node in space.nodes:
        rep = representative[node]
        if rep not in node_columns:
            node_columns[rep] = new_columns(len(space[rep].strategies), integral=True)
            rows.append(Row(node_columns[rep], np.ones(len(node_columns[rep])), 1.0, 1.0))
        columns = node_columns[node] = node_columns[rep]
        contributions.append(
            (columns, as_array(tables.compute_us[node], lambda v: np.asarray(v, dtype=np.float64)))
        )

    edge_columns = []
    edge_encodings = []
    shared_edges: dict[tuple, np.ndarray] = {}
    groups = _Groups()
    for edge in tables.edges:
        encoding = "routes" if use_routes and _routes_are_smaller(edge) else "pairs"
        key = (
            representative[edge.producer],
            representative[edge.consumer],
            edge.slot,
            edge.kind,
            id(edge.pairs),
        )
        columns = shared_edges.get(key)
        if encoding == "routes":
            table = edge.routes.table  # type: ignore[union-attr]
            if columns is None:
                columns = shared_edges[key] = new_columns(table.num_arcs, integral=False)
                rows.extend(_flow_rows(edge, columns, node_columns, groups))
            contributions.append(
                (
                    columns,
                    as_array(table.arc_comm, lambda comm, tie=table.step_tie_breaker: comm + tie),
                )
            )
        else:
            if columns is None:
                columns = shared_edges[key] = new_columns(len(edge.pairs), integral=False)
                rows.extend(_marginal_rows(edge, columns, node_columns, groups))
            contributions.append((columns, as_array(edge.pairs, _pair_costs)))
        edge_columns.append(columns)
        edge_encodings.append(encoding)

    objective = np.zeros(num_columns)
    for columns, costs in contributions:
        objective[columns] += costs  # columns are distinct within one contribution
    integrality = np.zeros(num_columns, dtype=bool)
    for start, stop in integral_ranges:
        integrality[start:stop] = True

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
        objective=objective,
        integrality=integrality,
        rows=rows,
        folding=folding,
        edge_encodings=edge_encodings,
    )
    if price_buckets:
        add_buckets(problem)
    if price_overlap:  # after the buckets: a window's comm is priced as the objective has it
        add_overlap(problem, tables.topology.hardware.overlap_fraction)
    logger.info(
        "problem: %d variables, %d constraints (%d nodes in %d classes, %d collective buckets, "
        "%d overlap windows)",
        problem.num_variables,
        problem.num_constraints,
        len(space.nodes),
        folding.num_classes,
        len(problem.buckets),
        len(problem.overlap_windows),
    )
    return problem


def _routes_are_smaller(edge: EdgeCost) -> bool:
    """A flow pays off when the table's arcs are at most half the edge's pairs."""
    return edge.routes is not None and 2 * edge.routes.table.num_arcs <= len(edge.pairs)


def _flow_rows(
    edge: EdgeCost, columns: np.ndarray, node_columns: dict[fx.Node, np.ndarray], groups: _Groups
) -> list[Row]:
    """Per route state: arcs out - arcs in - producer x's there + consumer x's there = 0.

    One state's row is left out: the rows of all states sum to (consumer x's - producer x's),
    which the one-hot rows already make 0, so any one of them follows from the others. Saying
    so spares the solver's presolve a search for dependent equations.
    """
    routes = edge.routes
    assert routes is not None
    table = routes.table
    leaving, entering = groups.arcs(table)
    num_states = table.num_states
    producer_states = groups.mapped(routes.src_states, edge.src_of_strategy)
    consumer_states = groups.mapped(routes.dst_states, edge.dst_of_strategy)
    supplies = groups.split(producer_states, None, producer_states, num_states)
    demands = groups.split(consumer_states, None, consumer_states, num_states)
    producer_columns, consumer_columns = node_columns[edge.producer], node_columns[edge.consumer]
    overlap = producer_columns is consumer_columns
    rows = []
    for state in range(num_states - 1):
        out_cols, in_cols = columns[leaving[state]], columns[entering[state]]
        supply_cols, demand_cols = (
            producer_columns[supplies[state]],
            consumer_columns[demands[state]],
        )
        row = Row(
            np.concatenate([out_cols, in_cols, supply_cols, demand_cols]),
            np.concatenate(
                [
                    np.ones(len(out_cols)),
                    -np.ones(len(in_cols)),
                    -np.ones(len(supply_cols)),
                    np.ones(len(demand_cols)),
                ]
            ),
            0.0,
            0.0,
        )
        rows.append(row.merged() if overlap else row)
    return rows


def _pair_costs(pairs: list[tuple[int, int, float, float]]) -> np.ndarray:
    """comm + transition of every pair, in pair order (the objective of its y column)."""
    if not pairs:
        return np.zeros(0)
    table = np.asarray(pairs, dtype=np.float64).reshape(-1, 4)
    return table[:, 2] + table[:, 3]


class _Groups:
    """Positions grouped by option, memoized per list object: for an index list ``of``
    (pair -> option or strategy -> option), ``split(of, n)[k]`` are the positions with
    option ``k``, in their original order (so rows come out exactly as a loop would)."""

    def __init__(self) -> None:
        self._found: dict[tuple, list[np.ndarray]] = {}
        self._keep: list = []  # keep keyed objects alive: ids must not be reused

    def arcs(self, table: object) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(arcs leaving, arcs entering) each state of a route table."""
        key = ("arcs", id(table))
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = (table.outgoing(), table.incoming())  # type: ignore[attr-defined]
            self._keep.append(table)
        return found  # type: ignore[return-value]

    def mapped(self, states: list[int], of_strategy: list[int]) -> np.ndarray:
        """State of each strategy: ``states[of_strategy[s]]`` (one array per pair of lists)."""
        key = ("mapped", id(states), id(of_strategy))
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = np.asarray(states, dtype=np.int64)[
                np.asarray(of_strategy, dtype=np.int64)
            ]
            self._keep.extend([states, of_strategy])
        return found  # type: ignore[return-value]

    def split(
        self, key_object: object, position: int | None, values, count: int
    ) -> list[np.ndarray]:
        key = (id(key_object), position, count)
        found = self._found.get(key)
        if found is None:
            if position is None:
                of = np.asarray(values, dtype=np.int64)
            else:
                of = np.fromiter(
                    (pair[position] for pair in values), dtype=np.int64, count=len(values)
                )
            order = np.argsort(of, kind="stable")
            bounds = np.searchsorted(of[order], np.arange(count + 1))
            found = self._found[key] = [order[bounds[k] : bounds[k + 1]] for k in range(count)]
            self._keep.append(key_object)
        return found


def _same_placement_rows(
    space: StrategySpace, node_columns: dict[fx.Node, np.ndarray], first: fx.Node, second: fx.Node
) -> list[Row]:
    """Two placeholders of one tied parameter take the same placement."""
    rows = []
    for placements in space[first].output_placements():
        first_cols = [
            c
            for c, s in zip(node_columns[first], space[first].strategies)
            if s.output == placements
        ]
        second_cols = [
            c
            for c, s in zip(node_columns[second], space[second].strategies)
            if s.output == placements
        ]
        columns = np.array(first_cols + second_cols, dtype=np.int64)
        values = np.concatenate([np.ones(len(first_cols)), -np.ones(len(second_cols))])
        rows.append(Row(columns, values, 0.0, 0.0))
    return rows


def _marginal_rows(
    edge: EdgeCost, columns: np.ndarray, node_columns: dict[fx.Node, np.ndarray], groups: _Groups
) -> list[Row]:
    """sum of y over pairs with src a == sum of producer x with output a; same for dst.

    The last dst row is left out: all src rows sum to (sum of y == producer x's), all dst
    rows to (sum of y == consumer x's), and both x sums are 1, so it follows from the others
    (as in ``_flow_rows``; it spares presolve a dependent-equation search).
    """
    rows = []
    sides = (
        (0, edge.src_options, edge.src_of_strategy, node_columns[edge.producer]),
        (1, edge.dst_options, edge.dst_of_strategy, node_columns[edge.consumer]),
    )
    for position, options, of_strategy, strategy_columns in sides:
        by_pair = groups.split(edge.pairs, position, edge.pairs, len(options))
        by_strategy = groups.split(of_strategy, None, of_strategy, len(options))
        for option in range(len(options) - position):  # position 1: all dst rows but the last
            pair_cols = columns[by_pair[option]]
            node_cols = strategy_columns[by_strategy[option]]
            row_columns = np.concatenate([pair_cols, node_cols])
            row_values = np.concatenate([np.ones(len(pair_cols)), -np.ones(len(node_cols))])
            rows.append(Row(row_columns, row_values, 0.0, 0.0))
    return rows
