"""Turning a fractional relaxation into a plan, close to its bound and quickly.

The solve (solver/highs.py) accepts an integral relaxation as it is. A fractional one
comes here, in this order:

1. **Branch on the counts** where the recompute counts (problem/recompute.py) are
   fractional: a small tree over those few integer columns only; each node whose counts
   come out integral goes through 2 and 3 with its counts held.
2. **The dive** (:func:`dive`): fix one node class at a time to the strategy the
   relaxation weighs most and re-solve the relaxation from its basis, until it comes out
   integral. A few warm LPs; it answers the relaxations that average a plan with its
   mirror image on a mesh of alike dims.
3. **Relax and fix** (:func:`relax_and_fix`): fix the columns the relaxation set above a
   threshold and solve the MIP over the rest: a memory budget (a knapsack row) leaves a
   few nodes fractional, and that MIP is small.

A plan is accepted within ``SolverOptions.fix_gap`` of the relaxation's objective, a lower
bound on every plan's. Each step leaves the column bounds of ``highs`` as it found them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import highspy
import numpy as np

from autoparallel.solver.options import SolverOptions
from autoparallel.solver.priced import allow
from autoparallel.types.problem import AuxiliaryColumns, Problem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A plan found along the way: its objective and every column's value."""

    objective: float
    values: np.ndarray

    def gap(self, bound: float) -> float:
        return max(0.0, (self.objective - bound) / max(abs(self.objective), 1e-12))


@dataclass(frozen=True)
class Found:
    """A plan, the lower bound it is measured against, and the method that found it."""

    plan: Candidate
    bound: float
    method: str

    @property
    def gap(self) -> float:
        return self.plan.gap(self.bound)


def fixed_plan(
    highs: highspy.Highs,
    problem: Problem,
    auxiliary: AuxiliaryColumns | None,
    counts: np.ndarray,
    options: SolverOptions,
    time_limit_s: float,
    bound: float,
    relaxed: np.ndarray,
) -> Found | None:
    """The plan that fixing the fractional relaxation ``relaxed`` (objective ``bound``)
    gives: branching on the recompute counts where they are fractional, else
    :func:`_fix_relaxation`; None when none finds a plan."""
    if len(counts) and not integral_in(relaxed, counts, options):
        branched = _branch_on_counts(
            highs, problem, auxiliary, counts, options, time_limit_s, (bound, relaxed)
        )
        return None if branched is None else Found(branched[0], branched[1], "lp+fix")
    deadline = time.perf_counter() + time_limit_s
    return _fix_relaxation(highs, problem, auxiliary, counts, options, deadline, relaxed, bound)


DIVE_UNFIXED_SHARE = 0.25
"""Under a peak-memory budget, the dive goes first only where relax and fix would leave at
least this share of the node classes to its MIP (no strategy above its first threshold), as
after a mirror-image tie (see :func:`dive`), where a few fixes cost far less than that MIP.
Below it relax and fix alone: there the fractional classes are the budget's trade of time
for memory, each fix moves the budget's price, and the dive needs many fixes, each a
re-solve, where relax and fix's MIP is quick. Without a peak-memory budget the dive always
goes first: the fractional classes are ties between plans of one price, which a few fixes
break, while relax and fix's MIP over even a fifth of the classes is slow (3-D meshes; see
docs/architecture.md)."""


def _fix_relaxation(
    highs: highspy.Highs,
    problem: Problem,
    auxiliary: AuxiliaryColumns | None,
    counts: np.ndarray,
    options: SolverOptions,
    deadline: float,
    relaxed: np.ndarray,
    bound: float,
) -> Found | None:
    """Where the dive goes first (``DIVE_UNFIXED_SHARE``), its plan if it is within
    ``fix_gap`` of ``bound``; else relax and fix's, or the dive's where it is the better
    (None when neither finds one). ``counts``: the recompute counts, integral
    in ``relaxed``, which the dive holds where they are."""
    dived = None
    if problem.memory_budget is None or _unfixed_share(problem, relaxed) >= DIVE_UNFIXED_SHARE:
        dived = dive(highs, problem, auxiliary, options, deadline, relaxed, bound, counts)
    if dived is not None and dived.gap(bound) <= options.fix_gap:
        return Found(dived, bound, "lp+dive")
    left = max(MIN_STEP_S, deadline - time.perf_counter())
    fixed = relax_and_fix(highs, problem, options, left, relaxed, bound, counts)
    if fixed is None or (dived is not None and dived.objective < fixed.objective):
        return None if dived is None else Found(dived, bound, "lp+dive")
    return Found(fixed, bound, "lp+fix")


