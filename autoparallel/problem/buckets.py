"""Collectives the runtime coalesces, priced as the buckets they become.

The runtime issues two kinds of collective together (``runtime/coalesce.py``,
``runtime/param_gathers.py``):

* parameter-gradient reductions whose move is sums over one or more mesh dims, to
  Replicate on each (all-reduces: DDP over every dim of a 2-D mesh) or to evenly dividing
  Shards on each (reduce-scatters: FSDP over both dims), one bucket per (mesh dims, targets,
  dtype) for the whole step;
* reads of a parameter (or of its mixed-precision cast) whose move is all-gathers (Shard ->
  Replicate on one or more mesh dims, evenly divided), one bucket per (phase, numbered layer,
  mesh dims, dtype).

A bucket over several mesh dims runs one collective per dim (``runtime/rank_layout.py``);
a tensor dim that a mesh dim the move keeps also shards is left out (nested layouts).

Pricing each of them as a collective of its own charges the fixed cost (the latency of every
ring step) once per tensor: on gloo, much of a gradient's reduction, so a per-tensor model
prefers plans that reduce nothing. Here every pair that the runtime would coalesce is priced without
that latency, plus the host's work packing it into the bucket and out (``pack_us``), plus
an equal share of it: the latency divided by the bucket's *candidates*, the edges that have
a pair in it. When every candidate joins (all gradients reduced the same
way, a whole layer gathered: the plans that matter) the shares add up to exactly one latency;
when only some join, the objective pays less than the runtime will, and the plan's totals,
which charge each bucket in use its whole latency once, say so. A fixed charge proper (a
column ``z >= y`` per member) is exact but makes the relaxation fractional: LLaMA on a 2-D
mesh then needs a branch and bound that outlasts the time limit. The shares keep the
problem's structure (no column, no row), and folding applies.

Known limit: buckets are priced on 1-D and 2-D meshes only. On 2-D meshes they cost some
planning time (with the overlap windows and the price refits, some relaxations turn
fractional and relax and fix runs), and they are worth it: pricing every collective at its
own latency there steers plans away from the data parallelism and the FSDP the runtime
makes cheap (on gloo a plan gathers activations rather than reduce a gradient). On 3-D
meshes the relaxation turns fractional for good, and branch and bound, or relax and fix
(close to the bound), makes planning several times slower, so there every collective
keeps its own latency (conservative: the runtime coalesces them). Lifting this limit needs
a formulation whose relaxation stays integral, not a faster fix (the figures:
``docs/architecture.md``, known limits).

Such a pair is priced as its direct single step even where the route table found a cheaper
multi-step route (say reduce-scatter then all-gather instead of an all-reduce): coalescing
needs the single step, so where the bucketed step is the cheaper, the plan takes it (its
``route`` is empty). Only pair-encoded edges take part: on a flow-encoded edge one arc does
not say whether the route is a single step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autoparallel.cost.collectives import (
    all_gather_us,
    all_reduce_us,
    reduce_scatter_us,
    ring_latency_us,
)
from autoparallel.cost.topology import Topology
from autoparallel.strategies.rules import evenly_divisible
from autoparallel.types.bucketing import packing_ops, ranks_per_tensor_dim
from autoparallel.types.costs import EdgeCost
from autoparallel.types.graph import layer_of
from autoparallel.types.placements import is_multi, placement_str
from autoparallel.types.problem import Bucket, BucketMember, Problem
from autoparallel.types.tensors import local_shape

MAX_BUCKET_MESH_DIMS = 2
"""Buckets are priced on meshes of at most this many dims (see the module docstring)."""

_PRICES = {
    "all_reduce": all_reduce_us,
    "reduce_scatter": reduce_scatter_us,
    "all_gather": all_gather_us,
}


def add_buckets(problem: Problem) -> None:
    """Reprice the coalesced pairs of ``problem``'s objective and record its buckets (in
    place: ``problem.objective`` and ``problem.buckets`` change)."""
    found: dict[tuple, list[tuple[int, int, float]]] = defaultdict(
        list
    )  # key -> (edge, pair, saving)
    latencies: dict[tuple, float] = {}
    param_names = problem.joint.parameter_sources()
    moves: dict[tuple, _Move | None] = {}  # this call's memo: repeated layers repeat moves
    for index, edge in enumerate(problem.tables.edges):
        if problem.edge_encoding(index) != "pairs":
            continue
        for key, pair, saving, latency in _coalesced_pairs(problem, edge, param_names, moves):
            found[key].append((index, pair, saving))
            latencies[key] = latency
    objective = problem.objective.copy()
    buckets = []
    for key, members in found.items():
        candidates = len({edge for edge, _, _ in members})
        share = latencies[key] / candidates
        kept = []
        for edge, pair, saving in members:
            if saving <= share:  # no cheaper even when every candidate joins
                continue
            objective[problem.edge_columns[edge][pair]] -= saving - share  # per member
            kept.append(BucketMember(edge, pair, saving, share))
        if kept:
            buckets.append(Bucket(key[0], key[1], latencies[key], candidates, tuple(kept)))
    problem.objective = objective
    problem.set_buckets(buckets)


def members_in_use(problem: Problem, choice: dict[fx.Node, int]) -> list[int]:
    """How many members of each bucket (in ``problem.buckets`` order) the strategies of
    ``choice`` use."""
    chosen: dict[int, tuple[int, int]] = {}
    counts = []
    for bucket in problem.buckets:
        count = 0
        for member in bucket.members:
            if member.edge not in chosen:
                edge = problem.tables.edges[member.edge]
                chosen[member.edge] = (
                    edge.src_of_strategy[choice[edge.producer]],
                    edge.dst_of_strategy[choice[edge.consumer]],
                )
            i, j, _, _ = problem.tables.edges[member.edge].pairs[member.pair]
            count += (i, j) == chosen[member.edge]
        counts.append(count)
    return counts


def share_by_use(problem: Problem, in_use: list[int]) -> bool:
    """Let the members a plan used of each bucket carry its whole latency: a bucket the
    plan used in part (``in_use[b]`` of its members, see :func:`members_in_use`) charges
    each member ``latency / in_use[b]`` from now on. Returns whether any price changed.

    The candidates' shares undercharge a bucket that only some candidates join, and the
    solver can lean on that (a few parameters sharded, their buckets almost free in the
    objective). Re-solving with the shares of the plan it chose removes that lean; the
    caller keeps whichever plan's totals are lower."""
    objective = problem.objective.copy()
    buckets, changed = [], False
    for bucket, count in zip(problem.buckets, in_use):
        share = bucket.latency_us / count if count else None
        if share is None or not share > bucket.members[0].share_us + 1e-9:
            buckets.append(bucket)
            continue
        members = []
        for member in bucket.members:
            objective[problem.edge_columns[member.edge][member.pair]] += share - member.share_us
            members.append(BucketMember(member.edge, member.pair, member.saving_us, share))
        buckets.append(dataclasses.replace(bucket, members=tuple(members)))
        changed = True
    if changed:
        problem.objective = objective
        problem.set_buckets(buckets)
    return changed


