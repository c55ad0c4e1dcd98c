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
from autoparallel.types.pipeline import (
    PipelineCost,
    PipelineOption,
    ScheduleName,
    StageMemory,
    StagePrice,
)


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


def price_stages(
    schedule: ScheduleName, microbatches: int, prices: Sequence[StagePrice]
) -> tuple[PipelineCost, tuple[StageMemory | None, ...]]:
    """The step of stages priced ``prices`` (in stage order) and each stage's memory under
    ``schedule`` (a stage's plan counts its microbatches in flight: see
    ``Problem.activation_copies``)."""
    cost = pipeline_cost(
        [p.microbatch_us for p in prices], [p.optimizer_us for p in prices], microbatches
    )
    memory = tuple(
        None
        if price.peak_bytes is None or price.activation_bytes is None
        else StageMemory(
            microbatches_in_flight(schedule, index, len(prices), microbatches),
            price.activation_bytes,
            price.peak_bytes,
        )
        for index, price in enumerate(prices)
    )
    return cost, memory


def choose_option(options: Sequence[PipelineOption], budget_bytes: float | None) -> int:
    """The index of the fastest option whose largest stage peak fits ``budget_bytes`` (the
    fewer microbatches on a tie: they are listed in increasing order); where none fits, the
    one with the smallest peak; -1 where no option has a plan."""
    planned = [i for i, o in enumerate(options) if o.step_us is not None]
    if not planned:
        return -1
    fitting = [
        i
        for i in planned
        if budget_bytes is None
        or options[i].peak_bytes is None
        or options[i].peak_bytes <= budget_bytes
    ]
    if fitting:
        return min(fitting, key=lambda i: options[i].step_us)
    return min(planned, key=lambda i: options[i].peak_bytes)
