"""How the solver runs: :class:`SolverOptions`, a frozen configuration read by
``solver/highs.py`` (the solve's steps) and ``solver/fixing.py`` (turning a fractional
relaxation into a plan). Imports no stage."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class SolverOptions:
    """How HiGHS solves a Problem. Frozen: a session's options are fixed when it starts.

    Attributes:
        time_limit_s: wall-clock budget of one solve; on a time-out the best plan found is
            returned with a warning (``plan.solver.status`` says so).
        relative_gap: the MIP stops once (objective - bound) / objective is below this.
        threads: HiGHS threads (1: planning runs beside other work and stays deterministic).
        lp_first: solve the LP relaxation first and accept it when it comes out integral
            (a proven optimum without branching); see the module docstring.
        lp_first_min_variables: below this many variables the MIP is solved directly: it
            costs little there, and small plans keep the MIP's choice among equal optima.
        integrality_tolerance: ``|x - round(x)|`` below this on every integer column counts
            as integral (HiGHS's own ``mip_feasibility_tolerance`` is 1e-6).
        fix_gap: a fractional relaxation's relax-and-fix plan is accepted within this
            relative distance of the relaxation's objective (see the module docstring);
            0 always runs the full MIP after it.
        polish_time_s: the full MIP that improves on a plan found by the steps before it
            (the dive, relax and fix, the priced search) runs at most this long; the plan then carries
            its gap (``plan.solver.gap``). A MIP with no such plan to start from has the
            whole ``time_limit_s``.
        priced_search: with budget rows (a memory budget), look for a plan by pricing the
            budget into the objective (solver/priced.py: a few warm-started LPs) where
            fixing the relaxation found none within ``fix_gap``, or where the relaxation is
            slow (see ``budget_relaxation_wait_s``).
        budget_relaxation_wait_s: how long the relaxation with budget rows may run before
            the priced search from scratch takes over (the relaxation then runs on after
            it); the relaxations of large budgeted problems usually finish well within the
            default, which bounds what a slow one costs before the search starts.
        relaxation_solver: HiGHS's LP solver for the relaxation: "simplex" (a vertex; several
            times faster than "ipm" when the relaxation is integral, as without a budget) or
            "ipm" (interior point with crossover: can be faster on a hard memory budget, one
            well below the free plan's peak).
    """

    time_limit_s: float = 300.0
    relative_gap: float = 1e-4
    threads: int = 1
    lp_first: bool = True
    lp_first_min_variables: int = 50_000
    integrality_tolerance: float = 1e-6
    fix_gap: float = 0.01
    polish_time_s: float = 30.0
    priced_search: bool = True
    budget_relaxation_wait_s: float = 15.0
    relaxation_solver: str = "simplex"

    def __post_init__(self) -> None:
        """Refuse a time limit or gap the solver could not use (TypeError for a value that
        is not a number, ValueError out of range), naming the argument."""
        for name, lowest, allow_equal in (
            ("time_limit_s", 0.0, False),
            ("relative_gap", 0.0, True),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if math.isnan(value) or value < lowest or (value == lowest and not allow_equal):
                relation = ">=" if allow_equal else ">"
                raise ValueError(f"{name} must be {relation} {lowest:g}, got {value!r}")
        if math.isinf(self.relative_gap):
            raise ValueError(f"relative_gap must be finite, got {self.relative_gap!r}")
