"""Time a training step of the parallel module against the plan's prediction.

The plan's ``totals.total_us`` is a promise: what one step (forward, backward and, when the
hardware prices it, the optimizer step) should take on the hardware it was priced on.
:func:`measure_step` times the user's own step function on every rank and sets the slowest
rank's median beside that promise, so a user can check it on their own model and cluster::

    timing = autoparallel.measure_step(train_step, plan, steps=10, warmup=3)
    print(timing)  # e.g. measured 504.74 ms, predicted 389.78 ms (-23 %), priced on cpu-gloo-vm

Every rank must call it (it synchronizes the ranks with a barrier before each step and takes
the slowest rank's time, as the slowest rank sets the pace of synchronous training).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autoparallel.types.plan import Plan

__all__ = ["StepTiming", "measure_step"]


@dataclass(frozen=True)
class StepTiming:
    """Measured step times (slowest rank, ms) beside the plan's prediction."""

    step_ms: tuple[float, ...]  # every timed step, in order
    predicted_ms: float | None  # the plan's total, None without a plan
    priced_on: str  # the hardware the prediction was priced on ("" without a plan)
    first_step_ms: float | None  # the first (untimed) step: tracing, compilation

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

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
        return text


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
    )


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _slowest_rank(times_ms: list[float]) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return times_ms
    backend = dist.get_backend()
    device = "cuda" if backend == "nccl" else "cpu"
    tensor = torch.tensor(times_ms, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
