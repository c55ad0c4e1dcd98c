"""The vocabulary-parallel embedding lookup, run by the executor on local pieces.

DTensor's rowwise embedding strategy shards the table's rows and marks both the token ids
and the looked-up rows with a ``_MaskPartial`` placement. Redistributing the ids into it
records, inside that placement object, which ids fall outside this rank's rows; the one
reduction of the result applies that mask and releases it. That lifecycle suits DTensor's
eager dispatch, not the executor:

- the executor redistributes into the *plan's* placement object, while DTensor's dispatch
  matches inputs against placement objects of its own (``_MaskPartial`` equality includes
  the mask's identity), so the mask ends up where the reduction never looks;
- the executor reduces a value once per consumer (an RMSNorm reads the embedding twice),
  and a mask serves one reduction.

So the executor runs such a lookup itself (:func:`masked_lookup`): the ids stay replicated
on the masked mesh dims, each rank looks up the ids that fall in its rows and zeroes the
others, and the result is a plain ``Partial(sum)``, exact under any number of reductions.
The collectives are those the plan priced: ``Replicate -> _MaskPartial`` is free, and the
result's reductions are a Partial's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from autoparallel import _torch_internals as internals
from autoparallel.types.placements import is_multi
from autoparallel.types.tensors import local_offset_at, local_shape_at

aten = torch.ops.aten


@dataclass(frozen=True)
class RowRange:
    """The table rows this rank holds: ``start`` to ``start + rows`` of the global table."""

    start: int
    rows: int

    def __call__(self, weight: torch.Tensor, ids: torch.Tensor, *_: Any) -> torch.Tensor:
        return masked_lookup(weight, ids, self)


def masked_lookup(weight: torch.Tensor, ids: torch.Tensor, held: RowRange) -> torch.Tensor:
    """This rank's share of ``embedding(table, ids)``: the rows of ids in ``held`` (``weight``
    is this rank's piece of the table), zeros for the others. Summed over the ranks that split
    the rows, the shares are the lookup. ``embedding``'s other arguments only shape its
    backward, which the joint graph holds as its own node."""
    if held.rows == 0:  # an uneven split left this rank no rows
        return weight.new_zeros((*ids.shape, weight.shape[-1]))
    outside = (ids < held.start) | (ids >= held.start + held.rows)
    local_ids = (ids - held.start).masked_fill(outside, 0)
    return aten.embedding.default(weight, local_ids).masked_fill(outside.unsqueeze(-1), 0)


def masks_ids(ids_placements: Sequence[Any] | None) -> bool:
    """Whether a lookup's ids are marked ``_MaskPartial`` on some mesh dim: a
    vocabulary-parallel lookup."""
    return any(internals.is_mask_partial(p) for p in ids_placements or ())


def held_rows(
    node: fx.Node, weight_placements: Sequence, mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> RowRange:
    """The rows of ``node``'s table (its first argument) this rank holds under
    ``weight_placements``."""
    shape = tuple(node.args[0].meta["val"].shape)
    start = local_offset_at(shape, weight_placements, mesh_shape, coordinate)[0]
    rows = local_shape_at(shape, weight_placements, mesh_shape, coordinate)[0]
    return RowRange(start, rows)


def plain_partials(placements: Any) -> Any:
    """``placements`` with every ``_MaskPartial`` read as the ``Partial`` it is once masked
    (one placement tuple, several outputs' tuples, or None)."""
    if placements is None:
        return None
    if is_multi(placements):
        return tuple(plain_partials(p) for p in placements)
    return tuple(Partial(p.reduce_op) if internals.is_mask_partial(p) else p for p in placements)


def unmasked_ids(placements: Sequence) -> tuple:
    """The ids' placements the lookup reads: replicated where the plan marks them masked."""
    return tuple(Replicate() if internals.is_mask_partial(p) else p for p in placements)
