"""Collectives the runtime coalesces are priced as the buckets they become (problem/buckets.py)."""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
from conftest import meta
from helpers.planning import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.cost import all_gather_us, all_reduce_us
from autoparallel.cost.collectives import ring_latency_us
from autoparallel.cost.hardware import CPU
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.optimizer import ShardingOptimizer
from autoparallel.types.placements import placement_str

CONFIG = llama_config("tiny")
# about what `autoparallel calibrate --nproc 2` measures on a small 2-core VM
GLOO_LIKE = dataclasses.replace(
    CPU,
    name="gloo-like",
    flops_fp32=80e9,
    flops_bf16=1e9,
    memory_bandwidth=12e9,
    kernel_launch_us=6.0,
    view_op_us=2.0,
    synchronous_ops=True,  # a CPU host: fixed cost per op added, bucket packing priced
    intra_node_latency_us=500.0,
    intra_node_bandwidth=1e9,
)


def _plan(mesh, model, input_fn, memory: bool, hardware: object = "cpu"):
    autop = AutoParallel(model, input_fn, mesh, hardware=hardware)
    with autop:
        batch = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        if memory:
            autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
    return autop, plan


def _nbytes(autop, producer: str) -> int:
    nodes = {n.name: n for n in autop.sharding_optimizer.problem.joint.graph.nodes}
    value = nodes[producer].meta["val"]
    return value.numel() * value.element_size()


def test_the_free_plan_of_a_small_llama_is_ddp_with_one_gradient_bucket(fake_mesh):
    """Priced one latency per gradient on a gloo-like link, this plan gathered the batch and
    reduced nothing; priced as the runtime's one all-reduce, DDP is the cheapest."""
    model = meta(lambda: Llama(CONFIG))
    tokens = lambda: torch.randint(0, CONFIG.vocab_size, (8, 32))  # noqa: E731
    autop, plan = _plan(fake_mesh((2,)), model, tokens, memory=False, hardware=GLOO_LIKE)
    assert {placement_str(p) for p in plan.param_placements.values()} == {"R"}
    (bucket,) = [b for b in plan.buckets if b.kind == "gradient_reduction"]
    assert bucket.tensors == bucket.candidates == len(plan.param_placements)
    topology = autop.topology
    assert bucket.latency_us == pytest.approx(ring_latency_us(0, topology, "all_reduce"))
    reductions = [(c, a) for c, a in plan.redistributions() if a.kind == "param_grad"]
    assert len(reductions) == len(plan.param_placements)
    for _, argument in reductions:  # each pays its bytes; the bucket pays the latency once
        assert argument.route == ()
        nbytes = _nbytes(autop, argument.producer)
        copy_in = 2 * nbytes / topology.hardware.memory_bandwidth * 1e6  # into the flat buffer
        views = 2 * topology.hardware.view_op_us  # flattened in, its slice viewed back
        host = (copy_in + views) * topology.hardware.synchronous_ops  # a synchronous host only
        bandwidth_only = all_reduce_us(nbytes, 0, topology)
        assert argument.comm_us == pytest.approx(bandwidth_only - bucket.latency_us + host)
    arguments = sum(n.comm_us for n in plan.nodes.values())
    assert plan.totals.comm_us == pytest.approx(arguments + bucket.latency_us)


def test_a_layer_of_sharded_parameters_is_gathered_in_one_bucket_per_phase(fake_mesh):
    model = meta(lambda: Llama(CONFIG))
    tokens = lambda: torch.randint(0, CONFIG.vocab_size, (8, 32))  # noqa: E731
    autop, plan = _plan(fake_mesh((4,)), model, tokens, memory=True)
    gathers = [b for b in plan.buckets if b.kind == "parameter_gather"]
    assert {"forward" in b.description for b in gathers} == {True, False}
    assert max(b.tensors for b in gathers) == 9  # a transformer block's parameters
    topology = autop.topology
    latency = ring_latency_us(0, topology, "all_gather")
    assert all(b.latency_us == pytest.approx(latency) for b in gathers)
    params = set(autop.sharding_optimizer.problem.joint.parameter_sources())
    direct_gathers = [
        a
        for _, a in plan.redistributions()
        if a.kind == "arg" and a.route == () and a.producer in {n.name for n in params}
    ]
    assert len(direct_gathers) >= sum(b.tensors for b in gathers)  # one step: coalesced
    json = autop.sharding_optimizer.get_json()
    assert len(json["buckets"]) == len(plan.buckets)
    assert sum(row["comm_us"] for row in json["layers"]) == pytest.approx(plan.totals.comm_us)


