"""Choose the mesh: plan a model on every sensible shape of N devices and rank the plans.

Which mesh shape to use (how many ways of data and of tensor parallelism) decides more of a
step's time than any single placement, and without this a user plans each guess by hand.
:func:`search_mesh` lists the candidate shapes, plans the model on each (a fake process
group: nothing allocated, nothing communicates) and ranks them by the plan's predicted step
time; the best plan is the one to apply.

Candidates (``candidate_shapes``): ``(devices,)`` named ``("dp",)``, and ``(dp, tp)`` named
``("dp", "tp")`` for every ``tp > 1`` dividing ``devices`` (``(devices,)`` named ``("tp",)``
where ``tp`` is all of them); with ``pipeline``, also ``(pp, ...)`` for every ``pp > 1``
dividing ``devices`` (on several nodes, the node count: a stage spans whole nodes) before
each of those shapes of ``devices / pp`` (``(devices,)`` named
``("pp",)`` where ``pp`` is all of them), each planned as AutoParallel plans a pipeline (its
microbatches, schedule and cuts chosen) and ranked by its pipeline's step and largest stage
peak. Tensor parallelism stays within a node (``tp`` divides ``gpus_per_node``) unless
``tp_across_nodes``. The global batch (the first dim of the first
input) is sharded over ``dp``: a ``dp`` that does not divide it is skipped, with the reason.
Each candidate is planned with the batch sharded over ``dp`` and replicated over ``tp`` on
every input and output whose first dim is the batch, and, unless
``parameter_memory=False``, the parameter memory constraint (parameters sharded as far as
they go). A candidate no plan fits (an infeasible constraint) is kept with its reason.

Contract: the returned :class:`MeshSearch` lists every candidate: the planned ones whose
predicted peak memory fits the hardware's device memory, by predicted step time, then the
planned ones that do not fit (a budget with recomputation is not searched yet: give the
mesh and ``add_memory_constraint``), then the skipped ones; ``best`` is the first.
``search_mesh`` leaves no process group behind. It raises ValueError for a device count or
node size below 1, and :class:`MeshSearchError` naming every candidate's reason
when none could be planned. Not yet here (issue 46): expert dims, and tracing the model once
for all candidates (each is traced on its own mesh).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from autoparallel.api import AutoParallel
from autoparallel.runtime.launch import fake_mesh
from autoparallel.solver.highs import InfeasibleConstraintsError
from autoparallel.types.pipeline import PipelineError
from autoparallel.types.plan import Plan

logger = logging.getLogger(__name__)

__all__ = [
    "MeshCandidate",
    "MeshSearch",
    "MeshSearchError",
    "candidate_shapes",
    "constrain_candidate",
    "search_mesh",
]


class MeshSearchError(ValueError):
    """No candidate mesh could be planned; the message names each one's reason."""


@dataclass(frozen=True)
class _PlanSettings:
    """What every candidate is planned with (``search_mesh``'s arguments but the mesh)."""

    gpus_per_node: int
    hardware: Any
    mp_policy: Any
    parameter_memory: bool
    time_limit_s: float


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh shape tried: its plan's predicted figures, or why it has none.

    ``predicted_ms``: the plan's step time (``plan.totals.total_us``); ``exposed_comm_ms``:
    the communication the step waits for; ``peak_memory_gib``: predicted peak bytes per
    device (None where the plan has no memory estimate); ``fits``: that peak is within the
    hardware's memory (None where unknown); ``planning_s``: the time its plan took;
    ``skipped``: why there is no plan (then ``plan`` is None)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    plan: Plan | None = None
    predicted_ms: float | None = None
    exposed_comm_ms: float | None = None
    peak_memory_gib: float | None = None
    fits: bool | None = None
    planning_s: float = 0.0
    skipped: str | None = None

    @property
    def mesh_text(self) -> str:
        """``4x2 (dp, tp)``."""
        return f"{'x'.join(map(str, self.shape))} ({', '.join(self.names)})"


