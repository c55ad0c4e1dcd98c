"""A calibration's device figures: each timed on every rank, logged, recorded and fitted.

The matmuls (per dtype and size, the profile's matmul table, and the rounds of the largest
fp32 matmul and a skinny one), the memory bandwidth, a view op as the runtime runs it, two
traced transformer blocks for the cost of an op, AdamW's step on DTensor parameters, and, on
a CPU host, the runtime's own work per step. Each step times through
:mod:`autoparallel.calibrate.measure_device`, prints one progress line (rank 0), appends its
raw timings to the samples a profile keeps, and fits its ``Hardware`` figures with
:mod:`autoparallel.calibrate.fit`. :mod:`autoparallel.calibrate.run` decides when each step
runs (the collectives between the rounds) and assembles the ``Hardware`` from the figures.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.calibrate import measure_device
from autoparallel.calibrate.fit import (
    fit_forward_share,
    fit_graph_bandwidth,
    fit_op_overhead,
    fit_optimizer_step,
    fit_runtime_overhead,
    matmul_half_dim,
    throughput,
)
from autoparallel.calibrate.settings import KIB, MIB, CalibrationSettings
from autoparallel.cost.hardware import CPU, Hardware
from autoparallel.cost.matmul_table import MatmulTable

CPU_MATMUL_GRID = (16, 64, 256, 1024)
"""The matmul table's dimensions on a CPU host: 64 shapes, few enough to time in seconds.
Larger dimensions are priced in proportion to the 1024 ones (where a CPU core's matmul has
reached its peak)."""

GPU_MATMUL_GRID = (64, 256, 1024, 4096, 16384)
"""The same on a GPU, in bf16: a GPU needs dimensions in the thousands to reach its peak."""


def time_device(
    device: torch.device,
    mesh: Any,
    settings: CalibrationSettings,
    say: Callable[[str], None],
    samples: list,
) -> dict[str, Any]:
    """The figures taken before the collectives (``Hardware`` field names -> values): matmul
    FLOP/s per dtype and size, the matmul table, memory bandwidth, the view op, AdamW's step."""
    figures: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        # fp32's largest size is timed by Rounds, whose median gives the FLOP/s
        sizes = settings.matmul_sizes[:-1] if dtype == torch.float32 else settings.matmul_sizes
        for size in sizes:
            flops = measure_device.matmul_flops(dtype, size, settings.repeats, device)
            samples.append(
                {
                    "what": "matmul",
                    "dtype": str(dtype).removeprefix("torch."),
                    "size": size,
                    "flops": flops,
                }
            )
            say(
                f"[calibrate] matmul {str(dtype).removeprefix('torch.'):<8} {size:>5}^3: {flops / 1e9:10.2f} GFLOP/s"
            )
    figures["flops_bf16"] = flops  # the largest size: closest to what big matmuls reach
    figures["matmul_table"] = _time_matmul_table(device, settings, say, samples)
    bandwidth = measure_device.memory_bandwidth(
        settings.memory_probe_bytes, settings.repeats, device
    )
    samples.append(
        {"what": "memory_bandwidth", "nbytes": settings.memory_probe_bytes, "bandwidth": bandwidth}
    )
    say(
        f"[calibrate] memory bandwidth ({bytes_text(settings.memory_probe_bytes)} add): {bandwidth / 1e9:.2f} GB/s"
    )
    figures["memory_bandwidth"] = bandwidth
    figures["view_op_us"] = measure_device.view_op_us(settings.repeats, device)
    samples.append({"what": "view_op", "time_us": figures["view_op_us"]})
    say(f"[calibrate] view op: {figures['view_op_us']:.2f} us")
    figures.update(_time_optimizer(mesh, settings, say, samples))
    return figures


