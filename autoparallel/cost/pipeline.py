"""The price of running a plan's stages as a pipeline (all in us).

Each stage's plan prices one microbatch's forward and backward on the stage's own mesh
(its ``totals`` less the optimizer step, which runs once per step). The schedules here
(GPipe, 1F1B, neither interleaved) run every microbatch through every stage in order, so
with per-microbatch stage times ``t_0 .. t_{p-1}`` and ``M`` microbatches the step takes
the first microbatch's trip through all stages plus ``M - 1`` more of the slowest stage:

    step = sum(t) + (M - 1) * max(t) + the slowest stage's optimizer step

and the bubble, the time the slowest stage waits, is ``step - M * max(t)`` (before the
optimizer). GPipe and 1F1B take the same time in this model; 1F1B holds fewer microbatches'
activations at once. Each cut costs a point-to-point send of its tensors forward and of their
gradients back per microbatch, on the ``pp`` dim's link, charged to the stage that sends.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoparallel.cost.topology import Topology
from autoparallel.types.memory import MemoryEstimate
from autoparallel.types.pipeline import PipelineCost, ScheduleName, StageMemory


def transfer_us(nbytes: float, topology: Topology, mesh_dim: int = 0) -> float:
    """One point-to-point send of ``nbytes`` along ``mesh_dim`` (the pp dim)."""
    if nbytes <= 0:
        return 0.0
    return topology.latency_us(mesh_dim) + nbytes / topology.bandwidth(mesh_dim) * 1e6


def microbatches_in_flight(
    schedule: ScheduleName, stage_index: int, num_stages: int, microbatches: int
) -> int:
    """Microbatches whose activations stage ``stage_index`` holds at once: GPipe runs every
    forward before any backward (all of them); 1F1B lets stage ``i`` run ``num_stages - i``
    forwards before its first backward, then one forward per backward."""
    if schedule == "gpipe":
        return microbatches
    return min(num_stages - stage_index, microbatches)


def stage_memory(memory: MemoryEstimate, in_flight: int) -> StageMemory:
    """The stage plan's memory (one microbatch's activations) with ``in_flight`` of them."""
    return StageMemory(
        in_flight=in_flight,
        activations=float(in_flight * memory.activations),
        peak=float(memory.peak + (in_flight - 1) * memory.activations),
    )


def pipeline_cost(
    microbatch_us: Sequence[float], optimizer_us: Sequence[float], microbatches: int
) -> PipelineCost:
    """The step of ``microbatches`` through stages taking ``microbatch_us`` each (see the
    module docstring); ``optimizer_us``: each stage's optimizer step."""
    slowest = max(microbatch_us)
    flow = sum(microbatch_us) + (microbatches - 1) * slowest
    return PipelineCost(
        stage_microbatch_us=tuple(float(t) for t in microbatch_us),
        bubble_us=float(flow - microbatches * slowest),
        step_us=float(flow + max(optimizer_us)),
    )
