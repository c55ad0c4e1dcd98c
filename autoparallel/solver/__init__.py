"""Stages 4-5, solver: the MIP built from the priced options, solved with HiGHS, and the Plan.

``problem.build_problem`` -> ``constraints`` (the named user constraint families) ->
``highs.solve`` -> ``plan.build_plan``; ``folding`` finds repeated layers before the build,
``prefetch`` selects the columns ``apply_prefetch_discount`` scales.
"""
