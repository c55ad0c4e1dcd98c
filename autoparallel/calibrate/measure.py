"""Timings on the ranks of a live process group: how a figure is timed, and the collectives.

Every rank calls every function. Collectives are timed per mesh dim as the runtime issues them:
torch's functional collectives (out of place, then waited on; ``_torch_internals``) for
all-gather, reduce-scatter and all-reduce, DTensor's own shard-to-shard move for the
all-to-all (on a CPU mesh DTensor runs it as an all-gather and a chunk copy, and that is what
the runtime pays), and ``batch_isend_irecv`` between neighbours for a pipeline's send-receive, each call after a stretch of compute as a step issues it
(``STEP_GAP_US``), and the mean over ranks counts. The device's figures (matmuls, memory
bandwidth, per-op cost, the optimizer step, the runtime's own work) are in
:mod:`autoparallel.calibrate.measure_device`, timed with the functions here.

Each figure comes from at least ``repeats`` timed calls after one untimed warm-up call (short
calls are repeated more, within a budget; see :func:`median_us`); ranks start each
measurement together (a barrier).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autoparallel import _torch_internals as internals
from autoparallel.calibrate.fit import CollectiveSample
from autoparallel.cost.hardware import SEND_RECV

PROBE_DTYPE = torch.float32
"""The dtype of the probes' buffers (collectives, memory bandwidth)."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_BUDGET_US = 100_000.0  # time a figure may take: short calls are repeated more, up to ...
_MOST_CALLS = 200  # ... this many, so the figure of a noisy 1 KiB collective settles
_BATCHES = 5


