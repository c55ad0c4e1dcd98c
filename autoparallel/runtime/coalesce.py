"""Parameter gradients reduced together: one collective per mesh dim, target and dtype.

At the end of the backward phase each parameter gradient is a pending sum (``Partial``) that
moves to its parameter's placement: an all-reduce for a replicated parameter, a
reduce-scatter for a sharded one. One collective per gradient pays a collective's fixed cost
once per parameter (hundreds of times a step for a large model; ~0.5 ms each over gloo),
which is why FSDP and DDP bucket them. Here every gradient whose planned move is that single
step, over the same mesh dim to the same target with the same dtype, joins one flat buffer
reduced by one functional collective (or a few: a bucket carries at most
``BUCKET_CAP_BYTES``, as DDP's do). On a mesh of several dims, a gradient pending over
several of them that moves to Replicate on all of them (DDP over a 2-D mesh) is one bucket
too, all-reduced over each of those mesh dims in turn. Anything else (a route through other
placements, a shard that does not divide evenly, a non-sum reduction, a sum that ends
sharded over one mesh dim and replicated over another) keeps its own redistribution.

The sums are the same elementwise sums as separate collectives would give; only the grouping
of the bytes on the wire changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoparallel import _torch_internals as internals
from autoparallel.runtime.executor import redistribute_along
from autoparallel.types.bucketing import BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES, capped_buckets


@dataclass(frozen=True)
class Reduction:
    """What gradients reduced in one bucket share: the mesh dims they are summed over (one
    for a reduce-scatter; one or more for all-reduces, issued in this order), the target
    placement on those dims and the dtype."""

    mesh_dims: tuple[int, ...]
    target: Replicate | Shard
    dtype: torch.dtype


def reduce_gradients(
    values: Sequence[DTensor],
    routes: Sequence[tuple],
    placements: Sequence[tuple],
    mesh: DeviceMesh,
    ready_order: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """The local tensor of each ``values[i]`` moved along ``routes[i]`` to ``placements[i]``,
    with the single-step sum reductions coalesced (see the module docstring).

    ``ready_order[i]`` is when gradient i becomes final in the backward (its node's position):
    buckets fill in that order, the first one small, so that the first bucket's collective can
    start while the backward still computes the earlier layers (local_graph.py moves it)."""
    order = sorted(
        range(len(values)), key=lambda i: ready_order[i] if ready_order is not None else i
    )
    results: list[torch.Tensor | None] = [None] * len(values)
    groups: dict[Reduction, list[int]] = {}
    for index in order:
        value, route, target = values[index], routes[index], placements[index]
        reduction = coalescable(value, route, tuple(target), mesh)
        if reduction is None:
            results[index] = redistribute_along(value, route, target).to_local()
        else:
            groups.setdefault(reduction, []).append(index)
    for reduction, members in groups.items():
        if len(members) == 1:
            index = members[0]
            results[index] = redistribute_along(
                values[index], routes[index], placements[index]
            ).to_local()
            continue
        local = {i: values[i].to_local() for i in members}  # once: each is a traced op
        sizes = [_nbytes(local[i]) for i in members]
        for bucket in capped_buckets(members, sizes, BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES):
            reduced = _reduce_together([local[i] for i in bucket], reduction, mesh)
            for index, tensor in zip(bucket, reduced):
                results[index] = tensor
    return results  # type: ignore[return-value]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def coalescable(value: DTensor, route: tuple, target: tuple, mesh: DeviceMesh) -> Reduction | None:
    """The reduction ``value``'s move is, when it is one sum over one mesh dim to an evenly
    dividing Shard, or sums over one or more mesh dims to Replicate on each; None otherwise."""
    if route or not isinstance(value, DTensor):
        return None
    source = tuple(value.placements)
    changed = [dim for dim, (src, dst) in enumerate(zip(source, target)) if src != dst]
    if not changed or not all(_is_sum(source[dim]) for dim in changed):
        return None
    if all(isinstance(target[dim], Replicate) for dim in changed):
        return Reduction(tuple(changed), Replicate(), value.dtype)
    if len(changed) != 1 or type(target[changed[0]]) is not Shard:
        return None
    mesh_dim = changed[0]
    dst = target[mesh_dim]
    local = value.to_local()
    if local.ndim <= dst.dim or local.shape[dst.dim] % mesh.size(mesh_dim):
        return None
    if any(_shards(p, dst.dim) for d, p in enumerate(target) if d != mesh_dim):
        # a tensor dim sharded over two mesh dims: this rank's block of the local tensor
        # is not its shard in the nested layout; left to DTensor's own redistribute
        return None
    return Reduction((mesh_dim,), dst, value.dtype)


def _is_sum(placement: object) -> bool:
    return isinstance(placement, Partial) and placement.reduce_op == "sum"


def _shards(placement: object, dim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim == dim


def _reduce_together(
    tensors: list[torch.Tensor], reduction: Reduction, mesh: DeviceMesh
) -> list[torch.Tensor]:
    if isinstance(reduction.target, Replicate):
        summed = torch.cat([t.reshape(-1) for t in tensors])
        for mesh_dim in reduction.mesh_dims:
            summed = internals.all_reduce_sum(summed, mesh, mesh_dim)
        return [
            part.view(t.shape)
            for part, t in zip(summed.split([t.numel() for t in tensors]), tensors)
        ]
    (mesh_dim,) = reduction.mesh_dims
    ranks, dim = mesh.size(mesh_dim), reduction.target.dim
    # rank-major: row r holds rank r's block of every gradient, in order
    rows = torch.cat([rank_blocks(t, ranks, dim) for t in tensors], dim=1)
    mine = internals.reduce_scatter_sum(rows.view(-1), mesh, mesh_dim)
    shapes = [_block_shape(t.shape, ranks, dim) for t in tensors]
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(mine.split(sizes), shapes)]


def rank_blocks(tensor: torch.Tensor, ranks: int, dim: int) -> torch.Tensor:
    """``[ranks, numel / ranks]``: row r is the r-th of ``ranks`` equal blocks of ``tensor``
    along ``dim``, flattened (views for a contiguous tensor split on ``dim`` 0, else one copy)."""
    shape = tuple(tensor.shape)
    blocks = tensor.reshape(*shape[:dim], ranks, shape[dim] // ranks, *shape[dim + 1 :])
    if dim:
        blocks = blocks.movedim(dim, 0)
    return blocks.reshape(ranks, -1)


def _block_shape(shape: torch.Size, ranks: int, dim: int) -> tuple[int, ...]:
    return (*shape[:dim], shape[dim] // ranks, *shape[dim + 1 :])
