"""The rank-major layout of a coalesced collective's flat buffer, over one or more mesh dims.

A bucket gathers (or reduce-scatters) many tensors in one flat buffer. Over mesh dims
``c0 < c1 < ...`` (each of size ``n_i``, each sharding some tensor dim), the buffer holds one
row per rank of those dims, in row-major order of their coordinates: row ``(i0, i1, ...)``
is that rank's block. Gathering over the dims in turn, innermost first, builds exactly
these rows; reduce-scattering over them in turn, outermost first, leaves each rank its own
row. Both need only the local tensor's view as blocks, which is what this module computes.

``shards`` lists, per mesh dim of the collective in ascending order, ``(ranks, tensor dim)``.
Two mesh dims may shard the same tensor dim (nested ``Shard(0), Shard(0)``): the outer mesh
dim's blocks are then the larger ones, as DTensor lays them out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autoparallel.types.bucketing import ranks_per_tensor_dim

Shards = Sequence[tuple[int, int]]


def _axis_order(shards: Shards, ndim: int) -> list[int]:
    """Where each axis of ``[*mesh axes, *tensor dims]`` goes in the split full tensor:
    per tensor dim, the mesh axes that shard it (outer first), then its local extent."""
    order: list[int] = []
    for dim in range(ndim):
        order += [axis for axis, (_, sharded) in enumerate(shards) if sharded == dim]
        order.append(len(shards) + dim)
    return order


def from_rank_rows(rows: torch.Tensor, local_shape: Sequence[int], shards: Shards) -> torch.Tensor:
    """The full tensor (over the collective's mesh dims) whose rank blocks are ``rows``
    (``[ranks, numel of local_shape]``, rows in rank-major order): one copy at most."""
    ranks = [size for size, _ in shards]
    pieces = rows.view(*ranks, *local_shape)
    order = _axis_order(shards, len(local_shape))
    if order != sorted(order):
        pieces = pieces.permute(order)
    ranks = ranks_per_tensor_dim(shards)
    return pieces.reshape([extent * ranks.get(d, 1) for d, extent in enumerate(local_shape)])


def to_rank_rows(tensor: torch.Tensor, shards: Shards) -> torch.Tensor:
    """``[ranks, numel / ranks]``: row r is rank r's block of ``tensor`` (views for blocks
    that are contiguous, such as a split of dim 0 alone; else one copy)."""
    split: list[int] = []
    for dim, extent in enumerate(tensor.shape):
        sizes = [size for size, sharded in shards if sharded == dim]
        split += sizes + [extent // math.prod(sizes)]
    order = _axis_order(shards, tensor.ndim)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    blocks = tensor.reshape(split)
    if inverse != sorted(inverse):
        blocks = blocks.permute(inverse)
    return blocks.reshape(math.prod(size for size, _ in shards), -1)


def block_shape(shape: Sequence[int], shards: Shards) -> tuple[int, ...]:
    """The shape of one rank's block of a tensor of ``shape``."""
    ranks = ranks_per_tensor_dim(shards)
    return tuple(extent // ranks.get(dim, 1) for dim, extent in enumerate(shape))
