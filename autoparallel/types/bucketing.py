"""How the runtime cuts gradient reductions into buckets and packs a bucket's members: shared
by the runtime, which does it (runtime/coalesce.py, runtime/param_gathers.py), and the
solver, which prices it (problem/buckets.py, problem/overlap.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BUCKET_CAP_BYTES = 25 << 20
"""The gradient bytes at which a bucket closes (DDP's default ``bucket_cap_mb``). A larger
flat buffer buys nothing on the wire and costs on the host: on CPU an allocation above
glibc's mmap threshold (32 MiB at most) is fresh pages on every step, whose first touch
runs at a fraction of the memory bandwidth."""


FIRST_BUCKET_CAP_BYTES = 1 << 20
"""Where the first bucket closes (DDP's first bucket is 1 MiB too): the gradients that are
final first go out early, while the rest of the backward runs."""


def capped_buckets(
    members: list[int], sizes: list[int], cap: int, first_cap: int | None = None
) -> list[list[int]]:
    """``members`` in order, cut into runs as DDP cuts its buckets: a run closes with the
    member that brings it to at least ``cap`` bytes (``first_cap`` for the first run;
    ``sizes[i]`` is ``members[i]``'s), so a run holds less than ``cap`` plus its last
    member.

    Closing *after* the member that fills it (not before) lets a large gradient go out as
    soon as it is final rather than wait in a run for the next layer's gradients: the
    reduction then overlaps that layer's backward."""
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, nbytes in zip(members, sizes):
        current.append(index)
        total += nbytes
        limit = first_cap if first_cap is not None and not buckets else cap
        if total >= limit:
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class PackingOps:
    """The host ops the runtime runs for one member of a coalesced collective, besides its
    share of the bucket's own ops (one concatenation into the flat buffer, one split of the
    result): ``views`` only dispatch; each of ``copies`` copies the member's bytes once (the
    gathered full tensor for an all-gather, the local gradient for a reduce-scatter)."""

    views: int
    copies: int


def packing_ops(collective: str, shard_dim: int | None = None) -> PackingOps:
    """What the runtime runs per member of a bucket (``runtime/coalesce.py``,
    ``runtime/param_gathers.py``; ``tests/test_buckets.py`` traces them and checks these
    counts):

    * ``all_reduce``: the gradient flattened into the buffer, its slice of the result viewed
      back;
    * ``reduce_scatter`` to ``Shard(shard_dim)``: the gradient viewed as rank blocks (for
      ``shard_dim`` > 0 moved rank-first and copied), flattened, and its block of the result
      viewed back;
    * ``all_gather`` from ``Shard(shard_dim)``: the shard flattened into the buffer, then its
      slice of the gathered rows viewed as the ranks' pieces (moved to ``shard_dim`` for
      ``shard_dim`` > 0) and copied into the full tensor.
    """
    moved = 1 if shard_dim else 0
    if collective == "all_reduce":
        return PackingOps(views=2, copies=0)
    if collective == "reduce_scatter":
        return PackingOps(views=3 + moved, copies=moved)
    if collective == "all_gather":
        return PackingOps(views=3 + moved, copies=1)
    raise ValueError(f"the runtime coalesces no {collective!r}")


def ranks_per_tensor_dim(shards: Iterable[tuple[int, int]]) -> dict[int, int]:
    """How many ranks split each tensor dim, given ``(ranks, tensor dim)`` for each mesh dim
    of a coalesced move (two mesh dims may split one tensor dim: nested shards). The runtime
    coalesces the move only where these divide the dims evenly, and the solver prices it so."""
    ranks: dict[int, int] = {}
    for size, dim in shards:
        ranks[dim] = ranks.get(dim, 1) * size
    return ranks
