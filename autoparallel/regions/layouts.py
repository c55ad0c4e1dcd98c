"""A region's layouts: its declared placements with every free mesh dim resolved.

A ``None`` in a region's placements leaves that mesh dim to the planner (see
:class:`~autoparallel.types.regions.LocalMapRegion`): per free mesh dim, all its ``None``
entries become ``Shard(0)`` together (the body's batch split over that dim) or
``Replicate()`` together (every rank along it runs the whole body). Each combination whose
shards divide the arguments evenly is a :class:`RegionLayout`, a strategy of the region's
ops; the planner prices each from the body's profile at its local shapes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autoparallel.types.placements import Placements, placement_str
from autoparallel.types.regions import RegionLayout, adjoint_placements
from autoparallel.types.tensors import TensorInfo

FREE_CHOICES: tuple[Placement, ...] = (Shard(0), Replicate())
"""What a free entry may become, in the order the layouts list them."""

Declared = tuple  # placements, one per mesh dim, None where free


def free_mesh_dims(*groups: Sequence[Declared]) -> tuple[int, ...]:
    """The mesh dims with a ``None`` entry in any declared placements of ``groups``."""
    return tuple(
        sorted(
            {
                d
                for group in groups
                for placements in group
                for d, p in enumerate(placements)
                if p is None
            }
        )
    )


def region_layouts(
    in_placements: Sequence[Declared],
    in_grad_placements: Sequence[Declared] | None,
    out_placements: Sequence[Declared],
    local_inputs: Callable[[tuple[Placements, ...]], tuple[TensorInfo, ...]],
) -> tuple[RegionLayout, ...]:
    """Every resolution of the free mesh dims whose shards divide the arguments evenly, the
    all-``Shard(0)`` one first. ``in_grad_placements`` None: each gradient lies as the
    adjoint of its argument. ``local_inputs`` gives the arguments' local shapes under
    resolved placements, or raises a ValueError saying why they do not divide; the first
    one is raised when no layout is left."""
    groups = [in_placements, out_placements] + ([in_grad_placements] if in_grad_placements else [])
    free = free_mesh_dims(*groups)
    layouts, first_error = [], None
    for combination in itertools.product(FREE_CHOICES, repeat=len(free)):
        chosen = dict(zip(free, combination))
        resolved_in = tuple(resolve_free(p, chosen) for p in in_placements)
        try:
            local = local_inputs(resolved_in)
        except ValueError as error:
            first_error = first_error or error
            continue
        if in_grad_placements is None:
            grads = tuple(adjoint_placements(p) for p in resolved_in)
        else:
            grads = tuple(_grad(g, p) for g, p in zip(in_grad_placements, resolved_in))
        layouts.append(
            RegionLayout(
                in_placements=resolved_in,
                in_grad_placements=grads,
                out_placements=tuple(resolve_free(p, chosen) for p in out_placements),
                local_inputs=local,
                free=tuple((d, _short(p)) for d, p in chosen.items()),
            )
        )
    if not layouts:
        assert first_error is not None
        raise first_error
    return tuple(layouts)


def resolve_free(placements: Declared, chosen: dict[int, Placement]) -> Placements:
    """``placements`` with each free entry the placement ``chosen`` for its mesh dim."""
    return tuple(chosen[d] if p is None else p for d, p in enumerate(placements))


def _grad(declared: Declared, argument: Placements) -> Placements:
    """A declared gradient placement with each free entry the adjoint of its argument's."""
    adjoint = adjoint_placements(argument)
    return tuple(adjoint[d] if p is None else p for d, p in enumerate(declared))


def _short(placement: Placement) -> str:
    return "S(0)" if isinstance(placement, Shard) else "R"


def declared_str(placements: Declared) -> str:
    """Compact notation of declared placements, ``*`` on a free mesh dim: ``*S(0)``."""
    return "".join("*" if p is None else placement_str((p,)) for p in placements)
