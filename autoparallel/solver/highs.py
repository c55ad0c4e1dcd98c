"""Stage 5: solve a Problem with HiGHS.

Returns a :class:`Solution` (the chosen strategy per node and the solver's statistics) or
raises :class:`InfeasibleConstraintsError` naming the smallest set of user constraints that
cannot hold together, found by removing constraints one at a time (a deletion filter).

LP first: the marginal formulation's LP relaxation is usually integral already (the x of
every node at 0 or 1). So we solve the relaxation first (dual simplex gives a vertex) and,
when every integer column is integral there, that vertex *is* an optimal MIP solution: the
relaxation's optimum bounds the MIP's from below and is attained by a feasible integer
point. Only a fractional relaxation runs the branch-and-bound, with the time left. On a
large problem this saves the MIP's presolve, heuristics and root node work, much of a solve.
``SolverOptions(lp_first=False)`` goes straight to the MIP, and so do problems under
``lp_first_min_variables`` (where the MIP is quick anyway). Both paths find an optimum of the
same problem; among equally priced plans they may pick different ones.

Fixing a fractional relaxation (solver/fixing.py): branch on the recompute counts, the
dive, relax and fix; a plan within ``fix_gap`` of the relaxation's objective (a lower
bound on every plan's) is accepted, and ``plan.solver.gap`` says how far it is. Otherwise
the full MIP runs, starting from the best plan found, for at most ``polish_time_s``: on a
large problem it can spend minutes improving a plan a few percent above its bound, which
the price refit that follows may replace anyway (a gain well inside the cost model's own
error is not worth minutes). Without any plan found before it, the MIP
has the whole ``time_limit_s``.

Priced search: where a memory budget binds, pricing its rows into the objective
(solver/priced.py) gives an integral plan within the budget in a few warm-started LP solves.
After a fractional relaxation it runs at the relaxation's duals, where fixing (solver/fixing.py)
found no plan within ``fix_gap``: fixing goes first, as on large budgeted problems it finds
plans sooner and closer to the bound. A relaxation with budget rows that has not
finished after ``budget_relaxation_wait_s`` hands over to the priced search from scratch
(no duals: the mean budget row, each priced LP also a Lagrangian lower bound, so its plan
has a gap of its own); a plan within ``fix_gap`` of that bound is accepted ("lp+price"),
else the relaxation runs on with it as the plan to beat and the plan returned when the
relaxation does not finish in time. (On large budgeted problems the relaxation usually
finishes within that wait, and the search from scratch, slower still, rarely comes close
enough to its bound to be accepted; ``benchmarks/plan_time.py`` times both.)

A re-solve after the prices were refitted to the last plan (ShardingOptimizer.resolve)
keeps that plan when, at the new prices, it is within ``fix_gap`` of the new relaxation's
bound ("lp+kept"): nothing is fixed again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import highspy
import numpy as np

from autoparallel.solver.fixing import (
    FEASIBLE,
    MIN_STEP_S,
    Candidate,
    Found,
    fixed_plan,
    integral,
    relaxation,
)
from autoparallel.solver.options import SolverOptions
from autoparallel.solver.priced import (
    PricedPlan,
    PriceSearch,
    allow,
    priced_from_scratch,
    priced_plan,
)
from autoparallel.types.plan import Solution, SolverStats
from autoparallel.types.problem import AuxiliaryColumns, Problem, Row

logger = logging.getLogger(__name__)


class InfeasibleConstraintsError(ValueError):
    """The user's constraints cannot all hold; ``conflict`` names the ones in conflict."""

    def __init__(self, conflict: list[str], descriptions: list[str]):
        self.conflict = conflict
        lines = "\n".join(f"  - {name}: {text}" for name, text in zip(conflict, descriptions))
        super().__init__(
            "no plan satisfies these constraints together:\n"
            f"{lines}\nremove or change one of them (sharding_optimizer.remove_constraints([...]))"
        )


