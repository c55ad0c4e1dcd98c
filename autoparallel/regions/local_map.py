"""``local_map``: a function written for local tensors, inside a model the planner traces.

The model calls ``local_map(body, out_placements, in_placements)(*args)``. Planning traces
the model on global fake tensors; the call then becomes two ops of the joint graph:

* ``autoparallel::local_map`` (forward): its inputs must arrive in ``in_placements`` and its
  outputs leave in ``out_placements``; the planner chooses everything around it and prices
  the redistributions into and out of it like any other edge;
* ``autoparallel::local_map_backward``: from the region's inputs and its outputs'
  gradients, the inputs' gradients. It re-runs the body under autograd and takes its
  vector-Jacobian product on every rank, so the region saves only its inputs.

Gradient convention: every rank's vector-Jacobian product is its own contribution, and the
collectives' backwards are their adjoints (regions/collectives.py). So an output gradient
reaches the body in :func:`~autoparallel.types.regions.adjoint_placements` of the output's
placements (a replicated output's gradient as a Partial sum: the whole of it on one rank),
and an input's gradient leaves by default in the adjoint of its placements (a replicated
weight's gradient is Partial: the planner adds the reduction it needs). This differs from
torch's ``local_map``, whose default gradient placement is the input's own (right only when
every rank computes the same gradient); pass ``in_grad_placements`` to choose.

At run time the parallel module calls the region ops on this rank's local shards; each
finds its body by key in the scope the module sets (regions/context.py). On plain tensors
outside planning (the model on one device) ``local_map`` just calls the body; on DTensors
it defers to torch's own ``local_map``.

Bodies must read tensors only through their arguments (a tensor read from ``self`` would be
the trace's fake copy), must not draw random numbers (the backward re-runs them), and keep
output shapes independent of values (while planning the body runs on fake tensors).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel import _torch_internals as internals
from autoparallel._torch_internals import tree_flatten
from autoparallel.regions.context import RegionScope, active_scope, body_context, scope_of
from autoparallel.regions.layouts import (
    declared_str,
    free_mesh_dims,
    region_layouts,
    resolve_free,
)
from autoparallel.types.placements import Placements
from autoparallel.types.regions import LocalMapRegion, adjoint_placements
from autoparallel.types.tensors import TensorInfo

__all__ = ["LocalMapError", "local_map", "region_forward_op", "region_backward_op"]


class LocalMapError(ValueError):
    """A ``local_map`` region whose placements do not fit its arguments, its outputs or the
    mesh. The message names the region's source line and the argument or output."""


