"""ShardingOptimizer: the user's handle on the problem (constrain, solve, re-solve).

It owns a Problem and the most recent Plan; it adds no algorithm of its own beyond naming
constraints. ``AutoParallel.sharding_optimizer`` returns it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch.fx as fx

from autoparallel.explain import log_plan
from autoparallel.solver.highs import SolverOptions, solve
from autoparallel.solver.plan import Plan, build_plan
from autoparallel.solver.problem import Problem
from autoparallel.strategies.types import Placements

logger = logging.getLogger(__name__)


class ShardingOptimizer:
    def __init__(self, problem: Problem, mesh_dim_names: tuple[str, ...] | None, options: SolverOptions | None = None):
        self.problem = problem
        self.mesh_dim_names = mesh_dim_names
        self.options = options or SolverOptions()
        self._plan: Plan | None = None

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
        self._plan = build_plan(self.problem, solution, self.mesh_dim_names)
        log_plan(self._plan, logging.INFO if verbose else logging.DEBUG)
        return self._plan

    def get_solution(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("no solution yet: call optimize_placement() (or resolve()) first")
        return self._plan

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
