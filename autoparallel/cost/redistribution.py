"""Price of moving a DTensor from one placement tuple to another.

One *step* changes the placement on one mesh dim and is one collective:

=============  ==================  =================================
src -> dst     collective          buffer it is priced on
=============  ==================  =================================
R -> S         local slice         free
R -> P         local (zeros)       free
P -> S         reduce-scatter      local buffer before the step
S(a) -> S(b)   all-to-all          local buffer before the step
P -> R         all-reduce          local buffer before the step
S -> R         all-gather          local buffer after the step
* -> P         impossible          ``math.inf`` (S -> P, P(op1) -> P(op2))
=============  ==================  =================================

A step on a tensor dim other than 0 also pays the copy that torch's functional collectives
add around it, since collectives move rows of dim 0 (``layout_copy_bytes``): an all-gather
from ``Shard(d)`` re-concatenates the gathered rows along ``d`` (a view instead when every
dim before ``d`` has size 1), a reduce-scatter to ``Shard(d)`` first concatenates the ranks'
blocks of ``d`` along dim 0, and an all-to-all permutes its input and output. The copy is
priced as an op moving those bytes (``cost.compute.copy_cost_us``).

A redistribution is priced as the cheapest *route* of steps (:mod:`autoparallel.cost.routes`),
which may pass through placements that are neither the source nor the target: e.g. a Partial
over a slow mesh dim is cheaper to all-reduce after slicing it over a fast dim, and gather
it there afterwards. The runtime executes the same route (``redistribution_route``). Every
step also costs the tie-breaker ``TRANSITION_COST_US``, so equal routes prefer fewer steps.

Placements outside the route states (strided shards, a Partial other than sum, tensors
whose state space is too large) are priced by the *direct* model instead: one step per
changed mesh dim in a fixed order that keeps buffers small (free slices, reduce-scatters,
all-to-alls, all-reduces, then all-gathers; ``direct_redistribution_cost_us``).

:class:`PairPricer` prices whole edge tables (all pairs of two option lists of one tensor)
on integer codes with memoized local sizes and one route table per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel._torch_internals import StridedShard
from autoparallel.cost.collectives import (
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    reduce_scatter_us,
)
from autoparallel.cost.compute import copy_cost_us
from autoparallel.cost.hardware import COLLECTIVES
from autoparallel.cost.routes import MAX_ROUTE_STATES, RouteTable
from autoparallel.cost.topology import Topology
from autoparallel.types.placements import is_multi
from autoparallel.types.tensors import TensorInfo, local_info

__all__ = [
    "TRANSITION_COST_US",
    "layout_copy_bytes",
    "PairPricer",
    "direct_redistribution_cost_us",
    "redistribution_cost_us",
    "redistribution_route",
    "transition_cost_us",
]

# Tie-breaker charged per changed mesh dim; real collectives cost >= ~1 us.
TRANSITION_COST_US = 0.01

# Execution phase of each step kind (lower runs first); see the module docstring.
_PHASE = {
    "slice": 0,
    "zero": 0,
    "reduce_scatter": 1,
    "all_to_all": 2,
    "all_reduce": 3,
    "all_gather": 4,
}


def _is_shard(p: Placement) -> bool:
    return isinstance(p, (Shard, StridedShard))  # strided shards (FSDP+TP) are not Shard subclasses


def _normalize(p: Placement, ndim: int) -> Placement:
    """Make ``Shard(-1)`` and ``Shard(ndim - 1)`` compare equal."""
    if type(p) is Shard and p.dim < 0 and ndim > 0:
        return Shard(p.dim % ndim)
    return p


def _step_kind(src: Placement, dst: Placement) -> str | None:
    """Name the collective that turns ``src`` into ``dst`` on one mesh dim.

    Returns None for "no change" and ``"impossible"`` for transitions that would have to
    invent a partial sum (anything into a Partial other than from Replicate).
    """
    if src == dst:
        return None
    if isinstance(dst, Partial):
        return "zero" if isinstance(src, Replicate) else "impossible"
    if isinstance(dst, Replicate):
        if isinstance(src, Partial):
            return "all_reduce"
        if _is_shard(src):
            return "all_gather"
    if _is_shard(dst):
        if isinstance(src, Replicate):
            return "slice"
        if isinstance(src, Partial):
            return "reduce_scatter"
        if _is_shard(src):
            return "all_to_all"
    return "impossible"


def _validate(src: Sequence[Placement], dst: Sequence[Placement], topology: Topology) -> None:
    n = len(topology.mesh_shape)
    if len(src) != n or len(dst) != n:
        raise ValueError(
            f"placements must have one entry per mesh dim ({n} for mesh {topology.mesh_shape}); "
            f"got src={tuple(src)}, dst={tuple(dst)}"
        )


def layout_copy_bytes(
    kind: str,
    src_dim: int | None,
    dst_dim: int | None,
    before_shape: Sequence[int],
    before_nbytes: float,
    after_nbytes: float,
) -> float:
    """Bytes read plus written by the copy that surrounds one step's collective when it
    works on a tensor dim other than 0 (0 when it needs none).

    ``src_dim``/``dst_dim`` are the tensor dims sharded on the step's mesh dim before and
    after it (None: not a shard), ``before_shape`` the local shape before it. Collectives
    move rows of dim 0, so (as ``torch.distributed._functional_collectives`` runs them):
    an all-gather from ``Shard(d)``, ``d > 0``, re-concatenates the gathered rows along
    ``d``, a view when every dim before ``d`` has size 1; a reduce-scatter to ``Shard(d)``,
    ``d > 0``, concatenates the ranks' blocks along dim 0 first; an all-to-all between dims
    permutes its input and its output.
    """
    if kind == "all_gather" and src_dim:
        return 2 * after_nbytes if any(size != 1 for size in before_shape[:src_dim]) else 0.0
    if kind == "reduce_scatter" and dst_dim:
        return 2 * before_nbytes
    if kind == "all_to_all" and (src_dim or dst_dim):
        return 2 * (before_nbytes + after_nbytes)
    return 0.0


def _shard_dim(placement: Placement) -> int | None:
    return placement.dim if _is_shard(placement) else None


def _step_cost_us(
    kind: str,
    before: TensorInfo,
    after: TensorInfo,
    src: Placement,
    dst: Placement,
    mesh_dim: int,
    topology: Topology,
) -> float:
    if kind == "reduce_scatter":
        comm = reduce_scatter_us(before.nbytes, mesh_dim, topology)
    elif kind == "all_to_all":
        comm = all_to_all_us(before.nbytes, mesh_dim, topology)
    elif kind == "all_reduce":
        comm = all_reduce_us(before.nbytes, mesh_dim, topology)
    elif kind == "all_gather":
        comm = all_gather_us(after.nbytes, mesh_dim, topology)
    else:
        return 0.0  # local slice / zero-fill
    if topology.mesh_shape[mesh_dim] == 1:
        return comm
    copied = layout_copy_bytes(
        kind, _shard_dim(src), _shard_dim(dst), before.shape, before.nbytes, after.nbytes
    )
    return comm + copy_cost_us(copied, topology.hardware)


def redistribution_cost_us(
    tensor: TensorInfo,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    topology: Topology,
) -> float:
    """Time (us) of the cheapest route from ``src`` to ``dst`` for the GLOBAL ``tensor``.

    Identity costs exactly 0.0; ``math.inf`` when no route exists (a Partial can only be
    reached from Replicate). Builds a route table per call: for many pairs of one tensor use
    :class:`PairPricer`.
    """
    return PairPricer(tensor, topology).price(tuple(src), tuple(dst))[0]


def redistribution_route(
    tensor: TensorInfo,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    topology: Topology,
) -> list[tuple[Placement, ...]]:
    """The placements the cheapest route visits, ``src`` and ``dst`` included (see
    :meth:`PairPricer.route`)."""
    return PairPricer(tensor, topology).route(tuple(src), tuple(dst))


def direct_redistribution_cost_us(
    tensor: TensorInfo,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    topology: Topology,
) -> float:
    """Time (us) of the direct model: one step per changed mesh dim, in the module's fixed
    order. Identity costs exactly 0.0; ``math.inf`` when a step is impossible."""
    _validate(src, dst, topology)
    ndim = len(tensor.shape)
    current = [_normalize(p, ndim) for p in src]
    target = [_normalize(p, ndim) for p in dst]

    steps: list[tuple[int, int, str]] = []
    for mesh_dim, (s, d) in enumerate(zip(current, target)):
        kind = _step_kind(s, d)
        if kind == "impossible":
            return math.inf
        if kind is not None:
            steps.append((_PHASE[kind], mesh_dim, kind))

    total = 0.0
    for _, mesh_dim, kind in sorted(steps):
        before = local_info(tensor, current, topology.mesh_shape)
        src = current[mesh_dim]
        current[mesh_dim] = target[mesh_dim]
        after = local_info(tensor, current, topology.mesh_shape)
        total += _step_cost_us(kind, before, after, src, current[mesh_dim], mesh_dim, topology)
    return total


def transition_cost_us(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> float:
    """Tie-breaker of the direct model: ``TRANSITION_COST_US`` per mesh dim whose placement
    differs (0 if identical); a route's tie-breaker is ``TRANSITION_COST_US`` per step.

    Orders of magnitude below any real collective, so it only decides between plans that
    are otherwise equally priced, in favour of the one with fewer placement changes. Shard
    dims are compared as given (no tensor rank is known here to normalise negatives).
    """
    changed = sum(1 for s, d in zip(src, dst) if s != d) + abs(len(src) - len(dst))
    return TRANSITION_COST_US * changed


class PairPricer:
    """Prices many (src, dst) pairs of one tensor on one topology, fast.

    Why: an edge table on a 3-D mesh has tens of thousands of pairs and the pricing stage
    asks hundreds of thousands of prices. Placements are turned into small integer codes
    (int >= 0: Shard(dim), -1: Replicate, ("P", op): Partial); the tensor's route table is
    built once, on first use. Contract: ``price(src, dst)`` is (comm us of the cheapest route,
    ``TRANSITION_COST_US`` per step of it) when both are route states, else the direct
    model's ``(direct_redistribution_cost_us, transition_cost_us)``.
    """

    _REPLICATE = -1
    _PARTIAL_SUM = ("P", "sum")

    def __init__(self, tensor: TensorInfo, topology: Topology):
        self.tensor = tensor
        self.topology = topology
        self.mesh_shape = tuple(topology.mesh_shape)
        self.ndim = len(tensor.shape)
        self.itemsize = _itemsize_of(tensor)
        self._nbytes: dict[tuple, float] = {}
        self._shapes: dict[tuple, tuple[int, ...]] = {}
        self._codes: dict[tuple, tuple | None] = {}
        self._prices: dict[tuple, tuple[float, float]] = {}
        self._routes: RouteTable | None | bool = False  # False: not built yet
        self._states: dict[object, int | None] = {}
        self._placements: dict[int, tuple[Placement, ...]] = {}  # placements_of_state's
        # per mesh dim and collective: (size, latency us, bytes per s) exactly as
        # collectives._ring_us reads them
        self._links = [
            {
                kind: (
                    n,
                    topology.latency_us(d, kind) if n > 1 else 0.0,
                    topology.bandwidth(d, kind) if n > 1 else 1.0,
                )
                for kind in COLLECTIVES
            }
            for d, n in enumerate(self.mesh_shape)
        ]

    # ------------------------------------------------------------------ routes

    @property
    def routes(self) -> RouteTable | None:
        """The tensor's route table, or None when its state space is too large."""
        if self._routes is False:
            values = [self._REPLICATE, self._PARTIAL_SUM, *range(self.ndim)]
            if RouteTable.size_for(len(values), len(self.mesh_shape)) > MAX_ROUTE_STATES:
                self._routes = None
            else:
                self._routes = RouteTable(
                    values, len(self.mesh_shape), self._arc_price, TRANSITION_COST_US
                )
        return self._routes  # type: ignore[return-value]

    def _arc_price(self, src: tuple, dst: tuple, mesh_dim: int) -> float | None:
        kind = _code_step(src[mesh_dim], dst[mesh_dim])
        if kind == "impossible":
            return None
        return self._step_us(kind, src, dst, mesh_dim)

    def state_of(self, placements: object) -> int | None:
        """Index of ``placements`` among the route states; None if it is not one."""
        if placements in self._states:
            return self._states[placements]
        state = None
        if (
            isinstance(placements, tuple)
            and len(placements) == len(self.mesh_shape)
            and not is_multi(placements)
        ):
            routes = self.routes
            codes = self._code_of(placements)
            if routes is not None and codes is not None:
                state = routes.index.get(codes)
        self._states[placements] = state
        return state

    def placements_of_state(self, state: int) -> tuple[Placement, ...]:
        found = self._placements.get(state)
        if found is None:
            codes = self.routes.states[state]  # type: ignore[union-attr]
            found = self._placements[state] = tuple(_placement_of_code(code) for code in codes)
        return found

    def route(self, src: tuple, dst: tuple) -> list[tuple[Placement, ...]]:
        """Placements visited from ``src`` to ``dst`` (both included, as given): each step
        changes one mesh dim. ``[src, dst]`` for the direct model or a one-step route; ``[]``
        when ``dst`` cannot be reached."""
        a, b = self.state_of(src), self.state_of(dst)
        if a is None or b is None:
            direct = self.price(src, dst)[0]
            return [] if direct == math.inf else ([src] if src == dst else [src, dst])
        if a == b:
            return [src]
        states = self.routes.route(a, b)  # type: ignore[union-attr]
        if not states:
            return []
        return [src] + [self.placements_of_state(s) for s in states[1:-1]] + [dst]

    # ------------------------------------------------------------------ prices

    def _code_of(self, placements: tuple) -> tuple | None:
        found = self._codes.get(placements, False)
        if found is not False:
            return found
        codes: list = []
        for p in placements:
            kind = type(p)
            if kind is Shard:
                codes.append(p.dim % self.ndim if p.dim < 0 and self.ndim > 0 else p.dim)
            elif kind is Replicate:
                codes.append(self._REPLICATE)
            elif kind is Partial:
                codes.append(("P", p.reduce_op))
            else:
                self._codes[placements] = None
                return None
        result = tuple(codes)
        self._codes[placements] = result
        return result

    def _local_shape(self, codes: tuple) -> tuple[int, ...]:
        found = self._shapes.get(codes)
        if found is None:
            shape = [int(size) for size in self.tensor.shape]
            for mesh_size, code in zip(self.mesh_shape, codes):
                if type(code) is int and code >= 0:
                    shape[code] = -(-shape[code] // mesh_size)
            found = self._shapes[codes] = tuple(shape)
        return found

    def _local_nbytes(self, codes: tuple) -> float:
        found = self._nbytes.get(codes)
        if found is None:
            found = self._nbytes[codes] = math.prod(self._local_shape(codes)) * self.itemsize
        return found

    def price(self, src: tuple, dst: tuple) -> tuple[float, float]:
        """(comm us, tie-breaker us) of ``src -> dst``; comm is ``math.inf`` if impossible."""
        if len(src) != len(self.mesh_shape) or len(dst) != len(self.mesh_shape):
            _validate(src, dst, self.topology)
        a, b = self.state_of(src), self.state_of(dst)
        if a is not None and b is not None:
            return self.routes.price(a, b)  # type: ignore[union-attr]
        return self._direct_price(src, dst)

    def _direct_price(self, src: tuple, dst: tuple) -> tuple[float, float]:
        if src == dst:
            return 0.0, 0.0
        a, b = self._code_of(src), self._code_of(dst)
        if a is None or b is None:
            return direct_redistribution_cost_us(
                self.tensor, src, dst, self.topology
            ), transition_cost_us(src, dst)
        return self._price_codes(a, b, self._raw_code_of(src), self._raw_code_of(dst))

    def price_table(
        self, src_options: list, dst_options: list
    ) -> list[tuple[int, int, float, float]]:
        """The feasible ``(i, j, comm us, tie-breaker us)`` over all pairs of two option lists
        (identical placements always cost ``(0, 0)``; impossible pairs are left out)."""
        src_states = [self.state_of(p) for p in src_options]
        dst_states = [self.state_of(p) for p in dst_options]
        if None not in src_states and None not in dst_states and src_options and dst_options:
            return self._prices_from_routes(src_states, dst_states)
        pairs = []
        for i, src in enumerate(src_options):
            for j, dst in enumerate(dst_options):
                comm, transition = self.price(src, dst)
                if comm != math.inf:
                    pairs.append((i, j, comm, transition))
        return pairs

    def _prices_from_routes(
        self, src_states: list, dst_states: list
    ) -> list[tuple[int, int, float, float]]:
        routes = self.routes
        assert routes is not None
        rows = np.asarray(src_states, dtype=np.int64)[:, None]
        cols = np.asarray(dst_states, dtype=np.int64)[None, :]
        same = rows == cols
        comm = np.where(same, 0.0, routes.comm[rows, cols])
        transition = np.where(same, 0.0, routes.steps[rows, cols] * routes.step_tie_breaker)
        i, j = np.nonzero(np.isfinite(comm))
        return list(zip(i.tolist(), j.tolist(), comm[i, j].tolist(), transition[i, j].tolist()))

    def _raw_code_of(self, placements: tuple) -> tuple | None:
        """Codes without normalising negative shard dims (the direct tie-breaker compares
        placements as given)."""
        key = ("raw", placements)
        found = self._codes.get(key, False)
        if found is not False:
            return found
        codes = self._code_of(placements)
        if codes is not None:
            codes = tuple(
                ("S", p.dim) if type(p) is Shard else code for p, code in zip(placements, codes)
            )
        self._codes[key] = codes
        return codes

    def _price_codes(self, a: tuple, b: tuple, raw_a: tuple, raw_b: tuple) -> tuple[float, float]:
        """The direct model on codes."""
        key = (a, b, raw_a, raw_b)
        found = self._prices.get(key)
        if found is not None:
            return found
        changed = 0
        for s, d in zip(raw_a, raw_b):
            if s != d:
                changed += 1
        transition = TRANSITION_COST_US * changed
        steps = []
        impossible = False
        for mesh_dim, (s, d) in enumerate(zip(a, b)):
            if s == d:
                continue
            kind = _code_step(s, d)
            if kind == "impossible":
                impossible = True
                break
            steps.append((_PHASE[kind], mesh_dim, kind))
        total = math.inf
        if not impossible:
            current = list(a)
            total = 0.0
            for _, mesh_dim, kind in sorted(steps):
                before = tuple(current)
                current[mesh_dim] = b[mesh_dim]
                total += self._step_us(kind, before, tuple(current), mesh_dim)
        found = self._prices[key] = (total, transition)
        return found

    def _step_us(self, kind: str, src: tuple, dst: tuple, mesh_dim: int) -> float:
        """One step from codes ``src`` to ``dst`` (they differ on ``mesh_dim`` only):
        the collective as ``collectives._ring_us`` prices it, plus its layout copy."""
        if kind in ("slice", "zero"):
            return 0.0
        n, latency, bandwidth = self._links[mesh_dim][kind]
        if n == 1:
            return 0.0
        before, after = self._local_nbytes(src), self._local_nbytes(dst)
        passes = 2 if kind == "all_reduce" else 1
        buffer = after if kind == "all_gather" else before
        steps = passes * (n - 1)
        transfer = passes * (n - 1) / n * max(float(buffer), 0.0) / bandwidth
        copied = layout_copy_bytes(
            kind,
            _code_dim(src[mesh_dim]),
            _code_dim(dst[mesh_dim]),
            self._local_shape(src),
            before,
            after,
        )
        return steps * latency + transfer * 1e6 + copy_cost_us(copied, self.topology.hardware)


def _placement_of_code(code: object) -> Placement:
    if code == PairPricer._REPLICATE:
        return Replicate()
    if type(code) is tuple:
        return Partial(code[1])
    return Shard(int(code))  # type: ignore[arg-type]


def _itemsize_of(tensor: TensorInfo) -> int:
    numel = tensor.numel
    if numel:
        return tensor.nbytes // numel
    return TensorInfo((1,), tensor.dtype).nbytes


def _code_dim(code: object) -> int | None:
    """The tensor dim a code shards (None for Replicate and Partial)."""
    return code if type(code) is int and code >= 0 else None


def _code_step(s: object, d: object) -> str:
    """``_step_kind`` on codes: int >= 0 is Shard(dim), -1 Replicate, ("P", op) Partial."""
    if type(d) is tuple:
        return "zero" if s == PairPricer._REPLICATE else "impossible"
    if d == PairPricer._REPLICATE:
        return "all_reduce" if type(s) is tuple else "all_gather"
    if s == PairPricer._REPLICATE:
        return "slice"
    if type(s) is tuple:
        return "reduce_scatter"
    return "all_to_all"
