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
simplex starts from the last basis (well under a second on LLaMA-3 8B, where the relaxation
itself takes seconds).

The plan is feasible, not proven optimal: its gap to the relaxation's bound is the duality
gap of the budget, a few percent on LLaMA-3 8B under a halfway budget. The caller decides
whether that is close enough or improves it (``solver/highs.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import highspy
import numpy as np

from autoparallel.types.problem import Row

MAX_DOUBLINGS = 12
"""How far the price may be scaled (2**12 times the duals') before the search gives up."""

BISECTIONS = 5
"""Halvings of the interval between the last price that broke the budget and the first that met
it: the plan found gets within 2**-5 of that interval of the cheapest price that fits."""


def priced_plan(
    highs: highspy.Highs,
    rows: Sequence[Row],
    budget_indices: Sequence[int],
    integral: np.ndarray,
    solve_relaxation: Callable[[], str],
    deadline: float,
    tolerance: float = 1e-6,
) -> np.ndarray | None:
    """Column values of an integral plan that meets every budget row, or None.

    ``highs`` holds the model whose rows are ``rows``, solved to its relaxation's optimum;
    ``budget_indices`` are the rows to price; ``integral`` flags the integer columns;
    ``solve_relaxation()`` re-solves the relaxation of the model ``highs`` holds and returns
    its status. The model's costs and row bounds are restored before returning."""
    if not budget_indices:
        return None
    num_cols = highs.getNumCol()
    duals = np.asarray(highs.getSolution().row_dual)
    price = np.zeros(num_cols)
    for index in budget_indices:
        row = rows[index]
        np.add.at(price, row.columns, -duals[index] * row.values)
    if not np.any(price):
        return None  # no budget row binds at the relaxation's optimum
    costs = np.asarray(highs.getLp().col_cost_, dtype=np.float64).copy()
    all_columns = np.arange(num_cols, dtype=np.int32)

    def plan_at(scale: float) -> tuple[bool, np.ndarray | None]:
        highs.changeColsCost(num_cols, all_columns, costs + scale * price)
        highs.setOptionValue("time_limit", max(1e-3, deadline - time.perf_counter()))
        if solve_relaxation().lower() != "optimal":
            return False, None
        values = np.asarray(highs.getSolution().col_value)
        whole = np.all(np.abs(values[integral] - np.round(values[integral])) <= tolerance)
        return bool(whole and _meets(rows, budget_indices, values, tolerance)), values

    for index in budget_indices:
        highs.changeRowBounds(index, -highspy.kHighsInf, highspy.kHighsInf)
    try:
        low, high, found = 1.0, 1.0, None
        for _ in range(MAX_DOUBLINGS + 1):
            if time.perf_counter() >= deadline:
                return None
            fits, values = plan_at(high)
            if fits:
                found = values
                break
            low, high = high, 2 * high
        if found is None:
            return None
        for _ in range(BISECTIONS):
            if time.perf_counter() >= deadline or high == 1.0:
                break
            middle = (low + high) / 2
            fits, values = plan_at(middle)
            if fits and float(costs @ values) <= float(costs @ found):
                found, high = values, middle
            elif fits:
                high = middle
            else:
                low = middle
        return found
    finally:
        highs.changeColsCost(num_cols, all_columns, costs)
        for index in budget_indices:
            highs.changeRowBounds(index, rows[index].lower, rows[index].upper)


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
