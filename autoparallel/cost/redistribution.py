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

__all__ = ["TRANSITION_COST_US", "redistribution_cost_us", "transition_cost_us"]

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
