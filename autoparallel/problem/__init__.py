"""Stage 5, problem: the priced options of every node -> one MIP (columns, rows, objective).

``build.build_problem`` is the entry point; ``folding`` finds repeated layers whose
variables are shared before the build; ``constraints`` adds the named user constraint
families; ``memory`` and ``recompute`` the memory model and activation checkpointing rows;
``buckets``, ``overlap`` and ``prefetch`` price coalesced collectives and communication
hidden behind compute. Solving the problem is ``solver/``'s job.
"""