def test_without_bucket_pricing_every_collective_pays_its_latency(fake_mesh):
    """The per-tensor model (build_problem(price_buckets=False)) is dearer for the same DDP plan."""
    from autoparallel.problem.build import build_problem
    from autoparallel.solver.highs import solve
    from autoparallel.solver.plan import build_plan

    model = meta(lambda: MLP(64, 256))
    autop, bucketed = _plan(fake_mesh((2,)), model, lambda: torch.randn(32, 64), memory=False)
    problem = autop.sharding_optimizer.problem
    plain = build_problem(problem.joint, problem.space, problem.tables, price_buckets=False)
    assert plain.buckets == [] and problem.buckets
    for constraint in problem.user_constraints.values():
        plain.add_constraint(constraint)
    unbucketed = build_plan(plain, solve(plain), None)
    assert unbucketed.buckets == []
    assert bucketed.totals.total_us < unbucketed.totals.total_us


def test_a_saved_problem_keeps_its_buckets(fake_mesh, tmp_path):
    model = meta(lambda: Llama(CONFIG))
    tokens = lambda: torch.randint(0, CONFIG.vocab_size, (8, 32))  # noqa: E731
    autop, plan = _plan(fake_mesh((2,)), model, tokens, memory=False)
    path = tmp_path / "problem.npz"
    autop.sharding_optimizer.save(str(path))
    loaded = ShardingOptimizer.load(str(path))
    again = loaded.get_solution()
    assert [b.description for b in again.buckets] == [b.description for b in plan.buckets]
    assert again.totals.total_us == pytest.approx(plan.totals.total_us)
    assert loaded.resolve().totals.total_us == pytest.approx(plan.totals.total_us)


def test_gather_prices_are_the_bandwidth_of_the_step(fake_mesh):
    model = meta(lambda: MLP(256, 1024))
    autop, plan = _plan(fake_mesh((4,)), model, lambda: torch.randn(4096, 256), memory=True)
    topology = autop.topology
    latency = ring_latency_us(0, topology, "all_gather")
    names = autop.sharding_optimizer.problem.joint.param_name_of()
    params = {node.name for node in names}
    gathers = [a for _, a in plan.redistributions() if a.producer in params and a.kind == "arg"]
    assert gathers
    for argument in gathers:
        nbytes = _nbytes(autop, argument.producer)
        copy_in = 2 * (nbytes / 4) / topology.hardware.memory_bandwidth * 1e6  # this rank's shard
        copy_in *= topology.hardware.synchronous_ops  # priced on a synchronous host only
        full = all_gather_us(nbytes, 0, topology)
        assert argument.comm_us == pytest.approx(full - latency + copy_in)


def test_a_gradient_sharded_twice_on_one_dim_is_not_coalesced(fake_mesh):
    """A parameter S(0)S(0) has its rows split by both mesh dims (nested): this rank's block
    of a reduce-scatter over mesh dim 0 would be the wrong rows, so the runtime leaves that
    move to DTensor (it once trained a LLaMA's w1 on the wrong gradient), and the solver
    does not price it as a bucket member."""
    from torch.distributed.tensor import DTensor, Partial

    from autoparallel.cost.topology import Topology
    from autoparallel.problem.buckets import _coalesced_step
    from autoparallel.runtime.coalesce import coalescable

    mesh = fake_mesh((2, 2))
    grad = DTensor.from_local(torch.zeros(8, 4), mesh, (Partial(), Shard(0)), run_check=False)
    assert coalescable(grad, (), (Shard(0), Shard(0)), mesh) is None
    assert coalescable(grad, (), (Shard(1), Shard(0)), mesh) is not None
    topology = Topology((2, 2))
    nested = ((Partial(), Shard(0)), (Shard(0), Shard(0)))
    assert _coalesced_step("gradient_reduction", *nested, (16, 4), topology) is None
    across = ((Partial(), Shard(0)), (Shard(1), Shard(0)))
    assert _coalesced_step("gradient_reduction", *across, (16, 4), topology) == (
        (0,),
        "reduce_scatter",
    )


def test_a_gradient_pending_over_two_mesh_dims_joins_one_all_reduce_bucket(fake_mesh):
    """DDP over a 2-D mesh: a gradient Partial on both dims moving to Replicate on both is
    coalesced by the runtime (all-reduced over each dim in turn) and priced as a bucket
    member whose bucket pays one latency per mesh dim; a sum that ends sharded over one dim
    and replicated over the other is neither."""
    from torch.distributed.tensor import DTensor, Partial

    from autoparallel.cost.topology import Topology
    from autoparallel.problem.buckets import _coalesced_step
    from autoparallel.runtime.coalesce import Reduction, coalescable

    mesh = fake_mesh((2, 2))
    grad = DTensor.from_local(torch.zeros(8, 4), mesh, (Partial(), Partial()), run_check=False)
    replicated = (Replicate(), Replicate())
    assert coalescable(grad, (), replicated, mesh) == Reduction((0, 1), replicated, torch.float32)
    assert coalescable(grad, (), (Shard(0), Replicate()), mesh) is None
    topology = Topology((2, 2))
    ddp = ((Partial(), Partial()), replicated)
    assert _coalesced_step("gradient_reduction", *ddp, (8, 4), topology) == ((0, 1), "all_reduce")
    mixed = ((Partial(), Partial()), (Shard(0), Replicate()))
    assert _coalesced_step("gradient_reduction", *mixed, (8, 4), topology) is None

    model = meta(lambda: MLP(64, 256))
    pinned = {"w1.weight", "w1.bias", "w2.weight", "w2.bias"}
    autop = AutoParallel(model, lambda: torch.randn(32, 64), mesh, hardware=GLOO_LIKE)
    with autop:
        rows = (Shard(0), Shard(0))
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        optimizer = autop.sharding_optimizer
        for name in pinned:
            optimizer.add_node_constraint(optimizer.problem.joint.params[name], replicated)
        plan = autop.optimize_placement()
    (bucket,) = [b for b in plan.buckets if b.kind == "gradient_reduction"]
    assert bucket.tensors == len(pinned)
    assert "mesh dims 0, 1" in bucket.description
    latency = sum(ring_latency_us(d, Topology((2, 2), GLOO_LIKE), "all_reduce") for d in (0, 1))
    assert bucket.latency_us == pytest.approx(latency)


