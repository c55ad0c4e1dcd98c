"""Fitting measured collective times to the cost model's ring latency-bandwidth form.

``cost/collectives.py`` prices a collective over ``n`` ranks on a buffer of ``x`` bytes as

    t(x) = p (n - 1) alpha  +  p (n - 1) / n * x / beta

with ``p`` ring sweeps (2 for an all-reduce, else 1), ``alpha`` the latency of one step and
``beta`` the bytes per second a rank pushes. The model is linear in ``alpha`` and ``1/beta``,
so timings over several sizes (and group sizes) give both by least squares. Residuals are
weighted by ``1/t``: a 1 KiB message timed at 500 us matters as much as a 64 MiB one at
200 ms, so the fit is good in relative error across the whole range, which is what the
planner's choices depend on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoparallel.cost.collectives import RING_PASSES
from autoparallel.cost.hardware import CollectiveFit

_US_PER_S = 1e6
_SMALLEST_SLOPE = 1e-15  # us per byte: a bandwidth of 1e21 B/s, i.e. "unmeasurably fast"


@dataclass(frozen=True)
class CollectiveSample:
    """One timing: ``collective`` over ``group_size`` ranks on ``nbytes`` (the full buffer,
    in the convention of ``cost/collectives.py``), median ``time_us``."""

    collective: str
    group_size: int
    nbytes: float
    time_us: float


def fit_collective(
    link: str, collective: str, samples: Sequence[CollectiveSample]
) -> CollectiveFit:
    """The latency and bandwidth that best explain ``samples`` of one collective and link.

    Raises ValueError when there is nothing to fit (no sample of a group of 2 or more).
    """
    usable = [s for s in samples if s.group_size > 1 and s.time_us > 0]
    if not usable:
        raise ValueError(f"no timing of {collective} over 2 or more ranks to fit")
    passes = RING_PASSES[collective]
    steps = np.array([passes * (s.group_size - 1) for s in usable], dtype=float)
    volume = np.array(
        [passes * (s.group_size - 1) / s.group_size * s.nbytes for s in usable], dtype=float
    )
    times = np.array([s.time_us for s in usable], dtype=float)
    latency, slope = _weighted_fit(steps, volume, times)
    predicted = latency * steps + slope * volume
    error = float(np.max(np.abs(predicted - times) / times))
    return CollectiveFit(
        link, collective, latency_us=latency, bandwidth=_US_PER_S / slope, max_error=error
    )


def _weighted_fit(steps: np.ndarray, volume: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """(alpha us, slope us/byte) minimizing the relative residuals, both kept >= 0."""
    weights = 1.0 / times
    design = np.stack([steps * weights, volume * weights], axis=1)
    target = np.ones_like(times)
    if len(times) >= 2 and np.ptp(volume) > 0:
        (latency, slope), *_ = np.linalg.lstsq(design, target, rcond=None)
    else:  # one size only: latency and bandwidth cannot be told apart; call it all latency
        latency, slope = float(np.mean(times / steps)), 0.0
    if latency < 0:  # bandwidth-bound throughout: refit the slope alone
        latency = 0.0
        slope = float(design[:, 1] @ target / (design[:, 1] @ design[:, 1]))
    if slope <= 0:  # latency-bound throughout: refit the latency alone
        slope = _SMALLEST_SLOPE
        latency = float(design[:, 0] @ target / (design[:, 0] @ design[:, 0]))
    return float(latency), float(max(slope, _SMALLEST_SLOPE))


def throughput(work: float, time_us: float) -> float:
    """Units of ``work`` per second (FLOP/s, bytes/s) done in ``time_us``."""
    if time_us <= 0:
        raise ValueError(f"a measured time must be positive, got {time_us} us")
    return work / (time_us / _US_PER_S)


@dataclass(frozen=True)
class OptimizerFit:
    """One optimizer step = step_us + us_per_tensor per tensor + ns_per_element per element."""

    step_us: float
    us_per_tensor: float
    ns_per_element: float


def fit_optimizer_step(runs: dict[tuple[int, int], float]) -> OptimizerFit:
    """Solve three timed steps, keyed (tensors, elements per tensor): two with the fewer
    elements (few and many tensors) and one with few tensors of more elements. Each part is
    clamped at 0 (a noisy measurement must not make a cost negative)."""
    by_numel = sorted({numel for _, numel in runs})
    by_count = sorted({count for count, _ in runs})
    if len(runs) != 3 or len(by_numel) != 2 or len(by_count) != 2:
        raise ValueError(
            f"need (few, small), (many, small) and (few, large) runs, got {sorted(runs)}"
        )
    (few, many), (small, large) = by_count, by_numel
    per_element_us = max(0.0, (runs[few, large] - runs[few, small]) / (few * (large - small)))
    per_tensor = (runs[many, small] - runs[few, small]) / (many - few) - small * per_element_us
    per_tensor = max(0.0, per_tensor)
    fixed = max(0.0, runs[few, small] - few * per_tensor - few * small * per_element_us)
    return OptimizerFit(fixed, per_tensor, 1e3 * per_element_us)