@dataclass(frozen=True)
class MeshSearch:
    """Every candidate: the planned ones whose peak fits the device first, then the planned
    ones that do not fit, each by predicted step time, then the skipped ones."""

    devices: int
    candidates: tuple[MeshCandidate, ...]

    @property
    def best(self) -> MeshCandidate:
        """The fastest planned candidate that fits the device's memory (the fastest planned
        one where none fits: its ``fits`` is then False)."""
        return self.candidates[0]

    def table(self) -> list[str]:
        """The ranked table as text lines, for a log or a terminal."""
        lines = [
            f"{'rank':>4}  {'mesh':<20} {'step ms':>10} {'exposed comm ms':>16} "
            f"{'peak GiB':>9} {'planning s':>10}"
        ]
        if any(c.fits is False for c in self.candidates):
            lines.append("      (* the predicted peak does not fit the device's memory)")
        for index, c in enumerate(self.candidates, start=1):
            if c.plan is None:
                lines.append(f"{'-':>4}  {c.mesh_text:<20} skipped: {c.skipped}")
                continue
            peak = "-" if c.peak_memory_gib is None else f"{c.peak_memory_gib:.3g}"
            peak += "*" if c.fits is False else ""
            exposed = "-" if c.exposed_comm_ms is None else f"{c.exposed_comm_ms:.3f}"
            lines.append(
                f"{index:>4}  {c.mesh_text:<20} {c.predicted_ms:>10.3f} "
                f"{exposed:>16} {peak:>9} {c.planning_s:>10.1f}"
            )
        return lines


def candidate_shapes(
    devices: int, gpus_per_node: int, tp_across_nodes: bool = False, pipeline: bool = False
) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """The mesh shapes :func:`search_mesh` tries (see the module doc), with their names;
    with ``pipeline``, also every ``(pp, ...)`` with ``pp > 1`` dividing ``devices`` before
    the shapes of ``devices / pp`` (``pp`` alone where it is all of them); on several nodes
    each stage spans whole nodes (``pp`` divides the node count), as pipeline recipes cut
    across the slow inter-node links."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    shapes: list[tuple[tuple[int, ...], tuple[str, ...]]] = [((devices,), ("dp",))]
    for tp in range(2, devices + 1):
        if devices % tp or (not tp_across_nodes and gpus_per_node % tp):
            continue
        dp = devices // tp
        shapes.append(((dp, tp), ("dp", "tp")) if dp > 1 else ((tp,), ("tp",)))
    if not pipeline:
        return shapes
    nodes = devices // gpus_per_node if devices % gpus_per_node == 0 else 1
    for pp in range(2, devices + 1):
        if devices % pp or (nodes > 1 and nodes % pp):  # a stage spans whole nodes
            continue
        if pp == devices:
            shapes.append(((pp,), ("pp",)))
            continue
        for shape, names in candidate_shapes(devices // pp, gpus_per_node, tp_across_nodes):
            shapes.append(((pp, *shape), ("pp", *names)))
    return shapes


def search_mesh(
    model: nn.Module,
    input_fn: Callable[[], Any],
    devices: int,
    gpus_per_node: int = 8,
    *,
    hardware: str | Any = None,
    mp_policy: Any = None,
    parameter_memory: bool = True,
    tp_across_nodes: bool = False,
    time_limit_s: float = 300.0,
    pipeline: bool = False,
) -> MeshSearch:
    """Plan ``model`` (best on the meta device) on every candidate mesh of ``devices``
    devices, ``gpus_per_node`` to a node, priced on ``hardware`` (a preset name, a profile
    path or a Hardware; see AutoParallel); the candidates ranked (see the module doc).
    ``pipeline``: pipeline meshes too (each plans its stages, microbatches and cuts)."""
    shapes = candidate_shapes(devices, gpus_per_node, tp_across_nodes, pipeline)
    batch = _global_batch(input_fn)
    settings = _PlanSettings(gpus_per_node, hardware, mp_policy, parameter_memory, time_limit_s)
    tried = []
    for index, (shape, names) in enumerate(shapes, start=1):
        logger.info("mesh %d of %d: %s %s", index, len(shapes), shape, names)
        tried.append(_plan_on(model, input_fn, shape, names, batch, settings))
    planned = sorted(
        (c for c in tried if c.plan is not None), key=lambda c: (c.fits is False, c.predicted_ms)
    )
    if not planned:
        reasons = "; ".join(f"{c.mesh_text}: {c.skipped}" for c in tried)
        raise MeshSearchError(f"no mesh of {devices} devices could be planned: {reasons}")
    return MeshSearch(devices, tuple(planned) + tuple(c for c in tried if c.plan is None))


def _global_batch(input_fn: Callable[[], Any]) -> int | None:
    """The first dim of the first tensor input_fn returns (the global batch), or None."""
    inputs = input_fn()
    first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else None


def _plan_on(
    model: nn.Module,
    input_fn: Callable[[], Any],
    shape: tuple[int, ...],
    names: tuple[str, ...],
    batch: int | None,
    settings: _PlanSettings,
) -> MeshCandidate:
    """One candidate planned on a fake mesh (left destroyed), or skipped with the reason."""
    dp = shape[names.index("dp")] if "dp" in names else 1
    if batch is not None and batch % dp:
        return MeshCandidate(shape, names, skipped=f"dp {dp} does not divide the batch {batch}")
    start = time.perf_counter()
    mesh = fake_mesh(shape, names)
    try:
        with AutoParallel(
            model,
            input_fn,
            mesh,
            settings.mp_policy,
            hardware=settings.hardware,
            gpus_per_node=settings.gpus_per_node,
            time_limit_s=settings.time_limit_s,
        ) as autop:
            constrain_candidate(autop, batch, names, settings.parameter_memory)
            plan = autop.optimize_placement()
            memory_bytes = autop.topology.hardware.memory_bytes
    except (InfeasibleConstraintsError, PipelineError) as error:
        return MeshCandidate(shape, names, skipped=" ".join(str(error).split()))
    finally:
        dist.destroy_process_group()
    step_us, exposed_us, peak = _figures(plan)
    return MeshCandidate(
        shape,
        names,
        plan,
        predicted_ms=step_us / 1e3,
        exposed_comm_ms=None if exposed_us is None else exposed_us / 1e3,
        peak_memory_gib=None if peak is None else peak / 2**30,
        fits=None if peak is None or not memory_bytes else peak <= memory_bytes,
        planning_s=time.perf_counter() - start,
    )


def _figures(plan: Plan) -> tuple[float, float | None, float | None]:
    """(step us, exposed comm us, peak bytes) of a plan; of a pipeline's: its step, no
    exposed comm (the stage plan's is one microbatch's), its largest stage peak."""
    peak = plan.memory.peak if plan.memory is not None else None
    pipeline = plan.pipeline
    if pipeline is None or pipeline.cost is None:
        return plan.totals.total_us, plan.totals.exposed_comm_us, peak
    peaks = [m.peak for m in pipeline.stage_memory if m is not None]
    return pipeline.cost.step_us, None, max(peaks) if peaks else peak


def constrain_candidate(
    autop: AutoParallel, batch: int | None, names: Sequence[str], parameter_memory: bool = True
) -> None:
    """The constraints a candidate mesh is planned under (see the module doc): the batch
    sharded over the first dim where it is ``dp`` (replicated otherwise) on every input and
    output whose first dim is ``batch``; the parameter memory constraint if asked. On a
    pipeline mesh the same on the dims after ``pp`` (Replicate on pp), the batch being a
    microbatch's rows, on the inputs only (the cut pins what the first stage sends on)."""
    joint = autop.sharding_optimizer.problem.joint
    if autop.stage_setup is not None:
        sharded = names[1:2] == ("dp",)
        autop.add_input_constraints(
            stage_batch_placements(autop, joint.user_inputs, batch, sharded)
        )
    else:
        outputs = [joint.tangents.get(i, out) for i, out in enumerate(joint.user_outputs)]
        sharded = names[0] == "dp"
        autop.add_input_constraints(batch_placements(joint.user_inputs, batch, len(names), sharded))
        autop.add_output_constraints(batch_placements(outputs, batch, len(names), sharded))
    if parameter_memory:
        autop.add_parameter_memory_constraint()