def _traced_ops(function, tensors) -> list:
    """The ops a local graph of ``function`` holds, as the runtime traces its phases."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoparallel.runtime.local_graph import drop_identity_views

    graph = make_fx(function)(*tensors)
    drop_identity_views(graph)
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


def _reduce(target):
    from autoparallel.runtime.coalesce import Reduction, _reduce_together

    def run(mesh, dim, *grads):
        return _reduce_together(list(grads), Reduction((0,), (target,), torch.float32), mesh)

    return run


def _gather(mesh, dim, *shards):
    from autoparallel.runtime.param_gathers import Gather, GatherPlan, ParameterGathers

    group = Gather("layers.0.", (0,), torch.float32)
    reads = [((f"w{i}", (Replicate(),)), group) for i in range(len(shards))]
    env = {name: shard for ((name, _), _), shard in zip(reads, shards)}
    gathers = ParameterGathers(GatherPlan.of_reads(reads), mesh)
    # each gathered value read by an op (neg), as in a phase: the identity view of its
    # DTensor wrap is then dropped as the runtime drops it
    return [gathers.take(name, wanted, env)._local_tensor.neg() for (name, wanted), _ in reads]


@pytest.mark.parametrize(
    "collective,dim,run",
    [
        ("all_reduce", None, _reduce(Replicate())),
        ("reduce_scatter", 0, _reduce(Shard(0))),
        ("reduce_scatter", 1, _reduce(Shard(1))),
        ("all_gather", 0, _gather),
        ("all_gather", 1, _gather),
    ],
)
def test_the_packing_priced_per_member_is_what_the_runtime_runs(fake_mesh, collective, dim, run):
    """A bucket of three members holds, beyond one of two, the ops ``packing_ops`` prices:
    if the runtime packs its buckets another way, this fails until the price follows."""
    from torch.distributed.tensor import DTensor

    from autoparallel.graph.view_ops import is_view_op
    from autoparallel.types.bucketing import packing_ops

    mesh = fake_mesh((2,))

    def tensors(count):  # gradients, or the DTensor shards a phase reads
        if collective != "all_gather":
            return [torch.randn(4, 6) for _ in range(count)]
        return [DTensor.from_local(torch.randn(4, 6), mesh, (Shard(dim),)) for _ in range(count)]

    ops = {
        count: _traced_ops(lambda *t: run(mesh, dim or 0, *t), tensors(count)) for count in (2, 3)
    }
    ignored = (operator.getitem, torch.ops.aten.neg.default)  # a list item, the reader
    added = [op for op in ops[3] if op not in ignored]
    for op in ops[2]:
        if op not in ignored:
            added.remove(op)
    views = sum(is_view_op(op) for op in added)
    copies = sum(op is torch.ops.aten.clone.default for op in added)
    assert views + copies == len(added), added
    expected = packing_ops(collective, dim)
    assert (views, copies) == (expected.views, expected.copies), added


@pytest.mark.parametrize(
    "shards", [[(2, 0)], [(2, 1)], [(2, 0), (3, 1)], [(2, 1), (3, 0)], [(2, 0), (3, 0)]]
)
def test_the_rank_major_layout_holds_each_ranks_shard(shards):
    """A coalesced bucket's row r is rank r's block, in DTensor's layout: the outer mesh dim
    chunks first, a tensor dim split by two mesh dims (nested) splits by the outer one first;
    and the rows rebuild the full tensor."""
    import itertools

    from autoparallel.runtime.rank_layout import block_shape, from_rank_rows, to_rank_rows

    full = torch.arange(12 * 18, dtype=torch.float32).view(12, 18)
    rows = to_rank_rows(full, shards)
    for rank, coordinates in enumerate(itertools.product(*(range(n) for n, _ in shards))):
        block = full
        for (ranks, dim), index in zip(shards, coordinates):
            block = block.chunk(ranks, dim)[index]
        assert block.shape == block_shape(full.shape, shards)
        assert torch.equal(rows[rank], block.reshape(-1))
    assert torch.equal(from_rank_rows(rows, block_shape(full.shape, shards), shards), full)
