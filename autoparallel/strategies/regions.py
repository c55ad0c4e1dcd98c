"""The strategies of a ``local_map`` region's ops: the placements the region states, one
strategy per layout (each resolution of the mesh dims it leaves free, regions/layouts.py).

The forward op takes the region's tensor arguments in ``in_placements`` and gives its
outputs in ``out_placements``. The backward op takes the same arguments and the outputs'
gradients in the adjoint of ``out_placements`` (see types/regions.py), and gives the
gradients of the floating-point arguments in ``in_grad_placements``. Every other choice
around a region (how its inputs get there, where its outputs go) is the planner's.
"""

from __future__ import annotations

import torch.fx as fx

from autoparallel.regions.local_map import region_backward_op
from autoparallel.types.regions import LocalMapRegion, RegionLayout, adjoint_placements
from autoparallel.types.strategies import Strategy


def region_strategies(node: fx.Node, region: LocalMapRegion) -> list[Strategy]:
    """The strategies of ``node``, one of ``region``'s two ops: one per layout, in
    ``region.layouts`` order (so the cost model prices strategy i from layout i)."""
    return [layout_strategy(node, region, layout) for layout in region.layouts]


def layout_strategy(node: fx.Node, region: LocalMapRegion, layout: RegionLayout) -> Strategy:
    """The strategy of ``node`` when the region runs in ``layout``."""
    if node.target is region_backward_op:
        grads_in = tuple(adjoint_placements(p) for p in layout.out_placements)
        grads_out = tuple(p for p, d in zip(layout.in_grad_placements, region.differentiable) if d)
        return Strategy(output=grads_out, inputs=layout.in_placements + grads_in)
    return Strategy(output=layout.out_placements, inputs=layout.in_placements)
