"""Which edge columns are parameter all-gathers that can overlap compute (prefetch).

:meth:`ShardingOptimizer.apply_prefetch_discount` scales the communication price of these
columns: a forward all-gather of a parameter (FSDP's gather, issued ahead of the layer that
needs it) hides behind the previous layer's compute on a runtime that prefetches.
"""

from __future__ import annotations

import numpy as np
import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from autoparallel.graph.view_ops import parameter_views
from autoparallel.types.costs import EdgeCost
from autoparallel.types.placements import OutputPlacements, is_multi
from autoparallel.types.problem import Problem


def _gathers(src: OutputPlacements, dst: OutputPlacements) -> bool:
    """Shard -> Replicate on some mesh dim (an all-gather)."""
    if is_multi(src) or is_multi(dst):
        return False
    return any(isinstance(s, Shard) and isinstance(d, Replicate) for s, d in zip(src, dst))


def _is_prefetchable(edge: EdgeCost, problem: Problem, sources: dict[fx.Node, str]) -> bool:
    return (
        edge.kind == "arg"
        and edge.consumer in problem.joint.forward_nodes
        and edge.producer in sources
    )


def prefetchable_columns(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(objective columns, comm us) of every forward parameter all-gather pair or step (see
    :meth:`ShardingOptimizer.apply_prefetch_discount`). A pair in a bucket counts with its
    bucketed price (its latency is the bucket's, which is not discounted)."""
    sources = parameter_views(problem.joint)
    columns: list[int] = []
    comm_us: list[float] = []
    for index, edge in enumerate(problem.tables.edges):
        if not _is_prefetchable(edge, problem, sources):
            continue
        for move in problem.edge_moves(index):  # pairs, or the gather steps of routes
            if _gathers(move.src, move.dst):
                columns.append(move.column)
                comm_us.append(move.comm_us)
    return np.array(columns, dtype=np.int64), np.array(comm_us, dtype=np.float64)
