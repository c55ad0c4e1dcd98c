"""Small helpers for planner tests: plan a model and read the plan's redistributions."""

from __future__ import annotations

import contextlib
import io
import subprocess
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.types.plan import Plan

TINY_PLAN_ARGS = ("plan", "--model", "tiny", "--mesh", "2", "--batch", "8", "--seq", "32")
"""``autoparallel plan`` of the tiny LLaMA on 2 fake ranks; tests add their own flags."""


def batch_sharded(mesh_ndim: int) -> tuple:
    return (Shard(0),) + (Replicate(),) * (mesh_ndim - 1)


def plan_model(
    model: torch.nn.Module,
    input_fn: Callable,
    mesh,
    inputs: Sequence | None = None,
    outputs: Sequence | None = None,
    memory: bool = False,
) -> Plan:
    with AutoParallel(model, input_fn, mesh) as autop:
        if inputs is not None:
            autop.add_input_constraints(list(inputs))
        if outputs is not None:
            autop.add_output_constraints(list(outputs))
        if memory:
            autop.add_parameter_memory_constraint()
        return autop.optimize_placement()


def transitions(plan: Plan, src_kind, dst_kind, mesh_dim: int = 0, phase: str | None = None):
    """Redistributions that change mesh dim ``mesh_dim`` from a src_kind to a dst_kind placement."""
    found = []
    for consumer, arg in plan.redistributions():
        src, dst = arg.src[mesh_dim], arg.dst[mesh_dim]
        if isinstance(src, src_kind) and isinstance(dst, dst_kind) and src != dst:
            if phase is None or plan.nodes[consumer].phase == phase or arg.kind == "param_grad":
                found.append((consumer, arg))
    return found


__all__ = ["Partial", "Replicate", "Shard", "batch_sharded", "plan_model", "transitions"]


def budget_only_recomputing_meets(optimizer) -> float:
    """A peak-memory budget (bytes) below what any plan that saves every activation needs
    (95 % of that smallest peak's lower bound), for ``optimizer``'s problem with AdamW."""
    from autoparallel.problem.memory import build_memory_model, smallest_peak

    return 0.95 * smallest_peak(build_memory_model(optimizer.problem, "adamw"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The ``autoparallel`` command run in this process (``main`` returns its exit status;
    ``plan`` destroys its fake process group on the way out, success or not)."""
    from autoparallel.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, stdout.getvalue(), stderr.getvalue())