@dataclass(frozen=True)
class _Basis:
    """A simplex basis for a re-solve of the same rows and columns at other prices, and
    which LP it is of: the relaxation with the budget rows (the re-solve's relaxation starts
    there, usually faster than from no basis), or the priced search's last LP, without them,
    where a slow relaxation handed over to the search from scratch (the re-solve's priced
    search starts there, which likewise beats starting it cold)."""

    basis: highspy.HighsBasis
    of_relaxation: bool
    cold_s: float = 0.0  # what the relaxation took from no basis, in the solve it came from
    # every column of the plan that solve returned: a re-solve keeps it where, at the new
    # prices, it is within fix_gap of the relaxation's bound (see _kept_plan)
    plan_values: np.ndarray | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class _Outcome:
    """How a solve ended: the Highs it ran in, its status, the seconds it took, the method
    ("lp", "lp+fix" or "mip") and the lower bound on the objective (None: read the MIP's
    own dual bound); ``plan`` when the plan is not the one ``highs`` holds last."""

    highs: highspy.Highs
    status: str
    elapsed_s: float
    method: str
    bound: float | None
    plan: Candidate | None = None
    basis: _Basis | None = None  # where the next solve at refitted prices starts
    polish_s: float | None = None  # the full MIP's limit when it only improved a plan


def _all_rows(problem: Problem, constraint_names: list[str]) -> list[Row]:
    rows = list(problem.rows)
    for name in constraint_names:
        rows.extend(problem.user_constraints[name].rows)
    return rows


def _auxiliary(problem: Problem, constraint_names: list[str]) -> AuxiliaryColumns | None:
    """The auxiliary columns of the constraints in force (at most one has them)."""
    owner = problem.auxiliary_owner()
    return problem.user_constraints[owner].columns if owner in constraint_names else None


def _to_highs(
    problem: Problem, rows: list[Row], auxiliary: AuxiliaryColumns | None
) -> highspy.HighsLp:
    lp = highspy.HighsLp()
    base = problem.num_variables
    extra = 0 if auxiliary is None else len(auxiliary)
    num_cols = base + extra
    lp.num_col_ = num_cols
    lp.num_row_ = len(rows)
    lp.col_cost_ = problem.objective.astype(np.float64)
    lp.col_lower_ = np.zeros(num_cols)
    lp.col_upper_ = np.ones(num_cols)
    integrality = list(problem.integrality)
    if auxiliary is not None:
        lp.col_cost_ = np.concatenate([problem.objective, auxiliary.objective]).astype(np.float64)
        lp.col_lower_ = np.concatenate([np.zeros(base), auxiliary.lower])
        lp.col_upper_ = np.concatenate([np.ones(base), auxiliary.upper])
        integrality += list(auxiliary.integral)
    lp.row_lower_ = np.array([r.lower for r in rows], dtype=np.float64)
    lp.row_upper_ = np.array([r.upper for r in rows], dtype=np.float64)
    starts = np.zeros(len(rows) + 1, dtype=np.int32)
    starts[1:] = np.cumsum([len(r.columns) for r in rows])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = (
        np.concatenate([r.columns for r in rows]).astype(np.int32)
        if rows
        else np.zeros(0, np.int32)
    )
    lp.a_matrix_.value_ = (
        np.concatenate([r.values for r in rows]).astype(np.float64) if rows else np.zeros(0)
    )
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous
        for flag in integrality
    ]
    return lp


