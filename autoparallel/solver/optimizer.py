"""ShardingOptimizer: the user's handle on the problem (constrain, solve, re-solve, explain).

It owns a Problem and the most recent Plan; it adds no algorithm of its own beyond naming
constraints and discounting overlappable collectives in the objective. Explanations and the
JSON view are thin delegations to ``explain.py`` and ``report_data.py``.
``AutoParallel.sharding_optimizer`` returns it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from autoparallel.cost.tables import EdgeCost
from autoparallel.explain import (
    PlacementExplanation,
    PlanDiff,
    cost_matrix,
    diff_plans,
    explain_logger,
    explain_placement,
    log_placement_explanations,
    log_plan,
)
from autoparallel.report_data import get_json
from autoparallel.solver.highs import Solution, SolverOptions, solve
from autoparallel.solver.plan import Plan, build_plan
from autoparallel.solver.problem import Problem
from autoparallel.strategies.types import OutputPlacements, Placements, is_multi

logger = logging.getLogger(__name__)


class ShardingOptimizer:
    def __init__(self, problem: Problem, mesh_dim_names: tuple[str, ...] | None, options: SolverOptions | None = None):
        self.problem = problem
        self.mesh_dim_names = mesh_dim_names
        self.options = options or SolverOptions()
        self._plan: Plan | None = None
        self._solution: Solution | None = None
        self._original_objective: np.ndarray | None = None
        self.prefetch_scale = 1.0

    # ------------------------------------------------------------------ constraints

    def add_node_constraint(self, node: fx.Node | str, placement: Sequence, name: str | None = None) -> list[str]:
        """Force a node's output placement; returns the names of the constraints added."""
        node = self._node(node)
        what = self._describe(node)
        placements = validate_placements(placement, len(self.problem.space.mesh_shape), what)
        name = name or f"node:{node.name}"
        constraint = self.problem.placement_constraint(name, node, placements, what)
        self.problem.add_constraint(constraint)
        return [name]

    def add_placement_constraint(self, node: fx.Node, placements: Placements, name: str, what: str) -> str:
        constraint = self.problem.placement_constraint(name, node, placements, what)
        return self.problem.add_constraint(constraint)

    def add_parameter_memory_constraint(self, low: float | None = None, high: float | None = None) -> str:
        name = "parameter_memory"
        if name in self.problem.user_constraints:
            self.problem.remove_constraints([name])
        return self.problem.add_constraint(self.problem.memory_constraint(name, low, high))

    def remove_constraints(self, names: Sequence[str]) -> None:
        self.problem.remove_constraints(list(names))

    def constraints(self) -> dict[str, str]:
        """Name -> description of every user constraint in force."""
        return {name: c.description for name, c in self.problem.user_constraints.items()}

    # ------------------------------------------------------------------ solving

    def resolve(self, verbose: bool = False) -> Plan:
        solution = solve(self.problem, self.options)
        self._solution = solution
        self._plan = build_plan(self.problem, solution, self.mesh_dim_names)
        log_plan(self._plan, logging.INFO if verbose else logging.DEBUG)
        return self._plan

    def adopt(self, plan: Plan, verbose: bool = False) -> Plan:
        """Take a plan solved elsewhere (another rank's solve of this same problem)."""
        self._solution = None
        self._plan = plan
        log_plan(plan, logging.INFO if verbose else logging.DEBUG)
        return plan

    # ------------------------------------------------------------------ persistence

    def save(self, path: str) -> None:
        """Write the whole problem (and the last solution) to ``path`` (.npz, versioned, no
        pickle): :meth:`load` can inspect, constrain and re-solve it without the model."""
        from autoparallel.problem_io import save_problem

        save_problem(self.problem, self.mesh_dim_names, path, self._solution)

    @classmethod
    def load(cls, path: str, options: SolverOptions | None = None) -> "ShardingOptimizer":
        from autoparallel.problem_io import load_problem

        problem, names, solution = load_problem(path)
        optimizer = cls(problem, names, options)
        if solution is not None:
            optimizer._solution = solution
            optimizer._plan = build_plan(problem, solution, names)
        return optimizer

    def get_solution(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("no solution yet: call optimize_placement() (or resolve()) first")
        return self._plan

    # ------------------------------------------------------------------ objective

    def apply_prefetch_discount(self, scale: float) -> int:
        """Price the collectives that can overlap with compute at ``scale`` times their
        communication cost, for later :meth:`resolve` calls; returns how many edge prices
        were discounted.

        Overlappable here means a forward all-gather of a parameter: an edge into a forward
        node whose producer is a parameter placeholder or a view/transpose chain of one,
        for the placement pairs that go Shard -> Replicate on some mesh dim (FSDP's
        prefetched gather). Only the communication part is scaled (the transition
        tie-breaker stays). The discount is always relative to the *original* prices, so
        calling with 0.5 twice is 0.5, and 1.0 restores them. ``0 <= scale <= 1``, else
        ValueError. The plan's ``totals`` keep undiscounted prices; its
        ``solver.objective`` is the discounted objective.
        """
        scale = float(scale)
        if not 0.0 <= scale <= 1.0:
            raise ValueError(f"prefetch discount scale must be within [0, 1], got {scale}")
        if self._original_objective is None or len(self._original_objective) != len(self.problem.objective):
            self._original_objective = self.problem.objective.copy()
        objective = self._original_objective.copy()
        columns, comm_us = prefetchable_columns(self.problem)
        # folded edges share columns: accumulate every member's discount (not last-write-wins)
        np.subtract.at(objective, columns, (1.0 - scale) * comm_us)
        self.problem.objective = objective
        self.prefetch_scale = scale
        return len(columns)

    # ------------------------------------------------------------------ explanations

    def explain_placement(
        self, target_placement: Sequence, nodes: Sequence[fx.Node | str] | None = None
    ) -> list[PlacementExplanation]:
        """For every node (or ``nodes``), the chosen output placement against
        ``target_placement`` with both local prices and a status; also logged as a table
        (logger ``autoparallel.explain``). See :func:`autoparallel.explain.explain_placement`."""
        plan = self.get_solution()
        selected = None if nodes is None else [self._node(n) for n in nodes]
        rows = explain_placement(self.problem, plan, tuple(target_placement), selected)
        log_placement_explanations(rows)
        return rows

    def print_costs_for_node(self, node: fx.Node | str, arg: int = 0) -> str:
        """The redistribution cost matrix (comm us) of ``node``'s input ``arg``: rows are the
        producer's placements, columns the placements ``node`` can require, ``*`` the pair
        of the last solution (if any). Returned and logged (logger ``autoparallel.explain``)."""
        text = str(cost_matrix(self.problem, self._node(node), arg, self._plan))
        explain_logger.info("%s", text)
        return text

    def diff_solutions(self, a: Plan, b: Plan) -> PlanDiff:
        """What changed from plan ``a`` to plan ``b`` (cost deltas, parameters, node moves)."""
        return diff_plans(a, b)

    def get_json(self) -> dict[str, Any]:
        """The last solution as JSON-serializable data (schema in ``report_data.py``)."""
        return get_json(self.problem, self.get_solution())

    def _describe(self, node: fx.Node) -> str:
        """A user's name for a node: parameters by their fully-qualified name."""
        joint = self.problem.joint
        for fqn, param in joint.params.items():
            if param is node:
                return f"parameter {fqn} ({node.name})"
        if node in joint.user_inputs:
            return f"input {joint.user_inputs.index(node)} ({node.name})"
        return f"node {node.name} ({node.target})"

    def _node(self, node: fx.Node | str) -> fx.Node:
        if isinstance(node, fx.Node):
            if node not in self.problem.space:
                raise ValueError(f"node {node.name} takes no part in the plan")
            return node
        for candidate in self.problem.space.nodes:
            if candidate.name == node:
                return candidate
        raise KeyError(f"no node named {node!r} in the traced graph")


def validate_placements(placements: Sequence, mesh_ndim: int, what: str) -> Placements:
    """Check one placement tuple against the mesh before any work is done with it."""
    from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

    if isinstance(placements, Placement) or not isinstance(placements, (tuple, list)):
        raise TypeError(
            f"{what}: expected a tuple of {mesh_ndim} placements (one per mesh dimension), got {placements!r}"
        )
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{what}: {len(placements)} placements given for a {mesh_ndim}-D mesh; give one per mesh "
            f"dimension, in mesh-dim order, e.g. {(Shard(0),) + (Replicate(),) * (mesh_ndim - 1)}"
        )
    for placement in placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise TypeError(f"{what}: {placement!r} is not supported here; use Shard(dim) or Replicate()")
    return tuple(placements)


