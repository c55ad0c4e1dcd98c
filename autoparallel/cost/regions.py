"""The time of a ``local_map`` region's ops on one rank, from its body's profile.

A region's node has one strategy per layout (regions/layouts.py), each priced from the
body's profile at that layout's local shapes: the roofline time of
each ATen op its body ran on local shapes (cost/compute.py) plus each collective it issued
(cost/collectives.py) on the mesh dim it named. The backward op re-runs the forward, so its
price includes the forward's ops and collectives again. The collectives are charged inside
the node's compute time (the plan's comm totals cover redistributions between nodes).
"""

from __future__ import annotations

from autoparallel.cost.collectives import (
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    reduce_scatter_us,
)
from autoparallel.cost.compute import compute_cost_us
from autoparallel.cost.topology import Topology
from autoparallel.types.regions import CollectiveRecord, OpRecord, RegionLayout

_COLLECTIVE_PRICES = {
    "all_to_all": all_to_all_us,
    "all_gather": all_gather_us,
    "reduce_scatter": reduce_scatter_us,
    "all_reduce": all_reduce_us,
}


def region_cost_us(layout: RegionLayout, backward: bool, topology: Topology) -> float:
    """Time of a region's forward op (``backward`` False) or backward op on one rank, run
    in ``layout``."""
    return sum(region_cost_parts_us(layout, backward, topology))


def region_cost_parts_us(
    layout: RegionLayout, backward: bool, topology: Topology
) -> tuple[float, float]:
    """(ops, collectives) of :func:`region_cost_us`: what the body computes and what its own
    collectives take, apart (for the plan's report)."""
    profile = layout.profile
    if profile is None:
        return 0.0, 0.0
    ops, collectives = (
        (profile.backward_ops, profile.backward_collectives)
        if backward
        else (profile.forward_ops, profile.forward_collectives)
    )
    return _ops_us(ops, topology), _collectives_us(collectives, topology)


def _ops_us(ops: tuple[OpRecord, ...], topology: Topology) -> float:
    return sum(
        compute_cost_us(op.op, op.args, op.kwargs, op.output, topology.hardware) for op in ops
    )


def _collectives_us(collectives: tuple[CollectiveRecord, ...], topology: Topology) -> float:
    return sum(_COLLECTIVE_PRICES[c.kind](c.nbytes, c.mesh_dim, topology) for c in collectives)
