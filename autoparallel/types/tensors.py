"""Plain tensor metadata shared by every stage, and the global -> local shape rule.

The pipeline reasons about *global* tensors while planning and about *local* (per-rank)
tensors when pricing compute and when running. Keeping the rule that links the two in one
place means the cost model, the runtime checks and the error messages can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Placement, Shard


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor, without any storage or device."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= int(size)
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        return cls(tuple(int(s) for s in tensor.shape), tensor.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    if dtype is None:
        return 4
    if dtype.is_floating_point or dtype.is_complex:
        return torch.finfo(dtype).bits // 8 * (2 if dtype.is_complex else 1)
    if dtype == torch.bool:
        return 1
    return torch.iinfo(dtype).bits // 8


def local_shape(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Largest local shape any rank holds (rank 0's: uneven shards round up).

    Shard(d) on a mesh dimension of size n divides tensor dim d by n (ceil); Replicate and
    Partial keep the full size. Applying placements in mesh-dim order matches DTensor's
    default (left-to-right) shard order.
    """
    shape = list(int(s) for s in global_shape)
    for mesh_size, placement in zip(mesh_shape, placements):
        if isinstance(placement, Shard):
            dim = placement.dim % len(shape) if shape else placement.dim
            shape[dim] = -(-shape[dim] // mesh_size)
    return tuple(shape)


def local_shape_at(
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    """The local shape of the rank at ``coordinate`` (uneven shards: ``torch.chunk`` pieces
    of ceil(size / n), so the last ranks may hold less), mesh dims applied in order."""
    return _local_piece(global_shape, placements, mesh_shape, coordinate)[1]


def local_offset_at(
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    """Where the piece of the rank at ``coordinate`` starts in the global tensor, per tensor
    dim: the offsets of :func:`local_shape_at`'s pieces."""
    return _local_piece(global_shape, placements, mesh_shape, coordinate)[0]


def _local_piece(
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of the rank's piece: each mesh dim that shards a tensor dim cuts the
    piece left by the mesh dims before it into ``torch.chunk`` pieces."""
    shape = list(int(s) for s in global_shape)
    offset = [0] * len(shape)
    for mesh_size, placement, index in zip(mesh_shape, placements, coordinate):
        if isinstance(placement, Shard):
            dim = placement.dim % len(shape)
            chunk = -(-shape[dim] // mesh_size)
            start = min(chunk * index, shape[dim])
            offset[dim] += start
            shape[dim] = max(0, min(chunk, shape[dim] - start))
    return tuple(offset), tuple(shape)


def local_info(
    info: TensorInfo, placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> TensorInfo:
    return TensorInfo(local_shape(info.shape, placements, mesh_shape), info.dtype)
