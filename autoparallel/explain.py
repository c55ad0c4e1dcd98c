"""Human-readable views of a Plan: the optimizer log.

The log states, for every node, the placements it runs with in the seed's notation
(``S(0)R, RS(1) -> S(0)S(1)``) and what it costs, then the totals and the solver's own
statistics, so that every decision can be questioned. Units are always printed.
"""

from __future__ import annotations

import logging

from autoparallel.solver.plan import NodePlan, Plan
from autoparallel.strategies.types import placement_str

logger = logging.getLogger("autoparallel.plan")


def format_node(node: NodePlan) -> str:
    inputs = ", ".join(placement_str(p) for p in node.strategy.inputs)
    arrow = f"{inputs} -> " if inputs else ""
    per_arg = ", ".join(
        f"{arg.producer}:({arg.comm_us:.2f}, {node.compute_us if i == 0 else 0.0:.2f}, {arg.transition_us:.2f})"
        for i, arg in enumerate(node.arguments)
    )
    if not node.arguments:
        per_arg = f"(0.00, {node.compute_us:.2f}, 0.00)"
    shape = "x".join(str(s) for s in node.shape) if node.shape is not None else "-"
    return (
        f"{node.name:<28} {node.target:<48} [{shape}] "
        f"{arrow}{placement_str(node.strategy.output)}  "
        f"cost us (comm, compute, transition) per arg: {per_arg}"
    )


def format_totals(plan: Plan) -> list[str]:
    t, s = plan.totals, plan.solver
    return [
        f"total cost: {t.total_us:.2f} us = comm {t.comm_us:.2f} us + compute {t.compute_us:.2f} us "
        f"+ transition {t.transition_us:.2f} us",
        f"solver: status {s.status}, objective {s.objective:.2f} us, bound {s.bound:.2f} us, gap {100 * s.gap:.3f}%, "
        f"time {s.time_s:.2f} s, {s.num_variables} variables, {s.num_constraints} constraints",
    ]


def format_parameters(plan: Plan) -> list[str]:
    width = max((len(n) for n in plan.param_placements), default=0)
    return [f"{name:<{width}}  {placement_str(p)}" for name, p in plan.param_placements.items()]


def log_plan(plan: Plan, level: int = logging.INFO) -> None:
    """Emit the whole plan through Python logging (logger ``autoparallel.plan``)."""
    names = plan.mesh_dim_names or tuple(f"dim{i}" for i in range(len(plan.mesh_shape)))
    mesh = ", ".join(f"{n}={s}" for n, s in zip(names, plan.mesh_shape))
    logger.log(level, "plan on mesh (%s); placements in mesh-dim order; costs in microseconds", mesh)
    for node in plan.nodes.values():
        logger.log(level, "%s", format_node(node))
    for line in format_totals(plan):
        logger.log(level, "%s", line)
    if plan.fallbacks:
        logger.log(level, "replicated for lack of a strategy: %s", ", ".join(plan.fallbacks))