def check_shard_dims(placements: Placements, ndim: int, what: str) -> None:
    from torch.distributed.tensor.placement_types import Shard

    for placement in placements:
        if isinstance(placement, Shard) and not -ndim <= placement.dim < ndim:
            raise ValueError(f"{what}: Shard({placement.dim}) is out of range for a {ndim}-D tensor")


_VIEW_OPS = frozenset(
    {"t", "view", "_unsafe_view", "reshape", "transpose", "permute", "alias", "detach", "expand", "unsqueeze",
     "squeeze"}
)


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        target.overloadpacket.__name__ in _VIEW_OPS
    )


def parameter_views(problem: Problem) -> set[fx.Node]:
    """Parameter placeholders and the forward view/transpose chains rooted at them (one pass)."""
    joint = problem.joint
    found = set(joint.params.values())
    for node in joint.graph.nodes:
        if node in joint.forward_nodes and _is_view(node) and node.all_input_nodes:
            if all(producer in found for producer in node.all_input_nodes):
                found.add(node)
    return found


def _gathers(src: OutputPlacements, dst: OutputPlacements) -> bool:
    """Shard -> Replicate on some mesh dim (an all-gather)."""
    if is_multi(src) or is_multi(dst):
        return False
    return any(isinstance(s, Shard) and isinstance(d, Replicate) for s, d in zip(src, dst))


def _is_prefetchable(edge: EdgeCost, problem: Problem, sources: set[fx.Node]) -> bool:
    return edge.kind == "arg" and edge.consumer in problem.joint.forward_nodes and edge.producer in sources


def prefetchable_columns(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(objective columns, comm us) of every forward parameter all-gather pair or step (see
    :meth:`ShardingOptimizer.apply_prefetch_discount`)."""
    sources = parameter_views(problem)
    columns: list[int] = []
    comm_us: list[float] = []
    for index, edge in enumerate(problem.tables.edges):
        if not _is_prefetchable(edge, problem, sources):
            continue
        for move in problem.edge_moves(index):  # pairs, or the gather steps of routes
            if _gathers(move.src, move.dst):
                columns.append(move.column)
                comm_us.append(move.comm_us)
    return np.array(columns, dtype=np.int64), np.array(comm_us, dtype=np.float64)
