"""Stage 6, solver: the MIP built by ``problem/`` solved with HiGHS, and the Plan.

``highs.solve`` solves (LP first, then relax and fix or branch and bound: ``fixing``),
``priced`` re-prices a solution and refits, ``options`` holds the solver's settings and
``plan.build_plan`` turns the chosen columns into the user's Plan.
"""