def _run(
    problem: Problem,
    constraint_names: list[str],
    options: SolverOptions,
    warm_start: _Basis | None = None,
) -> _Outcome:
    """Solve; the returned Highs holds the solution. With ``lp_first``, an integral
    relaxation is returned as is, a fractional one is fixed (solver/fixing.py, see the
    module docstring), else the MIP runs. ``warm_start``: another solve's basis of the same
    rows and columns, which the first LP starts from."""
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(options.time_limit_s))
    highs.setOptionValue("mip_rel_gap", float(options.relative_gap))
    highs.setOptionValue("threads", int(options.threads))
    auxiliary = _auxiliary(problem, constraint_names)
    rows = _all_rows(problem, constraint_names)
    highs.passModel(_to_highs(problem, rows, auxiliary))
    counts = _count_columns(problem, auxiliary)
    start = time.perf_counter()

    def remaining() -> float:
        return max(MIN_STEP_S, float(options.time_limit_s) - (time.perf_counter() - start))

    polish_s = None

    if (
        options.lp_first
        and problem.integrality.any()
        and (problem.num_variables >= options.lp_first_min_variables or len(counts))
    ):
        # a re-solve at refitted prices starts from the last solve's basis (see _Basis)
        if warm_start is not None:
            _start_from(highs, warm_start.basis)
        budgeted = options.priced_search and any(row.budget for row in rows)
        status = None
        cold_s = warm_start.cold_s if warm_start is not None else 0.0
        if warm_start is None or warm_start.of_relaxation or not budgeted:
            wait = min(remaining(), options.budget_relaxation_wait_s) if budgeted else remaining()
            status, cold_s = _first_relaxation(highs, options, wait, warm_start)
        found, early = None, None  # the priced search from scratch's plan, if it runs
        if budgeted and (status is None or _timed_out(status)):
            # the relaxation of a binding budget is slow here: the priced search from
            # scratch finds a plan (with a bound) first, then the relaxation runs on
            found = _priced(
                priced_from_scratch, highs, problem, rows, auxiliary, options, remaining()
            )
            early = None if found is None else Candidate(found.objective, found.values)
            if early is not None and early.gap(found.bound) <= options.fix_gap:
                elapsed = time.perf_counter() - start
                basis = _Basis(highs.getBasis(), of_relaxation=False, cold_s=cold_s)
                method = "lp" if early.objective <= found.bound else "lp+price"
                # "lp": the plan without the budget meets it
                return _Outcome(highs, "Optimal", elapsed, method, found.bound, early, basis)
            allow(highs, remaining())
            status = relaxation(highs, options)
        basis = _Basis(highs.getBasis(), True, cold_s) if status.lower() == "optimal" else None
        if early is not None and status.lower() != "optimal" and not _is_infeasible(status):
            # the relaxation did not finish: the priced plan is the best there is
            elapsed = time.perf_counter() - start
            return _Outcome(highs, status, elapsed, "lp+price", found.bound, early)
        if _is_infeasible(status) or (
            status.lower() == "optimal" and integral(highs, problem, auxiliary, options)
        ):
            objective = float(highs.getInfo().objective_function_value)
            return _Outcome(
                highs, status, time.perf_counter() - start, "lp", objective, None, basis
            )
        if status.lower() == "optimal":
            bound = float(highs.getInfo().objective_function_value)
            kept = _kept_plan(highs, warm_start, bound, options)
            if kept is not None:
                elapsed = time.perf_counter() - start
                return _Outcome(highs, "Optimal", elapsed, "lp+kept", bound, kept, basis)
            relaxed = np.asarray(highs.getSolution().col_value)
            duals = np.asarray(highs.getSolution().row_dual)
            # fixing first (on large budgeted problems it finds a plan sooner than the
            # priced search, and closer to the bound), then the priced
            # search at the relaxation's duals where fixing found nothing close enough
            best = fixed_plan(
                highs, problem, auxiliary, counts, options, remaining(), bound, relaxed
            )
            if best is None or best.gap > options.fix_gap:
                at_duals = _priced(
                    priced_plan, highs, problem, rows, auxiliary, options, remaining(), duals
                )
                for priced in (at_duals, early):
                    if priced is not None and (
                        best is None or priced.objective < best.plan.objective
                    ):
                        candidate = Candidate(priced.objective, priced.values)
                        best = Found(candidate, bound if best is None else best.bound, "lp+price")
            if best is not None:
                if best.gap <= options.fix_gap:
                    elapsed = time.perf_counter() - start
                    return _Outcome(
                        highs, "Optimal", elapsed, best.method, best.bound, best.plan, basis
                    )
                highs.setSolution(_as_solution(best.plan))  # the full MIP starts from it
                polish_s = min(remaining(), float(options.polish_time_s))
            logger.info(
                "fixing found no plan within %.1f%%: running branch and bound%s",
                100 * options.fix_gap,
                "" if polish_s is None else f" for at most {polish_s:.0f} s",
            )
        allow(highs, remaining() if polish_s is None else polish_s, problem.integrality.any())
    highs.run()
    status = highs.modelStatusToString(highs.getModelStatus())
    elapsed = time.perf_counter() - start
    return _Outcome(highs, status, elapsed, "mip", None, polish_s=polish_s)


