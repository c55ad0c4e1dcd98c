"""Placement notation: the seed's compact text form of DTensor placements, both ways.

A placement tuple lists one DTensor placement per mesh dimension, in mesh-dim order:
``(Shard(0), Replicate())`` is written ``S(0)R``. A node with several tensor outputs has one
tuple per output (``OutputPlacements``). :func:`placement_str` writes the notation and
:func:`parse_placements` reads it back; :func:`validate_placements` checks a user's tuple
against the mesh before any work is done with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

Placements = tuple[Placement, ...]
# A node with several tensor outputs (e.g. attention returning (out, logsumexp)) has one
# Placements per output; None where that output is not a tensor.
OutputPlacements = Placements | tuple[Placements | None, ...]

_TOKEN = re.compile(r"S\((-?\d+)\)|R|P\((\w+)\)")


class PlacementSyntaxError(ValueError):
    """Text that is not placements in the seed's notation (``S(0)R``, ``RS(1)``, ``P(sum)``)."""


def placement_str(placements: OutputPlacements | None) -> str:
    """The seed's compact notation: ``S(0)R``, ``P(sum)``, tuples joined by ', '."""
    if placements is None:
        return "-"
    if placements and isinstance(placements[0], tuple) or (placements and placements[0] is None):
        return "(" + ", ".join(placement_str(p) for p in placements) + ")"
    return "".join(_one(p) for p in placements)


def _one(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return f"P({placement.reduce_op})"
    return str(placement)


def is_multi(placements: OutputPlacements | None) -> bool:
    return bool(placements) and (isinstance(placements[0], tuple) or placements[0] is None)


def parse_placements(text: str) -> Placements:
    """``"S(0)R"`` -> ``(Shard(0), Replicate())``; inverse of placement_str."""

    placements = []
    position = 0
    for match in _TOKEN.finditer(text):
        if match.start() != position:
            break
        position = match.end()
        if match.group(1) is not None:
            placements.append(Shard(int(match.group(1))))
        elif match.group(2) is not None:
            placements.append(Partial(match.group(2)))
        else:
            placements.append(Replicate())
    if position != len(text) or not placements:
        raise PlacementSyntaxError(
            f"cannot read placements {text!r}: expected e.g. 'S(0)R' or 'RS(1)'"
        )
    return tuple(placements)


def validate_placements(placements: Sequence, mesh_ndim: int, what: str) -> Placements:
    """Check one placement tuple against the mesh before any work is done with it."""

    if isinstance(placements, Placement) or not isinstance(placements, (tuple, list)):
        raise TypeError(
            f"{what}: expected a tuple of {mesh_ndim} placements (one per mesh dimension), got {placements!r}"
        )
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{what}: {len(placements)} placements given for a {mesh_ndim}-D mesh; give one per mesh "
            f"dimension, in mesh-dim order, e.g. {(Shard(0),) + (Replicate(),) * (mesh_ndim - 1)}"
        )
    for placement in placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise TypeError(
                f"{what}: {placement!r} is not supported here; use Shard(dim) or Replicate()"
            )
    return tuple(placements)


def check_shard_dims(placements: Placements, ndim: int, what: str) -> None:

    for placement in placements:
        if isinstance(placement, Shard) and not -ndim <= placement.dim < ndim:
            raise ValueError(
                f"{what}: Shard({placement.dim}) is out of range for a {ndim}-D tensor"
            )