@dataclasses.dataclass(frozen=True)
class _Move:
    """A placement move the runtime coalesces, priced for one tensor: the collective, its
    mesh dims, the latency a bucket shares, and the move's time as a bucket member."""

    mesh_dims: tuple[int, ...]
    collective: str
    latency_us: float
    bucketed_us: float
    target: str


def _coalesced_pairs(
    problem: Problem,
    edge: EdgeCost,
    param_names: dict[fx.Node, str],
    moves: dict[tuple, _Move | None],
) -> Iterator[tuple[tuple, int, float, float]]:
    """(bucket key, pair index, saving, the collective's latency) of each pair of ``edge``
    that the runtime coalesces and that is cheaper without its latency than as priced.
    ``moves`` memoizes :func:`_coalesced_move` over the edges of one call."""
    joint, topology = problem.joint, problem.tables.topology
    if len(topology.mesh_shape) > MAX_BUCKET_MESH_DIMS:  # see the module docstring
        return
    if edge.kind == "param_grad":
        kind = "gradient_reduction"
    elif edge.kind == "arg" and edge.producer in param_names:
        kind = "parameter_gather"
    else:
        return
    value = edge.producer.meta.get("val")
    if value is None or not hasattr(value, "shape"):
        return
    shape, dtype = tuple(value.shape), value.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    for k, (i, j, comm, _) in enumerate(edge.pairs):
        src, dst = edge.src_options[i], edge.dst_options[j]
        memo = (kind, src, dst, shape, dtype)
        if memo not in moves:
            moves[memo] = _coalesced_move(kind, src, dst, shape, value.element_size(), topology)
        move = moves[memo]
        if move is None:
            continue
        if not math.isfinite(comm) or not move.bucketed_us < comm - 1e-9:  # no gain
            continue
        mesh_dims, collective = move.mesh_dims, move.collective
        over = (
            f"mesh dim {mesh_dims[0]}"
            if len(mesh_dims) == 1
            else "mesh dims " + ", ".join(map(str, mesh_dims))
        )
        if kind == "gradient_reduction":
            description = f"{collective} over {over} to {move.target}, {dtype_name}"
            key = (kind, description, mesh_dims, move.target, dtype_name)
        else:
            phase = "forward" if edge.consumer in joint.forward_nodes else "backward"
            layer = layer_of(param_names[edge.producer])
            description = f"{collective} over {over}, {dtype_name}, per layer, {phase}"
            key = (kind, description, mesh_dims, dtype_name, phase, layer)
        yield key, k, comm - move.bucketed_us, move.latency_us


