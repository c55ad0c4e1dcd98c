"""The device's figures, timed on the ranks of a live process group (every rank calls each).

Matmuls (one shape on cold caches, and every shape of a grid warm and cold for the profile's
matmul table), the memory bandwidth, the per-op cost of traced graphs (a small transformer
block, a chain of views), AdamW's step on DTensor parameters, and the runtime's own work per
step (the parallel step of a probe model). They are timed with the batches, gaps and
cross-rank reductions of :mod:`autoparallel.calibrate.measure`, which also times the
collectives. Device figures are timed on every rank at once, as training runs them (ranks
share the host's cores and memory on a CPU cluster), and the slowest rank's time counts, as
the slowest rank sets a step's time.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoparallel.calibrate.fit import throughput
from autoparallel.calibrate.measure import (
    PROBE_DTYPE,
    after_gap_us,
    median_us,
    one_call_us,
    slowest_rank,
)
from autoparallel.cost.hardware import Hardware
from autoparallel.runtime.bound_graph import bound_program
from autoparallel.runtime.timing import GraphClock, graph_clock

CACHE_FLUSH_BYTES = 64 << 20
"""Memory every rank writes before each timed matmul, off the clock: in a training step a
matmul's operands were last touched several ops ago (a layer's weights a whole step ago),
not by the same matmul a moment before, as in a loop. ``benchmarks/op_breakdown.py``
compares the matmuls priced on the cold figures with the profiler's times in a real step."""


