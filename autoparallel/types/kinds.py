"""The closed sets of names the types between stages use, as ``Literal`` types.

A kind is one of a few fixed words that the JSON, the logs and the reports print as is; a
``Literal`` keeps them plain strings there while a type checker refuses any other word.
"""

from __future__ import annotations

from typing import Literal

EdgeKind = Literal["arg", "param_grad", "input_grad", "output"]
"""What an edge feeds: an op's argument, a parameter's gradient output, a user input's
gradient output, or a graph output."""

Phase = Literal["forward", "backward"]
"""The half of the training step a piece of work runs in."""

NodePhase = Literal["placeholder", "forward", "backward"]
"""Where a node of the joint graph runs: a graph input (parameters, user inputs; the
optimizer's work is counted there), the forward or the backward."""

BucketKind = Literal["gradient_reduction", "parameter_gather"]
"""Collectives the runtime issues as one: gradient reductions of one target and dtype, or a
layer's parameter all-gathers."""

SolverMethod = Literal["lp", "lp+price", "lp+dive", "lp+fix", "lp+kept", "mip"]
"""How the solver reached its plan. ``lp``: the LP relaxation came out integral (an optimum
proven without branching); ``lp+price``: a memory budget priced into the objective gave a
plan within ``fix_gap`` of the relaxation's bound; ``lp+dive``: fixing node classes one at a
time did (solver/fixing.py); ``lp+fix``: relax and fix, or branching on the recompute
counts, did; ``lp+kept``: a re-solve at refitted prices kept the plan it started from,
within ``fix_gap`` of the new bound; ``mip``: branch and bound ran."""

ActivationCheckpointing = Literal["off", "auto", "all"]
"""Which layers the plan may recompute in the backward: none, the ones the solver chooses
under the memory budget, or every numbered layer."""

CollectiveKind = Literal["all_to_all", "all_gather", "reduce_scatter", "all_reduce"]
"""A collective issued by a ``local_map`` region's body, as the cost model prices it."""

ParameterOp = Literal["linear", "embedding", "scale", "other"]
"""How the forward reads a parameter: as a matmul's weight (or bias), as an embedding table,
as an elementwise scale (a norm's weight), or otherwise. The torch-code export maps the first
three to torch's tensor-parallel styles."""