def _coalesced_move(
    kind: str, src: tuple, dst: tuple, shape: tuple, element_size: int, topology: Topology
) -> _Move | None:
    """``src -> dst`` of a tensor of ``shape`` priced as a bucket member, or None when the
    runtime does not coalesce that move."""
    step = _coalesced_step(kind, src, dst, shape, topology)
    if step is None:
        return None
    mesh_dims, collective = step
    latency = sum(ring_latency_us(d, topology, collective) for d in mesh_dims)
    local_bytes = math.prod(local_shape(shape, src, topology.mesh_shape)) * element_size
    direct = _steps_us(collective, mesh_dims, local_bytes, topology)
    packing = pack_us(shape, element_size, src, dst, step, topology)
    target = placement_str(tuple(dst[d] for d in mesh_dims))
    return _Move(mesh_dims, collective, latency, direct - latency + packing, target)


def _steps_us(
    collective: str, mesh_dims: tuple[int, ...], local_bytes: float, topology: Topology
) -> float:
    """The collectives of a coalesced move, one per mesh dim in the runtime's order, from a
    local buffer of ``local_bytes``: all-gathers innermost dim first (the buffer grows by
    each dim's ranks), reduce-scatters outermost first (it shrinks), all-reduces at full size."""
    total, nbytes = 0.0, float(local_bytes)
    if collective == "all_gather":
        for d in reversed(mesh_dims):
            nbytes *= topology.mesh_shape[d]
            total += all_gather_us(nbytes, d, topology)
        return total
    for d in mesh_dims:
        total += _PRICES[collective](nbytes, d, topology)
        if collective == "reduce_scatter":
            nbytes /= topology.mesh_shape[d]
    return total


def pack_us(
    shape: tuple,
    element_size: int,
    src: tuple,
    dst: tuple,
    step: tuple[tuple[int, ...], str],
    topology: Topology,
) -> float:
    """The host's work for one member of a bucket (a tensor of ``shape``), on a synchronous
    host (CPU) only: its local bytes copied into the bucket's flat buffer, and the ops the
    runtime runs to pack and unpack it (``types.bucketing.packing_ops``: views at the
    host's dispatch cost, copies of the member's bytes at memory bandwidth). On a GPU these
    are kernels the host does not wait for (0 here: pricing the copy there turned the
    seed's DDP plan into a tie that FSDP won by 1 %)."""
    hardware = topology.hardware
    if not hardware.synchronous_ops:
        return 0.0
    mesh_dims, collective = step
    mesh_shape = topology.mesh_shape
    local_bytes = math.prod(local_shape(shape, src, mesh_shape)) * element_size
    sharded = dst if collective == "reduce_scatter" else src
    ops = packing_ops(collective, getattr(sharded[mesh_dims[0]], "dim", None))
    copied = math.prod(local_shape(shape, dst, mesh_shape)) * element_size
    copy_bytes = 2 * local_bytes + ops.copies * 2 * copied
    return (
        copy_bytes / hardware.memory_bandwidth * 1e6
        + ops.views * hardware.view_op_us
        + ops.copies * hardware.kernel_launch_us
    )


def _coalesced_step(
    kind: str, src: object, dst: object, shape: tuple, topology: Topology
) -> tuple[tuple[int, ...], str] | None:
    """(mesh dims, collective) when ``src -> dst`` is a move the runtime coalesces
    (``runtime/coalesce.coalescable``, ``runtime/param_gathers.plan_gather``): sums over one
    or more mesh dims to Replicate on each (all-reduces) or to evenly dividing Shards on each
    (reduce-scatters); all-gathers from evenly dividing Shards to Replicate on one or more
    mesh dims. A tensor dim that a mesh dim the move keeps also shards is left out."""
    if src is None or dst is None or is_multi(src) or is_multi(dst):
        return None
    changed = tuple(d for d, (a, b) in enumerate(zip(src, dst)) if a != b)
    if not changed:
        return None
    if kind == "gradient_reduction":
        if not all(isinstance(src[d], Partial) and src[d].reduce_op == "sum" for d in changed):
            return None
        if all(isinstance(dst[d], Replicate) for d in changed):
            return changed, "all_reduce"
        sharded, collective, split = (
            dst,
            "reduce_scatter",
            local_shape(shape, src, topology.mesh_shape),
        )
    else:
        if not all(type(src[d]) is Shard and isinstance(dst[d], Replicate) for d in changed):
            return None
        sharded, collective, split = src, "all_gather", shape
    if not all(type(sharded[d]) is Shard and sharded[d].dim < len(shape) for d in changed):
        return None
    ranks = ranks_per_tensor_dim((topology.mesh_shape[d], sharded[d].dim) for d in changed)
    kept = [p for d, p in enumerate(sharded) if d not in changed]
    if any(type(p) is Shard and p.dim in ranks for p in kept):
        return None  # nested with a kept mesh dim: the runtime leaves it to DTensor
    if kind == "parameter_gather" and not evenly_divisible(src, shape, topology.mesh_shape):
        return None
    if any(split[dim] % count for dim, count in ranks.items()):
        return None
    return changed, collective
