"""``with_sharding_constraint``: pin the placement of an intermediate tensor from the model.

Calling ``with_sharding_constraint(x, (Shard(0), Replicate()))`` inside a model's forward
records an ``autoparallel::sharding_constraint`` op in the traced graph. The op is an
identity on values; for planning it means:

* its strategies are the identity ones (output placement = input placement), so any
  redistribution the constraint implies sits on its input edge and is priced like any other;
* :func:`constraints_from_graph` turns every such node into a named constraint forcing its
  output to the given placements (listed by ``sharding_optimizer.constraints()``, shown in
  the verbose log, reported by name if it contradicts another constraint).

The gradient flowing back through the constraint is constrained to the same placements, as
in JAX: a layout chosen for an activation is usually the one wanted for its gradient too.
At run time the executor redistributes the input to the planned placements and passes it
through (no copy). Outside planning (the plain model on one device) the op is a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel.types.placements import placement_str


@torch.library.custom_op("autoparallel::sharding_constraint", mutates_args=())
def _sharding_constraint(
    x: torch.Tensor, placements: str, mesh_shape: Sequence[int]
) -> torch.Tensor:
    return x.clone()


@_sharding_constraint.register_fake
def _(x: torch.Tensor, placements: str, mesh_shape: Sequence[int]) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return sharding_constraint_op(grad, ctx.placements, ctx.mesh_shape), None, None


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _, ctx.placements, ctx.mesh_shape = inputs


_sharding_constraint.register_autograd(_backward, setup_context=_setup_context)

sharding_constraint_op = torch.ops.autoparallel.sharding_constraint.default
"""The ATen-level op the traced graph holds."""


def with_sharding_constraint(
    x: torch.Tensor, placements: Sequence[Placement], mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Force the planner to give ``x`` these placements (and its gradient too).

    Args:
        x: a tensor computed in the model's forward.
        placements: one ``Shard(d)`` / ``Replicate()`` per mesh dimension.
        mesh: the mesh the placements refer to; ``None`` means the mesh being planned for.
            When given, planning checks it has the planning mesh's shape.

    Returns a tensor equal to ``x``. On a DTensor (code already running on DTensors) it is
    simply redistributed.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"with_sharding_constraint expects a tensor, got {type(x).__name__}")
    placements = _checked(placements, x.ndim)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh is not None and len(placements) != mesh.ndim:
        raise ValueError(
            f"with_sharding_constraint: {len(placements)} placements for a {mesh.ndim}-D mesh"
        )
    if isinstance(x, DTensor):
        return x.redistribute(mesh or x.device_mesh, placements)
    mesh_shape = list(mesh.shape) if mesh is not None else []
    return sharding_constraint_op(x, placement_str(placements), mesh_shape)


def _checked(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    if (
        isinstance(placements, Placement)
        or not isinstance(placements, (tuple, list))
        or not placements
    ):
        raise TypeError(
            "with_sharding_constraint: placements must be a non-empty tuple with one Shard/Replicate "
            f"per mesh dimension, e.g. (Shard(0), Replicate()); got {placements!r}"
        )
    checked = []
    for placement in placements:
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                raise ValueError(
                    f"with_sharding_constraint: Shard({placement.dim}) on a {ndim}-D tensor"
                )
            checked.append(Shard(placement.dim % ndim))
        elif isinstance(placement, Replicate):
            checked.append(placement)
        elif isinstance(placement, Partial):
            raise ValueError(
                "with_sharding_constraint: Partial is not a layout a tensor can be constrained to"
            )
        else:
            raise TypeError(
                f"with_sharding_constraint: {placement!r} is not a Shard or Replicate placement"
            )
    return tuple(checked)


# ---------------------------------------------------------------------------- planning


def is_sharding_constraint(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is sharding_constraint_op


def constraint_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [node for node in graph.nodes if is_sharding_constraint(node)]


def requested_placements(
    node: fx.Node, mesh_shape: Sequence[int], where: str = ""
) -> tuple[Placement, ...]:
    """The placements a constraint node asks for, checked against the planning mesh."""
    from autoparallel.types.placements import parse_placements

    _, text, constraint_mesh = node.args
    placements = parse_placements(text)
    if constraint_mesh and tuple(constraint_mesh) != tuple(mesh_shape):
        raise ValueError(
            f"with_sharding_constraint{where} names a mesh of shape {tuple(constraint_mesh)} but the model is "
            f"planned on a mesh of shape {tuple(mesh_shape)}; pass the planning mesh or mesh=None"
        )
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"with_sharding_constraint{where} gives {len(placements)} placements ({text}) but the mesh has "
            f"{len(mesh_shape)} dimensions; give one placement per mesh dimension"
        )
    return placements
