"""Human-readable views of a Plan: the optimizer log, and explanations of its choices.

The log states, for every node, the placements it runs with in the seed's notation
(``S(0)R, RS(1) -> S(0)S(1)``) and what it costs, then the totals and the solver's own
statistics, so that every decision can be questioned. Units are always printed.

The explanations question it: :func:`explain_placement` (could this node produce that
placement, and at what local price?) and :func:`cost_matrix` (every price of one edge). They
read the Problem's price tables and the Plan only; nothing is re-solved. The totals lines and
the diff of two plans are the report's (:mod:`autoparallel.report.summary` and :mod:`autoparallel.report.diff`), on the plan's JSON.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx as fx

from autoparallel.cost.topology import Topology
from autoparallel.files.plan_json import hardware_json, plan_json
from autoparallel.report.summary import hardware_lines, memory_lines, solver_lines, totals_lines
from autoparallel.types.costs import EdgeCost
from autoparallel.types.placements import OutputPlacements, placement_str
from autoparallel.types.plan import NodePlan, Plan
from autoparallel.types.problem import Problem, UnknownNameError

logger = logging.getLogger("autoparallel.plan")


def format_node(node: NodePlan) -> str:
    inputs = ", ".join(placement_str(p) for p in node.strategy.inputs)
    arrow = f"{inputs} -> " if inputs else ""
    per_arg = ", ".join(
        f"{arg.producer}:({arg.comm_us:.2f}, {node.compute_us if i == 0 else 0.0:.2f}, {arg.transition_us:.2f})"
        for i, arg in enumerate(node.arguments)
    )
    if not node.arguments:
        per_arg = f"(0.00, {node.compute_us:.2f}, 0.00)"
    shape = "x".join(str(s) for s in node.shape) if node.shape is not None else "-"
    return (
        f"{node.name:<28} {node.target:<48} [{shape}] "
        f"{arrow}{placement_str(node.strategy.output)}  "
        f"cost us (comm, compute, transition) per arg: {per_arg}"
    )


def log_plan(plan: Plan, level: int = logging.INFO, topology: Topology | None = None) -> None:
    """Emit the whole plan through Python logging (logger ``autoparallel.plan``), with the
    hardware figures it was priced on when ``topology`` is given. Nothing is formatted when
    the logger would drop ``level`` (a large model's plan runs to thousands of lines)."""
    if not logger.isEnabledFor(level):
        return
    names = plan.mesh_dim_names or tuple(f"dim{i}" for i in range(len(plan.mesh_shape)))
    mesh = ", ".join(f"{n}={s}" for n, s in zip(names, plan.mesh_shape))
    logger.log(
        level, "plan on mesh (%s); placements in mesh-dim order; costs in microseconds", mesh
    )
    for node in plan.nodes.values():
        logger.log(level, "%s", format_node(node))
    data = plan_json(plan)
    if topology is not None:
        data["hardware"] = hardware_json(topology)
    for line in hardware_lines(data) + totals_lines(data) + memory_lines(data) + solver_lines(data):
        logger.log(level, "%s", line)
    if plan.fallbacks:
        logger.log(level, "replicated for lack of a strategy: %s", ", ".join(plan.fallbacks))


# ============================================================================ explanations
#
# Everything below answers a question about a plan ("why not this placement?", "what does
# this edge cost?", "what changed between two plans?") from the Problem's price tables and
# the Plan, and never re-solves. Costs are in microseconds ("us") everywhere.

explain_logger = logging.getLogger("autoparallel.explain")

CHOSEN = "CHOSEN"
CHOSEN_CHEAPER = "CHOSEN CHEAPER"
TARGET_CHEAPER = "TARGET CHEAPER"
UNAVAILABLE = "UNAVAILABLE"
TIE = "TIE"
TIE_RELATIVE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class PlacementExplanation:
    """One node's chosen output placement against a target placement, priced locally.

    ``*_compute_us`` is the node's own compute time; ``*_comm_us`` / ``*_transition_us``
    the sum over its incoming edges (arguments, and the gradient edge of a parameter or
    input placeholder). ``target_*`` are ``inf`` when the target is UNAVAILABLE (or when an
    incoming edge cannot be redistributed into what the target strategy needs).
    """

    node: str
    shape: tuple[int, ...] | None
    chosen: OutputPlacements
    target: OutputPlacements
    status: str
    chosen_compute_us: float
    target_compute_us: float
    chosen_comm_us: float
    target_comm_us: float
    chosen_transition_us: float = 0.0
    target_transition_us: float = 0.0

    @property
    def chosen_us(self) -> float:
        return self.chosen_compute_us + self.chosen_comm_us + self.chosen_transition_us

    @property
    def target_us(self) -> float:
        return self.target_compute_us + self.target_comm_us + self.target_transition_us


@dataclass(frozen=True)
class _LocalPrice:
    compute_us: float
    comm_us: float
    transition_us: float

    @property
    def total_us(self) -> float:
        return self.compute_us + self.comm_us + self.transition_us


def _pair_prices(edge: EdgeCost) -> dict[tuple[int, int], tuple[float, float]]:
    """(src index, dst index) -> (comm us, transition us) of one edge's feasible pairs."""
    return {(i, j): (comm, transition) for i, j, comm, transition in edge.pairs}


class _EdgePrices:
    """Pair prices of every edge, each edge's dict built once (explanations of a big graph
    ask for the same edges many times)."""

    def __init__(self) -> None:
        self._by_edge: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}

    def __call__(self, edge: EdgeCost) -> dict[tuple[int, int], tuple[float, float]]:
        if id(edge) not in self._by_edge:
            self._by_edge[id(edge)] = _pair_prices(edge)
        return self._by_edge[id(edge)]