def local_map(
    func: Callable | None = None,
    out_placements: Any = None,
    in_placements: Any = None,
    in_grad_placements: Any = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = True,
) -> Callable:
    """``func`` as a region of the model: it runs on local tensors with these placements.

    Args (as torch's ``torch.distributed.tensor.experimental.local_map``):
        func: the body, on local tensors; its tensor arguments are positional.
        out_placements: placements of its output (one per mesh dim), or a tuple of them,
            one per tensor of its flattened output.
        in_placements: one entry per flattened positional argument: placements for a
            tensor, None for anything else.
        in_grad_placements: placements of each argument's gradient; default: the adjoint
            of its placements (see the module doc).
        device_mesh: the mesh the placements refer to; default: the mesh being planned for.
        redistribute_inputs: kept for torch's signature. Planning always brings inputs into
            ``in_placements`` (the redistribution is part of the plan).

    Used as a decorator (``@local_map(out_placements=..., in_placements=...)``) too.
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    if not callable(func):
        raise TypeError(f"local_map expects a function, got {type(func).__name__}")

    @functools.wraps(func)
    def region(*args: Any, **kwargs: Any) -> Any:
        leaves, arg_spec = tree_flatten(args)
        if any(isinstance(leaf, DTensor) for leaf in leaves):
            return _torch_local_map(
                func, out_placements, in_placements, in_grad_placements, device_mesh, args, kwargs
            )
        scope = active_scope()
        if scope is None or not scope.recording:
            return func(*args, **kwargs)  # the plain model: one rank, collectives are identities
        definition = _define(
            scope,
            func,
            _caller(),
            leaves,
            arg_spec,
            kwargs,
            (out_placements, in_placements, in_grad_placements),
            device_mesh,
        )
        tensors = [leaves[i] for i in definition.tensor_positions]
        outputs = region_forward_op(definition.key, tensors)
        return definition.out_spec.unflatten(list(outputs))

    return region


def _torch_local_map(func, out_placements, in_placements, in_grad, mesh, args, kwargs) -> Any:
    """torch's own ``local_map`` on DTensor arguments, each free mesh dim resolved as the
    arguments lie: ``Shard(0)`` where a free argument is split on dim 0 there, else
    ``Replicate()``."""
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    leaves = tree_flatten(args)[0]
    declared = list(in_placements or ())
    entries = [e for e in declared if _is_placements(e)]
    outs = (out_placements,) if _is_placements(out_placements) else tuple(out_placements or ())
    grads = [e for e in (in_grad or ()) if _is_placements(e)]
    chosen = {}
    for d in free_mesh_dims(entries, outs, grads):
        split = any(
            isinstance(leaf, DTensor) and leaf.placements[d] == Shard(0)
            for leaf, entry in zip(leaves, declared)
            if _is_placements(entry) and entry[d] is None
        )
        chosen[d] = Shard(0) if split else Replicate()

    def resolved(entry: Any) -> Any:
        return resolve_free(entry, chosen) if _is_placements(entry) else entry

    return torch_local_map(
        func,
        # torch reads a tuple as one entry per output: one output's placements go as a list
        out_placements=(
            list(resolved(out_placements))
            if _is_placements(out_placements)
            else tuple(resolved(e) for e in out_placements)
        ),
        in_placements=None if in_placements is None else tuple(resolved(e) for e in declared),
        in_grad_placements=None if in_grad is None else tuple(resolved(e) for e in in_grad),
        device_mesh=mesh,
        redistribute_inputs=True,
    )(*args, **kwargs)


def _caller() -> str:
    frame = sys._getframe(2)  # region() was called from the model's forward
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


# ---------------------------------------------------------------------------- definition


def _define(
    scope: RegionScope,
    func: Callable,
    source: str,
    leaves: list,
    arg_spec: Any,
    kwargs: dict,
    placements: tuple,
    device_mesh: DeviceMesh | None,
) -> LocalMapRegion:
    """The region of this call (shared with an identical earlier call), checked."""
    out_placements, in_placements, in_grad_placements = placements
    mesh = _mesh(scope, device_mesh, source)
    where = f"local_map region at {source}"
    if any(isinstance(v, torch.Tensor) for v in tree_flatten(kwargs)[0]):
        raise LocalMapError(
            f"{where}: pass tensor arguments positionally (a keyword argument is a tensor)"
        )
    inputs = _per_argument(in_placements, leaves, "in_placements", where)
    tensor_positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    in_tensor = tuple(
        _checked(inputs[i], leaves[i], mesh, f"{where}: argument {i}") for i in tensor_positions
    )
    in_grad = None
    if in_grad_placements is not None:
        grads = _per_argument(in_grad_placements, leaves, "in_grad_placements", where)
        in_grad = tuple(
            _checked(grads[i], leaves[i], mesh, f"{where}: gradient of argument {i}")
            for i in tensor_positions
        )
    outputs = _output_placements(out_placements, mesh, where)
    mesh_shape = tuple(mesh.shape)

    def local_inputs(resolved: tuple[Placements, ...]) -> tuple[TensorInfo, ...]:
        infos = []
        for i, placements in zip(tensor_positions, resolved):
            what = f"{where}: argument {i}"
            shape = list(leaves[i].shape)
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, Shard):
                    shape = _sharded(shape, placement.dim, mesh_dim, mesh_shape[mesh_dim], what)
            infos.append(TensorInfo(tuple(shape), leaves[i].dtype))
        return tuple(infos)

    layouts = region_layouts(in_tensor, in_grad, outputs, local_inputs)
    body = functools.partial(func, **kwargs) if kwargs else func
    constants = tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    signature = (
        getattr(func, "__func__", func),
        repr(kwargs),
        repr(constants),
        repr((in_tensor, in_grad, outputs)),
        tuple(layout.local_inputs for layout in layouts),
    )
    key = scope.signatures.get(signature)
    if key is not None:
        return scope.regions[key]
    key = f"{getattr(func, '__qualname__', 'region')}#{len(scope.regions)}@{scope.trace_id}"
    definition = LocalMapRegion(
        key=key,
        func=body,
        source=source,
        arg_spec=arg_spec,
        constants=constants,
        tensor_positions=tensor_positions,
        in_placements=in_tensor,
        in_grad_placements=(
            in_grad if in_grad is not None else tuple(adjoint_placements(p) for p in in_tensor)
        ),
        out_placements=outputs,
        differentiable=tuple(leaves[i].dtype.is_floating_point for i in tensor_positions),
        layouts=layouts,
        free_mesh_dims=free_mesh_dims(in_tensor, outputs, in_grad or ()),
    )
    scope.signatures[signature] = key
    scope.regions[key] = definition
    return definition


def _mesh(scope: RegionScope, device_mesh: DeviceMesh | None, source: str) -> DeviceMesh:
    mesh = scope.mesh
    if mesh is None:
        raise LocalMapError(f"local_map region at {source}: no mesh is being planned for")
    if device_mesh is not None and tuple(device_mesh.shape) != tuple(mesh.shape):
        raise LocalMapError(
            f"local_map region at {source}: device_mesh has shape {tuple(device_mesh.shape)} but "
            f"the model is planned for a mesh of shape {tuple(mesh.shape)}; pass the planning "
            "mesh or leave device_mesh=None"
        )
    return mesh


def _per_argument(given: Any, leaves: list, name: str, where: str) -> tuple:
    if given is None:
        raise LocalMapError(
            f"{where}: {name} is required (one entry per positional argument: placements for "
            "a tensor, None otherwise)"
        )
    given = tuple(given)
    if len(given) != len(leaves):
        raise LocalMapError(
            f"{where}: {name} has {len(given)} entries for {len(leaves)} positional arguments"
        )
    return given


def _is_placements(value: Any) -> bool:
    """One placement (or None: a free mesh dim) per mesh dim."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(p is None or isinstance(p, Placement) for p in value)
    )


