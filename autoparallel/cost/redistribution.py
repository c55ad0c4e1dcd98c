"""Price of moving a DTensor from one placement tuple to another.

A redistribution is decomposed into one collective per mesh dim whose placement changes:

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

Steps are ordered to keep buffers small: steps that shrink the local tensor (free slices
first, then reduce-scatters) run first, then all-to-alls, then all-reduces (size-neutral),
then all-gathers last. The local size is recomputed with :func:`local_shape` after every
step, so an N-D cost is the sum of per-dim costs on the tensor as it actually is then.

:class:`PairPricer` is the same model for pricing whole edge tables (all pairs of two option
lists of one tensor): integer codes instead of placement objects, memoized local sizes and
pair prices; a test checks it against :func:`redistribution_cost_us` on every pair.
"""

from __future__ import annotations

import math
from typing import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel.cost.collectives import all_gather_us, all_reduce_us, all_to_all_us, reduce_scatter_us
from autoparallel.shapes import TensorInfo, local_info
from autoparallel.topology import Topology

try:  # Strided shards (FSDP+TP) are shard-like but are not Shard subclasses in torch 2.13.
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - depends on the torch version
    _StridedShard = Shard  # type: ignore[misc,assignment]

__all__ = ["TRANSITION_COST_US", "PairPricer", "redistribution_cost_us", "transition_cost_us"]

# Tie-breaker charged per changed mesh dim; real collectives cost >= ~1 us.
TRANSITION_COST_US = 0.01

# Execution phase of each step kind (lower runs first); see the module docstring.
_PHASE = {"slice": 0, "zero": 0, "reduce_scatter": 1, "all_to_all": 2, "all_reduce": 3, "all_gather": 4}


def _is_shard(p: Placement) -> bool:
    return isinstance(p, (Shard, _StridedShard))


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


def _step_cost_us(kind: str, before: TensorInfo, after: TensorInfo, mesh_dim: int, topology: Topology) -> float:
    if kind == "reduce_scatter":
        return reduce_scatter_us(before.nbytes, mesh_dim, topology)
    if kind == "all_to_all":
        return all_to_all_us(before.nbytes, mesh_dim, topology)
    if kind == "all_reduce":
        return all_reduce_us(before.nbytes, mesh_dim, topology)
    if kind == "all_gather":
        return all_gather_us(after.nbytes, mesh_dim, topology)
    return 0.0  # local slice / zero-fill


def redistribution_cost_us(
    tensor: TensorInfo,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    topology: Topology,
) -> float:
    """Time (us) to redistribute the GLOBAL ``tensor`` from ``src`` to ``dst`` placements.

    Identity costs exactly 0.0; a transition into Partial from anything but Replicate
    returns ``math.inf`` so the solver can never pick it.
    """
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
        current[mesh_dim] = target[mesh_dim]
        after = local_info(tensor, current, topology.mesh_shape)
        total += _step_cost_us(kind, before, after, mesh_dim, topology)
    return total