def _chosen_output(plan: Plan, node: fx.Node) -> OutputPlacements:
    return plan.nodes[node.name].strategy.output


def _local_price(
    problem: Problem, plan: Plan, node: fx.Node, strategy_index: int, prices: _EdgePrices
) -> _LocalPrice:
    """Compute of ``strategy_index`` plus what each incoming edge costs when its producer
    keeps the placement it has in ``plan`` (inf when that redistribution is impossible)."""
    compute = problem.tables.compute_us[node][strategy_index]
    comm = transition = 0.0
    for edge in problem.tables.incoming.get(node, []):
        src_placement = _chosen_output(plan, edge.producer)
        if src_placement not in edge.src_options:
            return _LocalPrice(compute, math.inf, 0.0)
        key = (edge.src_options.index(src_placement), edge.dst_of_strategy[strategy_index])
        pair_comm, pair_transition = prices(edge).get(key, (math.inf, 0.0))
        comm += pair_comm
        transition += pair_transition
    return _LocalPrice(compute, comm, transition)


def _chosen_index(problem: Problem, plan: Plan, node: fx.Node) -> int:
    return problem.space[node].strategies.index(plan.nodes[node.name].strategy)


def _status(chosen: _LocalPrice, target: _LocalPrice) -> str:
    a, b = chosen.total_us, target.total_us
    if a == b or (
        math.isfinite(a)
        and math.isfinite(b)
        and abs(a - b) <= TIE_RELATIVE_TOLERANCE * max(abs(a), abs(b))
    ):
        return TIE
    return CHOSEN_CHEAPER if a < b else TARGET_CHEAPER


def explain_node_placement(
    problem: Problem,
    plan: Plan,
    node: fx.Node,
    target: OutputPlacements,
    prices: _EdgePrices | None = None,
) -> PlacementExplanation:
    """Why ``node`` produces what ``plan`` says rather than ``target`` (see
    :func:`explain_placement` for the meaning of each status)."""
    prices = prices or _EdgePrices()
    chosen_output = _chosen_output(plan, node)
    chosen = _local_price(problem, plan, node, _chosen_index(problem, plan, node), prices)
    candidates = [i for i, s in enumerate(problem.space[node].strategies) if s.output == target]
    if chosen_output == target:
        best, status = chosen, CHOSEN
    elif not candidates:
        best, status = _LocalPrice(math.inf, math.inf, 0.0), UNAVAILABLE
    else:
        best = min(
            (_local_price(problem, plan, node, i, prices) for i in candidates),
            key=lambda p: p.total_us,
        )
        status = _status(chosen, best)
    return PlacementExplanation(
        node=node.name,
        shape=plan.nodes[node.name].shape,
        chosen=chosen_output,
        target=target,
        status=status,
        chosen_compute_us=chosen.compute_us,
        target_compute_us=best.compute_us,
        chosen_comm_us=chosen.comm_us,
        target_comm_us=best.comm_us,
        chosen_transition_us=chosen.transition_us,
        target_transition_us=best.transition_us,
    )


def explain_placement(
    problem: Problem, plan: Plan, target: OutputPlacements, nodes: Iterable[fx.Node] | None = None
) -> list[PlacementExplanation]:
    """For each node (default: every node of the plan), whether its output could be
    ``target`` and what that would cost locally, compared with what ``plan`` chose.

    The target side takes the cheapest strategy producing ``target`` (compute plus every
    incoming edge priced from the producer's *chosen* placement to what that strategy
    requires). Statuses:

    * ``CHOSEN``: the plan's output already is ``target``.
    * ``UNAVAILABLE``: no strategy of the node produces ``target`` (e.g. ``S(1)`` for a 1-D
      tensor, or a dim not divisible by the mesh).
    * ``CHOSEN CHEAPER``: the chosen strategy costs less, locally.
    * ``TARGET CHEAPER``: locally, the target would cost less. The plan is still optimal:
      this comparison holds the neighbours fixed and ignores the node's *outgoing* edges.
      Switching this node alone would make its consumers redistribute (or their own
      strategies change), and the solver weighed all of that together.
    * ``TIE``: both within a relative 1e-6.
    """
    target = tuple(target)
    selected = list(problem.space.nodes) if nodes is None else list(nodes)
    prices = _EdgePrices()
    return [explain_node_placement(problem, plan, node, target, prices) for node in selected]


