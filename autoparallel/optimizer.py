"""ShardingOptimizer: the user's handle on a built problem (constrain, solve, re-solve, explain).

A facade above the solver: it owns a Problem and the most recent Plan and delegates every
step to the stage that does it (constraint families in ``problem/constraints.py``, solving in
``solver/highs.py``, the plan in ``solver/plan.py``, questions in ``explain.py``, the JSON in
``files/plan_json_graph.py`` and ``files/plan_json.py``, the diff in ``report/diff.py``).
``AutoParallel.sharding_optimizer`` returns it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from autoparallel.explain import (
    PlacementExplanation,
    cost_matrix,
    explain_logger,
    explain_placement,
    log_placement_explanations,
    log_plan,
)
from autoparallel.files.plan_json import plan_json
from autoparallel.files.plan_json_graph import get_json
from autoparallel.files.problem import load_problem, save_problem
from autoparallel.problem.buckets import members_in_use, share_by_use
from autoparallel.problem.constraints import (
    byte_count,
    parameter_memory_constraint,
    placement_constraint,
)
from autoparallel.problem.memory import (
    build_memory_model,
    estimate_memory,
    memory_constraint_of,
    memory_model,
    smallest_peak,
)
from autoparallel.problem.overlap import fit_shares
from autoparallel.problem.prefetch import prefetchable_columns
from autoparallel.problem.recompute import recompute_counts
from autoparallel.report.diff import PlanDiff, diff_plan_json
from autoparallel.solver.highs import InfeasibleConstraintsError, SolverOptions, solve
from autoparallel.solver.plan import build_plan
from autoparallel.types.kinds import ActivationCheckpointing
from autoparallel.types.memory import MemoryEstimate
from autoparallel.types.placements import Placements, validate_placements
from autoparallel.types.plan import Plan, Solution
from autoparallel.types.problem import Problem, UnknownNameError

logger = logging.getLogger(__name__)

MEMORY_CONSTRAINT = "memory"
"""The name of the constraint :meth:`ShardingOptimizer.add_memory_constraint` adds."""

ACTIVATION_CHECKPOINTING = ("off", "auto", "all")
"""What the memory constraint does about saved activations: keep them all, recompute layers
where the solver finds it pays, or recompute every layer that can be (problem/recompute.py)."""

REFITS = 3
"""Re-solves at most after the prices that follow the plan were refitted (see resolve)."""

LARGE_PROBLEM_VARIABLES = 50_000
LARGE_PROBLEM_REFITS = 1
"""A problem of at least ``LARGE_PROBLEM_VARIABLES`` columns is re-solved at most this often.
A second refit's plan is rarely kept, and then only a little cheaper, while on a large
problem each re-solve costs seconds of planning; below the threshold re-solves are cheap
and all ``REFITS`` may run (the figures: ``docs/measurements.md``, planning time)."""


class ShardingOptimizer:
    def __init__(
        self,
        problem: Problem,
        mesh_dim_names: tuple[str, ...] | None,
        options: SolverOptions | None = None,
    ):
        self.problem = problem
        self.mesh_dim_names = mesh_dim_names
        self.options = options or SolverOptions()
        self._plan: Plan | None = None
        self._solution: Solution | None = None
        self.prefetch_scale = 1.0

    # ------------------------------------------------------------------ constraints

    def add_node_constraint(
        self, node: fx.Node | str, placement: Sequence, name: str | None = None
    ) -> list[str]:
        """Force a node's output placement; returns the names of the constraints added."""
        node = self._node(node)
        what = self._describe(node)
        placements = validate_placements(placement, len(self.problem.space.mesh_shape), what)
        name = name or f"node:{node.name}"
        constraint = placement_constraint(self.problem, name, node, placements, what)
        self.problem.add_constraint(constraint)
        return [name]

    def add_placement_constraint(
        self, node: fx.Node, placements: Placements, name: str, what: str
    ) -> str:
        constraint = placement_constraint(self.problem, name, node, placements, what)
        return self.problem.add_constraint(constraint)

    def add_parameter_memory_constraint(
        self, low: float | None = None, high: float | None = None
    ) -> str:
        name = "parameter_memory"
        if name in self.problem.user_constraints:
            self.problem.remove_constraints([name])
        return self.problem.add_constraint(
            parameter_memory_constraint(self.problem, name, low, high)
        )

    def add_memory_constraint(
        self,
        budget_bytes: float,
        optimizer: str | float = "adamw",
        activation_checkpointing: ActivationCheckpointing = "off",
    ) -> str:
        """Keep the predicted peak memory per device of a training step within
        ``budget_bytes`` (parameters, gradients, optimizer state, saved activations and
        gathered parameters: see ``problem/memory.py``). ``optimizer`` says what state the
        optimizer keeps: "adamw" (default), "adam", "sgd", "sgd-momentum", or bytes per
        parameter element. ``activation_checkpointing="auto"`` lets the solver recompute
        layers in the backward instead of saving their activations, where that is the
        cheapest way to fit (``plan.recompute`` names them; problem/recompute.py); "all"
        recomputes every layer that can be (no random numbers in its forward); "off"
        (default) never recomputes. Replaces an earlier memory constraint; returns its name.

        Raises InfeasibleConstraintsError when no plan can fit, naming a lower bound on the
        smallest peak; TypeError for a budget that is not a number of bytes, ValueError for one
        that is not positive, an unknown optimizer or activation_checkpointing mode.
        """
        budget_bytes = byte_count(budget_bytes, "memory budget_bytes")
        if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING}, "
                f"got {activation_checkpointing!r}"
            )
        name = MEMORY_CONSTRAINT
        if name in self.problem.user_constraints:
            self.remove_constraints([name])
        model = build_memory_model(self.problem, optimizer, activation_checkpointing != "off")
        constraint = memory_constraint_of(
            self.problem, model, name, float(budget_bytes), activation_checkpointing == "all"
        )
        if smallest_peak(model) > float(budget_bytes):
            raise InfeasibleConstraintsError([name], [constraint.description])
        self.problem.memory = model
        self.problem.memory_optimizer = optimizer
        self.problem.memory_budget = float(budget_bytes)
        self.problem.activation_checkpointing = activation_checkpointing
        return self.problem.add_constraint(constraint)

    def remove_constraints(self, names: Sequence[str]) -> None:
        """Remove the named constraints (see ``Problem.remove_constraints`` for the errors)."""
        names = self.problem.remove_constraints(names)
        if MEMORY_CONSTRAINT in names:
            self.problem.memory_budget = None
            if self.problem.activation_checkpointing != "off":  # nothing left to recompute for
                self.problem.activation_checkpointing = "off"
                self.problem.memory = None

    def constraints(self) -> dict[str, str]:
        """Name -> description of every user constraint in force."""
        return {name: c.description for name, c in self.problem.user_constraints.items()}

    # ------------------------------------------------------------------ solving

    def resolve(self, verbose: bool = False) -> Plan:
        """Solve the problem with the constraints in force and return the plan.

        Two prices follow the plan they are part of: a collective bucket's latency is
        shared by the members a plan uses (problem/buckets.py), and each overlap window's
        comm is discounted by what the plan hides of it (problem/overlap.py). After a solve
        both are refitted to its plan; while that changes a price the problem is solved
        again, up to ``REFITS`` times (``LARGE_PROBLEM_REFITS`` for a large problem), and the
        plan with the lowest totals is kept (with the prices it was solved at, so a saved
        problem re-solves to it)."""
        solution = solve(self.problem, self.options)
        plan = build_plan(self.problem, solution, self.mesh_dim_names)
        large = self.problem.num_variables >= LARGE_PROBLEM_VARIABLES
        for _ in range(LARGE_PROBLEM_REFITS if large else REFITS):
            kept = (self.problem.objective, self.problem.buckets, self.problem.overlap_shares)
            shared = share_by_use(self.problem, members_in_use(self.problem, solution.choice))
            if not fit_shares(self.problem, solution.choice) and not shared:
                break
            retry = solve(self.problem, self.options, warm_start=solution)
            retry_plan = build_plan(self.problem, retry, self.mesh_dim_names)
            logger.info(
                "prices refitted to the plan: re-solved, %.1f us -> %.1f us",
                plan.totals.total_us,
                retry_plan.totals.total_us,
            )
            if not retry_plan.totals.total_us < plan.totals.total_us - 1e-9:
                self.problem.objective, self.problem.overlap_shares = kept[0], kept[2]
                self.problem.set_buckets(kept[1])
                break
            solution, plan = retry, retry_plan
        self._solution = solution
        self._plan = plan
        log_plan(
            self._plan, logging.INFO if verbose else logging.DEBUG, self.problem.tables.topology
        )
        return self._plan

    def adopt(self, plan: Plan, verbose: bool = False) -> Plan:
        """Take a plan solved elsewhere (another rank's solve of this same problem)."""
        self._solution = None
        self._plan = plan
        log_plan(plan, logging.INFO if verbose else logging.DEBUG, self.problem.tables.topology)
        return plan

    def memory_in_flight(self, copies: int) -> MemoryEstimate | None:
        """The last solved plan's memory had ``copies`` microbatches' activations been alive
        at once (a pipeline stage of this same graph further along the schedule; see
        ``Problem.activation_copies``); None without a solution of this process."""
        if self._solution is None:
            return None
        problem = self.problem
        kept = problem.activation_copies, problem.memory
        problem.activation_copies, problem.memory = copies, None
        try:
            counts = recompute_counts(memory_model(problem).recompute, self._solution.auxiliary)
            return estimate_memory(problem, self._solution.choice, problem.memory_budget, counts)
        finally:
            problem.activation_copies, problem.memory = kept

    # ------------------------------------------------------------------ persistence

    def save(self, path: str) -> None:
        """Write the whole problem (and the last solution) to ``path`` (.npz, versioned, no
        pickle): :meth:`load` can inspect, constrain and re-solve it without the model."""
        save_problem(self.problem, self.mesh_dim_names, path, self._solution)

    @classmethod
    def load(cls, path: str, options: SolverOptions | None = None) -> ShardingOptimizer:
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
        tie-breaker stays). The discount replaces the one in force, so calling with 0.5
        twice is 0.5, and 1.0 takes it off. ``0 <= scale <= 1``, else ValueError. The
        plan's ``totals`` keep undiscounted prices; its ``solver.objective`` is the
        discounted objective.

        The planner already charges only the exposed part of these gathers (each layer's
        behind the previous layer's forward, problem/overlap.py); this discount comes on top
        of that, for a runtime that hides more of them than that model says.
        """
        scale = float(scale)
        if not 0.0 <= scale <= 1.0:
            raise ValueError(f"prefetch discount scale must be within [0, 1], got {scale}")
        objective = self.problem.objective.copy()
        columns, comm_us = prefetchable_columns(self.problem)
        # folded edges share columns: accumulate every member's discount (not last-write-wins)
        np.subtract.at(objective, columns, (self.prefetch_scale - scale) * comm_us)
        self.problem.objective = objective
        self.prefetch_scale = scale
        return len(columns)

    # ------------------------------------------------------------------ explanations

    def explain_placement(
        self, target_placement: Sequence, nodes: Sequence[fx.Node | str] | None = None
    ) -> list[PlacementExplanation]:
        """For every node (or ``nodes``), the chosen output placement against
        ``target_placement`` with both local prices and a status; also logged as a table
        (logger ``autoparallel.explain``). See :func:`autoparallel.explain.explain_placement`.
        TypeError / ValueError when ``target_placement`` is not one placement per mesh dim."""
        plan = self.get_solution()
        ndim = len(self.problem.space.mesh_shape)
        if not isinstance(target_placement, (tuple, list)) or not all(
            isinstance(p, Placement) for p in target_placement
        ):
            raise TypeError(
                f"target_placement must be a tuple of {ndim} placements (one per mesh dim), "
                f"got {target_placement!r}"
            )
        if len(target_placement) != ndim:
            raise ValueError(
                f"target_placement has {len(target_placement)} placements for a {ndim}-D mesh"
            )
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
        """What changed from plan ``a`` to plan ``b`` (cost deltas, parameters, node moves):
        the diff ``autoparallel diff`` prints, on the two plans' JSON."""
        return diff_plan_json(plan_json(a), plan_json(b))

    def get_json(self) -> dict[str, Any]:
        """The last solution as JSON-serializable data (``files/plan_json_graph.get_json``;
        schema in ``files/plan_json.py``)."""
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
        raise UnknownNameError(f"no node named {node!r} in the traced graph")