def median_us(work: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The time of one call: calls are timed in ``_BATCHES`` batches back to back, and the
    median of the batches' mean counts. A batch's mean is what a training step sees of a
    noisy call (gloo on a busy host is bimodal: most calls fast, some a scheduler tick
    slower); the median over batches drops a batch that a stray process disturbed."""
    per_batch = _calls_per_batch(work, repeats, device)
    means = []
    for _ in range(_BATCHES):
        start = time.perf_counter()
        for _ in range(per_batch):
            work()
        _synchronize(device)
        means.append((time.perf_counter() - start) * 1e6 / per_batch)
    return statistics.median(means)


def _calls_per_batch(
    work: Callable[[], object],
    repeats: int,
    device: torch.device,
    gap: Callable[[], None] | None = None,
) -> int:
    """Make the untimed warm-up call (first-call allocations, lazy initialization), after
    ``gap`` if given, and size the batches by the two within the time budget: every rank
    must make the same number of calls (collectives pair them up), so the count follows the
    slowest rank's warm-up."""
    start = time.perf_counter()
    if gap is not None:
        gap()
    work()
    _synchronize(device)
    first_us = slowest_rank((time.perf_counter() - start) * 1e6, device)
    calls = int(min(_MOST_CALLS, max(repeats, _BUDGET_US // max(first_us, 1.0))))
    return max(1, calls // _BATCHES)


STEP_GAP_US = 1000.0
"""Compute every rank runs before each timed collective call (about this long): a step issues
its collectives between ops, not back to back. Ranks then arrive a little apart (each rank's
compute jitters) and a rank that waited may have let its core go idle, which costs a wake-up
when the data lands; a training step pays both at each collective it waits on, and a loop of
back-to-back calls (ranks in lockstep, never idle) hides both. On a virtual machine with
gloo the two are a large part of a small collective's time, so a fit to back-to-back calls
under-prices every small collective of a plan (``benchmarks/plan_fidelity.py`` shows it)."""


def _gap(device: torch.device, gap_us: float) -> Callable[[], None]:
    """Matmuls of about ``gap_us`` on ``device`` (the same count on every rank)."""
    a = torch.randn(256, 256, device=device)
    start = time.perf_counter()
    for _ in range(4):
        torch.mm(a, a)
    _synchronize(device)
    one_us = slowest_rank((time.perf_counter() - start) * 1e6 / 4, device)
    count = max(1, round(gap_us / max(one_us, 1e-3)))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, a)

    return compute


def _mean_after_gap_us(
    work: Callable[[], object], gap: Callable[[], None], repeats: int, device: torch.device
) -> float:
    """The time of one call of ``work`` issued after ``gap`` on every rank, the gap off the
    clock (``after_gap_us``), averaged over the ranks: for a collective, each rank's wait
    for the last one to arrive is what the step pays beyond its own compute; averaged over
    ranks it is the step's expected share, where the slowest rank's would count one rank's
    bad luck."""
    return mean_over_ranks(after_gap_us(work, gap, repeats, device), device)


def after_gap_us(
    work: Callable[[], object], gap: Callable[[], None], repeats: int, device: torch.device
) -> float:
    """This rank's time of one call of ``work`` issued after ``gap``, the gap off the clock:
    the calls' mean within each of ``_BATCHES`` batches, and the median over batches (as
    ``median_us``)."""
    per_batch = _calls_per_batch(work, repeats, device, gap)
    means = []
    for _ in range(_BATCHES):
        total = sum(one_call_us(work, gap, device) for _ in range(per_batch))
        means.append(total / per_batch)
    return statistics.median(means)


def one_call_us(
    work: Callable[[], object], before: Callable[[], None], device: torch.device
) -> float:
    """One call of ``work`` after ``before``, which runs off the clock."""
    before()
    _synchronize(device)
    start = time.perf_counter()
    work()
    _synchronize(device)
    return (time.perf_counter() - start) * 1e6


def mean_over_ranks(value_us: float, device: torch.device) -> float:
    """The mean of every rank's ``value_us`` (a collective over the whole world)."""
    return _over_ranks(value_us, dist.ReduceOp.SUM, device) / dist.get_world_size()


def slowest_rank(value_us: float, device: torch.device) -> float:
    """The largest of every rank's ``value_us`` (a collective over the whole world)."""
    return _over_ranks(value_us, dist.ReduceOp.MAX, device)


def _over_ranks(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def time_collective(
    collective: str, nbytes: int, mesh: DeviceMesh, mesh_dim: int, repeats: int
) -> CollectiveSample:
    """Time of one ``collective`` along ``mesh_dim`` on a buffer of ``nbytes`` as a step
    pays it: issued after ``STEP_GAP_US`` of compute on every rank (``_mean_after_gap_us``).

    ``nbytes`` is the full buffer in the cost model's convention: the gathered output of an
    all-gather, the unscattered input of a reduce-scatter, the buffer of an all-reduce, each
    rank's local buffer of an all-to-all, the message of a send-receive.
    """
    ranks = mesh.size(mesh_dim)
    device = torch.device(mesh.device_type)
    # a multiple of ranks**2 elements: the all-to-all's [ranks, n] block splits its columns
    numel = max(ranks * ranks, nbytes // PROBE_DTYPE.itemsize // (ranks * ranks) * ranks * ranks)
    full = torch.ones(numel, dtype=PROBE_DTYPE, device=device)
    part = torch.ones(numel // ranks, dtype=PROBE_DTYPE, device=device)
    block = full.view(ranks, numel // ranks)
    calls: dict[str, Callable[[], object]] = {
        "all_gather": lambda: internals.all_gather_rows(part, mesh, mesh_dim),
        "reduce_scatter": lambda: internals.reduce_scatter_sum(full, mesh, mesh_dim),
        "all_reduce": lambda: internals.all_reduce_sum(full, mesh, mesh_dim),
        "all_to_all": lambda: internals.shard_to_shard(block, mesh, mesh_dim),
        SEND_RECV: _exchange(full, mesh, mesh_dim),
    }
    gap = _gap(device, STEP_GAP_US)
    dist.barrier()
    time_us = _mean_after_gap_us(calls[collective], gap, repeats, device)
    return CollectiveSample(collective, ranks, float(numel * PROBE_DTYPE.itemsize), time_us)


def _exchange(buffer: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> Callable[[], None]:
    """One point-to-point exchange of ``buffer`` with this rank's neighbour along
    ``mesh_dim`` (coordinates 0 and 1 pair up, 2 and 3, ...), sent and received at once
    with torch's ``batch_isend_irecv``, as torch.distributed.pipelining passes a stage's
    activations and gradients; a rank without a neighbour (the last of an odd dim) waits."""
    group = mesh.get_group(mesh_dim)
    coordinate, size = mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)
    partner = coordinate ^ 1
    received = torch.empty_like(buffer)
    if partner >= size:
        return lambda: None
    peer = dist.get_global_rank(group, partner)

    def exchange() -> None:
        ops = [
            dist.P2POp(dist.isend, buffer, peer, group),
            dist.P2POp(dist.irecv, received, peer, group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return exchange


@dataclass(frozen=True)
class OverlapSample:
    """One all-reduce and a run of matmuls of about its length, timed apart and together."""

    comm_us: float
    compute_us: float
    both_us: float

    @property
    def fraction(self) -> float:
        """How much of the shorter of the two hid behind the other, within [0, 1]."""
        hidden = self.comm_us + self.compute_us - self.both_us
        return min(1.0, max(0.0, hidden / min(self.comm_us, self.compute_us)))


def overlap(
    nbytes: int, mesh: DeviceMesh, mesh_dim: int, repeats: int, device: torch.device
) -> OverlapSample:
    """An all-reduce of ``nbytes`` along ``mesh_dim`` with matmuls on the host meanwhile,
    issued as the runtime issues a bucket (started, then waited on after the compute): how
    far the collective's threads (gloo) or stream (NCCL) slow the compute down."""
    buffer = torch.ones(nbytes // PROBE_DTYPE.itemsize, dtype=PROBE_DTYPE, device=device)
    a = torch.randn(256, 256, device=device)
    dist.barrier()
    comm_us = slowest_rank(
        median_us(lambda: internals.all_reduce_sum(buffer, mesh, mesh_dim), repeats, device),
        device,
    )
    matmul_us = slowest_rank(median_us(lambda: torch.mm(a, a), repeats, device), device)
    count = max(1, round(comm_us / max(matmul_us, 1e-3)))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, a)

    def both() -> None:
        pending = internals.start_all_reduce_sum(buffer, mesh, mesh_dim)
        compute()
        internals.wait_tensor(pending)

    compute_us = slowest_rank(median_us(compute, repeats, device), device)
    dist.barrier()
    both_us = slowest_rank(median_us(both, repeats, device), device)
    return OverlapSample(comm_us, compute_us, both_us)