def stage_batch_placements(
    autop: AutoParallel, nodes: Sequence[Any], batch: int | None, sharded: bool = True
) -> list[Any]:
    """On a pipeline mesh: :func:`batch_placements` of the stage's ``nodes`` over the dims
    after ``pp`` (the batch being a microbatch's rows), written on the whole mesh (Replicate
    on pp), as the user's constraints are; ``batch`` None: no batch."""
    rows = None if batch is None else autop.stage_setup.microbatch_rows
    inner = batch_placements(nodes, rows, autop.mesh.ndim, sharded)
    return [None if p is None else (Replicate(), *p) for p in inner]


def batch_placements(
    nodes: Sequence[Any], batch: int | None, ndim: int, sharded: bool = True
) -> list[Any]:
    """``(Shard(0), Replicate(), ...)`` (the batch over the first mesh dim; all Replicate
    where not ``sharded``) for every graph input or output whose first dim is ``batch``;
    None (the planner's choice) for the others."""
    first = Shard(0) if sharded else Replicate()
    placement = (first,) + (Replicate(),) * (ndim - 1)
    placements = []
    for node in nodes:
        value = node.meta.get("val") if node is not None else None
        shape = getattr(value, "shape", None)
        is_batch = batch is not None and shape is not None and len(shape) >= 1
        placements.append(placement if is_batch and int(shape[0]) == batch else None)
    return placements
