"""What a calibration measures: the sizes, repeats and probes of ``autoparallel calibrate``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KIB, MIB = 1 << 10, 1 << 20


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
            (``run_device.CPU_MATMUL_GRID``, ``GPU_MATMUL_GRID``); () measures no table.
        matmul_grid_calls: timed calls per shape of that grid (the median counts).
        name: the profile's hardware name (default: ``<device>-<backend>-<host>``).
        device: where the device figures are measured; None: CUDA under NCCL, else the CPU
            ("cuda" under gloo measures a GPU whose ranks cannot use NCCL, e.g. two ranks
            sharing one GPU, or a group of one).
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
    device: Literal["cpu", "cuda"] | None = None

    def sizes(self) -> list[int]:
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= 4
        return sizes
