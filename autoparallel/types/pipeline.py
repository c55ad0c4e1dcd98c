"""Pipeline parallelism's plain data: what the user may fix and what a plan with stages holds.

A mesh dim named ``pp`` runs the model as that many stages, one per coordinate of the dim,
each split at the boundaries of the model's layer stack and planned on the other mesh dims
(trace/stages.py splits, runtime/pipeline.py runs the stages with
torch.distributed.pipelining's schedules)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

PIPELINE_DIM = "pp"
"""The mesh dim name that makes the model run as pipeline stages."""

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b"]
"""torch.distributed.pipelining's ``ScheduleGPipe``, ``Schedule1F1B`` (one stage per rank)
and ``ScheduleInterleaved1F1B`` (several stages per rank)."""

INTERLEAVED: ScheduleName = "interleaved-1f1b"
INTERLEAVED_STAGES_PER_RANK = 2
"""The stages per rank interleaved 1F1B runs where the user does not say: the planner prices
it beside one (more halve the bubble again but add as many sends and cuts to plan)."""

SCHEDULES: tuple[str, ...] = get_args(ScheduleName)


class PipelineError(ValueError):
    """A pipeline setting that cannot run: more stages than layers, microbatches that do not
    divide the batch, an unknown schedule, a pp dim that is not the mesh's first."""


@dataclass(frozen=True)
class PipelineConfig:
    """What the user fixed with ``add_pipeline_constraint`` (None: the default below).

    schedule: chosen by default: "1f1b" where there are at least as many microbatches as
        stages (one microbatch's activations in flight per stage ahead of its backward, where
        GPipe keeps all of them), else "gpipe".
    microbatches: how many pieces each rank's batch is cut into; by default the planner
        prices every count from the number of stages to four times it that divides the
        local batch, and keeps the fastest (stage_setup.py's ``pipeline_settings``).
    stage_layers: how many layers of the model's layer stack each stage runs, first stage
        first (they sum to the stack's length); by default chosen: first as even as
        possible (earlier stages taking the remainder), then evened out by the stages'
        prices (pipeline_planning.py). The embedding goes with the first stage, everything
        after the stack with the last.
    stages_per_rank: how many stages each rank of the pp dim runs (the model is cut into
        ``pp * stages_per_rank`` stages, stage ``s`` on pp rank ``s % pp``); more than one
        needs the "interleaved-1f1b" schedule, which is then the default. By default 1,
        and the planner also prices 2 under "interleaved-1f1b" where the stack has the
        layers for it (pipeline_planning.py). A decided setting (``pipeline_settings``)
        always holds it.
    """

    schedule: ScheduleName | None = None
    microbatches: int | None = None
    stage_layers: tuple[int, ...] | None = None
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise PipelineError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.stages_per_rank is not None and (
            not isinstance(self.stages_per_rank, int)
            or isinstance(self.stages_per_rank, bool)
            or self.stages_per_rank < 1
        ):
            raise PipelineError(
                f"stages_per_rank must be a positive int, got {self.stages_per_rank!r}"
            )
        if (self.stages_per_rank or 1) > 1 and self.schedule not in (None, INTERLEAVED):
            raise PipelineError(
                f"{self.stages_per_rank} stages per rank need schedule='{INTERLEAVED}', "
                f"got {self.schedule!r}"
            )
        if self.microbatches is not None and (
            not isinstance(self.microbatches, int)
            or isinstance(self.microbatches, bool)
            or self.microbatches < 1
        ):
            raise PipelineError(f"microbatches must be a positive int, got {self.microbatches!r}")
        if self.stage_layers is not None and (
            not isinstance(self.stage_layers, tuple)
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in self.stage_layers)
            or any(n < 1 for n in self.stage_layers)
        ):
            raise PipelineError(
                f"stage_layers must be a tuple of positive ints (layers per stage), "
                f"got {self.stage_layers!r}"
            )


def stage_spans(stages: Sequence[Sequence[str]]) -> list[str]:
    """``"stage i: first..last"`` (or its one layer) for every stage, in order."""
    return [
        f"stage {i}: {layers[0]}..{layers[-1]}" if len(layers) > 1 else f"stage {i}: {layers[0]}"
        for i, layers in enumerate(stages)
    ]


PassKind = Literal["forward", "backward"]


@dataclass(frozen=True)
class TimelineBlock:
    """One stage running one microbatch's forward or backward in the predicted schedule."""

    stage: int
    microbatch: int
    kind: PassKind
    start_us: float
    end_us: float


