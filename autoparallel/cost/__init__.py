"""Stage 4, cost: per-op compute time, collective time and redistribution time (all in us)."""

from autoparallel.cost.collectives import (
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    reduce_scatter_us,
)
from autoparallel.cost.compute import (
    bytes_moved,
    compute_cost_us,
    copy_cost_us,
    flop_count,
    is_free_op,
)
from autoparallel.cost.redistribution import (
    TRANSITION_COST_US,
    PairPricer,
    direct_redistribution_cost_us,
    redistribution_cost_us,
    redistribution_route,
    transition_cost_us,
)

__all__ = [
    "PairPricer",
    "TRANSITION_COST_US",
    "all_gather_us",
    "all_reduce_us",
    "all_to_all_us",
    "bytes_moved",
    "compute_cost_us",
    "copy_cost_us",
    "direct_redistribution_cost_us",
    "flop_count",
    "is_free_op",
    "redistribution_cost_us",
    "redistribution_route",
    "reduce_scatter_us",
    "transition_cost_us",
]
