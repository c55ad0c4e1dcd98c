"""Collectives with autograd for the body of a ``local_map`` region, named by mesh dim.

Each is built on torch's functional collectives and differentiates as its adjoint: the
backward of an all-to-all is the reverse all-to-all, of an all-gather a reduce-scatter, of a
reduce-scatter an all-gather, of an all-reduce an all-reduce. That is exact under the
convention the region's backward follows (see autoparallel/regions/local_map.py): every
rank's gradient is its own contribution, and contributions add across ranks.

Inside a region the mesh is the one the model is planned for or run on; outside one (the
plain model on one device) every collective is the identity and every mesh dim has size 1,
so a body written for N ranks runs unchanged on one. While planning, the body runs on fake
tensors: an all-to-all whose split sizes come from the data is then assumed balanced (each
rank receives as many rows as it sends), which is also how the cost model prices it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoparallel import _torch_internals as internals
from autoparallel.regions.context import active_body

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "mesh_dim_rank",
    "mesh_dim_size",
    "reduce_scatter",
]

MeshDim = str | int
SplitSizes = Sequence[int] | torch.Tensor | None


def _group(mesh_dim: MeshDim) -> tuple[DeviceMesh, int] | None:
    """(mesh, dim index) of ``mesh_dim`` in the running region, or None where the group has
    one rank (no region, no mesh, a size-1 dim, or a named dim the mesh does not have)."""
    body = active_body()
    if body is None or body.mesh is None:
        return None
    mesh = body.mesh
    if isinstance(mesh_dim, str) and mesh_dim not in (mesh.mesh_dim_names or ()):
        return None  # a mesh without that dim: the group is this rank alone
    index = _dim_index(mesh, mesh_dim)
    return None if mesh.size(index) == 1 else (mesh, index)


def _dim_index(mesh: DeviceMesh, mesh_dim: MeshDim) -> int:
    names = mesh.mesh_dim_names or ()
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ValueError(
                f"mesh dim {mesh_dim!r} is not a dim of the mesh (its dims: {list(names)}); "
                "name the mesh dims with init_device_mesh(..., mesh_dim_names=...)"
            )
        return names.index(mesh_dim)
    if not 0 <= mesh_dim < mesh.ndim:
        raise ValueError(f"mesh dim {mesh_dim} is out of range for a {mesh.ndim}-D mesh")
    return mesh_dim


def mesh_dim_size(mesh_dim: MeshDim) -> int:
    """Ranks along ``mesh_dim`` of the running region's mesh (1 outside a region, or where
    the mesh lacks a dim of that name)."""
    body = active_body()
    if body is None or body.mesh is None:
        return 1
    names = body.mesh.mesh_dim_names or ()
    if isinstance(mesh_dim, str) and mesh_dim not in names:
        return 1
    return body.mesh.size(_dim_index(body.mesh, mesh_dim))


def mesh_dim_rank(mesh_dim: MeshDim) -> int:
    """This rank's coordinate along ``mesh_dim`` (0 outside a region)."""
    group = _group(mesh_dim)
    if group is None:
        return 0
    mesh, index = group
    return mesh.get_local_rank(index)


def all_to_all(
    tensor: torch.Tensor,
    mesh_dim: MeshDim,
    output_split_sizes: SplitSizes = None,
    input_split_sizes: SplitSizes = None,
) -> torch.Tensor:
    """Exchange rows of ``tensor`` between the ranks of ``mesh_dim``: rank r sends its
    ``input_split_sizes[j]`` rows to rank j and receives ``output_split_sizes[j]`` from each.

    Split sizes may be tensors (dropless token dispatch: counts computed from the data);
    None means equal splits. Differentiable (the backward sends the gradients back)."""
    group = _group(mesh_dim)
    if group is None:
        return tensor
    mesh, index = group
    body = active_body()
    if body is not None and body.balanced:
        # fake tensors: data-dependent counts are unknown; assume a balanced exchange
        given = output_split_sizes is not None or input_split_sizes is not None
        even = _even_splits(tensor.shape[0], mesh.size(index)) if given else None
        return _AllToAll.apply(tensor, even, even, mesh, index)
    out_splits = _sizes(output_split_sizes)
    in_splits = _sizes(input_split_sizes)
    return _AllToAll.apply(tensor, out_splits, in_splits, mesh, index)


def all_gather(tensor: torch.Tensor, mesh_dim: MeshDim, dim: int = 0) -> torch.Tensor:
    """Every rank's ``tensor`` along ``mesh_dim`` concatenated on ``dim`` (backward:
    reduce-scatter of the gradient)."""
    group = _group(mesh_dim)
    return tensor if group is None else _AllGather.apply(tensor, dim, *group)


def reduce_scatter(tensor: torch.Tensor, mesh_dim: MeshDim, dim: int = 0) -> torch.Tensor:
    """This rank's block on ``dim`` of the sum over ``mesh_dim`` (backward: all-gather)."""
    group = _group(mesh_dim)
    return tensor if group is None else _ReduceScatter.apply(tensor, dim, *group)


def all_reduce(tensor: torch.Tensor, mesh_dim: MeshDim) -> torch.Tensor:
    """The sum of ``tensor`` over ``mesh_dim`` (backward: the sum of the gradients)."""
    group = _group(mesh_dim)
    return tensor if group is None else _AllReduce.apply(tensor, *group)


def _sizes(split_sizes: SplitSizes) -> list[int] | None:
    if split_sizes is None:
        return None
    if isinstance(split_sizes, torch.Tensor):
        return [int(size) for size in split_sizes.tolist()]
    return [int(size) for size in split_sizes]


def _even_splits(rows: int, ranks: int) -> list[int]:
    base, extra = divmod(int(rows), ranks)
    return [base + (rank < extra) for rank in range(ranks)]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor, out_splits, in_splits, mesh, index):  # type: ignore[override]
        ctx.routing = (out_splits, in_splits, mesh, index)
        return internals.collective_all_to_all(
            tensor.contiguous(), out_splits, in_splits, mesh, index
        )

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        out_splits, in_splits, mesh, index = ctx.routing
        back = internals.collective_all_to_all(
            grad.contiguous(), in_splits, out_splits, mesh, index
        )
        return back, None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor, dim, mesh, index):  # type: ignore[override]
        ctx.group = (dim, mesh, index)
        return internals.collective_all_gather(tensor, dim, mesh, index)

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        dim, mesh, index = ctx.group
        return internals.collective_reduce_scatter(grad, dim, mesh, index), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor, dim, mesh, index):  # type: ignore[override]
        ctx.group = (dim, mesh, index)
        return internals.collective_reduce_scatter(tensor, dim, mesh, index)

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        dim, mesh, index = ctx.group
        return internals.collective_all_gather(grad, dim, mesh, index), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor, mesh, index):  # type: ignore[override]
        ctx.group = (mesh, index)
        return internals.all_reduce_sum(tensor.contiguous(), mesh, index)

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        mesh, index = ctx.group
        return internals.all_reduce_sum(grad.contiguous(), mesh, index), None, None
