"""Wrapping a rank's local piece as a DTensor when the shards may be uneven.

``DTensor.from_local`` infers the global shape as local size x mesh size per sharded dim,
which is wrong when the plan shards a dim unevenly (the last ranks hold smaller
``torch.chunk`` pieces). Wherever the runtime wraps a local tensor it knows the global shape
from the trace, so it says it; even shards keep DTensor's own inference (and its strides).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def wrap_shard(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence, global_shape: Sequence[int]
) -> DTensor:
    """``local`` as this rank's piece of a DTensor of ``global_shape`` with ``placements``."""
    global_shape = tuple(int(size) for size in global_shape)
    if _inferred_shape(local.shape, placements, mesh.shape) == global_shape:
        return DTensor.from_local(local, mesh, placements, run_check=False)
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=contiguous_strides(global_shape),
    )


def _inferred_shape(
    local_shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    shape = [int(size) for size in local_shape]
    for mesh_size, placement in zip(mesh_shape, placements):
        if isinstance(placement, Shard) and shape:
            shape[placement.dim % len(shape)] *= mesh_size
    return tuple(shape)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))
