"""Ops whose output values do not depend on their tensor inputs' values.

``new_zeros(x, size)``, ``zeros_like(x)``, ``full(size, v)`` and kin read at most their
input's dtype and device, never its values, so their output can be made in any placement
directly, on every rank, without moving anything. DTensor's own strategy for them has the
output follow its input's placement (or be replicated), so a plan could redistribute a
tensor of zeros, or the input it only needed for its dtype: a collective for nothing (the
top-k backward of the mixture-of-experts router all-gathered its zeros over "ep"; under
torch 2.14.1's Inductor the two layers' identical all-gathers were merged into one saved
buffer that the backward then overwrote). The strategy stage offers them every
Shard/Replicate placement with no input edge; the runtime makes each rank's piece.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

_FILLS: dict[object, tuple[int | None, int | None]] = {
    aten.new_zeros: (0, None),
    aten.new_ones: (1, None),
    aten.new_empty: (None, None),
    aten.new_full: (None, 2),
    aten.zeros_like: (0, None),
    aten.ones_like: (1, None),
    aten.empty_like: (None, None),
    aten.full_like: (None, 1),
    aten.zeros: (0, None),
    aten.ones: (1, None),
    aten.empty: (None, None),
    aten.full: (None, 1),
}
"""Each fill op's packet -> (its fixed value, or the position of its fill value in
``node.args``); neither for ``empty``: uninitialized."""


def is_fill(node: fx.Node) -> bool:
    """True for a call of one of the ops above that returns one tensor."""
    packet = getattr(node.target, "overloadpacket", None)
    return (
        node.op == "call_function"
        and packet in _FILLS
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def fill_value(node: fx.Node) -> float | int | bool | None:
    """The value every element of ``node``'s output holds (None: uninitialized, ``empty``)."""
    fixed, position = _FILLS[node.target.overloadpacket]
    if position is None:
        return fixed
    return node.args[position] if len(node.args) > position else node.kwargs["fill_value"]
