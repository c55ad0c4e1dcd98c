"""The priced search: a plan that meets the budget rows, found by putting a price on them.

A memory budget that binds makes the LP relaxation fractional: the relaxation mixes two
strategies of a few nodes to spend exactly the budget. Without the budget rows the same
problem's relaxation is integral (the structure alone is what LP-first relies on). Lagrangian
relaxation joins the two: with the relaxation's optimal duals ``y`` of the budget rows, the
problem without those rows whose costs are ``c - sum_r y_r a_r`` has the relaxation's optimum
among its optima, and its vertices are integral plans. At that price a vertex may still break
the budget (the duals price memory at the margin only), so the price is scaled by ``t >= 1``:
doubling until the plan meets every budget row, then bisecting for the smallest such ``t``,
whose plan spends the least time among those found. Each step changes only the costs, so the
simplex starts from the last basis (a small fraction of what the relaxation itself takes).

That is :func:`priced_plan`, run after a fractional relaxation. :func:`priced_from_scratch`
runs before it, for a relaxation that may take minutes: without duals, it prices the mean of
the budget rows, starting where the price adds 1 % to the budget-free plan's time; every LP
it solves is also a Lagrangian lower bound on the optimum, so its plan comes with a gap.

Either plan is feasible, not proven optimal: its gap is the duality gap of the budget
(usually wider from scratch than at the duals, which start it at the margin's price). The
caller decides whether that is close enough or improves it (``solver/highs.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from autoparallel.types.problem import Row

MAX_DOUBLINGS = 12
"""How far the price may be scaled (2**12 times the duals') before the search gives up."""

BISECTIONS = 5
"""Halvings of the interval between the last price that broke the budget and the first that met
it: the plan found gets within 2**-5 of that interval of the cheapest price that fits."""


@dataclass
class PricedPlan:
    """A plan that meets the budget rows (column values), its objective, and a lower bound
    on every plan's objective (the best Lagrangian bound seen)."""

    values: np.ndarray
    objective: float
    bound: float

    def __str__(self) -> str:
        if not np.isfinite(self.bound):
            return f"a plan of {self.objective:.1f} us"
        gap = max(0.0, (self.objective - self.bound) / max(abs(self.objective), 1e-12))
        return f"a plan of {self.objective:.1f} us, {100 * gap:.2f}% above its bound"


def priced_plan(search: PriceSearch, duals: np.ndarray | None = None) -> PricedPlan | None:
    """An integral plan that meets every budget row (its bound: -inf, the caller has the
    relaxation's), or None. ``search.highs`` holds the model solved to its relaxation's
    optimum; the budget rows are priced at that optimum's duals, scaled. The model's costs
    and row bounds are restored before returning."""
    rows, indices = search.rows, search.budget_indices
    if duals is None:
        duals = np.asarray(search.highs.getSolution().row_dual)
    price = _weighted_sum(rows, indices, -duals[indices], search.num_cols)
    if not np.any(price):
        return None  # no budget row binds at the relaxation's optimum
    with search.without_budget_rows():
        found = search.cheapest_fit(price, 1.0)
    return None if found is None else PricedPlan(found, float(search.costs @ found), -np.inf)


def priced_from_scratch(search: PriceSearch) -> PricedPlan | None:
    """The priced search without the relaxation's duals, for a relaxation too slow to wait
    for: the budget rows leave the model and their mean enters the objective, at a price
    starting where it adds 1 % to the budget-free plan's time. Every priced LP also bounds
    the optimum from below (Lagrangian duality: ``c x + price (a x - budget)`` at the LP's
    optimum, the budget being every row's upper bound), so the plan comes with its gap.
    None when nothing fits (or the budget rows are not all upper bounds alike)."""
    rows, indices = search.rows, search.budget_indices
    uppers = {rows[index].upper for index in indices}
    if len(uppers) != 1 or not np.isfinite(next(iter(uppers))):
        return None
    budget = next(iter(uppers))
    price = _weighted_sum(rows, indices, np.full(len(indices), 1.0 / len(indices)), search.num_cols)
    with search.without_budget_rows():
        fits, free = search.plan_at(price, 0.0)
        if free is None:
            return None
        objective = float(search.costs @ free)
        if fits:
            return PricedPlan(free, objective, objective)
        used = float(price @ free)
        if not used > 0:
            return None
        start = 0.01 * max(abs(objective), 1e-9) / used
        search.bound_of = lambda values, scale: float(
            search.costs @ values + scale * (price @ values - budget)
        )
        found = search.cheapest_fit(price, start)
    if found is None:
        return None
    return PricedPlan(found, float(search.costs @ found), max(search.bounds, default=-np.inf))


class PriceSearch:
    """Doubling then bisection of the price's scale over the LP without the budget rows.

    ``highs`` holds the model whose rows are ``rows``; ``budget_indices`` (not empty) are
    the rows to price; ``integral`` flags the integer columns; ``solve_relaxation()``
    re-solves the relaxation of the model ``highs`` holds and returns its status; no LP
    starts after ``deadline`` (``time.perf_counter()``). One search per call of
    :func:`priced_plan` or :func:`priced_from_scratch`."""

    def __init__(
        self,
        highs: highspy.Highs,
        rows: Sequence[Row],
        budget_indices: Sequence[int],
        integral: np.ndarray,
        solve_relaxation: Callable[[], str],
        deadline: float,
        tolerance: float = 1e-6,
    ):
        self.highs, self.rows, self.budget_indices = highs, rows, list(budget_indices)
        self.integral, self.solve_relaxation = integral, solve_relaxation
        self.deadline, self.tolerance = deadline, tolerance
        self.num_cols = highs.getNumCol()
        self.columns = np.arange(self.num_cols, dtype=np.int32)
        self.costs = np.asarray(highs.getLp().col_cost_, dtype=np.float64).copy()
        self.bound_of: Callable[[np.ndarray, float], float] | None = None
        self.bounds: list[float] = []

    @contextlib.contextmanager
    def without_budget_rows(self) -> Iterator[None]:
        """The budget rows free while inside; costs and row bounds restored after."""
        for index in self.budget_indices:
            self.highs.changeRowBounds(index, -highspy.kHighsInf, highspy.kHighsInf)
        try:
            yield
        finally:
            self.highs.changeColsCost(self.num_cols, self.columns, self.costs)
            for index in self.budget_indices:
                row = self.rows[index]
                self.highs.changeRowBounds(index, row.lower, row.upper)

    def plan_at(self, price: np.ndarray, scale: float) -> tuple[bool, np.ndarray | None]:
        """(whether it is integral and meets every budget row, its values) of the LP priced
        at ``scale`` x ``price``; (False, None) when the LP did not solve."""
        self.highs.changeColsCost(self.num_cols, self.columns, self.costs + scale * price)
        allow(self.highs, self.deadline - time.perf_counter())
        if self.solve_relaxation().lower() != "optimal":
            return False, None
        values = np.asarray(self.highs.getSolution().col_value)
        if self.bound_of is not None:
            self.bounds.append(self.bound_of(values, scale))
        at = values[self.integral]
        whole = np.all(np.abs(at - np.round(at)) <= self.tolerance)
        return bool(
            whole and _meets(self.rows, self.budget_indices, values, self.tolerance)
        ), values

    def cheapest_fit(self, price: np.ndarray, start: float) -> np.ndarray | None:
        """Double the scale from ``start`` until the plan fits, then bisect towards the
        last scale that did not; the cheapest fitting plan seen, or None."""
        low, high, found = 0.0, start, None
        for _ in range(MAX_DOUBLINGS + 1):
            if time.perf_counter() >= self.deadline:
                return None
            fits, values = self.plan_at(price, high)
            if fits:
                found = values
                break
            low, high = high, 2 * high
        if found is None:
            return None
        low = max(low, start / 2) if low == 0.0 else low
        for _ in range(BISECTIONS):
            if time.perf_counter() >= self.deadline:
                break
            middle = (low + high) / 2
            fits, values = self.plan_at(price, middle)
            if fits:
                high = middle
                if float(self.costs @ values) <= float(self.costs @ found):
                    found = values
            else:
                low = middle
        return found


def _weighted_sum(
    rows: Sequence[Row], indices: Sequence[int], weights: np.ndarray, num_cols: int
) -> np.ndarray:
    """sum_i weights[i] * rows[indices[i]] as a dense vector over the columns."""
    total = np.zeros(num_cols)
    for index, weight in zip(indices, weights):
        np.add.at(total, rows[index].columns, weight * rows[index].values)
    return total


def allow(highs: highspy.Highs, seconds: float, mip: bool = False) -> None:
    """Let the next run of ``highs`` take ``seconds`` more (at least a millisecond); ``mip``:
    that run is a branch and bound (integer columns, no ``solve_relaxation``).

    HiGHS's ``time_limit`` counts an LP's time over all the instance's runs, so a limit of
    "what is left" set after earlier runs would stop it at once; a MIP's counts from the
    start of its own run (so HiGHS 1.16 behaves; the limit set below follows both). HiGHS
    stops a MIP only between its steps, so a MIP may run somewhat past its limit."""
    seconds = max(1e-3, seconds)
    highs.setOptionValue("time_limit", seconds if mip else highs.getRunTime() + seconds)


def _meets(
    rows: Sequence[Row], indices: Sequence[int], values: np.ndarray, tolerance: float
) -> bool:
    for index in indices:
        row = rows[index]
        activity = float(row.values @ values[row.columns])
        slack = tolerance * max(1.0, abs(row.upper) if np.isfinite(row.upper) else 1.0)
        if activity > row.upper + slack or activity < row.lower - slack:
            return False
    return True