MAX_DIVE_FIXES = 64
"""The dive gives up after fixing this many node classes one by one (relax and fix takes
over). The ties it is for break within a few fixes; the limit bounds a dive that does not."""


def dive(
    highs: highspy.Highs,
    problem: Problem,
    auxiliary: AuxiliaryColumns | None,
    options: SolverOptions,
    deadline: float,
    relaxed: np.ndarray,
    bound: float,
    held: np.ndarray | None = None,
) -> Candidate | None:
    """Fix node classes one at a time to the strategy the relaxation ``relaxed`` weighs
    most (the largest fractional value; among equals the first node in graph order) and
    re-solve the relaxation from its basis after each, until it comes out integral: that
    vertex is a plan. None when a fix leaves no feasible relaxation, time runs out or
    ``MAX_DIVE_FIXES`` fixes do not suffice; the column bounds are restored either way.
    ``held``: columns kept at their (integral) values in ``relaxed`` throughout, e.g. the
    recompute counts, which the re-solves would otherwise move off integers.

    Why: where the mesh's dims are alike (one host, equal sizes), the relaxation of a large
    problem can average a plan and its mirror image (every node half one strategy, half the
    same with the mesh dims swapped). Relax and fix then leaves a MIP over nearly the whole
    problem, nearly every node class at 0.5, and that MIP is slow. Fixing one node breaks the
    tie for its neighbours; each re-solve starts from the last basis and needs few dual
    simplex pivots, and a few fixes give a plan close to the bound."""
    flat, starts = _node_class_columns(problem)
    held = np.zeros(0, np.int32) if held is None else held
    original = highs.getLp()
    touched = [int(column) for column in held]  # whose bounds to restore
    highs.changeColsBounds(len(held), held, np.round(relaxed[held]), np.round(relaxed[held]))
    values, began = relaxed, time.perf_counter()
    try:
        while time.perf_counter() < deadline:
            at = values[flat]
            column = _most_weighted_fractional(at, flat, starts, options.integrality_tolerance)
            fixes = len(touched) - len(held)
            if column is None:
                if not integral(highs, problem, auxiliary, options):
                    return None
                plan = Candidate(float(highs.getInfo().objective_function_value), values)
                logger.info(
                    "dive: %d node classes fixed, %.3f%% above the relaxation's bound (%.2f s)",
                    fixes,
                    100 * plan.gap(bound),
                    time.perf_counter() - began,
                )
                return plan
            if fixes == MAX_DIVE_FIXES:
                break
            highs.changeColsBounds(1, np.array([column], np.int32), np.ones(1), np.ones(1))
            touched.append(column)
            allow(highs, deadline - time.perf_counter())
            if relaxation(highs, options).lower() != "optimal":
                return None
            values = np.asarray(highs.getSolution().col_value)
        logger.debug("dive: no plan after %d fixes", len(touched) - len(held))
        return None
    finally:
        columns = np.array(touched, np.int32)
        lower = np.asarray(original.col_lower_)[columns]
        upper = np.asarray(original.col_upper_)[columns]
        highs.changeColsBounds(len(columns), columns, lower, upper)


def _unfixed_share(problem: Problem, relaxed: np.ndarray) -> float:
    """The share of node classes with no strategy above relax and fix's first threshold."""
    flat, starts = _node_class_columns(problem)
    if not len(flat):
        return 0.0
    largest = np.maximum.reduceat(relaxed[flat], starts)
    return float(np.mean(largest <= FIX_THRESHOLDS[0]))