def _kept_plan(
    highs: highspy.Highs, warm_start: _Basis | None, bound: float, options: SolverOptions
) -> Candidate | None:
    """The last solve's plan, where it is within ``fix_gap`` of this relaxation's ``bound``
    at the prices now in ``highs``: a re-solve after the prices were refitted to that plan
    (same rows, so it is still feasible) then needs no relax and fix, which on a large
    problem can take long to return a plan no cheaper than the one it started from."""
    if warm_start is None or warm_start.plan_values is None:
        return None
    lp = highs.getLp()
    values = warm_start.plan_values
    if len(values) != lp.num_col_:
        return None
    objective = float(np.dot(np.asarray(lp.col_cost_), values) + lp.offset_)
    kept = Candidate(objective, values)
    if kept.gap(bound) > options.fix_gap:
        return None
    logger.info(
        "the last plan at the refitted prices: %.3f%% above the relaxation's bound, kept",
        100 * kept.gap(bound),
    )
    return kept


WARM_START_FACTOR = 1.0
WARM_START_MIN_S = 2.0
"""A relaxation started from an earlier solve's basis runs at most ``WARM_START_FACTOR``
times what that solve's relaxation took from no basis (and at least ``WARM_START_MIN_S``,
so that the run-to-run spread of a relaxation of a fraction of a second does not cut a warm
start short) before it starts again from none. Usually the warm start is the faster, but not
always: where the presolve a cold start runs shrinks the problem first, a warm start can
take several times as long. Once the warm start has run as long as a cold one would take,
starting again costs at most that much more, and a warm start this slow is usually far
slower (a larger factor only spends longer on it before starting again)."""


def _first_relaxation(
    highs: highspy.Highs, options: SolverOptions, wait_s: float, warm_start: _Basis | None
) -> tuple[str, float]:
    """The solve's relaxation, within ``wait_s``: from ``warm_start``'s basis (already set)
    while that pays (see WARM_START_FACTOR), else from none. Returns its status and what a
    relaxation from no basis took (this one's, or the earlier solve's when the warm start
    finished)."""
    if warm_start is not None:
        cap = max(WARM_START_FACTOR * warm_start.cold_s, WARM_START_MIN_S)
        allow(highs, min(wait_s, cap))
        status = relaxation(highs, options)
        if not _timed_out(status) or cap >= wait_s:
            return status, warm_start.cold_s
        logger.info("the warm-started relaxation ran past %.1f s: starting it again cold", cap)
        highs.clearSolver()
        wait_s -= cap
    allow(highs, wait_s)
    began = time.perf_counter()
    status = relaxation(highs, options)
    return status, time.perf_counter() - began


def _start_from(highs: highspy.Highs, basis: highspy.HighsBasis) -> None:
    """Start the next simplex from ``basis`` where it fits the model (same rows and
    columns); otherwise the solve starts cold."""
    if len(basis.col_status) != highs.getNumCol() or len(basis.row_status) != highs.getNumRow():
        return
    if highs.setBasis(basis) != highspy.HighsStatus.kOk:
        logger.debug("warm start refused: the relaxation starts cold")


def _integral_mask(problem: Problem, auxiliary: AuxiliaryColumns | None) -> np.ndarray:
    integral = np.asarray(problem.integrality, dtype=bool)
    if auxiliary is None:
        return integral
    return np.concatenate([integral, np.asarray(auxiliary.integral, dtype=bool)])


def _priced(
    search: Callable[..., PricedPlan | None],
    highs: highspy.Highs,
    problem: Problem,
    rows: list[Row],
    auxiliary: AuxiliaryColumns | None,
    options: SolverOptions,
    time_limit_s: float,
    duals: np.ndarray | None = None,
) -> PricedPlan | None:
    """``search`` (solver/priced.py: ``priced_from_scratch`` before the relaxation, which a
    budget can make slow, or ``priced_plan`` after a fractional one) over the budget rows;
    None without budget rows or when it finds no plan within them."""
    budget = [index for index, row in enumerate(rows) if row.budget]
    if not budget or not options.priced_search:
        return None
    began = time.perf_counter()
    found = search(
        PriceSearch(
            highs,
            rows,
            budget,
            _integral_mask(problem, auxiliary),
            lambda: relaxation(highs, options),
            began + time_limit_s,
            options.integrality_tolerance,
        ),
        **({} if duals is None else {"duals": duals}),
    )
    logger.info("%s: %s (%.2f s)", search.__name__, found or "no plan", time.perf_counter() - began)
    return found