def _cache_flush(device: torch.device) -> Callable[[], None]:
    buffer = torch.empty(CACHE_FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    return lambda: buffer.fill_(1.0)


def matmul_us(
    dtype: torch.dtype, shape: tuple[int, int, int], repeats: int, device: torch.device
) -> float:
    """Time of an (m x k) @ (k x n) matmul in ``dtype``, ``shape`` = (m, k, n), on cold caches
    (``CACHE_FLUSH_BYTES``; slowest rank)."""
    m, k, n = shape
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    dist.barrier()
    time_us = after_gap_us(lambda: torch.mm(a, b), _cache_flush(device), repeats, device)
    return slowest_rank(time_us, device)


def _each_call_us(
    work: Callable[[], object], before: Callable[[], None], calls: int, device: torch.device
) -> float:
    """The median time of ``calls`` calls of ``work``, each after ``before`` (off the clock),
    after one untimed call; a fixed count, so every rank makes the same calls."""
    before()
    work()
    return statistics.median(one_call_us(work, before, device) for _ in range(calls))


def matmul_grid_us(
    dtype: torch.dtype, dims: tuple[int, ...], calls: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Every (M, K, N) of ``dims`` cubed, N fastest, timed warm (each call right after the
    last) and cold (each call after ``CACHE_FLUSH_BYTES`` of other writes): two lists of
    times (us, slowest rank), in :class:`~autoparallel.cost.matmul_table.MatmulTable`'s
    order."""
    flush = _cache_flush(device)
    warm, cold = [], []
    for m in dims:
        for k in dims:
            for n in dims:
                matmul = functools.partial(
                    torch.mm,
                    torch.randn(m, k, device=device).to(dtype),
                    torch.randn(k, n, device=device).to(dtype),
                )
                dist.barrier()
                pair = (
                    _each_call_us(matmul, lambda: None, calls, device),
                    _each_call_us(matmul, flush, calls, device),
                )
                warm_us, cold_us = (slowest_rank(t, device) for t in pair)
                warm.append(warm_us)
                cold.append(max(cold_us, warm_us))
    return warm, cold


def cache_bytes(device: torch.device) -> float:
    """The cache a matmul's operands must fit in to stay warm between uses: the L2 of one
    CPU core (sysfs) or of the GPU; 1 MiB where the host does not say."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return float(size or 1 << 20)
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
                return float(int(text.rstrip("KM")) * scale)
    except (OSError, ValueError):
        pass
    return float(1 << 20)


def matmul_flops(dtype: torch.dtype, size: int, repeats: int, device: torch.device) -> float:
    """FLOP/s of a ``size``^3 matmul in ``dtype`` on cold caches (slowest rank)."""
    return throughput(2.0 * size**3, matmul_us(dtype, (size, size, size), repeats, device))


def memory_bandwidth(nbytes: int, repeats: int, device: torch.device) -> float:
    """Bytes/s of ``c = a + b`` on buffers of ``nbytes`` (three buffers move; slowest rank)."""
    numel = max(1, nbytes // PROBE_DTYPE.itemsize)
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    c = torch.empty_like(a)
    dist.barrier()
    median = slowest_rank(median_us(lambda: torch.add(a, b, out=c), repeats, device), device)
    return 3.0 * numel * PROBE_DTYPE.itemsize / (median / 1e6)


def _traced_chain_us(
    step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, ops: int, repeats: int
) -> float:
    """Per-op time of ``ops`` applications of ``step``, traced with ``make_fx`` and run as
    ``runtime/local_graph.py`` traces and runs the runtime's graphs (slowest rank)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def chain(value: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            value = step(value)
        return value

    graph = bound_program(make_fx(chain)(x))
    dist.barrier()
    return slowest_rank(median_us(lambda: graph(x), repeats, x.device), x.device) / ops


def _block_joint(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Forward and backward of a small pre-norm transformer block (attention and a gated
    MLP): the mix of ops a training graph is made of."""
    import torch.nn.functional as F

    wq, wk, wv, wo, w1, w2, gain = weights
    batch, seq, dim = x.shape
    heads = 4

    def norm(t: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * gain

    def split_heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, heads, dim // heads).transpose(1, 2)

    y = norm(x)
    q, k, v = (split_heads(F.linear(y, w)) for w in (wq, wk, wv))
    attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = x + F.linear(attention.transpose(1, 2).reshape(batch, seq, dim), wo)
    out = h + F.linear(F.silu(F.linear(norm(h), w1)), w2)
    loss = out.float().pow(2).mean()
    return torch.autograd.grad(loss, (x, *weights))


TINY_BLOCK = (2, 8, 32)
"""(batch, seq, dim) of the block that gives the fixed cost per op: at these shapes the
roofline is a small part of the block's time, so the figure is not the difference of two
similar numbers (at 4 x 32 x 64 the roofline is half the time, and on a shared host such a
residual varies by orders of magnitude from one run to the next)."""

TRAINING_BLOCK = (4, 32, 64)
"""(batch, seq, dim) of the block that gives the memory bandwidth small training ops reach
(activations of tens of KiB, where a CPU runs elementwise ops far below the streaming
bandwidth of the 64 MiB probe)."""


@dataclass(frozen=True)
class TracedBlock:
    """The joint forward+backward graph of a small transformer block on ``shape`` =
    (batch, seq, dim), traced with ``make_fx`` as ``runtime/local_graph.py`` traces the
    runtime's graphs, and the tensors it runs on."""

    shape: tuple[int, int, int]
    graph: fx.GraphModule
    inputs: tuple[torch.Tensor, ...]


def traced_block(shape: tuple[int, int, int], device: torch.device) -> TracedBlock:
    from torch.fx.experimental.proxy_tensor import make_fx

    batch, seq, dim = shape
    generator = torch.Generator().manual_seed(0)
    shapes = [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim), (dim,)]
    weights = [
        (0.1 * torch.randn(shape, generator=generator)).to(device).requires_grad_()
        for shape in shapes
    ]
    x = torch.randn(batch, seq, dim, generator=generator).to(device).requires_grad_()
    inputs = (x, *weights)
    return TracedBlock(shape, make_fx(_block_joint)(*inputs), inputs)


def time_block(block: TracedBlock, repeats: int, device: torch.device) -> float:
    """Median time of one run of ``block``'s graph, run as the runtime runs its graphs
    (slowest rank)."""
    program = bound_program(block.graph)
    dist.barrier()
    with torch.no_grad():
        median = median_us(lambda: program(*block.inputs), repeats, device)
    return slowest_rank(median, device)


def view_op_us(repeats: int, device: torch.device, ops: int = 200) -> float:
    """The cost of one view op (no kernel: the host's dispatch only), traced as above."""

    def step(value: torch.Tensor) -> torch.Tensor:
        return value.view(-1) if value.dim() == 2 else value.view(8, -1)

    return _traced_chain_us(step, torch.ones(8, 8, device=device), ops, repeats)


OPTIMIZER_CHURN_BYTES = 256 << 20
"""Memory every rank writes and frees before each timed optimizer step, off the clock: in
training the forward and backward run between two steps, and their activations push the
optimizer's state out of the caches and the allocator's free memory back to the system, so
the step's temporaries land on fresh pages. Steps timed back to back keep both warm, and
their fixed part per step comes out several times smaller than a training step pays
(``benchmarks/plan_fidelity.py``'s phase split compares the churned price with real steps).
A small model's step, whose state stays in cache, does not pay the churn's fixed part: see
``OPTIMIZER_WARM_CHURN_BYTES``."""


OPTIMIZER_WARM_CHURN_BYTES = 16 << 20
"""The churn before the step of a model whose whole step stays in this much memory: its
optimizer state and the host's own structures stay warm, and the churned step's fixed part
is not paid (``Hardware.optimizer_fixed_us`` interpolates between the two by the plan's
predicted peak)."""


def _memory_churn(device: torch.device, nbytes: int) -> Callable[[], None]:
    def churn() -> None:
        buffer = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        buffer.fill_(1.0)
        del buffer

    return churn


def optimizer_step_us(
    mesh: DeviceMesh,
    tensors: int,
    numel: int,
    repeats: int,
    churn_bytes: int = OPTIMIZER_CHURN_BYTES,
) -> float:
    """One ``AdamW(foreach=True).step()`` over ``tensors`` replicated DTensor parameters of
    ``numel`` elements each, with gradients set: what the runtime's optimizer step runs.
    Every rank writes ``churn_bytes`` off the clock before each timed step."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    device = torch.device(mesh.device_type)
    params = []
    for _ in range(tensors):
        param = torch.nn.Parameter(
            distribute_tensor(torch.ones(numel, device=device), mesh, [Replicate()] * mesh.ndim)
        )
        param.grad = distribute_tensor(
            torch.full((numel,), 1e-3, device=device), mesh, [Replicate()] * mesh.ndim
        )
        params.append(param)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    churn = _memory_churn(device, churn_bytes)

    def churn_then_align() -> None:
        # A step's optimizer starts on every rank at once: the backward ends in a gradient
        # reduction that waits for the last rank. Timed unaligned, one rank's step overlaps
        # another's churn where ranks share cores, which inflates the per-tensor figure
        # several times over.
        churn()
        dist.barrier()

    dist.barrier()
    return slowest_rank(after_gap_us(optimizer.step, churn_then_align, repeats, device), device)


# ------------------------------------------------------------- the runtime's own work


class _Scale(torch.nn.Module):
    """One probe block: a weight of its own, read by a multiply whose result goes through
    a tanh (the backward reads the block's input, its weight and the tanh's output)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight)


class ParameterChain(torch.nn.Module):
    """The runtime probe: ``parameters`` blocks of one weight of ``width`` elements each, in
    a module list, as a model holds one or two parameters per submodule. Its traced graphs
    are a few tiny ops per parameter, so a step of its parallel module is mostly the
    runtime's own work: entering and leaving the forward and the backward, walking the
    modules for the parameters, unwrapping each and wrapping and accumulating its gradient,
    handing the saved tensors to the backward."""

    def __init__(self, parameters: int, width: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Scale(width) for _ in range(parameters))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


@dataclass(frozen=True)
class RuntimeSample:
    """One forward + backward of the probe's parallel module, and its forward alone:
    measured (slowest rank), and how long their traced graphs ran within that time
    (``runtime/timing.graph_clock``): the rest is the module's own work."""

    parameters: int
    measured_us: float
    graphs_us: float
    forward_us: float = 0.0
    forward_graphs_us: float = 0.0

    @property
    def outside_graphs_us(self) -> float:
        return self.measured_us - self.graphs_us

    @property
    def forward_outside_graphs_us(self) -> float:
        return self.forward_us - self.forward_graphs_us


def runtime_step(
    mesh: DeviceMesh, parameters: int, hardware: Hardware, repeats: int, rows: int = 4
) -> RuntimeSample:
    """Plan :class:`ParameterChain` on ``mesh`` with its input and output replicated (every
    rank computes the whole step: no collective), build its parallel module as a user does,
    and time zero_grad + forward + backward, and the forward alone, each with the time its
    graphs ran inside it. (The graphs' measured time is taken off, not their priced time,
    which would leave the op model's error on the probe's tiny ops in the runtime's figure
    and swamp it wherever a forward runs faster than its graphs' price.)"""
    from torch.distributed.tensor import Replicate

    from autoparallel.api import AutoParallel

    device = torch.device(mesh.device_type)
    with torch.device("meta"):
        model = ParameterChain(parameters)
    x = torch.randn(rows, model.blocks[0].weight.numel(), device=device)
    replicated = tuple(Replicate() for _ in range(mesh.ndim))
    with AutoParallel(model, lambda: x, mesh, hardware=hardware) as autop:
        autop.add_input_constraints([replicated])
        autop.add_output_constraints([replicated])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    if plan.totals.comm_us > 0:
        raise RuntimeError(f"the runtime probe's plan communicates ({plan.totals.comm_us:.0f} us)")
    parallel.to_empty(device=device)
    with torch.no_grad():
        for weight in parallel.parameters():
            weight.fill_(1.0)

    def step() -> None:
        for weight in parallel.parameters():
            weight.grad = None
        parallel(x).backward()

    def forward() -> None:  # its autograd graph is dropped unused
        parallel(x)

    dist.barrier()
    with graph_clock(parallel) as clock:
        measured, graphs_us = _with_graph_time(step, clock, repeats, device)
        forward_us, forward_graphs_us = _with_graph_time(forward, clock, repeats, device)
    return RuntimeSample(parameters, measured, graphs_us, forward_us, forward_graphs_us)


def _with_graph_time(
    work: Callable[[], object], clock: GraphClock, repeats: int, device: torch.device
) -> tuple[float, float]:
    """The median time of ``work`` and the part of it its graphs ran (slowest rank each):
    the time outside the graphs is the median of each call's own difference."""
    work()
    clock.take_us()
    totals, outside = [], []
    for _ in range(max(repeats, 5) * 4):
        start = time.perf_counter()
        work()
        elapsed = (time.perf_counter() - start) * 1e6
        totals.append(elapsed)
        outside.append(elapsed - clock.take_us())
    total = slowest_rank(statistics.median(totals), device)
    return total, total - slowest_rank(statistics.median(outside), device)
