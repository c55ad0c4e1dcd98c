"""Alpha-beta (latency-bandwidth) costs of ring collectives along one mesh dimension.

Model: a ring collective over ``n`` ranks runs ``n - 1`` steps; each step pays the link
latency once (alpha) and every rank pushes ``1/n`` of the full buffer over its one-direction
link (beta). Summed over steps this gives the textbook bus-bandwidth factors NCCL reports:
``(n-1)/n`` for all-gather / reduce-scatter and ``2(n-1)/n`` for all-reduce (reduce-scatter
followed by all-gather, hence also twice the latency steps).

All-to-all is priced as ``n - 1`` pairwise exchanges: each rank sends ``(n-1)/n`` of its
local buffer, and we charge one latency per peer. NCCL overlaps those sends, so this latency
term is conservative; it is deliberately the same shape as the ring's so that the solver
does not see all-to-all as free for small tensors.

Arguments are byte counts (floats are fine); results are microseconds. A mesh dim of size 1
never communicates and costs exactly 0.0.
"""

from __future__ import annotations

from autoparallel.cost.topology import Topology

__all__ = [
    "all_gather_us",
    "all_reduce_us",
    "all_to_all_us",
    "reduce_scatter_us",
    "RING_PASSES",
    "ring_latency_us",
]

_US_PER_S = 1e6
# ring sweeps per collective: an all-reduce is a reduce-scatter followed by an all-gather
RING_PASSES = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 1}


def ring_latency_us(mesh_dim: int, topology: Topology, collective: str) -> float:
    """The fixed part of one ``collective`` along ``mesh_dim``: what a message of 0 bytes
    costs, paid once per collective call however many tensors share its buffer."""
    n = topology.mesh_shape[mesh_dim]
    return (
        RING_PASSES[collective] * (n - 1) * topology.latency_us(mesh_dim, collective)
        if n > 1
        else 0.0
    )


def _ring_us(buffer_bytes: float, mesh_dim: int, topology: Topology, collective: str) -> float:
    """Ring sweeps over a buffer of ``buffer_bytes`` (the full, un-sharded size), priced on
    the profile's fit of ``collective`` where it has one."""
    n = topology.mesh_shape[mesh_dim]
    if n == 1:
        return 0.0
    passes = RING_PASSES[collective]
    bandwidth = topology.bandwidth(mesh_dim, collective)
    transfer = passes * (n - 1) / n * max(float(buffer_bytes), 0.0) / bandwidth
    return ring_latency_us(mesh_dim, topology, collective) + transfer * _US_PER_S


def all_gather_us(output_bytes: float, mesh_dim: int, topology: Topology) -> float:
    """All-gather whose *gathered* (output) buffer is ``output_bytes`` per rank."""
    return _ring_us(output_bytes, mesh_dim, topology, "all_gather")


def reduce_scatter_us(input_bytes: float, mesh_dim: int, topology: Topology) -> float:
    """Reduce-scatter whose *unscattered* (input) buffer is ``input_bytes`` per rank."""
    return _ring_us(input_bytes, mesh_dim, topology, "reduce_scatter")


def all_reduce_us(nbytes: float, mesh_dim: int, topology: Topology) -> float:
    """Ring all-reduce of an ``nbytes`` buffer: a reduce-scatter then an all-gather."""
    return _ring_us(nbytes, mesh_dim, topology, "all_reduce")


def all_to_all_us(nbytes: float, mesh_dim: int, topology: Topology) -> float:
    """All-to-all where each rank holds (and ends with) ``nbytes`` locally."""
    return _ring_us(nbytes, mesh_dim, topology, "all_to_all")
