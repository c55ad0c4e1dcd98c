"""How the runtime cuts gradient reductions into buckets: shared by the runtime, which cuts
them (runtime/coalesce.py), and the solver, which prices what they overlap with
(solver/overlap.py)."""

from __future__ import annotations

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
