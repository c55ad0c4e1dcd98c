"""Timings taken on the ranks of a live process group (every rank calls every function).

Collectives are timed per mesh dim through torch's public c10d calls on that dim's group
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single``),
the ones the runtime's functional collectives lower to. Device figures are timed on every rank
at once, as training runs them (ranks share the host's cores and memory on a CPU cluster), and
the slowest rank's time counts, as the slowest rank sets a step's time.

Each figure comes from at least ``repeats`` timed calls after one untimed warm-up call (short
calls are repeated more, within a budget; see ``_median_us``); ranks start each measurement
together (a barrier) and report the largest figure of any rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autoparallel.calibrate.fit import CollectiveSample

_ELEMENT = torch.float32


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_BUDGET_US = 100_000.0  # time a figure may take: short calls are repeated more, up to ...
_MOST_CALLS = 200  # ... this many, so the figure of a noisy 1 KiB collective settles
_BATCHES = 5


def _median_us(work: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The time of one call: calls are timed in ``_BATCHES`` batches back to back, and the
    median of the batches' mean counts. A batch's mean is what a training step sees of a
    noisy call (gloo on a busy host is bimodal: most calls fast, some a scheduler tick
    slower); the median over batches drops a batch that a stray process disturbed."""
    start = time.perf_counter()
    work()  # warm-up: first-call allocations, lazy initialization
    _synchronize(device)
    # every rank must make the same number of calls (collectives pair them up): the count
    # follows the slowest rank's warm-up
    first_us = slowest_rank((time.perf_counter() - start) * 1e6, device)
    per_batch = int(min(_MOST_CALLS, max(repeats, _BUDGET_US // max(first_us, 1.0)))) // _BATCHES
    per_batch = max(1, per_batch)
    means = []
    for _ in range(_BATCHES):
        start = time.perf_counter()
        for _ in range(per_batch):
            work()
        _synchronize(device)
        means.append((time.perf_counter() - start) * 1e6 / per_batch)
    return statistics.median(means)


def slowest_rank(value_us: float, device: torch.device) -> float:
    """The largest of every rank's ``value_us`` (a collective over the whole world)."""
    tensor = torch.tensor([value_us], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def time_collective(
    collective: str, nbytes: int, mesh: DeviceMesh, mesh_dim: int, repeats: int
) -> CollectiveSample:
    """Median time of one ``collective`` along ``mesh_dim`` on a buffer of ``nbytes``.

    ``nbytes`` is the full buffer in the cost model's convention: the gathered output of an
    all-gather, the unscattered input of a reduce-scatter, the buffer of an all-reduce, each
    rank's local buffer of an all-to-all.
    """
    group = mesh.get_group(mesh_dim)
    ranks = mesh.size(mesh_dim)
    device = torch.device(mesh.device_type)
    numel = max(ranks, nbytes // _ELEMENT.itemsize // ranks * ranks)
    full = torch.ones(numel, dtype=_ELEMENT, device=device)
    part = torch.ones(numel // ranks, dtype=_ELEMENT, device=device)
    out = torch.empty_like(full)
    # torch 2.13 renamed the *_into_tensor / *_tensor calls to *_single (same signature)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls: dict[str, Callable[[], object]] = {
        "all_gather": lambda: all_gather(out, part, group=group),
        "reduce_scatter": lambda: reduce_scatter(part, full, group=group),
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, full, group=group),
    }
    dist.barrier()
    median = _median_us(calls[collective], repeats, device)
    return CollectiveSample(
        collective, ranks, float(numel * _ELEMENT.itemsize), slowest_rank(median, device)
    )


def matmul_flops(dtype: torch.dtype, size: int, repeats: int, device: torch.device) -> float:
    """FLOP/s of a ``size`` x ``size`` by ``size`` x ``size`` matmul in ``dtype`` (slowest rank)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    dist.barrier()
    median = slowest_rank(_median_us(lambda: torch.mm(a, b), repeats, device), device)
    return 2.0 * size**3 / (median / 1e6)


def memory_bandwidth(nbytes: int, repeats: int, device: torch.device) -> float:
    """Bytes/s of ``c = a + b`` on buffers of ``nbytes`` (three buffers move; slowest rank)."""
    numel = max(1, nbytes // _ELEMENT.itemsize)
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    c = torch.empty_like(a)
    dist.barrier()
    median = slowest_rank(_median_us(lambda: torch.add(a, b, out=c), repeats, device), device)
    return 3.0 * numel * _ELEMENT.itemsize / (median / 1e6)


def op_overhead_us(repeats: int, device: torch.device, ops: int = 200) -> float:
    """The fixed cost of one op as the runtime runs it: a traced local graph (``make_fx``, as
    ``runtime/local_graph.py`` builds them) of ``ops`` additions on 1-element tensors, timed
    whole and divided by ``ops`` (slowest rank)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            x = x + 1
        return x

    x = torch.zeros(1, device=device)
    graph = make_fx(chain)(x)
    dist.barrier()
    return slowest_rank(_median_us(lambda: graph(x), repeats, device), device) / ops
