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

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from autoparallel._torch_internals import OpOverload
from autoparallel.cost.collectives import RING_PASSES
from autoparallel.cost.compute import compute_cost_us, is_free_op, priced_by_table
from autoparallel.cost.hardware import SEND_RECV, CollectiveFit, Hardware
from autoparallel.graph.fx_args import map_args
from autoparallel.types.tensors import TensorInfo

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
    if collective == SEND_RECV:  # one message each way: its fixed cost and its bytes
        steps = np.ones(len(usable))
        volume = np.array([s.nbytes for s in usable], dtype=float)
    else:
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
    """One optimizer step = step_us + us_per_tensor per tensor + a cost per element:
    ns_per_element on tensors of base_numel elements, ns_per_element_large on tensors of
    large_numel (0: measured at one size only; see ``Hardware.optimizer_ns_per_element_at``)."""

    step_us: float
    us_per_tensor: float
    ns_per_element: float
    base_numel: int = 0
    large_numel: int = 0
    ns_per_element_large: float = 0.0


def fit_optimizer_step(runs: dict[tuple[int, int], float]) -> OptimizerFit:
    """Solve timed steps, keyed (tensors, elements per tensor): two with the fewest elements
    (few and many tensors), and few tensors of one or two larger sizes. The smaller of those
    sizes gives the base cost per element, the larger (if timed) the rate on large tensors.
    Each part is clamped at 0 (a noisy measurement must not make a cost negative)."""
    by_numel = sorted({numel for _, numel in runs})
    by_count = sorted({count for count, _ in runs})
    if len(by_count) != 2 or len(by_numel) not in (2, 3):
        raise ValueError(
            "need (few, small), (many, small) and (few, large) runs, and optionally "
            f"(few, larger), got {sorted(runs)}"
        )
    (few, many), small = by_count, by_numel[0]
    expected = {(few, small), (many, small)} | {(few, numel) for numel in by_numel[1:]}
    if set(runs) != expected:
        raise ValueError(f"need the runs {sorted(expected)}, got {sorted(runs)}")

    def per_element_us(numel: int) -> float:
        return max(0.0, (runs[few, numel] - runs[few, small]) / (few * (numel - small)))

    base_us = per_element_us(by_numel[1])
    per_tensor = max(0.0, (runs[many, small] - runs[few, small]) / (many - few) - small * base_us)
    fixed = max(0.0, runs[few, small] - few * per_tensor - few * small * base_us)
    large = by_numel[2] if len(by_numel) == 3 else 0
    return OptimizerFit(
        fixed,
        per_tensor,
        1e3 * base_us,
        base_numel=by_numel[1] if large else 0,
        large_numel=large,
        ns_per_element_large=1e3 * per_element_us(large) if large else 0.0,
    )


@dataclass(frozen=True)
class RuntimeFit:
    """The runtime's own work in one step = step_us + us_per_parameter per trained parameter."""

    step_us: float
    us_per_parameter: float
    max_error: float  # the largest relative error of the line over the runs, in time outside


def fit_runtime_overhead(outside_us: dict[int, float]) -> RuntimeFit:
    """Least-squares line through the time outside the graphs, keyed by the parameter count
    of the probe (at least two counts). Each part is clamped at 0 (a noisy measurement must
    not make a cost negative)."""
    if len(outside_us) < 2:
        raise ValueError(f"need runs with at least two parameter counts, got {sorted(outside_us)}")
    counts = np.array(sorted(outside_us), dtype=float)
    times = np.array([outside_us[int(c)] for c in counts])
    slope, intercept = np.polyfit(counts, times, 1)
    slope, intercept = max(0.0, float(slope)), max(0.0, float(intercept))
    fitted = intercept + slope * counts
    error = float(np.max(np.abs(fitted - times) / np.maximum(np.abs(times), 1e-9)))
    return RuntimeFit(intercept, slope, error)


def fit_forward_share(forward_outside_us: list[float], outside_us: list[float]) -> float:
    """The part of the runtime's own work that the forward does: the forward's time outside
    its graphs over the step's, summed over the probe's runs, within [0, 1] (0 when the step
    spent nothing outside its graphs)."""
    total = sum(outside_us)
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, sum(forward_outside_us) / total))


# ------------------------------------------------------------------ the op model of a host


def matmul_half_dim(peak_flops: float, skinny_flops: float, small: int) -> float:
    """``Hardware.matmul_half_dim``: the dimension ``h`` at which a matmul runs at half the
    peak, from a matmul with one dimension ``small`` running at ``skinny_flops`` under the
    model's rate = peak * d / (d + h); 0 when it ran at the peak or faster."""
    return max(0.0, small * (peak_flops / skinny_flops - 1.0))


def block_charge_us(graph: fx.GraphModule, hardware: Hardware) -> tuple[float, int]:
    """What the cost model charges every op of a traced graph on ``hardware``, and how many
    of its ops pay ``kernel_launch_us`` (not views, nor matmuls priced by a measured table,
    whose timings include that cost)."""
    charged, ops = 0.0, 0
    for node in graph.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        args, kwargs = map_args(_tensor_info, (node.args, dict(node.kwargs)))
        charged += compute_cost_us(node.target, args, kwargs, _tensor_info(node), hardware)
        ops += not (is_free_op(node.target) or priced_by_table(node.target, args, hardware))
    return charged, ops


def fit_op_overhead(graph: fx.GraphModule, measured_us: float, roofline: Hardware) -> float:
    """The fixed cost per non-view op that makes the model's time of ``graph`` (priced on
    ``roofline``, whose own fixed cost is ignored) equal ``measured_us``; at least 0."""
    charged, ops = block_charge_us(graph, dataclasses.replace(roofline, kernel_launch_us=0.0))
    return max(0.0, measured_us - charged) / max(1, ops)


def fit_graph_bandwidth(graph: fx.GraphModule, measured_us: float, hardware: Hardware) -> float:
    """The memory bandwidth that makes the model's time of ``graph`` on ``hardware`` (its
    fixed cost per op already fitted) equal ``measured_us``, by bisection on a log scale.

    Never above ``hardware.memory_bandwidth`` (a graph that runs faster than the streaming
    probe says keeps the probe's figure) nor below a thousandth of it."""

    def charged(bandwidth: float) -> float:
        return block_charge_us(graph, dataclasses.replace(hardware, memory_bandwidth=bandwidth))[0]

    high = hardware.memory_bandwidth
    low = high / 1000.0
    if charged(high) >= measured_us:
        return high
    if charged(low) <= measured_us:
        return low
    for _ in range(40):  # the charge falls as the bandwidth rises
        middle = math.sqrt(low * high)
        low, high = (low, middle) if charged(middle) < measured_us else (middle, high)
    return math.sqrt(low * high)


def _tensor_info(value: Any) -> Any:
    """A traced node's TensorInfo (shape and dtype of its ``val``); anything else as is."""
    meta = getattr(value, "meta", None)
    tensor = meta.get("val") if meta else None
    if isinstance(tensor, torch.Tensor):
        return TensorInfo(tuple(tensor.shape), tensor.dtype)
    return None if isinstance(value, fx.Node) else value
