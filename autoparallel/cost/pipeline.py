"""The price of running a plan's stages as a pipeline (all in us).

Each stage's plan prices one microbatch's forward and backward on the stage's own mesh
(its ``totals`` less the optimizer step, which runs once per step), split into the forward's
and the backward's part. The step is the schedule played out (``timeline``): each stage runs
its passes in the order torch.distributed.pipelining's schedule gives it (GPipe: every
forward, then every backward; 1F1B: ``min(M, stages - i)`` forwards on stage ``i``, then a
backward and a forward in turn, then the remaining backwards), each pass starting when the
stage is free and its input is there (a forward after the stage before ran it, a backward
after the stage after ran its own). For stages of equal times ``f + b`` both schedules take

    step = (M + stages - 1) * (f + b) + the slowest stage's optimizer step

and the bubble, the time the busiest stage waits, is the step (before the optimizer) less
its ``M`` passes. 1F1B holds fewer microbatches' activations at once. Each cut costs a
point-to-point send of its tensors forward and of their gradients back per microbatch, on
the ``pp`` dim's link, charged to the stage that sends.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoparallel.cost.topology import Topology
from autoparallel.types.pipeline import (
    PassKind,
    PipelineCost,
    PipelineOption,
    ScheduleName,
    StageMemory,
    StagePrice,
    TimelineBlock,
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


def pass_order(
    schedule: ScheduleName, stage_index: int, num_stages: int, microbatches: int
) -> list[tuple[PassKind, int]]:
    """The passes stage ``stage_index`` runs, in order (see the module docstring)."""
    forwards = [("forward", m) for m in range(microbatches)]
    backwards = [("backward", m) for m in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = microbatches_in_flight(schedule, stage_index, num_stages, microbatches)
    order = forwards[:warmup]
    for m in range(microbatches):
        order.append(backwards[m])
        if warmup + m < microbatches:
            order.append(forwards[warmup + m])
    return order


def timeline(
    schedule: ScheduleName,
    forward_us: Sequence[float],
    backward_us: Sequence[float],
    microbatches: int,
) -> tuple[TimelineBlock, ...]:
    """Every stage's passes in time: each starts when its stage is free and its input is
    there (a forward once the stage before ran it, a backward once the stage after did)."""
    stages = len(forward_us)
    orders = [pass_order(schedule, i, stages, microbatches) for i in range(stages)]
    done: dict[tuple[int, PassKind, int], float] = {}
    free, nxt = [0.0] * stages, [0] * stages
    blocks: list[TimelineBlock] = []
    while len(blocks) < sum(len(order) for order in orders):
        for i in range(stages):
            if nxt[i] == len(orders[i]):
                continue
            kind, m = orders[i][nxt[i]]
            source = i - 1 if kind == "forward" else i + 1
            ready = done.get((source, kind, m)) if 0 <= source < stages else 0.0
            if ready is None:
                continue  # the pass it waits for is not placed yet
            start = max(free[i], ready)
            end = start + (forward_us[i] if kind == "forward" else backward_us[i])
            blocks.append(TimelineBlock(i, m, kind, start, end))
            done[(i, kind, m)], free[i], nxt[i] = end, end, nxt[i] + 1
    return tuple(sorted(blocks, key=lambda b: (b.stage, b.start_us)))


def pipeline_cost(
    schedule: ScheduleName,
    forward_us: Sequence[float],
    backward_us: Sequence[float],
    optimizer_us: Sequence[float],
    microbatches: int,
) -> PipelineCost:
    """The step of ``microbatches`` through stages whose forward and backward of one
    microbatch take ``forward_us`` and ``backward_us`` (see the module docstring);
    ``optimizer_us``: each stage's optimizer step."""
    blocks = timeline(schedule, forward_us, backward_us, microbatches)
    flow = max(block.end_us for block in blocks)
    per_stage = [f + b for f, b in zip(forward_us, backward_us)]
    return PipelineCost(
        stage_microbatch_us=tuple(float(t) for t in per_stage),
        bubble_us=float(flow - microbatches * max(per_stage)),
        step_us=float(flow + max(optimizer_us)),
        timeline=blocks,
    )


def price_stages(
    schedule: ScheduleName, microbatches: int, prices: Sequence[StagePrice]
) -> tuple[PipelineCost, tuple[StageMemory | None, ...]]:
    """The step of stages priced ``prices`` (in stage order) and each stage's memory under
    ``schedule`` (a stage's plan counts its microbatches in flight: see
    ``Problem.activation_copies``)."""
    cost = pipeline_cost(
        schedule,
        [p.forward_us for p in prices],
        [p.microbatch_us - p.forward_us for p in prices],
        [p.optimizer_us for p in prices],
        microbatches,
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


def balanced_layers(
    prices: Sequence[StagePrice], counts: Sequence[int]
) -> tuple[tuple[int, ...], float]:
    """Layers per stage that even out the stages' microbatch times, read from a split into
    ``counts``, and the slowest stage's time they predict: each stage's time is what it
    runs besides its layers (the embedding, the head, its sends) plus its layers at one
    layer's time (the lower median of the stages' own); the layers go one at a time to the
    stage that stays fastest with it, every stage keeping one, which makes the slowest
    stage as fast as whole layers allow. ``counts`` and their slowest time where no stage
    knows its layer time."""
    slowest = max(p.microbatch_us for p in prices)
    known = sorted(p.layer_us for p in prices if p.layer_us)
    if not known:
        return tuple(counts), slowest
    layer = known[(len(known) - 1) // 2]
    base = [p.microbatch_us - n * layer for p, n in zip(prices, counts)]
    split = [1] * len(counts)
    for _ in range(sum(counts) - len(counts)):
        lightest = min(range(len(split)), key=lambda i: base[i] + (split[i] + 1) * layer)
        split[lightest] += 1
    return tuple(split), max(b + n * layer for b, n in zip(base, split))


def choose_option(options: Sequence[PipelineOption], budget_bytes: float | None) -> int:
    """The index of the fastest option whose largest stage peak fits ``budget_bytes`` (on a
    tie the smaller peak, then the first listed: the fewer microbatches); where none fits,
    the one with the smallest peak; -1 where no option has a plan."""
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
        return min(fitting, key=lambda i: (options[i].step_us, options[i].peak_bytes or 0.0))
    return min(planned, key=lambda i: options[i].peak_bytes)