def _us(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "inf"


def format_placement_explanations(rows: list[PlacementExplanation]) -> list[str]:
    """A fixed-width table of :func:`explain_placement`'s answer (times in us)."""
    target = placement_str(rows[0].target) if rows else "-"
    header = (
        f"{'node':<28} {'shape':<16} {'chosen':<12} {'compute us':>12} {'target comp us':>15} "
        f"{'comm us':>10} {'target comm us':>15}  status (target {target})"
    )
    lines = [header]
    for row in rows:
        shape = "x".join(str(s) for s in row.shape) if row.shape is not None else "-"
        unavailable = row.status == UNAVAILABLE
        lines.append(
            f"{row.node:<28} {shape:<16} {placement_str(row.chosen):<12} {_us(row.chosen_compute_us):>12} "
            f"{'-' if unavailable else _us(row.target_compute_us):>15} {_us(row.chosen_comm_us):>10} "
            f"{'-' if unavailable else _us(row.target_comm_us):>15}  {row.status}"
        )
    return lines


def log_placement_explanations(rows: list[PlacementExplanation], level: int = logging.INFO) -> None:
    """Emit the table through logger ``autoparallel.explain``."""
    for line in format_placement_explanations(rows):
        explain_logger.log(level, "%s", line)


# ---------------------------------------------------------------------------- one edge


@dataclass(frozen=True)
class CostMatrix:
    """Redistribution prices of one edge: ``comm_us[r][c]`` moves the producer's output
    from ``rows[r]`` to the consumer's required ``columns[c]`` (inf: impossible).
    ``chosen`` is the (row, column) the plan uses, if a plan was given."""

    producer: str
    consumer: str
    slot: int
    rows: list[OutputPlacements]
    columns: list[OutputPlacements]
    comm_us: list[list[float]]
    chosen: tuple[int, int] | None

    def __str__(self) -> str:
        width = max([10] + [len(placement_str(p)) + 2 for p in self.rows + self.columns])

        def cell(r: int, c: int) -> str:
            mark = "*" if self.chosen == (r, c) else ""
            return f"{_us(self.comm_us[r][c])}{mark}"

        lines = [
            f"redistribution cost of {self.producer} -> {self.consumer} (arg {self.slot}), comm us; "
            f"rows: {self.producer}'s placement, columns: placement {self.consumer} requires, * = chosen",
            f"{'':<{width}}" + "".join(f"{placement_str(p):>{width}}" for p in self.columns),
        ]
        for r, src in enumerate(self.rows):
            cells = "".join(f"{cell(r, c):>{width}}" for c in range(len(self.columns)))
            lines.append(f"{placement_str(src):<{width}}{cells}")
        return "\n".join(lines)


def incoming_edge(problem: Problem, node: fx.Node, slot: int, kind: str = "arg") -> EdgeCost:
    """The edge feeding input ``slot`` of ``node`` (UnknownNameError, a KeyError and a
    ValueError, naming the slots there are)."""
    edges = problem.tables.incoming.get(node, [])
    for edge in edges:
        if edge.kind == kind and edge.slot == slot:
            return edge
    available = ", ".join(f"{e.kind}:{e.slot} from {e.producer.name}" for e in edges) or "none"
    raise UnknownNameError(
        f"node {node.name} has no {kind} input {slot!r}; its inputs: {available}"
    )


def cost_matrix(
    problem: Problem, node: fx.Node, slot: int = 0, plan: Plan | None = None
) -> CostMatrix:
    """The price of every (producer placement, required placement) pair of one edge."""
    edge = incoming_edge(problem, node, slot)
    prices = _pair_prices(edge)
    matrix = [
        [prices.get((i, j), (math.inf, 0.0))[0] for j in range(len(edge.dst_options))]
        for i in range(len(edge.src_options))
    ]
    chosen = None
    if plan is not None:
        src = _chosen_output(plan, edge.producer)
        dst = edge.dst_options[edge.dst_of_strategy[_chosen_index(problem, plan, node)]]
        chosen = (edge.src_options.index(src), edge.dst_options.index(dst))
    return CostMatrix(
        edge.producer.name,
        node.name,
        slot,
        list(edge.src_options),
        list(edge.dst_options),
        matrix,
        chosen,
    )
