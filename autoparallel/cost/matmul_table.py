"""Measured matmul times over a grid of shapes: what a calibrated profile prices matmuls by.

One peak FLOP/s and a rule for small dimensions cannot say how fast a host runs the matmuls
of a real model: a mid-sized matmul, as a training step runs it, can fall further below
the peak than that rule prices it, and a small one whose operands a step still holds in
cache runs several times faster than after the caches were flushed. So ``autoparallel calibrate``
times every (M, K, N) of a grid twice, on warm caches (the same call back to back) and on
cold ones (after 64 MiB of other writes), and a matmul is priced between the two by how
much memory it touches: ``warm + min(1, bytes / cold_bytes) * (cold - warm)``, with
``cold_bytes`` the host's L2 cache per core (a GPU's L2). Between grid points the times are
interpolated on log scales; a dimension below the grid prices as the grid's smallest (such
matmuls cost their fixed overhead and the other operands' reads); above it the time grows in
proportion (the largest shapes already run at the host's peak).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MatmulTable"]


@dataclass(frozen=True)
class MatmulTable:
    """Times (us) of an (M x K) @ (K x N) matmul in ``dtype`` at every (M, K, N) in
    ``dims`` x ``dims`` x ``dims``, flattened with N fastest (index ``(i * len(dims) + j) *
    len(dims) + l`` for ``(dims[i], dims[j], dims[l])``); ``warm_us`` back to back,
    ``cold_us`` after the caches were flushed. ``cold_bytes``: the bytes touched (operands
    and result) at which a matmul pays its whole cold-cache time."""

    dtype: str
    dims: tuple[int, ...]
    warm_us: tuple[float, ...]
    cold_us: tuple[float, ...]
    cold_bytes: float

    def __post_init__(self) -> None:
        if len(self.dims) < 2 or list(self.dims) != sorted(set(self.dims)) or self.dims[0] < 1:
            raise ValueError(f"matmul table dims must rise from >= 1, got {self.dims}")
        cells = len(self.dims) ** 3
        for name in ("warm_us", "cold_us"):
            times = getattr(self, name)
            if len(times) != cells:
                raise ValueError(f"matmul table {name} has {len(times)} times; {cells} expected")
            if not all(math.isfinite(t) and t > 0 for t in times):
                raise ValueError(f"matmul table {name} must be positive and finite")
        if not (math.isfinite(self.cold_bytes) and self.cold_bytes > 0):
            raise ValueError(f"matmul table cold_bytes must be positive, got {self.cold_bytes}")

    def time_us(self, m: int, k: int, n: int, nbytes: float) -> float:
        """The time of one (m x k) @ (k x n) matmul touching ``nbytes`` in all."""
        corners = [self._bracket(d) for d in (m, k, n)]
        beyond = math.prod(max(1.0, d / self.dims[-1]) for d in (m, k, n))
        warm = self._interpolate(self.warm_us, corners) * beyond
        cold = self._interpolate(self.cold_us, corners) * beyond
        cold_share = min(1.0, max(0.0, nbytes / self.cold_bytes))
        return warm + cold_share * max(0.0, cold - warm)

    def _interpolate(self, times: Sequence[float], corners: list[list[tuple[int, float]]]) -> float:
        """Trilinear interpolation of log(time) over log(dim) between the grid ``corners``
        of (M, K, N) (each dim clamped to the grid: beyond its largest dimension the caller
        scales in proportion)."""
        size = len(self.dims)
        log_time = 0.0
        for a, wa in corners[0]:
            for b, wb in corners[1]:
                for c, wc in corners[2]:
                    weight = wa * wb * wc
                    if weight:
                        log_time += weight * math.log(times[(a * size + b) * size + c])
        return math.exp(log_time)

    def _bracket(self, dim: int) -> list[tuple[int, float]]:
        """The grid indices around ``dim`` and their weights (log scale)."""
        if dim <= self.dims[0]:
            return [(0, 1.0)]
        if dim >= self.dims[-1]:
            return [(len(self.dims) - 1, 1.0)]
        upper = bisect.bisect_right(self.dims, dim)
        low, high = self.dims[upper - 1], self.dims[upper]
        weight = math.log(dim / low) / math.log(high / low)
        return [(upper - 1, 1.0 - weight), (upper, weight)]
