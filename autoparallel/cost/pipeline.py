"""The price of running a plan's stages as a pipeline (all in us).

Each stage's plan prices one microbatch's forward and backward on the stage's own mesh
(its ``totals`` less the optimizer step, which runs once per step), split into the forward's
and the backward's part. The step is the schedule played out (``timeline``): each stage runs
its passes in the order torch.distributed.pipelining's schedule gives its rank (GPipe: every
forward, then every backward; 1F1B: ``min(M, stages - i)`` forwards on stage ``i``, then a
backward and a forward in turn, then the remaining backwards), each pass starting when the
stage is free and its input is there (a forward after the stage before ran it, a backward
after the stage after ran its own). For stages of equal times ``f + b`` both schedules take

    step = (M + stages - 1) * (f + b) + the slowest stage's optimizer step

and the bubble, the time the busiest stage waits, is the step (before the optimizer) less
its ``M`` passes. 1F1B holds fewer microbatches' activations at once. Interleaved 1F1B runs
``v`` stages per rank (``v * ranks`` stages of ``1 / v`` the layers each), which shrinks the
bubble towards ``(ranks - 1) * (f + b) / v`` for the price of ``v`` times the sends and more
activations in flight on the early ranks (``rank_order``). Each cut costs a
point-to-point send of its tensors forward and of their gradients back per microbatch, on
the ``pp`` dim's link (``transfer_us``): torch's schedules send asynchronously, so a send
delays the stage that receives it, not the one that sends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autoparallel.cost.hardware import SEND_RECV
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
    """One point-to-point send of ``nbytes`` along ``mesh_dim`` (the pp dim): the profile's
    send-receive fit where it has one (``autoparallel calibrate``), else the link's figures."""
    if nbytes <= 0:
        return 0.0
    latency = topology.latency_us(mesh_dim, SEND_RECV)
    return latency + nbytes / topology.bandwidth(mesh_dim, SEND_RECV) * 1e6


Pass = tuple[int, PassKind, int]
"""One forward or backward of one microbatch on one stage: (stage, kind, microbatch)."""


