"""torch's functional collectives and the fake process group, wrapped.

The functional collectives (what DTensor itself emits) live in the private module
``torch.distributed._functional_collectives``; the runtime's coalesced gradient reductions,
calibration and the ``local_map`` regions' collectives call them directly. torch's fake
process group, which lets one process plan for a mesh of any size, needs a store that only
``torch.testing._internal`` provides.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _funcol
from torch.distributed.tensor._collective_utils import shard_dim_alltoall as _shard_dim_alltoall

# torch 2.13 renamed the gather and the scatter along a dim ``all_gather_single`` and
# ``reduce_scatter_single`` and deprecated the old names, the only ones torch 2.11 has;
# same arguments and results.
_all_gather_along = getattr(_funcol, "all_gather_single", None) or _funcol.all_gather_tensor
_reduce_scatter_along = (
    getattr(_funcol, "reduce_scatter_single", None) or _funcol.reduce_scatter_tensor
)


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Start torch's fake process group of ``world_size`` ranks in this process (replacing
    any default group): collectives return at once without moving data, so a mesh of any
    size can be built and planned for on one machine."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def release_mesh_groups() -> int:
    """Drop the process groups every live ``DeviceMesh`` still holds; returns how many meshes
    held some. Call it only after ``destroy_process_group()``, when those groups are dead.

    Private on two counts, and no public API does it: a DeviceMesh keeps its groups' objects
    in ``_pg_registry``, and torch's own module-level caches (DTensor's redistribute planner
    cache, ``MeshTopoInfo.build_from_mesh``, the sharding propagation caches) keep every mesh
    that ever redistributed alive for the life of the process. So a gloo group outlives
    ``destroy_process_group()`` with its worker threads running, until the interpreter's exit
    (runtime/shutdown.py says why that can abort the process). Without the registry (a torch
    whose mesh holds group names only) there is nothing to drop."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    released = 0
    for obj in gc.get_objects():
        # the type's MRO, not isinstance: DeviceMesh's metaclass check touches attributes of
        # every object it is asked about, and some of torch's objects warn when touched
        is_mesh = DeviceMesh in type(obj).__mro__
        registry = getattr(obj, "_pg_registry", None) if is_mesh else None
        if registry:
            registry.clear()
            released += 1
    return released


# runtime's coalesced gradient reductions call them directly (runtime/coalesce.py).


FUNCTIONAL_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
FUNCTIONAL_ALL_REDUCE_IN_PLACE = torch.ops._c10d_functional.all_reduce_.default
"""The functional all-reduce as DTensor traces it (it copies its input, then reduces the
copy) and its in-place twin (reduces the input itself), for runtime/local_graph.py's
``reduce_in_place``: the ops are registered by torch but have no public handle."""


def all_reduce_sum(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Sum of ``tensor`` over the ranks of ``mesh_dim``, waited on."""
    return _funcol.wait_tensor(_funcol.all_reduce(tensor, "sum", (mesh, mesh_dim)))


def start_all_reduce_sum(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """:func:`all_reduce_sum` issued but not waited on: pass the result to
    :func:`wait_tensor` before reading it (the collective runs meanwhile)."""
    return _funcol.all_reduce(tensor, "sum", (mesh, mesh_dim))


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, once it has finished."""
    return _funcol.wait_tensor(tensor)


def all_gather_rows(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` of ``mesh_dim`` stacked along dim 0 in rank order, waited on."""
    return _funcol.wait_tensor(_all_gather_along(tensor, 0, (mesh, mesh_dim)))


def reduce_scatter_sum(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """This rank's block of the sum of ``tensor`` over the ranks of ``mesh_dim``, where
    rank r (its coordinate along ``mesh_dim``) gets the r-th of equal blocks along dim 0."""
    return _funcol.wait_tensor(_reduce_scatter_along(tensor, "sum", 0, (mesh, mesh_dim)))


def shard_to_shard(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """This rank's local tensor after DTensor's ``Shard(0) -> Shard(1)`` along ``mesh_dim``,
    issued as DTensor issues it: an all-to-all, except on CPU meshes, where DTensor falls back
    to an all-gather and a chunk copy (gloo has no functional all-to-all). Calibration times
    this private DTensor function so that the all-to-all it fits is the one the runtime runs."""
    return _shard_dim_alltoall(tensor, 0, 1, mesh, mesh_dim)


def collective_all_to_all(
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    mesh: Any,
    mesh_dim: int,
) -> torch.Tensor:
    """Rows of ``tensor`` exchanged between the ranks of ``mesh_dim``, waited on."""
    return _funcol.wait_tensor(
        _funcol.all_to_all_single(tensor, output_split_sizes, input_split_sizes, (mesh, mesh_dim))
    )


def collective_all_gather(tensor: torch.Tensor, dim: int, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` of ``mesh_dim`` concatenated along ``dim``, waited on."""
    return _funcol.wait_tensor(_all_gather_along(tensor.contiguous(), dim, (mesh, mesh_dim)))


def collective_reduce_scatter(
    tensor: torch.Tensor, dim: int, mesh: Any, mesh_dim: int
) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum over the ranks of ``mesh_dim``, waited on."""
    return _funcol.wait_tensor(
        _reduce_scatter_along(tensor.contiguous(), "sum", dim, (mesh, mesh_dim))
    )


def group_name_of(mesh: Any, mesh_dim: int) -> str:
    """The process group name the functional collectives record for ``mesh_dim``."""
    return mesh.get_group(mesh_dim).group_name


COLLECTIVE_OPS = {
    "all_to_all": "_c10d_functional.all_to_all_single",
    "all_gather": "_c10d_functional.all_gather_into_tensor",
    "reduce_scatter": "_c10d_functional.reduce_scatter_tensor",
    "all_reduce": "_c10d_functional.all_reduce",
}
"""Functional collective op names (as ``str(op)`` starts) by the cost model's kind."""


def one_worker_gloo(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroupGloo:
    """A gloo backend that runs its collectives on one worker thread (the creator torch's
    ``Backend.register_backend`` calls for each new group; runtime/gloo.py says why).

    Private: gloo's worker count is only reachable through ``ProcessGroupGloo._Options``
    (``_threads``, ``_devices``, ``_timeout``); ``init_process_group`` and ``new_group``
    ignore options for gloo and always start two workers per device."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def gloo_worker_threads(group: dist.ProcessGroup, device_type: str) -> int | None:
    """How many worker threads run ``group``'s collectives on ``device_type`` where its
    backend there is gloo; None for any other backend (nccl, the fake group of planning).

    Private: ``ProcessGroup._get_backend`` and ``ProcessGroupGloo.options._threads`` are the
    only way to read which backend serves a device and how many workers it runs."""
    try:
        backend = group._get_backend(torch.device(device_type))
    except RuntimeError:  # no backend for that device
        return None
    if not isinstance(backend, dist.ProcessGroupGloo):
        return None
    return int(backend.options._threads)