def transition_cost_us(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> float:
    """Tie-breaker: ``TRANSITION_COST_US`` per mesh dim whose placement differs (0 if identical).

    Orders of magnitude below any real collective, so it only decides between plans that
    are otherwise equally priced, in favour of the one with fewer placement changes. Shard
    dims are compared as given (no tensor rank is known here to normalise negatives).
    """
    changed = sum(1 for s, d in zip(src, dst) if s != d) + abs(len(src) - len(dst))
    return TRANSITION_COST_US * changed


class PairPricer:
    """Prices many (src, dst) pairs of one tensor on one topology, fast.

    Why: an edge table on a 3-D mesh has tens of thousands of pairs and the pricing stage
    calls the redistribution model hundreds of thousands of times. This class computes
    exactly what :func:`redistribution_cost_us` and :func:`transition_cost_us` compute (same
    steps, same order, same local sizes, same collective formulas), but on small integer
    codes of the placements, with the local size of every intermediate placement tuple
    memoized. Placements it does not know (strided shards, custom ones) are handed to the
    reference functions, so the contract is: ``price(src, dst)`` equals
    ``(redistribution_cost_us(t, src, dst, topo), transition_cost_us(src, dst))``.
    """

    _REPLICATE = -1

    def __init__(self, tensor: TensorInfo, topology: Topology):
        self.tensor = tensor
        self.topology = topology
        self.mesh_shape = tuple(topology.mesh_shape)
        self.ndim = len(tensor.shape)
        self.itemsize = _itemsize_of(tensor)
        self._nbytes: dict[tuple, float] = {}
        self._codes: dict[tuple, tuple | None] = {}
        self._prices: dict[tuple, tuple[float, float]] = {}
        # per mesh dim: (size, latency us, bytes per us) exactly as collectives._ring_us reads them
        self._links = [
            (n, topology.latency_us(d) if n > 1 else 0.0, topology.bandwidth(d) if n > 1 else 1.0)
            for d, n in enumerate(self.mesh_shape)
        ]

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

    def _local_nbytes(self, codes: tuple) -> float:
        found = self._nbytes.get(codes)
        if found is None:
            shape = list(self.tensor.shape)
            for mesh_size, code in zip(self.mesh_shape, codes):
                if type(code) is int and code >= 0:
                    shape[code] = -(-shape[code] // mesh_size)
            numel = 1
            for size in shape:
                numel *= int(size)
            found = self._nbytes[codes] = numel * self.itemsize
        return found

    def price(self, src: tuple, dst: tuple) -> tuple[float, float]:
        """(comm us, transition us) of ``src -> dst``; comm is ``math.inf`` if impossible."""
        if len(src) != len(self.mesh_shape) or len(dst) != len(self.mesh_shape):
            _validate(src, dst, self.topology)
        a, b = self._code_of(src), self._code_of(dst)
        if a is None or b is None:
            transition = transition_cost_us(src, dst)
            if src == dst:
                return 0.0, transition
            return redistribution_cost_us(self.tensor, src, dst, self.topology), transition
        return self._price_codes(a, b, self._raw_code_of(src), self._raw_code_of(dst))

    def price_table(self, src_options: list, dst_options: list) -> list[tuple[int, int, float, float]]:
        """The feasible ``(i, j, comm us, transition us)`` over all pairs of two option lists
        (identical placements always cost ``(0, 0)``; impossible pairs are left out)."""
        src_codes = [(self._code_of(p), self._raw_code_of(p)) for p in src_options]
        dst_codes = [(self._code_of(p), self._raw_code_of(p)) for p in dst_options]
        pairs = []
        for i, (src, (a, raw_a)) in enumerate(zip(src_options, src_codes)):
            for j, (dst, (b, raw_b)) in enumerate(zip(dst_options, dst_codes)):
                if a is None or b is None:
                    if src == dst:
                        pairs.append((i, j, 0.0, 0.0))
                        continue
                    comm, transition = self.price(src, dst)
                else:
                    if raw_a == raw_b:
                        pairs.append((i, j, 0.0, 0.0))
                        continue
                    comm, transition = self._price_codes(a, b, raw_a, raw_b)
                if comm != math.inf:
                    pairs.append((i, j, comm, transition))
        return pairs

    def _raw_code_of(self, placements: tuple) -> tuple | None:
        """Codes without normalising negative shard dims (the transition tie-breaker compares
        placements as given)."""
        key = ("raw", placements)
        found = self._codes.get(key, False)
        if found is not False:
            return found
        codes = self._code_of(placements)
        if codes is not None:
            codes = tuple(("S", p.dim) if type(p) is Shard else code for p, code in zip(placements, codes))
        self._codes[key] = codes
        return codes

    def _price_codes(self, a: tuple, b: tuple, raw_a: tuple, raw_b: tuple) -> tuple[float, float]:
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
                before = self._local_nbytes(tuple(current))
                current[mesh_dim] = b[mesh_dim]
                after = self._local_nbytes(tuple(current))
                total += self._step_us(kind, before, after, mesh_dim)
        found = self._prices[key] = (total, transition)
        return found

    def _step_us(self, kind: str, before: float, after: float, mesh_dim: int) -> float:
        if kind in ("slice", "zero"):
            return 0.0
        n, latency, bandwidth = self._links[mesh_dim]
        if n == 1:
            return 0.0
        passes = 2 if kind == "all_reduce" else 1
        buffer = after if kind == "all_gather" else before
        steps = passes * (n - 1)
        transfer = passes * (n - 1) / n * max(float(buffer), 0.0) / bandwidth
        return steps * latency + transfer * 1e6


def _itemsize_of(tensor: TensorInfo) -> int:
    numel = tensor.numel
    if numel:
        return tensor.nbytes // numel
    return TensorInfo((1,), tensor.dtype).nbytes


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
