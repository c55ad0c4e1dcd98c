"""Run a calibration: on a launched process group (torchrun) or on N spawned local gloo ranks.

Order of work, on every rank together: the device (matmul per dtype and size, memory
bandwidth, a view op as the runtime runs it, AdamW's step on DTensor parameters) and the
first round of the figures timed in rounds (``_Rounds``: the largest fp32 matmul and a skinny
one, two traced transformer blocks for the cost of an op); per mesh dim and collective, each
message size from ``min_bytes`` to ``max_bytes`` (x4 apart); how much of an all-reduce hides
behind compute; the other rounds; last, on a CPU host, the runtime's own work. Rank 0 prints one progress line per measurement and the fits with
their largest relative error. The result is one ``Hardware`` whose link figures are the
all-reduce fits (the generic figures a preset would have) and whose ``collectives`` hold every
fit; ``cost/profile.py`` writes it with the raw timings.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoparallel.calibrate import measure, measure_device
from autoparallel.calibrate.fit import (
    CollectiveSample,
    fit_collective,
    fit_forward_share,
    fit_graph_bandwidth,
    fit_op_overhead,
    fit_optimizer_step,
    fit_runtime_overhead,
    matmul_half_dim,
    throughput,
)
from autoparallel.cost.hardware import COLLECTIVES, CPU, CollectiveFit, Hardware
from autoparallel.cost.matmul_table import MatmulTable
from autoparallel.cost.profile import write_profile
from autoparallel.cost.topology import Topology

KIB, MIB = 1 << 10, 1 << 20

CPU_MATMUL_GRID = (16, 64, 256, 1024)
"""The matmul table's dimensions on a CPU host: 64 shapes in about 5 s on the 2-core VM.
Larger dimensions are priced in proportion to the 1024 ones (where a CPU core's matmul has
reached its peak)."""

GPU_MATMUL_GRID = (64, 256, 1024, 4096, 16384)
"""The same on a GPU, in bf16: a GPU needs dimensions in the thousands to reach its peak."""


@dataclass(frozen=True)
class CalibrationSettings:
    """What to measure.

    Attributes:
        mesh_shape: the mesh whose dims are measured (row-major ranks, as init_device_mesh);
            None: one dim over every rank.
        min_bytes / max_bytes: the smallest and largest collective buffer (sizes x4 apart).
        repeats: timed calls per figure at the least, after one warm-up call.
        rounds: passes over every (collective, size); the median over passes counts.
        matmul_sizes: square matmul sizes timed per dtype (the largest gives the FLOP/s).
        memory_probe_bytes: buffer size of the memory-bandwidth probe.
        skinny_matmul_dim: M of the skinny matmul (M x size x size, size the largest
            matmul size) that measures how fast matmuls slow down at small dimensions.
        optimizer_tensors / optimizer_numel / optimizer_large_numel: the optimizer step is
            timed on (few, 256), (many, 256), (few, optimizer_numel) and (few,
            optimizer_large_numel) tensors x elements, and solved for a fixed cost per step,
            a cost per tensor and a cost per element on tensors of each of the two sizes
            (large tensors cost more per element on a CPU host: their working set leaves
            the caches and the step's temporaries land on fresh pages; 0 skips that run).
        runtime_parameters: the parameter counts of the probe model whose parallel step
            measures the runtime's own work outside its graphs (CPU hosts only).
        matmul_grid: the dimensions whose every (M, K, N) is timed warm and cold for the
            profile's matmul table (cost/matmul_table.py); None: the device's default
            (``CPU_MATMUL_GRID``, ``GPU_MATMUL_GRID``); () measures no table.
        matmul_grid_calls: timed calls per shape of that grid (the median counts).
        name: the profile's hardware name (default: ``<device>-<backend>-<host>``).
    """

    mesh_shape: tuple[int, ...] | None = None
    min_bytes: int = 1 * KIB
    max_bytes: int = 64 * MIB
    repeats: int = 5
    rounds: int = 3
    matmul_sizes: tuple[int, ...] = (256, 512, 1024)
    memory_probe_bytes: int = 64 * MIB
    skinny_matmul_dim: int = 32
    optimizer_tensors: tuple[int, int] = (4, 32)
    optimizer_numel: int = 1 << 20
    optimizer_large_numel: int = 1 << 22
    runtime_parameters: tuple[int, ...] = (4, 16, 64)
    matmul_grid: tuple[int, ...] | None = None
    matmul_grid_calls: int = 7
    name: str | None = None

    def sizes(self) -> list[int]:
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= 4
        return sizes


@dataclass(frozen=True)
class Calibration:
    """What a calibration found: the Hardware, where it was measured, and the raw timings."""

    hardware: Hardware
    measured_on: dict[str, Any]
    samples: list[dict[str, Any]]

    def write(self, path: str | Path) -> None:
        write_profile(self.hardware, path, self.measured_on, self.samples)


def calibrate_group(
    settings: CalibrationSettings, log: Callable[[str], None] = print
) -> Calibration:
    """Calibrate on the default process group, which every rank must have joined; every rank
    calls this and gets the same result (rank 0 logs)."""
    world = dist.get_world_size()
    mesh_shape = settings.mesh_shape or (world,)
    if math.prod(mesh_shape) != world:
        raise ValueError(
            f"mesh {mesh_shape} has {math.prod(mesh_shape)} ranks; the group has {world}"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    say = log if dist.get_rank() == 0 else (lambda _: None)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = init_device_mesh(device_type, mesh_shape)
    topology = Topology(mesh_shape, CPU, per_node)
    samples: list[dict[str, Any]] = []
    # The device first, then the collectives, then the other rounds of _Rounds: they fall
    # half a minute apart, not all in one fast or slow spell of a shared host.
    rounds = _Rounds.trace(device, settings)
    device_figures = _time_device(device, mesh, settings, say, samples)
    rounds.time_round(settings.repeats, device)
    fits = _fit_links(_time_collectives(mesh, topology, settings, say, samples), say)
    device_figures["overlap_fraction"] = _time_overlap(mesh, settings, say, samples, device)
    for _ in range(settings.rounds - 1):
        rounds.time_round(settings.repeats, device)
    device_figures.update(rounds.fit(device, device_figures, say, samples))
    hardware = _hardware(settings, device, fits, device_figures, per_node)
    # last: the probe is planned and priced on the figures above, the op model included
    if hardware.synchronous_ops:
        hardware = _time_runtime(mesh, hardware, settings, say, samples)
    measured_on = {
        "backend": dist.get_backend(),
        "world_size": world,
        "mesh_shape": list(mesh_shape),
        "devices_per_node": per_node,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return Calibration(hardware, measured_on, samples)


def _time_collectives(
    mesh: Any,
    topology: Topology,
    settings: CalibrationSettings,
    say: Callable[[str], None],
    samples: list,
) -> dict[str, list[CollectiveSample]]:
    """Timings per link class ("intra"/"inter"), over every mesh dim of that class.

    Every (collective, size) is timed once per round and the median over rounds counts:
    a busy host's slow spells (seconds long) then spread over all sizes instead of bending
    the fit at the few sizes they happened to hit.
    """
    by_link: dict[str, list[CollectiveSample]] = {}
    for mesh_dim, ranks in enumerate(topology.mesh_shape):
        if ranks == 1:
            continue
        link = topology.link(mesh_dim)
        for collective in COLLECTIVES:
            rounds = [
                [
                    measure.time_collective(collective, nbytes, mesh, mesh_dim, settings.repeats)
                    for nbytes in settings.sizes()
                ]
                for _ in range(settings.rounds)
            ]
            for timings in zip(*rounds):
                sample = dataclasses.replace(
                    timings[0], time_us=statistics.median(t.time_us for t in timings)
                )
                by_link.setdefault(link, []).append(sample)
                samples.append(
                    {
                        "what": collective,
                        "mesh_dim": mesh_dim,
                        "link": link,
                        **dataclasses.asdict(sample),
                        "rounds_us": [t.time_us for t in timings],
                    }
                )
                say(
                    f"[calibrate] {collective:<14} mesh dim {mesh_dim} ({link}, {ranks} ranks) "
                    f"{_bytes(sample.nbytes):>9}: {sample.time_us:12.1f} us "
                    f"(rounds: {', '.join(f'{t.time_us:.0f}' for t in timings)})"
                )
    return by_link


OVERLAP_PROBE_BYTES = 4 << 20  # an all-reduce of about a bucket's size on a small model


def _time_overlap(
    mesh: Any,
    settings: CalibrationSettings,
    say: Callable[[str], None],
    samples: list,
    device: torch.device,
) -> float:
    """``Hardware.overlap_fraction``: the median over rounds of how much of an all-reduce
    hides behind compute (mesh dim 0; 0 on a single rank, where nothing is reduced)."""
    if mesh.size(0) == 1:
        return 0.0
    rounds = [
        measure.overlap(OVERLAP_PROBE_BYTES, mesh, 0, settings.repeats, device)
        for _ in range(settings.rounds)
    ]
    for sample in rounds:
        samples.append({"what": "overlap", **dataclasses.asdict(sample)})
    fraction = statistics.median(sample.fraction for sample in rounds)
    say(
        f"[calibrate] overlap: all-reduce of {_bytes(OVERLAP_PROBE_BYTES)} beside matmuls: "
        f"{fraction:.2f} of it hidden (rounds: "
        + ", ".join(
            f"{s.comm_us:.0f} + {s.compute_us:.0f} us -> {s.both_us:.0f} us" for s in rounds
        )
        + ")"
    )
    return fraction


def _fit_links(
    by_link: dict[str, list[CollectiveSample]], say: Callable[[str], None]
) -> list[CollectiveFit]:
    fits = []
    for link, link_samples in by_link.items():
        for collective in COLLECTIVES:
            fit = fit_collective(
                link, collective, [s for s in link_samples if s.collective == collective]
            )
            fits.append(fit)
            say(
                f"[calibrate] fit {collective:<14} {link}: {fit.latency_us:9.1f} us per ring step, "
                f"{fit.bandwidth / 1e9:8.3f} GB/s; largest error {100 * fit.max_error:.0f}%"
            )
    return fits


def _time_device(
    device: torch.device,
    mesh: Any,
    settings: CalibrationSettings,
    say: Callable[[str], None],
    samples: list,
) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        # fp32's largest size is timed by _Rounds, whose median gives the FLOP/s
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
        f"[calibrate] memory bandwidth ({_bytes(settings.memory_probe_bytes)} add): {bandwidth / 1e9:.2f} GB/s"
    )
    figures["memory_bandwidth"] = bandwidth
    figures["view_op_us"] = measure_device.view_op_us(settings.repeats, device)
    samples.append({"what": "view_op", "time_us": figures["view_op_us"]})
    say(f"[calibrate] view op: {figures['view_op_us']:.2f} us")
    figures.update(_time_optimizer(mesh, settings, say, samples))
    return figures


@dataclass
class _Rounds:
    """The figures timed in rounds spread over the calibration, whose medians count: the
    largest fp32 matmul and the skinny one (the FLOP/s and ``matmul_half_dim``), and the two
    traced transformer blocks that fit the op model of the host. A shared host drifts
    between fast and slow spells for seconds at a time, so one round runs with the device
    figures and the others after the collectives; a single timing of the matmul gave 153
    and 182 GFLOP/s in two ``autoparallel calibrate --nproc 2`` runs on this VM."""

    matmul_shape: tuple[int, int, int]
    skinny_shape: tuple[int, int, int]
    tiny: measure_device.TracedBlock
    training: measure_device.TracedBlock
    matmul_us: list[float]
    skinny_us: list[float]
    tiny_us: list[float]
    training_us: list[float]

    @classmethod
    def trace(cls, device: torch.device, settings: CalibrationSettings) -> _Rounds:
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
        roofline = dataclasses.replace(CPU, **_device_model(device, measured))
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


def _time_runtime(
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
        f"cold above {_bytes(int(table.cold_bytes))} touched"
    )
    return table


def _device_model(device: torch.device, figures: dict[str, Any]) -> dict[str, Any]:
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


def _hardware(
    settings: CalibrationSettings,
    device: torch.device,
    fits: list[CollectiveFit],
    figures: dict[str, Any],
    per_node: int,
) -> Hardware:
    by_link = {(f.link, f.collective): f for f in fits}
    intra = by_link.get(("intra", "all_reduce")) or by_link.get(("inter", "all_reduce"))
    inter = by_link.get(("inter", "all_reduce")) or intra
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / per_node
        fp8 = False
    name = settings.name or f"{device.type}-{dist.get_backend()}-{platform.node() or 'host'}"
    return Hardware(
        name=name,
        **_device_model(device, figures),
        intra_node_bandwidth=intra.bandwidth if intra else CPU.intra_node_bandwidth,
        inter_node_bandwidth=inter.bandwidth if inter else CPU.inter_node_bandwidth,
        intra_node_latency_us=intra.latency_us if intra else CPU.intra_node_latency_us,
        inter_node_latency_us=inter.latency_us if inter else CPU.inter_node_latency_us,
        kernel_launch_us=figures["kernel_launch_us"],
        optimizer_step_us=figures["optimizer_step_us"],
        optimizer_us_per_tensor=figures["optimizer_us_per_tensor"],
        optimizer_ns_per_element=figures["optimizer_ns_per_element"],
        optimizer_base_numel=figures["optimizer_base_numel"],
        optimizer_large_numel=figures["optimizer_large_numel"],
        optimizer_ns_per_element_large=figures["optimizer_ns_per_element_large"],
        optimizer_step_warm_us=figures["optimizer_step_warm_us"],
        optimizer_warm_bytes=figures["optimizer_warm_bytes"],
        optimizer_cold_bytes=figures["optimizer_cold_bytes"],
        overlap_fraction=figures["overlap_fraction"],
        memory_bytes=memory,
        supports_fp8=fp8,
        collectives=tuple(fits),
        devices_per_node=per_node,
    )


def _bytes(nbytes: float) -> str:
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size:
            return f"{nbytes / size:.0f} {unit}"
    return f"{nbytes:.0f} B"


# ---------------------------------------------------------------------------- local ranks


def _calibrate_rank(
    rank: int, world_size: int, settings: CalibrationSettings
) -> Calibration | None:
    result = calibrate_group(settings, log=lambda line: print(line, flush=True))
    return result if rank == 0 else None


def calibrate_local(
    nproc: int, settings: CalibrationSettings, timeout_s: float = 3600
) -> Calibration:
    """Calibrate on ``nproc`` gloo ranks spawned on this machine (one thread each)."""
    from autoparallel._testing.harness import run_distributed

    return run_distributed(_calibrate_rank, nproc, settings, timeout_s=timeout_s)[0]