def _count_columns(problem: Problem, auxiliary: AuxiliaryColumns | None) -> np.ndarray:
    """The indices of the integer auxiliary columns (recompute counts)."""
    if auxiliary is None:
        return np.zeros(0, dtype=np.int32)
    return (problem.num_variables + np.flatnonzero(auxiliary.integral)).astype(np.int32)


def _as_solution(plan: Candidate) -> highspy.HighsSolution:
    solution = highspy.HighsSolution()
    solution.col_value = plan.values.tolist()
    solution.value_valid = True
    return solution


def _is_infeasible(status: str) -> bool:
    return "infeasible" in status.lower()


def _timed_out(status: str) -> bool:
    return "time limit" in status.lower()


def solve(
    problem: Problem, options: SolverOptions | None = None, warm_start: Solution | None = None
) -> Solution:
    """The plan's strategy per node. ``warm_start``: an earlier solution of this problem
    with the same constraints (only the prices changed since), whose last basis this
    solve's first LP starts from."""
    options = options or SolverOptions()
    names = list(problem.user_constraints)
    outcome = _run(problem, names, options, warm_start.warm_start if warm_start else None)
    highs, status, elapsed = outcome.highs, outcome.status, outcome.elapsed_s
    if _is_infeasible(status):
        conflict = _minimal_conflict(problem, names, options)
        raise InfeasibleConstraintsError(
            conflict, [problem.user_constraints[n].description for n in conflict]
        )
    info = highs.getInfo()
    plan = outcome.plan
    values = plan.values if plan is not None else np.asarray(highs.getSolution().col_value)
    auxiliary = _auxiliary(problem, names)
    if len(values) != problem.num_variables + (0 if auxiliary is None else len(auxiliary)):
        raise RuntimeError(f"HiGHS returned no solution (status: {status})")
    feasible = plan is not None or info.primal_solution_status == FEASIBLE
    if status.lower() != "optimal" and not feasible:
        raise RuntimeError(
            f"the solver stopped ({status}) after {elapsed:.0f} s before it found a plan that "
            f"meets every constraint ({problem.num_variables} variables); give it more time "
            "(AutoParallel(..., time_limit_s=...)) or make the problem smaller (fewer or "
            "looser constraints, a smaller mesh)"
        )
    objective = plan.objective if plan is not None else float(info.objective_function_value)
    # an integral relaxation is a proven optimum: its objective is also the bound; relax
    # and fix is bounded by the relaxation's objective
    bound = outcome.bound if outcome.bound is not None else float(info.mip_dual_bound)
    gap = (
        float(info.mip_gap)
        if outcome.bound is None
        else max(0.0, (objective - bound) / max(abs(objective), 1e-12))
    )
    if outcome.polish_s is not None and "time limit" in status.lower():
        logger.info(
            "branch and bound stopped after %.0f s (SolverOptions.polish_time_s): the plan is "
            "within %.2f%% of the bound",
            outcome.polish_s,
            100 * gap,
        )
    elif status.lower() not in ("optimal",):
        logger.warning(
            "solver stopped with status %r; using the best plan found (gap %.2f%%)",
            status,
            100 * gap,
        )
    choice = {
        node: int(np.argmax(values[columns])) for node, columns in problem.node_columns.items()
    }
    stats = SolverStats(
        status=status,
        objective=objective,
        bound=bound,
        gap=gap,
        time_s=elapsed,
        num_variables=problem.num_variables + (0 if auxiliary is None else len(auxiliary)),
        num_constraints=problem.num_constraints,
        method=outcome.method if problem.integrality.any() else "mip",
    )
    extra = (
        {}
        if auxiliary is None
        else dict(zip(auxiliary.names, values[problem.num_variables :].tolist()))
    )
    basis = outcome.basis
    if basis is not None:
        basis = dataclasses.replace(basis, plan_values=values)
    return Solution(choice=choice, stats=stats, auxiliary=extra, warm_start=basis)


def _minimal_conflict(problem: Problem, names: list[str], options: SolverOptions) -> list[str]:
    """Deletion filter: drop each constraint whose removal keeps the problem infeasible."""
    if _is_infeasible(_run(problem, [], options).status):
        return ["<structural: no strategy combination is valid>"]
    kept = list(names)
    for name in names:
        trial = [n for n in kept if n != name]
        if _is_infeasible(_run(problem, trial, options).status):
            kept = trial
    return kept
