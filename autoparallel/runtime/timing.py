"""Time a training step of the parallel module against the plan's prediction.

The plan's ``totals.total_us`` is a promise: what one step (forward, backward and, when the
hardware prices it, the optimizer step) should take on the hardware it was priced on.
:func:`measure_step` times the user's own step function on every rank and sets the slowest
rank's median beside that promise, so a user can check it on their own model and cluster::

    timing = autoparallel.measure_step(train_step, plan, steps=10, warmup=3)
    print(timing)  # e.g. measured 504.74 ms, predicted 389.78 ms (-23 %), priced on cpu-gloo-vm

Every rank must call it (it synchronizes the ranks with a barrier before each step and takes
the slowest rank's time, as the slowest rank sets the pace of synchronous training).

Each rank's own median is kept too (``rank_median_ms``): where the ranks leave a step's last
collective at different moments (on an oversubscribed host the wake-up after it varies by a
millisecond or more, and which rank is late changes from step to step), the slowest rank's
median step lies above every rank's own median, and ``skew`` says by how much.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autoparallel.types.plan import Plan

__all__ = ["GraphClock", "StepTiming", "graph_clock", "measure_step"]


@dataclass(frozen=True)
class StepTiming:
    """Measured step times (slowest rank, ms) beside the plan's prediction."""

    step_ms: tuple[float, ...]  # every timed step, in order
    predicted_ms: float | None  # the plan's total, None without a plan
    priced_on: str  # the hardware the prediction was priced on ("" without a plan)
    first_step_ms: float | None  # the first (untimed) step: tracing, compilation
    rank_median_ms: tuple[float, ...] = ()  # each rank's own median step, in rank order

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def skew(self) -> float:
        """How far the slowest rank's median step lies above the largest of the ranks' own
        medians (0 on one rank): what the ranks' misalignment at their collectives costs."""
        if not self.rank_median_ms:
            return 0.0
        return self.median_ms / max(self.rank_median_ms) - 1.0

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; negative when the plan promised too little."""
        if self.predicted_ms is None:
            return None
        return (self.predicted_ms - self.median_ms) / self.median_ms

    def __str__(self) -> str:
        text = f"measured {self.median_ms:.2f} ms"
        if self.predicted_ms is not None:
            text += (
                f", predicted {self.predicted_ms:.2f} ms ({100 * self.error:+.0f} %), "
                f"priced on {self.priced_on}"
            )
        if len(self.rank_median_ms) > 1:
            text += (
                f"; the ranks' own medians {self._rank_text()} ms (skew {100 * self.skew:+.0f} %)"
            )
        return text

    def _rank_text(self) -> str:
        return " / ".join(f"{value:.2f}" for value in self.rank_median_ms)


def measure_step(
    step: Callable[[], Any],
    plan: Plan | None = None,
    steps: int = 10,
    warmup: int = 3,
    device: torch.device | str | None = None,
) -> StepTiming:
    """Run ``step()`` ``warmup + steps`` times and time the last ``steps`` (see module doc).

    ``step`` is one whole training step (zero_grad, forward, loss, backward, optimizer step).
    On a CUDA ``device`` each step is synchronized before its clock stops. Raises ValueError
    for ``steps < 1`` or ``warmup < 0``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"measure_step needs steps >= 1 and warmup >= 0, got {steps}, {warmup}")
    device = torch.device(device) if device is not None else None
    times = []
    for _ in range(warmup + steps):
        _barrier()
        start = time.perf_counter()
        step()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    slowest = _slowest_rank(times)
    return StepTiming(
        step_ms=tuple(slowest[warmup:]),
        predicted_ms=plan.totals.total_us / 1e3 if plan is not None else None,
        priced_on=plan.priced_on if plan is not None else "",
        first_step_ms=slowest[0] if warmup else None,
        rank_median_ms=_every_rank(statistics.median(times[warmup:])),
    )


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _slowest_rank(times_ms: list[float]) -> list[float]:
    if not _distributed():
        return times_ms
    tensor = torch.tensor(times_ms, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _every_rank(value_ms: float) -> tuple[float, ...]:
    """``value_ms`` of every rank, in rank order (this rank's alone without a process group)."""
    if not _distributed():
        return (value_ms,)
    values = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=_device())
    values[dist.get_rank()] = value_ms
    dist.all_reduce(values)
    return tuple(values.tolist())


class GraphClock:
    """The time a parallel module spent inside its traced graphs (eager runs only), so that
    a step's time splits into its graphs' ops and the module's own work around them."""

    def __init__(self, phases: tuple[Any, ...]):
        self._phases = phases

    def take_us(self) -> float:
        """Microseconds inside the graphs since the last call (or since the clock started)."""
        total = sum(phase.graph_s for phase in self._phases)
        for phase in self._phases:
            phase.graph_s = 0.0
        return total * 1e6


@contextmanager
def graph_clock(parallel: torch.nn.Module) -> Iterator[GraphClock]:
    """Time the graphs of ``parallel`` (a module from ``apply_placement``) while inside."""
    runtime = getattr(parallel, "_autoparallel", None)
    if runtime is None:
        raise TypeError(f"{type(parallel).__name__} is not a parallel module from apply_placement")
    phases = (runtime.forward_phase, runtime.backward_phase, runtime.inference_phase)
    for phase in phases:
        phase.timed, phase.graph_s = True, 0.0
    try:
        yield GraphClock(phases)
    finally:
        for phase in phases:
            phase.timed, phase.graph_s = False, 0.0