@dataclass(frozen=True)
class PipelineCost:
    """The predicted step of the pipeline (us; cost/pipeline.py): each stage's time for one
    microbatch's forward and backward with its sends, the busiest stage's idle time (the
    bubble), the whole step with the optimizer, and the schedule's blocks in time."""

    stage_microbatch_us: tuple[float, ...]
    bubble_us: float
    step_us: float
    timeline: tuple[TimelineBlock, ...] = ()


@dataclass(frozen=True)
class StagePrice:
    """One stage's plan as the pipeline prices it (us; bytes per device): one microbatch's
    forward and backward, its optimizer step, its sends on the pp link of one microbatch's
    outputs forward and of its inputs' gradients back, and its peak memory and
    activations' bytes with the microbatches its schedule keeps in flight (None without a
    memory estimate)."""

    microbatch_us: float
    forward_us: float  # the forward's part of microbatch_us
    optimizer_us: float
    peak_bytes: float | None = None
    activation_bytes: float | None = None
    # one of its numbered layers' forward and backward (None: the stage has none)
    layer_us: float | None = None
    send_forward_us: float = 0.0
    send_backward_us: float = 0.0


@dataclass(frozen=True)
class PipelineOption:
    """A pipeline setting the planner priced: its predicted step and the largest stage peak
    under it (None where a stage had no plan within the constraints)."""

    schedule: ScheduleName
    microbatches: int
    step_us: float | None
    peak_bytes: float | None = None
    stage_layers: tuple[int, ...] = ()  # layers per stage
    stages_per_rank: int = 1

    def describe(self) -> str:
        head = f"{self.schedule} x{self.microbatches}"
        if self.stages_per_rank > 1:
            head += f" ({self.stages_per_rank} stages per rank)"
        if self.stage_layers:
            head += f" layers {'/'.join(str(n) for n in self.stage_layers)}"
        if self.step_us is None:
            return f"{head}: no plan within the constraints"
        peak = "" if self.peak_bytes is None else f", peak {self.peak_bytes / 2**30:.2f} GiB"
        return f"{head}: step {self.step_us / 1e3:.2f} ms{peak}"


@dataclass(frozen=True)
class StageMemory:
    """A stage under the schedule (bytes per device): how many microbatches' activations it
    holds at once, their bytes, and its peak (its plan's, which counts them all)."""

    in_flight: int
    activations: float
    peak: float


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline of a plan: the schedule, the microbatches, and which layers each stage
    runs (``stages[i]``: the layer-stack entries of stage ``i``, e.g. ``("layers.0",
    "layers.1")``). ``stage_index`` is the stage this plan places (this rank's first); the
    plan beside this holds that stage's placements on the mesh's other dims. With
    ``stages_per_rank`` > 1, pp rank ``r`` runs stages ``r, r + ranks, ...``
    (``rank_stages``)."""

    schedule: ScheduleName
    microbatches: int
    stages: tuple[tuple[str, ...], ...]
    stage_index: int
    cost: PipelineCost | None = None
    # every stage's memory under the schedule (None where it has no memory estimate)
    stage_memory: tuple[StageMemory | None, ...] = ()
    # the settings the planner priced, this one among them
    options: tuple[PipelineOption, ...] = ()
    stages_per_rank: int = 1

    @property
    def ranks(self) -> int:
        """The pp dim's size."""
        return self.num_stages // self.stages_per_rank

    @property
    def rank_stages(self) -> tuple[int, ...]:
        """The stages of the pp rank that runs ``stage_index``, in order."""
        return tuple(range(self.stage_index % self.ranks, self.num_stages, self.ranks))

    @property
    def memory(self) -> StageMemory | None:
        """This rank's stage's memory under the schedule."""
        return self.stage_memory[self.stage_index] if self.stage_memory else None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (it reads the model's inputs)."""
        return 0 in self.rank_stages

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.rank_stages

    def describe(self) -> str:
        spans = ", ".join(stage_spans(self.stages))
        per_rank = f"{self.stages_per_rank} stages per rank, " if self.stages_per_rank > 1 else ""
        described = f"{self.schedule}, {self.microbatches} microbatches, {per_rank}{spans}"
        if self.cost is None:
            return described
        return (
            f"{described}; predicted step {self.cost.step_us / 1e3:.2f} ms, bubble "
            f"{self.cost.bubble_us / 1e3:.2f} ms"
        )