@dataclass
class Rounds:
    """The figures timed in rounds spread over the calibration, whose medians count: the
    largest fp32 matmul and the skinny one (the FLOP/s and ``matmul_half_dim``), and the two
    traced transformer blocks that fit the op model of the host. A shared host drifts
    between fast and slow spells for seconds at a time, so one round runs with the device
    figures and the others after the collectives, where a single timing of the matmul would
    take the FLOP/s of whichever spell it fell in."""

    matmul_shape: tuple[int, int, int]
    skinny_shape: tuple[int, int, int]
    tiny: measure_device.TracedBlock
    training: measure_device.TracedBlock
    matmul_us: list[float]
    skinny_us: list[float]
    tiny_us: list[float]
    training_us: list[float]

    @classmethod
    def trace(cls, device: torch.device, settings: CalibrationSettings) -> Rounds:
        size, small = settings.matmul_sizes[-1], settings.skinny_matmul_dim
        return cls(
            (size, size, size),
            (small, size, size),
            measure_device.traced_block(measure_device.TINY_BLOCK, device),
            measure_device.traced_block(measure_device.TRAINING_BLOCK, device),
            [],
            [],
            [],
            [],
        )

    def time_round(self, repeats: int, device: torch.device) -> None:
        self.matmul_us.append(
            measure_device.matmul_us(torch.float32, self.matmul_shape, repeats, device)
        )
        self.skinny_us.append(
            measure_device.matmul_us(torch.float32, self.skinny_shape, repeats, device)
        )
        self.tiny_us.append(measure_device.time_block(self.tiny, repeats, device))
        self.training_us.append(measure_device.time_block(self.training, repeats, device))

    def fit(
        self,
        device: torch.device,
        figures: dict[str, Any],
        say: Callable[[str], None],
        samples: list,
    ) -> dict[str, float]:
        """The matmul figures, then the fixed cost per op (the tiny block, at those figures)
        and the memory bandwidth small training ops reach (the training-sized block, at that
        fixed cost)."""
        flops = _flops(self.matmul_shape, statistics.median(self.matmul_us))
        skinny = _flops(self.skinny_shape, statistics.median(self.skinny_us))
        small = self.skinny_shape[0]
        half = matmul_half_dim(flops, skinny, small)
        for shape, times in (
            (self.matmul_shape, self.matmul_us),
            (self.skinny_shape, self.skinny_us),
        ):
            samples.append({"what": "matmul_rounds", "shape": list(shape), "rounds_us": times})
        say(
            f"[calibrate] matmul float32 {_shape_text(self.matmul_shape)} on cold caches: "
            f"{flops / 1e9:.2f} GFLOP/s (rounds: {_rounds(self.matmul_us)} us); "
            f"{_shape_text(self.skinny_shape)}: {skinny / 1e9:.2f} GFLOP/s, half the peak at a "
            f"dimension of {half:.0f} (rounds: {_rounds(self.skinny_us)} us)"
        )
        measured = {**figures, "flops_fp32": flops, "matmul_half_dim": half}
        roofline = dataclasses.replace(CPU, **device_model(device, measured))
        tiny_us, training_us = statistics.median(self.tiny_us), statistics.median(self.training_us)
        overhead = fit_op_overhead(self.tiny.graph, tiny_us, roofline)
        with_overhead = dataclasses.replace(roofline, kernel_launch_us=overhead)
        bandwidth = fit_graph_bandwidth(self.training.graph, training_us, with_overhead)
        for block, times in ((self.tiny, self.tiny_us), (self.training, self.training_us)):
            samples.append({"what": "block", "shape": list(block.shape), "rounds_us": times})
        say(
            f"[calibrate] fixed cost per op (a traced transformer block {_shape_text(self.tiny.shape)}): "
            f"{overhead:.2f} us (block rounds: {_rounds(self.tiny_us)} us)"
        )
        say(
            f"[calibrate] memory bandwidth of training ops (block {_shape_text(self.training.shape)}): "
            f"{bandwidth / 1e9:.2f} GB/s (block rounds: {_rounds(self.training_us)} us)"
        )
        return {
            "flops_fp32": flops,
            "matmul_half_dim": half,
            "kernel_launch_us": overhead,
            "memory_bandwidth": bandwidth,
        }