def rank_order(
    schedule: ScheduleName, rank: int, ranks: int, stages_per_rank: int, microbatches: int
) -> list[Pass]:
    """The passes pipeline rank ``rank`` (of ``ranks``) runs, in order, as torch's schedule
    orders them. GPipe: every forward, then every backward. 1F1B: ``min(M, ranks - rank)``
    forwards, then a backward and a forward in turn, then the remaining backwards.
    Interleaved 1F1B (``stages_per_rank`` = v stages per rank, stage ``rank + k * ranks``
    the rank's k-th, torch's loop placement): the microbatches go in rounds of
    ``M // max(1, M // ranks)``, each round through the rank's stages in turn; after a
    warmup of ``(v - 1) * round + 2 * (ranks - 1 - rank)`` forwards (at most ``v * M``)
    every forward is followed by a backward, the backwards visiting the rank's stages last
    to first, then the remaining backwards."""
    if schedule != "interleaved-1f1b":
        forwards = [(rank, "forward", m) for m in range(microbatches)]
        backwards = [(rank, "backward", m) for m in range(microbatches)]
        if schedule == "gpipe":
            return forwards + backwards
        warmup = min(ranks - rank, microbatches)
        order = forwards[:warmup]
        for m in range(microbatches):
            order.append(backwards[m])
            if warmup + m < microbatches:
                order.append(forwards[warmup + m])
        return order
    per_round = microbatches // max(1, microbatches // ranks)
    passes = stages_per_rank * microbatches
    warmup = min((stages_per_rank - 1) * per_round + 2 * (ranks - 1 - rank), passes)
    done = {"forward": [0] * stages_per_rank, "backward": [0] * stages_per_rank}

    def run(kind: PassKind, local: int) -> Pass:
        microbatch = done[kind][local]
        done[kind][local] += 1
        return (local * ranks + rank, kind, microbatch)

    order: list[Pass] = []
    for step in range(passes + warmup):
        if step < passes:
            order.append(run("forward", step // per_round % stages_per_rank))
        if step >= warmup:
            back = stages_per_rank - 1 - (step - warmup) // per_round % stages_per_rank
            order.append(run("backward", back))
    return order


def microbatches_in_flight(
    schedule: ScheduleName,
    stage_index: int,
    num_stages: int,
    microbatches: int,
    stages_per_rank: int = 1,
) -> int:
    """The most microbatches whose activations stage ``stage_index`` holds at once (forward
    run, backward not yet) under the schedule's order (``rank_order``): all of them for
    GPipe, ``min(M, stages - i)`` for 1F1B."""
    ranks = num_stages // stages_per_rank
    counted = [1.0 if stage == stage_index else 0.0 for stage in range(num_stages)]
    rank = stage_index % ranks
    peak = rank_activation_peak(schedule, rank, ranks, stages_per_rank, microbatches, counted)
    return int(peak)


def rank_activation_peak(
    schedule: ScheduleName,
    rank: int,
    ranks: int,
    stages_per_rank: int,
    microbatches: int,
    microbatch_bytes: Sequence[float],
) -> float:
    """The most activation bytes pp rank ``rank`` holds at once over its stages: each
    forward of stage ``s`` keeps ``microbatch_bytes[s]`` until that microbatch's backward
    on ``s``, in the rank's order (``rank_order``). With one stage per rank, that stage's
    microbatches in flight times its bytes."""
    held = peak = 0.0
    for stage, kind, _ in rank_order(schedule, rank, ranks, stages_per_rank, microbatches):
        held += microbatch_bytes[stage] if kind == "forward" else -microbatch_bytes[stage]
        peak = max(peak, held)
    return peak


def timeline(
    schedule: ScheduleName,
    forward_us: Sequence[float],
    backward_us: Sequence[float],
    microbatches: int,
    stages_per_rank: int = 1,
    sends_us: tuple[Sequence[float], Sequence[float]] | None = None,
) -> tuple[TimelineBlock, ...]:
    """Every stage's passes in time, each rank running its own in ``rank_order``: a pass
    starts when its rank is free and its input is there (a forward once the stage before ran
    it and sent its output, a backward once the stage after ran its own and sent the
    gradient back; the last stage's once its own forward did). ``sends_us``: each stage's
    send of one microbatch's outputs forward and of its inputs' gradients back; a send
    delays its receiver, not its sender (torch's schedules send asynchronously)."""
    stages = len(forward_us)
    ranks = stages // stages_per_rank
    ahead, back = sends_us or ([0.0] * stages, [0.0] * stages)
    orders = [rank_order(schedule, r, ranks, stages_per_rank, microbatches) for r in range(ranks)]
    done: dict[Pass, float] = {}
    free, nxt = [0.0] * ranks, [0] * ranks
    blocks: list[TimelineBlock] = []
    while len(blocks) < sum(len(order) for order in orders):
        placed = len(blocks)
        for r in range(ranks):
            if nxt[r] == len(orders[r]):
                continue
            stage, kind, m = orders[r][nxt[r]]
            needs = _needs(stage, kind, m, stages)
            if needs is not None and needs not in done:
                continue  # the pass it waits for is not placed yet
            start = free[r] if needs is None else max(free[r], done[needs])
            if needs is not None and needs[0] != stage:  # sent by another stage
                start = max(start, done[needs] + (ahead if kind == "forward" else back)[needs[0]])
            end = start + (forward_us[stage] if kind == "forward" else backward_us[stage])
            blocks.append(TimelineBlock(stage, m, kind, start, end))
            done[(stage, kind, m)], free[r], nxt[r] = end, end, nxt[r] + 1
        if len(blocks) == placed:
            raise ValueError(f"{schedule}: the passes' order waits on itself")
    return tuple(sorted(blocks, key=lambda b: (b.stage, b.start_us)))


def _needs(stage: int, kind: PassKind, microbatch: int, stages: int) -> Pass | None:
    """The pass whose output this one reads (None: the first stage's forward reads the
    batch)."""
    if kind == "forward":
        return None if stage == 0 else (stage - 1, "forward", microbatch)
    if stage == stages - 1:
        return (stage, "forward", microbatch)
    return (stage + 1, "backward", microbatch)


def pipeline_cost(
    schedule: ScheduleName,
    forward_us: Sequence[float],
    backward_us: Sequence[float],
    optimizer_us: Sequence[float],
    microbatches: int,
    stages_per_rank: int = 1,
    sends_us: tuple[Sequence[float], Sequence[float]] | None = None,
) -> PipelineCost:
    """The step of ``microbatches`` through stages whose forward and backward of one
    microbatch take ``forward_us`` and ``backward_us`` (see the module docstring);
    ``optimizer_us``: each stage's optimizer step; ``sends_us``: see ``timeline``. The
    bubble is the time the busiest rank waits; a rank steps the optimizer of each of its
    stages."""
    blocks = timeline(schedule, forward_us, backward_us, microbatches, stages_per_rank, sends_us)
    flow = max(block.end_us for block in blocks)
    per_stage = [f + b for f, b in zip(forward_us, backward_us)]
    ranks = len(per_stage) // stages_per_rank
    busiest = max(sum(per_stage[r::ranks]) for r in range(ranks))
    optimizer = max(sum(optimizer_us[r::ranks]) for r in range(ranks))
    return PipelineCost(
        stage_microbatch_us=tuple(float(t) for t in per_stage),
        bubble_us=float(flow - microbatches * busiest),
        step_us=float(flow + optimizer),
        timeline=blocks,
    )


def price_stages(
    schedule: ScheduleName,
    microbatches: int,
    prices: Sequence[StagePrice],
    stages_per_rank: int = 1,
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
        stages_per_rank,
        ([p.send_forward_us for p in prices], [p.send_backward_us for p in prices]),
    )
    memory = tuple(
        None
        if price.peak_bytes is None or price.activation_bytes is None
        else StageMemory(
            microbatches_in_flight(schedule, index, len(prices), microbatches, stages_per_rank),
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


def halved_stages_step(
    prices: Sequence[StagePrice], microbatches: int, stages_per_rank: int
) -> float:
    """A first guess of the step with each stage's work cut into ``stages_per_rank`` equal
    stages, in model order, under interleaved 1F1B (each cut's extra sends left out): what
    decides whether that setting is worth a cut and a plan of its own."""
    pieces = [
        dataclasses.replace(
            p,
            microbatch_us=p.microbatch_us / stages_per_rank,
            forward_us=p.forward_us / stages_per_rank,
            optimizer_us=p.optimizer_us / stages_per_rank,
        )
        for p in prices
        for _ in range(stages_per_rank)
    ]
    cost, _ = price_stages("interleaved-1f1b", microbatches, pieces, stages_per_rank)
    return cost.step_us


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
