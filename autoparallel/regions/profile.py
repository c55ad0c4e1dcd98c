"""What a region's body does on one rank: its ops and collectives on local fake tensors.

The cost model cannot read a region's body from the joint graph (the graph holds it as one
op), so after tracing the body runs once more, on fake tensors of its local input shapes, in
a fresh fake mode: its forward, then what the backward op runs (the forward again and the
vector-Jacobian product). A dispatch mode records every ATen op and functional collective
with its local shapes; :mod:`autoparallel.cost.regions` prices the records. Data-dependent
exchanges are balanced here (regions/collectives.py), so that is what gets priced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoparallel import _torch_internals as internals
from autoparallel._torch_internals import tree_flatten, tree_map
from autoparallel.regions.context import body_context
from autoparallel.regions.local_map import LocalMapError
from autoparallel.types.regions import (
    CollectiveRecord,
    LocalMapRegion,
    OpRecord,
    RegionLayout,
    RegionProfile,
)
from autoparallel.types.tensors import TensorInfo

_WAIT = "_c10d_functional.wait_tensor"


class _Recorder(internals.TorchDispatchMode):
    """Records each op it sees (collectives apart) and runs it."""

    def __init__(self, group_dims: dict[str, int]):
        super().__init__()
        self.group_dims = group_dims
        self.ops: list[OpRecord] = []
        self.collectives: list[CollectiveRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        name = str(func)
        if name.startswith(_WAIT):
            return output
        kind = next((k for k, op in internals.COLLECTIVE_OPS.items() if name.startswith(op)), None)
        if kind is not None:
            self.collectives.append(self._collective(kind, args, output))
        else:
            self.ops.append(OpRecord(func, _infos(args), _infos(kwargs), _infos(output)))
        return output

    def _collective(self, kind: str, args: tuple, output: Any) -> CollectiveRecord:
        group = next(a for a in args if isinstance(a, str) and a in self.group_dims)
        sizes = [t.nbytes for t in (args[0], output) if isinstance(t, torch.Tensor)]
        return CollectiveRecord(kind, self.group_dims[group], max(sizes))


def _infos(tree: Any) -> Any:
    return tree_map(lambda x: TensorInfo.of(x) if isinstance(x, torch.Tensor) else x, tree)


def profile_region(region: LocalMapRegion, layout: RegionLayout, mesh: DeviceMesh) -> RegionProfile:
    """The ops and collectives of ``region``'s forward op and of its backward op on one rank,
    with its arguments at ``layout``'s local shapes."""
    group_dims = {internals.group_name_of(mesh, dim): dim for dim in range(mesh.ndim)}
    fake_mode = internals.new_fake_mode()
    with fake_mode:
        inputs = [
            torch.empty(info.shape, dtype=info.dtype).requires_grad_(differentiable)
            for info, differentiable in zip(layout.local_inputs, region.differentiable)
        ]
    forward, backward = _Recorder(group_dims), _Recorder(group_dims)
    with fake_mode, body_context(mesh, balanced=True):
        with torch.no_grad(), forward:
            region.func(*region.arguments(inputs))
        with torch.enable_grad(), backward:
            outputs = tree_flatten(region.func(*region.arguments(inputs)))[0]
            pairs = [(o, torch.ones_like(o)) for o in outputs if o.requires_grad]
            wanted = [t for t in inputs if t.requires_grad]
            if pairs and wanted:
                torch.autograd.grad(
                    [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
                )
    return RegionProfile(
        tuple(forward.ops),
        tuple(forward.collectives),
        tuple(backward.ops),
        tuple(backward.collectives),
    )


def check_free_dims(region: LocalMapRegion) -> None:
    """Raise LocalMapError where a profiled body issues a collective over a mesh dim its
    placements leave free: a free dim's batch split would change what that collective
    exchanges (see :class:`~autoparallel.types.regions.LocalMapRegion`)."""
    for layout in region.layouts:
        profile = layout.profile
        if profile is None:
            continue
        for record in profile.forward_collectives + profile.backward_collectives:
            if record.mesh_dim in region.free_mesh_dims:
                raise LocalMapError(
                    f"local_map region at {region.source}: its body issues {record.kind} over "
                    f"mesh dim {record.mesh_dim}, which its placements leave free (None); give "
                    "that mesh dim's placements explicitly"
                )