def _checked(placements: Any, tensor: torch.Tensor, mesh: DeviceMesh, what: str) -> Placements:
    """``placements`` as a tuple, checked against the mesh and the tensor's global shape."""
    if not _is_placements(placements):
        raise LocalMapError(
            f"{what} is a tensor: give it placements (one Shard/Replicate/Partial per mesh "
            f"dim, or None where the planner may choose), got {placements!r}"
        )
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise LocalMapError(
            f"{what}: {len(placements)} placements for a {mesh.ndim}-D mesh "
            f"({declared_str(placements)})"
        )
    shape = list(tensor.shape)
    for mesh_dim, placement in enumerate(placements):
        if placement is None:  # free: checked per layout (regions/layouts.py)
            continue
        if not isinstance(placement, (Shard, Replicate, Partial)):
            raise LocalMapError(f"{what}: unsupported placement {placement!r}")
        if isinstance(placement, Shard):
            shape = _sharded(shape, placement.dim, mesh_dim, mesh.size(mesh_dim), what)
    return placements


def _sharded(shape: list, dim: int, mesh_dim: int, ranks: int, what: str) -> list:
    """``shape`` with ``dim`` split evenly over ``ranks``, or a LocalMapError saying why not."""
    if not -len(shape) <= dim < len(shape):
        raise LocalMapError(f"{what}: Shard({dim}) on a tensor of {len(shape)} dims ({shape})")
    dim %= len(shape)
    if shape[dim] % ranks:
        raise LocalMapError(
            f"{what}: Shard({dim}) over mesh dim {mesh_dim} ({ranks} ranks) does not divide "
            f"its size {shape[dim]} evenly (local shape so far {tuple(shape)}); a region's "
            "shards must be even"
        )
    return shape[:dim] + [shape[dim] // ranks] + shape[dim + 1 :]


def _output_placements(given: Any, mesh: DeviceMesh, where: str) -> tuple[Placements, ...]:
    if given is None:
        raise LocalMapError(f"{where}: out_placements is required")
    entries = (given,) if _is_placements(given) else tuple(given)
    result = []
    for index, entry in enumerate(entries):
        if not _is_placements(entry) or len(entry) != mesh.ndim:
            raise LocalMapError(
                f"{where}: out_placements entry {index} must be {mesh.ndim} placements (one "
                f"per mesh dim), got {entry!r}"
            )
        result.append(tuple(entry))
    return tuple(result)


# ---------------------------------------------------------------------------- the ops


def _region_of(key: str) -> tuple[LocalMapRegion, RegionScope]:
    scope = scope_of(key)
    if scope is None:
        raise RuntimeError(
            f"local_map region {key!r} is not known here: region ops run only while an "
            "autoparallel model is traced or its parallel module runs"
        )
    return scope.regions[key], scope


def _flat_outputs(region: LocalMapRegion, result: Any) -> list[torch.Tensor]:
    flat, spec = tree_flatten(result)
    where = f"local_map region at {region.source}"
    if not all(isinstance(value, torch.Tensor) for value in flat):
        kinds = ", ".join(type(v).__name__ for v in flat)
        raise LocalMapError(f"{where}: the body must return tensors only, it returned {kinds}")
    if len(flat) != len(region.out_placements):
        raise LocalMapError(
            f"{where}: the body returns {len(flat)} tensors but out_placements has "
            f"{len(region.out_placements)} entries"
        )
    region.out_spec = spec
    return flat


def _global_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> list:
    shape = list(shape)
    for size, placement in zip(mesh_shape, placements):
        if isinstance(placement, Shard):
            shape[placement.dim % len(shape)] *= size
    return shape


@torch.library.custom_op("autoparallel::local_map", mutates_args=())
def _region_forward(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    region, scope = _region_of(key)
    with body_context(scope.mesh, balanced=False):
        result = region.func(*region.arguments(tensors))
    flat = _flat_outputs(region, result)
    inputs = {t.untyped_storage().data_ptr() for t in tensors}
    return [out.clone() if out.untyped_storage().data_ptr() in inputs else out for out in flat]


@_region_forward.register_fake
def _(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    region, scope = _region_of(key)
    if scope.recording:  # planning: global inputs in, global outputs out
        # any layout: a free entry's batch split gives the same global shapes as its
        # replication (see types/regions.py)
        local = region.layouts[0].local_inputs
        tensors = [t.new_empty(info.shape) for t, info in zip(tensors, local)]
    with body_context(scope.mesh, balanced=True):
        flat = _flat_outputs(region, region.func(*region.arguments(tensors)))
    if not scope.recording:
        return [out.new_empty(out.shape) for out in flat]
    mesh_shape = tuple(scope.mesh.shape)
    return [
        out.new_empty(_global_shape(out.shape, p, mesh_shape))
        for out, p in zip(flat, region.layouts[0].out_placements)
    ]


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    key, tensors = inputs
    ctx.key = key
    ctx.save_for_backward(*tensors)
    ctx.outputs = [(out.shape, out.dtype) for out in output]


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    region, _ = _region_of(ctx.key)
    tensors = list(ctx.saved_tensors)
    like = tensors[0]
    filled = [
        g if g is not None else like.new_zeros(shape, dtype=dtype)
        for g, (shape, dtype) in zip(grads, ctx.outputs)
    ]
    input_grads = iter(region_backward_op(ctx.key, tensors, filled))
    return None, [next(input_grads) if d else None for d in region.differentiable]


_region_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("autoparallel::local_map_backward", mutates_args=())
def _region_backward(
    key: str, tensors: list[torch.Tensor], grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    region, scope = _region_of(key)
    with internals.autograd_inside_kernel(), body_context(scope.mesh, balanced=False):
        inputs = [t.detach().requires_grad_(d) for t, d in zip(tensors, region.differentiable)]
        wanted = [t for t in inputs if t.requires_grad]
        outputs = tree_flatten(region.func(*region.arguments(inputs)))[0]
        pairs = [(out, g) for out, g in zip(outputs, grads) if out.requires_grad]
        found: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            found = torch.autograd.grad(
                [out for out, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
    # autograd hands back a view of an incoming gradient where the body only views its
    # argument; a custom op's outputs may not alias its inputs (as in the forward op)
    given = {t.untyped_storage().data_ptr() for t in (*tensors, *grads)}
    return [
        torch.zeros_like(t)
        if g is None
        else (g.clone() if g.untyped_storage().data_ptr() in given else g)
        for g, t in zip(found, wanted)
    ]


@_region_backward.register_fake
def _(key: str, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    region, _ = _region_of(key)
    return [t.new_empty(t.shape) for t, d in zip(tensors, region.differentiable) if d]


region_forward_op = torch.ops.autoparallel.local_map.default
"""The graph's forward op of a region: ``(key, tensors) -> outputs``."""
region_backward_op = torch.ops.autoparallel.local_map_backward.default
"""The graph's backward op: ``(key, tensors, output gradients) -> input gradients``."""