def _node_class_columns(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Every node class's integer strategy columns, once per class (folded nodes share
    them), in graph order: the columns end to end and where each class starts."""
    seen: set[int] = set()
    groups = []
    for columns in problem.node_columns.values():
        integer = columns[problem.integrality[columns]]
        if len(integer) < 2 or int(integer[0]) in seen:
            continue
        seen.add(int(integer[0]))
        groups.append(integer)
    if not groups:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
    return np.concatenate(groups), starts


def _most_weighted_fractional(
    at: np.ndarray, flat: np.ndarray, starts: np.ndarray, tolerance: float
) -> int | None:
    """The column of the largest value among the node classes whose values ``at`` are
    fractional (the first such class on ties); None when every class is integral."""
    if not len(flat):
        return None
    fractional = np.logical_or.reduceat((at > tolerance) & (at < 1 - tolerance), starts)
    if not fractional.any():
        return None
    largest = np.where(fractional, np.maximum.reduceat(at, starts), -1.0)
    group = int(np.argmax(largest))
    end = starts[group + 1] if group + 1 < len(starts) else len(flat)
    return int(flat[starts[group] + int(np.argmax(at[starts[group] : end]))])


def relaxation(highs: highspy.Highs, options: SolverOptions) -> str:
    """Solve the LP relaxation of the model ``highs`` holds; returns its status. The
    simplex starts from the basis ``highs`` holds (the last LP's, or one set by
    ``_start_from``): after a price refit the dual simplex from the last solve's basis is
    several times faster than from none, and the primal simplex from it slower than both."""
    highs.setOptionValue("solve_relaxation", True)
    highs.setOptionValue("solver", options.relaxation_solver)
    began = time.perf_counter()
    highs.run()
    highs.setOptionValue("solver", "choose")
    highs.setOptionValue("solve_relaxation", False)
    status = highs.modelStatusToString(highs.getModelStatus())
    logger.debug("relaxation: %s in %.2f s", status, time.perf_counter() - began)
    return status


FIX_THRESHOLDS = (0.5, 0.9)
"""Relax and fix tries fixing the columns the relaxation set strictly above each of these
(then the ones it set to 1): the more it fixes, the smaller the MIP left, the likelier it
misses. Strictly: a node the relaxation splits half and half between two strategies would
have both fixed at 0.5, which leaves no plan (and where many nodes are split so, the MIP
left after the 0.9 pass is most of the problem)."""


def relax_and_fix(
    highs: highspy.Highs,
    problem: Problem,
    options: SolverOptions,
    time_limit_s: float,
    relaxed: np.ndarray | None = None,
    bound: float | None = None,
    held: np.ndarray | None = None,
) -> Candidate | None:
    """Fix the strategy columns the relaxation (``relaxed``, of objective ``bound``; by
    default the one ``highs`` holds) set above a threshold (FIX_THRESHOLDS, then 1) and
    solve the MIP over the rest. Returns the first plan within ``options.fix_gap`` of the
    relaxation's objective, else the best plan found (None if none); the column bounds are
    restored either way. ``held``: integer columns integral in ``relaxed`` (the recompute
    counts), which a fix that leaves no node class open holds too (:func:`_fixed_whole`)."""
    if relaxed is None or bound is None:
        bound = float(highs.getInfo().objective_function_value)
        relaxed = np.asarray(highs.getSolution().col_value)
    deadline = time.perf_counter() + time_limit_s
    # a plan is accepted within fix_gap of the bound: the MIPs over the rest need not
    # prove more than half of it
    highs.setOptionValue("mip_rel_gap", max(float(options.relative_gap), options.fix_gap / 2))
    try:
        return _fix_in_turn(highs, problem, options, relaxed, bound, deadline, held)
    finally:
        highs.setOptionValue("mip_rel_gap", float(options.relative_gap))


def _fix_in_turn(
    highs: highspy.Highs,
    problem: Problem,
    options: SolverOptions,
    relaxed: np.ndarray,
    bound: float,
    deadline: float,
    held: np.ndarray | None,
) -> Candidate | None:
    values = relaxed[: problem.num_variables]
    best: Candidate | None = None
    tried: set[bytes] = set()  # a higher threshold often fixes the same columns
    flat, starts = _node_class_columns(problem)
    for threshold in (*FIX_THRESHOLDS, 1.0 - options.integrality_tolerance):
        fixed = np.flatnonzero(problem.integrality & (values > threshold)).astype(np.int32)
        if not len(fixed) or fixed.tobytes() in tried or time.perf_counter() >= deadline:
            continue
        tried.add(fixed.tobytes())
        began = time.perf_counter()
        count = len(fixed)
        highs.changeColsBounds(count, fixed, np.ones(count), np.ones(count))
        every_class = len(flat) > 0 and bool(
            np.all(np.logical_or.reduceat(values[flat] > threshold, starts))
        )
        whole = (
            _fixed_whole(highs, problem, options, deadline, relaxed, held) if every_class else None
        )
        if whole is not None:
            status, plan = whole
        else:
            allow(highs, deadline - time.perf_counter(), mip=True)
            highs.run()
            status = highs.modelStatusToString(highs.getModelStatus())
            found = highs.getInfo().primal_solution_status == FEASIBLE
            plan = None
            if found:
                objective = float(highs.getInfo().objective_function_value)
                plan = Candidate(objective, np.asarray(highs.getSolution().col_value))
        if plan is not None and (best is None or plan.objective < best.objective):
            best = plan
        highs.changeColsBounds(count, fixed, np.zeros(count), np.ones(count))
        logger.debug(
            "relax and fix at %.2f: %d columns fixed, %s by %s in %.2f s, %s",
            threshold,
            count,
            status,
            "LP" if whole is not None else "MIP",
            time.perf_counter() - began,
            "no plan" if plan is None else f"{100 * plan.gap(bound):.3f}% above the bound",
        )
        if plan is not None and status.lower() == "optimal" and plan.gap(bound) <= options.fix_gap:
            logger.info(
                "relax and fix (columns above %.2f fixed): %.3f%% above the relaxation's bound",
                threshold,
                100 * plan.gap(bound),
            )
            return plan
    return best


def _fixed_whole(
    highs: highspy.Highs,
    problem: Problem,
    options: SolverOptions,
    deadline: float,
    relaxed: np.ndarray,
    held: np.ndarray | None,
) -> tuple[str, Candidate | None] | None:
    """With a strategy fixed for every node class (and ``held`` at their values in
    ``relaxed``), what is left is the columns the strategies determine, and its relaxation's
    vertex is the plan. Solved from no basis, so HiGHS's presolve removes the fixed columns
    first, which makes it faster than the MIP over the same columns and than the relaxation
    from the basis ``highs`` holds. Returns (status,
    the plan or None: infeasible); None where the vertex is not integral or the LP stopped
    (the caller runs the MIP). ``held``'s bounds and ``highs``'s basis are restored."""
    held = np.zeros(0, np.int32) if held is None else np.asarray(held, np.int32)
    bounds = [highs.getCol(int(column))[2:4] for column in held]  # (lower, upper) to restore
    basis = highs.getBasis()
    at = np.round(relaxed[held])
    highs.changeColsBounds(len(held), held, at, at)
    highs.clearSolver()  # from no basis, HiGHS's presolve removes the fixed columns first
    try:
        allow(highs, deadline - time.perf_counter())
        status = relaxation(highs, options)
        if status.lower() != "optimal":
            return (status, None) if "infeasible" in status.lower() else None
        values = np.asarray(highs.getSolution().col_value)
        integer = values[: problem.num_variables][problem.integrality]
        if np.any(np.abs(integer - np.round(integer)) > options.integrality_tolerance):
            return None
        return status, Candidate(float(highs.getInfo().objective_function_value), values)
    finally:
        lower, upper = (np.array([b[i] for b in bounds], dtype=np.float64) for i in (0, 1))
        highs.changeColsBounds(len(held), held, lower, upper)
        highs.setBasis(basis)


def _branch_on_counts(
    highs: highspy.Highs,
    problem: Problem,
    auxiliary: AuxiliaryColumns | None,
    counts: np.ndarray,
    options: SolverOptions,
    time_limit_s: float,
    root: tuple[float, np.ndarray],
) -> tuple[Candidate, float] | None:
    """Branch and bound over the few integer auxiliary columns only (how many layers each
    class recomputes): the relaxation spreads a count over a fraction of a layer, which the
    full MIP takes minutes to undo. Each node solves the relaxation with the counts
    bounded; where the counts come out integral, the dive or relax and fix finds the plan. ``root``:
    the relaxation with the counts unbounded, already solved (objective, column values),
    which the tree starts from instead of solving it again (seconds on a large problem). Returns
    the best plan and a lower bound on every plan's objective (the smallest relaxation
    among the nodes left), or None if no plan was found; the bounds are restored."""
    original = (
        np.asarray(auxiliary.lower)[auxiliary.integral],
        np.asarray(auxiliary.upper)[auxiliary.integral],
    )
    deadline = time.perf_counter() + time_limit_s
    stack = [(original[0].copy(), original[1].copy(), -np.inf)]
    best: Candidate | None = None
    bounds: list[float] = []  # the relaxations of the nodes closed without branching

    def pruned(bound: float) -> bool:  # nothing below it could beat best by fix_gap
        return best is not None and bound >= best.objective * (1 - options.fix_gap)

    solved: tuple[float, np.ndarray] | None = root
    while stack:
        lower, upper, parent = stack.pop()
        if pruned(parent):
            bounds.append(parent)
            continue
        if time.perf_counter() >= deadline:
            bounds.append(parent)
            continue
        if solved is None:
            highs.changeColsBounds(len(counts), counts, lower, upper)
            allow(highs, deadline - time.perf_counter())
            status = relaxation(highs, options)
            if status.lower() != "optimal":
                continue  # infeasible (or stopped): no plan with these counts
            solved = (
                float(highs.getInfo().objective_function_value),
                np.asarray(highs.getSolution().col_value),
            )
        (objective, values), solved = solved, None
        if pruned(objective):
            bounds.append(objective)
            continue
        at = values[counts]
        fractional = np.flatnonzero(np.abs(at - np.round(at)) > options.integrality_tolerance)
        if len(fractional):
            j, value = fractional[0], at[fractional[0]]
            down, up = upper.copy(), lower.copy()
            down[j], up[j] = np.floor(value), np.ceil(value)
            stack.append((lower, down, objective))
            stack.append((up, upper, objective))  # more recomputed first: likelier to fit
            continue
        bounds.append(objective)
        if integral(highs, problem, auxiliary, options):
            plan = Candidate(objective, values)
        else:
            found = _fix_relaxation(
                highs, problem, auxiliary, counts, options, deadline, values, objective
            )
            plan = None if found is None else found.plan
        if plan is not None and (best is None or plan.objective < best.objective):
            best = plan
    highs.changeColsBounds(len(counts), counts, original[0], original[1])
    if best is None:
        return None
    bound = min(bounds, default=best.objective)
    logger.info(
        "recompute counts branched on: %.3f%% above the relaxation's bound", 100 * best.gap(bound)
    )
    return best, min(bound, best.objective)


def integral_in(values: np.ndarray, columns: np.ndarray, options: SolverOptions) -> bool:
    at = values[columns]
    return bool(np.all(np.abs(at - np.round(at)) <= options.integrality_tolerance))


def integral(
    highs: highspy.Highs,
    problem: Problem,
    auxiliary: AuxiliaryColumns | None,
    options: SolverOptions,
) -> bool:
    values = np.asarray(highs.getSolution().col_value)
    extra = 0 if auxiliary is None else len(auxiliary)
    if len(values) != problem.num_variables + extra:
        return False
    integer = values[: problem.num_variables][problem.integrality]
    if auxiliary is not None:
        integer = np.concatenate([integer, values[problem.num_variables :][auxiliary.integral]])
    return bool(np.all(np.abs(integer - np.round(integer)) <= options.integrality_tolerance))


MIN_STEP_S = 1e-3
"""The time limit of a solve step once the user's is spent: stop at once, keep what was found."""

FEASIBLE = 2  # HiGHS's kSolutionStatusFeasible: the values meet every row and bound
