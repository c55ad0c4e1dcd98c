"""``as_strided`` calls that only reshape a contiguous tensor, rewritten as the views they are.

Functionalization turns a view written to in place (Swin's window buffers, a pooler's
``flatten``) into ``as_strided`` reads and ``as_strided_scatter`` writes over the base's
storage. DTensor has no strategy for either (strides say nothing about which dim a shard
runs along), so those nodes would run replicated. Where the strides are the contiguous ones
of the new shape, from offset 0 of a contiguous tensor of as many elements, the op is a
row-major reshape: ``as_strided(x, size, ...)`` is ``x.view(size)``, and an
``as_strided_scatter`` that overwrites every element of its base is ``src.view(base.shape)``.
Rewritten so, every stage after the trace (strategies, cost, the runtime's local graphs)
sees a view it knows how to shard.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.fx as fx

from autoparallel.types.graph import JointGraph

logger = logging.getLogger(__name__)

aten = torch.ops.aten


def rewrite_contiguous_restrides(joint: JointGraph) -> int:
    """Rewrite the graph's contiguous ``as_strided`` / ``as_strided_scatter`` nodes as
    ``view`` nodes in place (same node, same value); returns how many."""
    rewritten = 0
    for node in joint.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.as_strided.default and _reads_whole(node, node.args[0]):
            node.target, node.args, node.kwargs = (
                aten.view.default,
                (node.args[0], list(node.args[1])),
                {},
            )
            rewritten += 1
        elif node.target is aten.as_strided_scatter.default and _writes_whole(node):
            base = node.args[0].meta["val"]
            node.target = aten.view.default
            node.args, node.kwargs = (node.args[1], list(base.shape)), {}
            rewritten += 1
    if rewritten:
        logger.info("%d as_strided node(s) that only reshape rewritten as views", rewritten)
    return rewritten


def _contiguous_strides(size: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(int(extent), 1)
    return strides[::-1]


def _is_row_major(size: Sequence[int], stride: Sequence[int]) -> bool:
    """``stride`` is the contiguous stride of ``size`` (size-1 dims may have any stride)."""
    expected = _contiguous_strides(size)
    return all(int(n) == 1 or int(s) == e for n, s, e in zip(size, stride, expected))


def _static(values: object) -> list[int] | None:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) for v in values):
        return None
    return list(values)


def _reads_whole(node: fx.Node, source: object) -> bool:
    """``node`` (``as_strided(source, size, stride, offset)``) reads all of a contiguous
    ``source`` from offset 0 in row-major order."""
    if not isinstance(source, fx.Node) or not isinstance(source.meta.get("val"), torch.Tensor):
        return False
    value = source.meta["val"]
    size, stride = _static(node.args[1]), _static(node.args[2])
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0)
    return (
        size is not None
        and stride is not None
        and offset in (0, None)
        and value.storage_offset() == 0
        and value.is_contiguous()
        and math.prod(size) == value.numel()
        and _is_row_major(size, stride)
    )


def _writes_whole(node: fx.Node) -> bool:
    """``as_strided_scatter(base, src, size, stride, offset)`` overwrites every element of a
    contiguous ``base`` in row-major order with a contiguous ``src`` of the same dtype."""
    base, src = node.args[0], node.args[1]
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
        return False
    value, written = base.meta.get("val"), src.meta["val"]
    size, stride = _static(node.args[2]), _static(node.args[3])
    offset = node.args[4] if len(node.args) > 4 else node.kwargs.get("storage_offset", 0)
    return (
        isinstance(value, torch.Tensor)
        and size is not None
        and stride is not None
        and offset in (0, None)
        and value.storage_offset() == 0
        and value.is_contiguous()
        and written.is_contiguous()
        and written.dtype == value.dtype
        and list(written.shape) == size
        and math.prod(size) == value.numel()
        and _is_row_major(size, stride)
    )