def _flops(shape: tuple[int, int, int], time_us: float) -> float:
    return throughput(2.0 * math.prod(shape), time_us)


def _shape_text(shape: tuple[int, ...]) -> str:
    return " x ".join(str(d) for d in shape)


def _rounds(times: list[float]) -> str:
    return ", ".join(f"{t:.0f}" for t in times)


def _time_optimizer(
    mesh: Any, settings: CalibrationSettings, say: Callable[[str], None], samples: list
) -> dict[str, float]:
    """AdamW's step at three or four points, solved for its fixed, per-tensor and
    per-element parts (the last on tensors of two sizes)."""
    few, many = settings.optimizer_tensors
    small = 256
    points = [(few, small), (many, small), (few, settings.optimizer_numel)]
    if settings.optimizer_large_numel > settings.optimizer_numel:
        points.append((few, settings.optimizer_large_numel))
    runs = {}
    for tensors, numel in points:
        runs[tensors, numel] = measure_device.optimizer_step_us(
            mesh, tensors, numel, settings.repeats
        )
        samples.append(
            {
                "what": "optimizer_step",
                "tensors": tensors,
                "numel": numel,
                "time_us": runs[tensors, numel],
            }
        )
        say(
            f"[calibrate] AdamW step, {tensors} tensors of {numel} elements: {runs[tensors, numel]:.0f} us"
        )
    fit = fit_optimizer_step(runs)
    warm = measure_device.optimizer_step_us(
        mesh, few, small, settings.repeats, churn_bytes=measure_device.OPTIMIZER_WARM_CHURN_BYTES
    )
    samples.append(
        {
            "what": "optimizer_step",
            "tensors": few,
            "numel": small,
            "churn_bytes": measure_device.OPTIMIZER_WARM_CHURN_BYTES,
            "time_us": warm,
        }
    )
    # What the cold caches add to a step of a few small tensors is a fixed cost.
    warm_step_us = min(fit.step_us, max(0.0, fit.step_us - (runs[few, small] - warm)))
    say(
        f"[calibrate] AdamW step, {few} tensors of {small} elements after "
        f"{measure_device.OPTIMIZER_WARM_CHURN_BYTES >> 20} MiB of other work: {warm:.0f} us, "
        f"a fixed part of {warm_step_us:.0f} us"
    )
    large = (
        f" ({fit.ns_per_element_large:.3f} ns on tensors of {fit.large_numel} elements)"
        if fit.large_numel
        else ""
    )
    say(
        f"[calibrate] optimizer step: {fit.step_us:.0f} us per step + {fit.us_per_tensor:.1f} us "
        f"per tensor + {fit.ns_per_element:.3f} ns per element{large}"
    )
    return {
        "optimizer_step_us": fit.step_us,
        "optimizer_us_per_tensor": fit.us_per_tensor,
        "optimizer_ns_per_element": fit.ns_per_element,
        "optimizer_base_numel": float(fit.base_numel),
        "optimizer_large_numel": float(fit.large_numel),
        "optimizer_ns_per_element_large": fit.ns_per_element_large,
        "optimizer_step_warm_us": warm_step_us,
        "optimizer_warm_bytes": float(measure_device.OPTIMIZER_WARM_CHURN_BYTES),
        "optimizer_cold_bytes": float(measure_device.OPTIMIZER_CHURN_BYTES),
    }


