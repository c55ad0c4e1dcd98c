"""The mapping from device-mesh dimensions to physical links, on a given ``Hardware``.

The cost model needs two facts that a ``DeviceMesh`` does not carry: how fast one device
computes and moves memory (``Hardware``, in ``cost/hardware.py``: a preset or a calibrated
profile), and which mesh dimensions talk over NVLink versus the network (``Topology``). Both
are plain frozen dataclasses so they can be hashed, cached and compared, and so a plan can
record exactly which machine it was priced for.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # DeviceMesh pulls in torch.distributed; only needed for annotations.
    from torch.distributed.device_mesh import DeviceMesh

from autoparallel.cost.hardware import H100, HARDWARE_PRESETS, Hardware
from autoparallel.cost.profile import load_profile

__all__ = ["Topology", "get_hardware"]


def get_hardware(hardware: str | Path | Hardware | None) -> Hardware:
    """Resolve a preset name (case-insensitive) or a profile file (``*.json``, written by
    ``autoparallel calibrate``), pass a ``Hardware`` through, ``None`` -> H100."""
    if hardware is None:
        return H100
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, Path) or (isinstance(hardware, str) and hardware.endswith(".json")):
        return load_profile(hardware)
    if isinstance(hardware, str):
        key = hardware.strip().lower()
        if key in HARDWARE_PRESETS:
            return HARDWARE_PRESETS[key]
        choices = ", ".join(sorted(HARDWARE_PRESETS))
        raise ValueError(
            f"unknown hardware preset {hardware!r}; choose one of: {choices} "
            "(or a profile.json from `autoparallel calibrate`, or a Hardware instance)"
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

    def link(self, mesh_dim: int) -> str:
        """The link class collectives along ``mesh_dim`` use: "inter" (node) or "intra"."""
        return "inter" if self.is_inter_node(mesh_dim) else "intra"

    def bandwidth(self, mesh_dim: int, collective: str | None = None) -> float:
        """Per-device one-direction bandwidth (bytes/s) along ``mesh_dim``: the profile's fit
        of ``collective`` when it has one, else the slowest link's figure."""
        hw = self.hardware
        fit = hw.collective_fit(self.link(mesh_dim), collective) if collective else None
        if fit is not None:
            return fit.bandwidth
        return hw.inter_node_bandwidth if self.is_inter_node(mesh_dim) else hw.intra_node_bandwidth

    def latency_us(self, mesh_dim: int, collective: str | None = None) -> float:
        """Latency (us) of one step along ``mesh_dim``: the profile's fit of ``collective``
        when it has one, else the link's figure."""
        hw = self.hardware
        fit = hw.collective_fit(self.link(mesh_dim), collective) if collective else None
        if fit is not None:
            return fit.latency_us
        return (
            hw.inter_node_latency_us if self.is_inter_node(mesh_dim) else hw.intra_node_latency_us
        )

    @classmethod
    def from_mesh(
        cls,
        mesh: DeviceMesh,
        hardware: str | Path | Hardware | None = None,
        gpus_per_node: int | None = None,
    ) -> Topology:
        """Build from a ``DeviceMesh``; ``gpus_per_node=None`` means the profile's ranks per
        node where it has one, else ``min(8, world size)``."""
        shape = tuple(int(s) for s in mesh.shape)
        resolved = get_hardware(hardware)
        if gpus_per_node is None:
            gpus_per_node = resolved.devices_per_node or (min(8, math.prod(shape)) if shape else 8)
        return cls(shape, resolved, gpus_per_node)
