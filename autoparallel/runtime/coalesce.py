"""Parameter gradients reduced together: one collective per mesh dim, target and dtype.

At the end of the backward phase each parameter gradient is a pending sum (``Partial``) that
moves to its parameter's placement: an all-reduce for a replicated parameter, a
reduce-scatter for a sharded one. One collective per gradient pays a collective's fixed cost
once per parameter (hundreds of times a step for a large model, each a round of latency),
which is why FSDP and DDP bucket them. Here every gradient whose planned move is that single
step, over the same mesh dim to the same target with the same dtype, joins one flat buffer
reduced by one functional collective (or a few: a bucket carries at most
``BUCKET_CAP_BYTES``, as DDP's do). On a mesh of several dims, a gradient pending over
several of them joins one bucket with the gradients that move the same way: to Replicate on
all of them (DDP over a 2-D mesh: all-reduced over each mesh dim in turn) or to Shard on
all of them (FSDP over a 2-D mesh: reduce-scattered over each mesh dim in turn, the buffer
in the rank-major layout of ``rank_layout.py``). Anything else (a route through other
placements, a shard that does not divide evenly, a tensor dim another mesh dim also shards,
a non-sum reduction, a sum that ends sharded over one mesh dim and replicated over another)
keeps its own redistribution.

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
from autoparallel.runtime import rank_layout
from autoparallel.runtime.executor import redistribute_along
from autoparallel.types.bucketing import (
    BUCKET_CAP_BYTES,
    FIRST_BUCKET_CAP_BYTES,
    capped_buckets,
    ranks_per_tensor_dim,
)


@dataclass(frozen=True)
class Reduction:
    """What gradients reduced in one bucket share: the mesh dims they are summed over (in
    ascending order), the target placement on each of them (all Replicate: all-reduces; all
    Shard: reduce-scatters) and the dtype."""

    mesh_dims: tuple[int, ...]
    targets: tuple[Replicate | Shard, ...]
    dtype: torch.dtype

    @property
    def scatters(self) -> bool:
        return isinstance(self.targets[0], Shard)


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
    """The reduction ``value``'s move is, when it is sums over one or more mesh dims to
    Replicate on each, or to evenly dividing Shards on each (of tensor dims no other mesh dim
    shards); None otherwise."""
    if route or not isinstance(value, DTensor):
        return None
    source = tuple(value.placements)
    changed = [dim for dim, (src, dst) in enumerate(zip(source, target)) if src != dst]
    if not changed or not all(_is_sum(source[dim]) for dim in changed):
        return None
    targets = tuple(target[dim] for dim in changed)
    if all(isinstance(t, Replicate) for t in targets):
        return Reduction(tuple(changed), targets, value.dtype)
    if not all(type(t) is Shard for t in targets):
        return None
    local = value.to_local()
    for placement in targets:
        if placement.dim >= local.ndim:
            return None
        if any(_shards(p, placement.dim) for d, p in enumerate(target) if d not in changed):
            # a tensor dim also sharded by a mesh dim the move keeps: this rank's block of
            # the local tensor is not its shard in the nested layout; left to DTensor
            return None
    splits = ranks_per_tensor_dim(_shards_of(changed, targets, mesh))
    if any(local.shape[dim] % ranks for dim, ranks in splits.items()):
        return None
    return Reduction(tuple(changed), targets, value.dtype)


def _shards_of(mesh_dims: Sequence[int], targets: tuple, mesh: DeviceMesh) -> list[tuple[int, int]]:
    return [(mesh.size(d), t.dim) for d, t in zip(mesh_dims, targets)]


def _is_sum(placement: object) -> bool:
    return isinstance(placement, Partial) and placement.reduce_op == "sum"


def _shards(placement: object, dim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim == dim


def _reduce_together(
    tensors: list[torch.Tensor], reduction: Reduction, mesh: DeviceMesh
) -> list[torch.Tensor]:
    if not reduction.scatters:
        summed = torch.cat([t.reshape(-1) for t in tensors])
        for mesh_dim in reduction.mesh_dims:
            summed = internals.all_reduce_sum(summed, mesh, mesh_dim)
        return [
            part.view(t.shape)
            for part, t in zip(summed.split([t.numel() for t in tensors]), tensors)
        ]
    shards = _shards_of(reduction.mesh_dims, reduction.targets, mesh)
    # rank-major: row r holds rank r's block of every gradient, in order; each
    # reduce-scatter, outermost mesh dim first, keeps this rank's rows of the next
    mine = torch.cat([rank_layout.to_rank_rows(t, shards) for t in tensors], dim=1).view(-1)
    for mesh_dim in reduction.mesh_dims:
        mine = internals.reduce_scatter_sum(mine, mesh, mesh_dim)
    shapes = [rank_layout.block_shape(t.shape, shards) for t in tensors]
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(mine.split(sizes), shapes)]