def time_runtime(
    mesh: Any,
    hardware: Hardware,
    settings: CalibrationSettings,
    say: Callable[[str], None],
    samples: list,
) -> Hardware:
    """The parallel module's own work per step outside its traced graphs, from the probe at
    a few parameter counts (``measure_device.runtime_step``), as a line: a fixed part per step and a
    part per trained parameter. Measured on a synchronous host (CPU) only: on a GPU the host
    runs ahead of the kernels and this work hides behind them."""
    outside, forward_outside = {}, {}
    for parameters in settings.runtime_parameters:
        sample = measure_device.runtime_step(mesh, parameters, hardware, settings.repeats)
        outside[parameters] = sample.outside_graphs_us
        forward_outside[parameters] = sample.forward_outside_graphs_us
        samples.append(
            {
                "what": "runtime_step",
                "parameters": parameters,
                "time_us": sample.measured_us,
                "graphs_us": sample.graphs_us,
                "forward_us": sample.forward_us,
                "forward_graphs_us": sample.forward_graphs_us,
            }
        )
        say(
            f"[calibrate] parallel module step, {parameters} parameters: {sample.measured_us:.0f} us, "
            f"of which its graphs ran {sample.graphs_us:.0f} us; its forward "
            f"{sample.forward_us:.0f} us, graphs {sample.forward_graphs_us:.0f} us"
        )
    fit = fit_runtime_overhead(outside)
    share = fit_forward_share(list(forward_outside.values()), list(outside.values()))
    say(
        f"[calibrate] the runtime's own work: {fit.step_us:.0f} us per step + "
        f"{fit.us_per_parameter:.1f} us per parameter ({100 * share:.0f}% of it in the "
        f"forward); largest error {100 * fit.max_error:.0f}%"
    )
    return dataclasses.replace(
        hardware,
        runtime_step_us=fit.step_us,
        runtime_us_per_parameter=fit.us_per_parameter,
        runtime_forward_share=share,
    )


def _time_matmul_table(
    device: torch.device, settings: CalibrationSettings, say: Callable[[str], None], samples: list
) -> MatmulTable | None:
    """The profile's matmul table: every shape of the grid timed warm and cold."""
    grid = settings.matmul_grid
    if grid is None:
        grid = GPU_MATMUL_GRID if device.type == "cuda" else CPU_MATMUL_GRID
    if not grid:
        return None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    warm, cold = measure_device.matmul_grid_us(
        dtype, tuple(grid), settings.matmul_grid_calls, device
    )
    table = MatmulTable(
        dtype=str(dtype).removeprefix("torch."),
        dims=tuple(grid),
        warm_us=tuple(warm),
        cold_us=tuple(cold),
        cold_bytes=measure_device.cache_bytes(device),
    )
    samples.append({"what": "matmul_table", **dataclasses.asdict(table)})
    small, large = grid[0], grid[-1]
    say(
        f"[calibrate] matmul table {table.dtype}, {len(warm)} shapes ({small}..{large} per "
        f"dim) in {time.perf_counter() - start:.1f} s: {large}^3 {warm[-1]:.0f} us warm, "
        f"{cold[-1]:.0f} us cold; {small}^3 {warm[0]:.1f} us warm, {cold[0]:.1f} us cold; "
        f"cold above {bytes_text(int(table.cold_bytes))} touched"
    )
    return table


def device_model(device: torch.device, figures: dict[str, Any]) -> dict[str, Any]:
    """The ``Hardware`` fields of how ops run on ``device``, from the figures measured so far:
    a CPU host runs its ops synchronously (views cost its dispatch); a GPU does not."""
    synchronous = device.type == "cpu"
    return {
        "flops_fp32": figures["flops_fp32"],
        "flops_bf16": figures["flops_bf16"],
        "memory_bandwidth": figures["memory_bandwidth"],
        "synchronous_ops": synchronous,
        "view_op_us": figures["view_op_us"] if synchronous else 0.0,
        "matmul_half_dim": figures["matmul_half_dim"],
        "matmul_table": figures.get("matmul_table"),
    }


def bytes_text(nbytes: float) -> str:
    """A size as the progress lines print it: ``64 MiB``, ``4 KiB``, ``512 B``."""
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size:
            return f"{nbytes / size:.0f} {unit}"
    return f"{nbytes:.0f} B"
