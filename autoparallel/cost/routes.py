"""Cheapest routes between the placements of one tensor: shortest paths over single steps.

A redistribution changes a tensor's placement one mesh dim at a time; each step is one
collective (or a free local slice). Which order, and which intermediate placements, decide
the price: all-reducing a Partial over a slow inter-node dim costs several times more than
first slicing it over a fast intra-node dim, all-reducing the smaller shard, then
all-gathering over the fast dim again (the hierarchical all-reduce). So the model prices a
redistribution as the cheapest *route* through the placement states of the tensor, and the
runtime executes that route step by step.

:class:`RouteTable` is that graph for one tensor: its states are every placement tuple over
the values Replicate, Partial(sum) and Shard(d) of each tensor dim; its arcs are the single-
mesh-dim steps, priced by the caller. All-pairs shortest paths (Floyd-Warshall on numpy)
give, for every (source, target) state, the route's communication time, its number of steps
(the tie-breaker) and the next state to visit.

The same arcs let the solver price an edge as a flow through the states instead of one
variable per (source, target) pair (see ``problem/build.py``): with hundreds of placements
per activation on a 3-D mesh, the arcs are an order of magnitude fewer than the pairs.
(Every possible step keeps its arc, even one that lies on no cheapest route: pruning those
arcs leaves a problem the LP solves several times more slowly.)

This module knows nothing about placements or collectives: states are opaque hashable codes
and ``arc_price`` says what a step costs (or None when the step is impossible).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence

import numpy as np

__all__ = ["MAX_ROUTE_STATES", "RouteTable"]

# Above this many states the all-pairs table (n^2 memory, n^3 time) is not worth building:
# e.g. a 4-D tensor on a 4-D mesh has 6^4 = 1296. Callers then price pairs directly.
MAX_ROUTE_STATES = 512

# A route replaces a cheaper-looking one only when it is cheaper by more than rounding noise,
# so that equal routes are resolved the same way on every machine.
_RELATIVE_TOLERANCE = 1e-12


class RouteTable:
    """Shortest routes between all states of ``product(values, repeat=mesh_ndim)``.

    ``arc_price(src_state, dst_state, mesh_dim)`` is the communication time (us) of the step
    that changes only ``mesh_dim``, or None if no collective can make it. Every step also
    costs ``step_tie_breaker`` (the model's per-change tie-breaker), so of two equally fast
    routes the one with fewer steps wins.
    """

    def __init__(
        self,
        values: Sequence[Hashable],
        mesh_ndim: int,
        arc_price: Callable[[tuple, tuple, int], float | None],
        step_tie_breaker: float,
    ):
        self.states: list[tuple] = list(itertools.product(values, repeat=mesh_ndim))
        self.index: dict[tuple, int] = {state: i for i, state in enumerate(self.states)}
        self.step_tie_breaker = step_tie_breaker
        self.arc_src, self.arc_dst, self.arc_comm = self._arcs(values, mesh_ndim, arc_price)
        self.total, self.comm, self.steps, self.next_state = self._all_pairs()

    @staticmethod
    def size_for(num_values: int, mesh_ndim: int) -> int:
        return num_values**mesh_ndim

    @property
    def num_states(self) -> int:
        return len(self.states)

    @property
    def num_arcs(self) -> int:
        return len(self.arc_src)

    def _arcs(
        self, values: Sequence[Hashable], mesh_ndim: int, arc_price
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sources, targets, comms = [], [], []
        for i, state in enumerate(self.states):
            for mesh_dim in range(mesh_ndim):
                for value in values:
                    if value == state[mesh_dim]:
                        continue
                    target = state[:mesh_dim] + (value,) + state[mesh_dim + 1 :]
                    comm = arc_price(state, target, mesh_dim)
                    if comm is None:
                        continue
                    sources.append(i)
                    targets.append(self.index[target])
                    comms.append(float(comm))
        return (
            np.array(sources, dtype=np.int64),
            np.array(targets, dtype=np.int64),
            np.array(comms, dtype=np.float64),
        )

    def _all_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Floyd-Warshall carrying, beside the total, the comm part, the step count and
        the first hop of each best route (for reconstructing it)."""
        n = self.num_states
        total = np.full((n, n), np.inf)
        comm = np.full((n, n), np.inf)
        steps = np.zeros((n, n), dtype=np.int64)
        next_state = np.full((n, n), -1, dtype=np.int64)
        diagonal = np.arange(n)
        total[diagonal, diagonal] = 0.0
        comm[diagonal, diagonal] = 0.0
        next_state[diagonal, diagonal] = diagonal
        arc_total = self.arc_comm + self.step_tie_breaker
        # Several arcs never join the same two states (one mesh dim, one value), so plain
        # assignment is safe.
        total[self.arc_src, self.arc_dst] = arc_total
        comm[self.arc_src, self.arc_dst] = self.arc_comm
        steps[self.arc_src, self.arc_dst] = 1
        next_state[self.arc_src, self.arc_dst] = self.arc_dst
        for k in range(n):
            through = total[:, k : k + 1] + total[k : k + 1, :]
            better = through < total * (1.0 - _RELATIVE_TOLERANCE)
            if not better.any():
                continue
            total = np.where(better, through, total)
            comm = np.where(better, comm[:, k : k + 1] + comm[k : k + 1, :], comm)
            steps = np.where(better, steps[:, k : k + 1] + steps[k : k + 1, :], steps)
            next_state = np.where(better, next_state[:, k : k + 1], next_state)
        return total, comm, steps, next_state

    def price(self, src: int, dst: int) -> tuple[float, float]:
        """(comm us, tie-breaker us) of the best route; comm is inf when there is none."""
        if src == dst:
            return 0.0, 0.0
        return float(self.comm[src, dst]), float(self.steps[src, dst]) * self.step_tie_breaker

    def route(self, src: int, dst: int) -> list[int]:
        """The states of the best route, both ends included; [] when there is none."""
        if not np.isfinite(self.total[src, dst]):
            return []
        path = [src]
        while path[-1] != dst:
            path.append(int(self.next_state[path[-1], dst]))
        return path

    def outgoing(self) -> list[np.ndarray]:
        """Per state, the indices of the arcs leaving it."""
        return _split_by(self.arc_src, self.num_states)

    def incoming(self) -> list[np.ndarray]:
        """Per state, the indices of the arcs entering it."""
        return _split_by(self.arc_dst, self.num_states)


def _split_by(keys: np.ndarray, count: int) -> list[np.ndarray]:
    order = np.argsort(keys, kind="stable")
    bounds = np.searchsorted(keys[order], np.arange(count + 1))
    return [order[bounds[k] : bounds[k + 1]] for k in range(count)]
