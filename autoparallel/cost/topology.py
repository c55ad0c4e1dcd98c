"""Hardware presets and the mapping from device-mesh dimensions to physical links.

The cost model needs two facts that a ``DeviceMesh`` does not carry: how fast one device
computes and moves memory (``Hardware``), and which mesh dimensions talk over NVLink versus
the network (``Topology``). Both are plain frozen dataclasses so they can be hashed, cached
and compared, and so a plan can record exactly which machine it was priced for.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # DeviceMesh pulls in torch.distributed; only needed for annotations.
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "A100",
    "B200",
    "CPU",
    "H100",
    "H200",
    "HARDWARE_PRESETS",
    "Hardware",
    "Topology",
    "get_hardware",
]

_HALF_DTYPES = frozenset({torch.bfloat16, torch.float16})
_FP8_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)


@dataclass(frozen=True)
class Hardware:
    """Per-device throughput figures, all in SI units (FLOP/s, bytes/s, bytes, us).

    Figures are *dense* peaks from public datasheets; the cost model divides by them, so
    they are optimistic by design and matter mostly in ratio (compute vs. link speeds).
    ``supports_fp8`` says whether fp8 math runs on tensor cores at twice the bf16 rate;
    without it fp8 is priced as bf16 (the kernel upcasts).
    """

    name: str
    flops_fp32: float
    flops_bf16: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    kernel_launch_us: float
    memory_bytes: float
    supports_fp8: bool = True

    def peak_flops(self, dtype: torch.dtype | None) -> float:
        """Peak dense FLOP/s for math in ``dtype`` (fp32 rate for anything unrecognised)."""
        if dtype in _HALF_DTYPES:
            return self.flops_bf16
        if dtype in _FP8_DTYPES:
            return 2.0 * self.flops_bf16 if self.supports_fp8 else self.flops_bf16
        return self.flops_fp32


_GB = 1e9

# H100 SXM5 80GB: 67 TF fp32 (non-tensor), 989 TF dense bf16, 3.35 TB/s HBM3,
# NVLink4 900 GB/s bidirectional (450 GB/s per direction), 400 Gb/s NIC per GPU.
H100 = Hardware(
    name="h100",
    flops_fp32=67e12,
    flops_bf16=989e12,
    memory_bandwidth=3.35e12,
    intra_node_bandwidth=450 * _GB,
    inter_node_bandwidth=50 * _GB,
    intra_node_latency_us=2.0,
    inter_node_latency_us=6.0,
    kernel_launch_us=3.0,
    memory_bytes=80 * _GB,
)

# A100 SXM4 80GB: 19.5 TF fp32, 312 TF bf16, 2.04 TB/s HBM2e, NVLink3 600 GB/s
# bidirectional, 200 Gb/s HDR NIC per GPU; no fp8 tensor cores.
A100 = Hardware(
    name="a100",
    flops_fp32=19.5e12,
    flops_bf16=312e12,
    memory_bandwidth=2.039e12,
    intra_node_bandwidth=300 * _GB,
    inter_node_bandwidth=25 * _GB,
    intra_node_latency_us=2.5,
    inter_node_latency_us=8.0,
    kernel_launch_us=4.0,
    memory_bytes=80 * _GB,
    supports_fp8=False,
)

# H200 SXM: H100 compute with 141 GB HBM3e at 4.8 TB/s.
H200 = Hardware(
    name="h200",
    flops_fp32=67e12,
    flops_bf16=989e12,
    memory_bandwidth=4.8e12,
    intra_node_bandwidth=450 * _GB,
    inter_node_bandwidth=50 * _GB,
    intra_node_latency_us=2.0,
    inter_node_latency_us=6.0,
    kernel_launch_us=3.0,
    memory_bytes=141 * _GB,
)

# B200 (HGX): ~80 TF fp32, 2.25 PF dense bf16, 8 TB/s HBM3e, 180 GB, NVLink5 1.8 TB/s
# bidirectional, 400 Gb/s NIC per GPU.
B200 = Hardware(
    name="b200",
    flops_fp32=80e12,
    flops_bf16=2.25e15,
    memory_bandwidth=8e12,
    intra_node_bandwidth=900 * _GB,
    inter_node_bandwidth=50 * _GB,
    intra_node_latency_us=2.0,
    inter_node_latency_us=6.0,
    kernel_launch_us=3.0,
    memory_bytes=180 * _GB,
)

# A generic multi-core server CPU running gloo: rough figures, meant for tests and dry
# runs where only the relative ordering of plans matters.
CPU = Hardware(
    name="cpu",
    flops_fp32=1e12,
    flops_bf16=1e12,
    memory_bandwidth=100 * _GB,
    intra_node_bandwidth=20 * _GB,
    inter_node_bandwidth=1.25 * _GB,
    intra_node_latency_us=20.0,
    inter_node_latency_us=100.0,
    kernel_launch_us=5.0,
    memory_bytes=64 * _GB,
    supports_fp8=False,
)

HARDWARE_PRESETS: dict[str, Hardware] = {hw.name: hw for hw in (H100, A100, H200, B200, CPU)}


def get_hardware(hardware: str | Hardware | None) -> Hardware:
    """Resolve a preset name (case-insensitive), pass a ``Hardware`` through, ``None`` -> H100."""
    if hardware is None:
        return H100
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        key = hardware.strip().lower()
        if key in HARDWARE_PRESETS:
            return HARDWARE_PRESETS[key]
        choices = ", ".join(sorted(HARDWARE_PRESETS))
        raise ValueError(
            f"unknown hardware preset {hardware!r}; choose one of: {choices} "
            "(or pass a Hardware instance)"
        )
    raise TypeError(
        f"hardware must be a preset name, a Hardware or None, got {type(hardware).__name__}"
    )


def _dim_crosses_nodes(mesh_shape: tuple[int, ...], mesh_dim: int, gpus_per_node: int) -> bool:
    """Whether any process group along ``mesh_dim`` spans more than one node.

    Ranks are laid out row-major, so a group along dim i is ``base + k * stride`` with
    ``stride = prod(mesh_shape[i+1:])`` and lives inside an aligned block of
    ``stride * size`` ranks. Nodes hold contiguous rank ranges, so a group is intra-node iff
    its smallest and largest rank fall in the same node. The fast path covers the usual case
    where blocks tile nodes exactly; the loop handles odd node sizes exactly.
    """
    size = mesh_shape[mesh_dim]
    if size == 1:
        return False
    stride = math.prod(mesh_shape[mesh_dim + 1 :])
    block = stride * size
    if block <= gpus_per_node and gpus_per_node % block == 0:
        return False
    world = math.prod(mesh_shape)
    span = (size - 1) * stride
    for outer in range(0, world, block):
        for inner in range(stride):
            first = outer + inner
            if first // gpus_per_node != (first + span) // gpus_per_node:
                return True
    return False


def _normalize_mesh_shape(mesh_shape: object) -> tuple[int, ...]:
    """Coerce to a tuple of Python ints; reject empty shapes and non-positive sizes."""
    try:
        shape = tuple(operator.index(s) for s in mesh_shape)  # type: ignore[union-attr]
    except TypeError:
        raise ValueError(
            f"mesh_shape must be a sequence of positive integers, got {mesh_shape!r}"
        ) from None
    if not shape:
        raise ValueError("mesh_shape must have at least one dimension")
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh_shape sizes must be positive integers, got {shape}")
    return shape


@dataclass(frozen=True)
class Topology:
    """A device mesh's shape placed on physical hardware (row-major rank layout).

    Mesh dim ``i`` connects ranks with stride ``prod(mesh_shape[i+1:])``, as
    ``init_device_mesh`` lays them out; a dim whose groups stay within one node uses the
    intra-node (NVLink) link, otherwise the NIC. ``hardware`` also accepts a preset name.
    """

    mesh_shape: tuple[int, ...]
    hardware: Hardware = H100
    gpus_per_node: int = 8
    _inter: tuple[bool, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = _normalize_mesh_shape(self.mesh_shape)
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "hardware", get_hardware(self.hardware))
        inter = tuple(_dim_crosses_nodes(shape, d, self.gpus_per_node) for d in range(len(shape)))
        object.__setattr__(self, "_inter", inter)

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def _check_dim(self, mesh_dim: int) -> int:
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(
                f"mesh_dim {mesh_dim} out of range for mesh of shape {self.mesh_shape}"
            )
        return mesh_dim % self.ndim

    def is_inter_node(self, mesh_dim: int) -> bool:
        """True when collectives along ``mesh_dim`` cross the network (size-1 dims never do)."""
        return self._inter[self._check_dim(mesh_dim)]

    def bandwidth(self, mesh_dim: int) -> float:
        """Per-GPU one-direction bandwidth (bytes/s) of the slowest link used along ``mesh_dim``."""
        hw = self.hardware
        return hw.inter_node_bandwidth if self.is_inter_node(mesh_dim) else hw.intra_node_bandwidth

    def latency_us(self, mesh_dim: int) -> float:
        """Per-message latency (us) of the link used along ``mesh_dim``."""
        hw = self.hardware
        return (
            hw.inter_node_latency_us if self.is_inter_node(mesh_dim) else hw.intra_node_latency_us
        )

    @classmethod
    def from_mesh(
        cls,
        mesh: DeviceMesh,
        hardware: str | Hardware | None = None,
        gpus_per_node: int | None = None,
    ) -> Topology:
        """Build from a ``DeviceMesh``; ``gpus_per_node=None`` means ``min(8, world size)``."""
        shape = tuple(int(s) for s in mesh.shape)
        if gpus_per_node is None:
            gpus_per_node = min(8, math.prod(shape)) if shape else 8
        return cls(shape, get_hardware(hardware), gpus_per_node)
