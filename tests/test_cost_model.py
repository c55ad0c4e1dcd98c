"""Cost model v1: hardware presets, mesh topology, compute, collectives, redistribution."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel.cost import (
    TRANSITION_COST_US,
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    compute_cost_us,
    copy_cost_us,
    direct_redistribution_cost_us,
    redistribution_cost_us,
    redistribution_route,
    reduce_scatter_us,
    transition_cost_us,
)
from autoparallel.cost.hardware import A100, CPU, H100, HARDWARE_PRESETS, Hardware
from autoparallel.cost.topology import Topology, get_hardware
from autoparallel.types.tensors import TensorInfo

aten = torch.ops.aten
BF16 = torch.bfloat16
R, P = Replicate(), Partial()


def info(*shape: int, dtype: torch.dtype = BF16) -> TensorInfo:
    return TensorInfo(tuple(shape), dtype)


# ------------------------------------------------------------------ hardware
def test_presets_exist_and_lookup_is_case_insensitive() -> None:
    assert set(HARDWARE_PRESETS) == {"h100", "a100", "h200", "b200", "cpu"}
    assert get_hardware("H100") is H100
    assert get_hardware(" a100 ") is A100
    assert get_hardware(None) is H100
    assert get_hardware(CPU) is CPU


def test_unknown_preset_error_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown hardware") as excinfo:
        get_hardware("tpu-v9")
    for name in HARDWARE_PRESETS:
        assert name in str(excinfo.value)


def test_peak_flops_by_dtype() -> None:
    assert H100.peak_flops(torch.bfloat16) == H100.flops_bf16
    assert H100.peak_flops(torch.float16) == H100.flops_bf16
    assert H100.peak_flops(torch.float32) == H100.flops_fp32
    assert H100.peak_flops(torch.float8_e4m3fn) == 2 * H100.flops_bf16
    assert A100.peak_flops(torch.float8_e4m3fn) == A100.flops_bf16  # no fp8 tensor cores
    # Presets are ordered as their datasheets are.
    assert H100.flops_bf16 > A100.flops_bf16 > H100.flops_fp32
    assert H100.intra_node_bandwidth > H100.inter_node_bandwidth


# ------------------------------------------------------------------ topology
@pytest.mark.parametrize(
    ("mesh_shape", "gpus_per_node", "expected"),
    [
        ((8, 8), 8, (True, False)),
        ((2, 4), 8, (False, False)),
        ((2, 4), 4, (True, False)),
        ((4, 8, 8), 8, (True, True, False)),
        ((4, 8, 8), 64, (True, False, False)),
        ((4, 8, 8), 256, (False, False, False)),
        ((1, 16), 8, (False, True)),  # size-1 dims never communicate
        ((16, 1), 8, (True, False)),
        ((3, 3), 4, (True, True)),  # groups straddle node boundaries
    ],
)
def test_inter_node_dims(mesh_shape, gpus_per_node, expected) -> None:
    topo = Topology(mesh_shape, gpus_per_node=gpus_per_node)
    assert tuple(topo.is_inter_node(d) for d in range(len(mesh_shape))) == expected
    for d, inter in enumerate(expected):
        hw = topo.hardware
        assert topo.bandwidth(d) == (hw.inter_node_bandwidth if inter else hw.intra_node_bandwidth)
        assert topo.latency_us(d) == (
            hw.inter_node_latency_us if inter else hw.intra_node_latency_us
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mesh_shape": ()}, "at least one"),
        ({"mesh_shape": (2, 0)}, "positive"),
        ({"mesh_shape": (2, 4), "gpus_per_node": 0}, "gpus_per_node"),
    ],
)
def test_topology_validation(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_topology_from_mesh() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(16).view(2, 8), _init_backend=False, _rank=0)
    topo = Topology.from_mesh(mesh, hardware="A100")
    assert topo.mesh_shape == (2, 8) and topo.hardware is A100 and topo.gpus_per_node == 8
    assert topo.is_inter_node(0) and not topo.is_inter_node(1)

    small = DeviceMesh("cpu", torch.arange(4).view(2, 2), _init_backend=False, _rank=0)
    assert Topology.from_mesh(small).gpus_per_node == 4  # min(8, world size)
    assert Topology.from_mesh(small).hardware is H100
    assert Topology.from_mesh(small, gpus_per_node=2).is_inter_node(0)


# ------------------------------------------------------------------ collectives
def test_collectives_on_size_one_dim_are_free() -> None:
    topo = Topology((1, 8))
    for fn in (all_gather_us, reduce_scatter_us, all_reduce_us, all_to_all_us):
        assert fn(1e9, 0, topo) == 0.0
        assert fn(1e9, 1, topo) > 0.0


def test_inter_node_all_gather_slower_than_intra_node() -> None:
    topo = Topology((8, 8), gpus_per_node=8)  # dim 0 inter, dim 1 intra, same group size
    nbytes = 64 * 2**20
    assert all_gather_us(nbytes, 0, topo) > 2 * all_gather_us(nbytes, 1, topo)


def test_ring_all_gather_matches_alpha_beta_by_hand() -> None:
    topo = Topology((4,), hardware=H100)
    nbytes = 4 * 2**20
    expected = 3 * H100.intra_node_latency_us + 0.75 * nbytes / H100.intra_node_bandwidth * 1e6
    assert all_gather_us(nbytes, 0, topo) == pytest.approx(expected)
    assert reduce_scatter_us(nbytes, 0, topo) == pytest.approx(expected)
    assert all_reduce_us(nbytes, 0, topo) == pytest.approx(2 * expected)
    assert all_gather_us(2 * nbytes, 0, topo) > all_gather_us(nbytes, 0, topo)


# ------------------------------------------------------------------ redistribution
def test_identity_redistribution_is_exactly_zero() -> None:
    topo = Topology((2, 4))
    t = info(1024, 1024)
    for placements in [(R, R), (Shard(0), Shard(1)), (P, Shard(0)), (P, P)]:
        assert redistribution_cost_us(t, placements, placements, topo) == 0.0
        assert transition_cost_us(placements, placements) == 0.0
    # Negative shard dims are the same placement.
    assert redistribution_cost_us(t, (Shard(-1), R), (Shard(1), R), topo) == 0.0


def test_shard_to_replicate_is_an_all_gather_of_the_full_tensor() -> None:
    topo = Topology((8,))
    t = info(4096, 1024)
    assert redistribution_cost_us(t, (Shard(0),), (R,), topo) == pytest.approx(
        all_gather_us(t.nbytes, 0, topo)
    )
    assert redistribution_cost_us(t, (P,), (R,), topo) == pytest.approx(
        all_reduce_us(t.nbytes, 0, topo)
    )
    # Off dim 0, the collective's rows are re-laid out by a copy of its buffers.
    hw = topo.hardware
    assert redistribution_cost_us(t, (P,), (Shard(1),), topo) == pytest.approx(
        reduce_scatter_us(t.nbytes, 0, topo) + copy_cost_us(2 * t.nbytes, hw)
    )
    per_rank = t.nbytes / 8
    assert redistribution_cost_us(t, (Shard(0),), (Shard(1),), topo) == pytest.approx(
        all_to_all_us(per_rank, 0, topo) + copy_cost_us(4 * per_rank, hw)
    )


@pytest.mark.parametrize("hardware", [H100, CPU], ids=["h100", "cpu"])
def test_a_gather_off_dim_0_pays_the_copy_that_lays_its_rows_out(hardware) -> None:
    """An all-gather from Shard(1) re-concatenates the gathered rows along dim 1: one copy
    of the full tensor, unless every dim before dim 1 has size 1 (then it is a view)."""
    topo = Topology((4,), hardware=hardware)
    rows = info(64, 4096)
    gather = all_gather_us(rows.nbytes, 0, topo)
    assert redistribution_cost_us(rows, (Shard(0),), (R,), topo) == pytest.approx(gather)
    assert redistribution_cost_us(rows, (Shard(1),), (R,), topo) == pytest.approx(
        gather + copy_cost_us(2 * rows.nbytes, hardware)
    )
    assert copy_cost_us(2 * rows.nbytes, hardware) > 0
    one_row = info(1, 64 * 4096)
    assert redistribution_cost_us(one_row, (Shard(1),), (R,), topo) == pytest.approx(gather)
    # The same on the direct model (placements outside the route states).
    assert direct_redistribution_cost_us(rows, (Shard(1),), (R,), topo) == pytest.approx(
        gather + copy_cost_us(2 * rows.nbytes, hardware)
    )


def test_partial_to_shard_cheaper_than_partial_to_replicate() -> None:
    topo = Topology((8,))
    t = info(4096, 4096)
    assert redistribution_cost_us(t, (P,), (Shard(0),), topo) < redistribution_cost_us(
        t, (P,), (R,), topo
    )


def test_local_transitions_are_free() -> None:
    topo = Topology((4,))
    t = info(4096, 4096)
    assert redistribution_cost_us(t, (R,), (Shard(0),), topo) == 0.0
    assert redistribution_cost_us(t, (R,), (P,), topo) == 0.0


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (P, Partial("max")),
        (Partial("max"), Partial("sum")),
    ],
)
def test_inventing_a_partial_is_impossible(src, dst) -> None:
    topo = Topology((2, 4))
    assert redistribution_cost_us(info(64, 64), (R, src), (R, dst), topo) == math.inf


def test_a_partial_is_reached_through_replicate() -> None:
    # S -> P has no collective; the route gathers first, then keeps the value on one rank.
    topo = Topology((2, 4))
    t = info(64, 64)
    assert redistribution_route(t, (R, Shard(0)), (R, P), topo) == [(R, Shard(0)), (R, R), (R, P)]
    assert redistribution_cost_us(t, (R, Shard(0)), (R, P), topo) == pytest.approx(
        all_gather_us(t.nbytes, 1, topo)
    )


def test_hierarchical_all_reduce_beats_the_direct_one() -> None:
    """A Partial over the inter-node dim of a (2, 8) mesh: slicing over the fast intra-node
    dim, all-reducing the 8x smaller shard across nodes and gathering it back is cheaper than
    one all-reduce of the whole tensor across nodes; the route says so and is priced so."""
    topo = Topology((2, 8), gpus_per_node=8)  # dim 0 inter-node, dim 1 intra-node
    t = info(4096, 4096)
    direct = direct_redistribution_cost_us(t, (P, R), (R, R), topo)
    assert direct == pytest.approx(all_reduce_us(t.nbytes, 0, topo))
    route = redistribution_route(t, (P, R), (R, R), topo)
    assert route[0] == (P, R) and route[-1] == (R, R) and len(route) == 4
    sliced = route[1]
    assert sliced[0] == P and isinstance(sliced[1], Shard)
    assert route[2] == (R, sliced[1])
    expected = all_reduce_us(t.nbytes / 8, 0, topo) + all_gather_us(t.nbytes, 1, topo)
    assert redistribution_cost_us(t, (P, R), (R, R), topo) == pytest.approx(expected)
    assert expected < direct / 3


def test_other_reduce_ops_reduce_like_sum() -> None:
    topo = Topology((4,))
    t = info(256, 256)
    assert redistribution_cost_us(t, (Partial("max"),), (R,), topo) == pytest.approx(
        redistribution_cost_us(t, (P,), (R,), topo)
    )


def test_two_dim_mesh_cost_is_sum_of_steps_by_hand() -> None:
    # (S(0), S(1)) -> (R, R) on a (2, 4) mesh: both dims all-gather, in the cheaper order.
    # The local tensor starts at (512, 256). Mesh dim 0 first grows it to (1024, 256),
    # then dim 1 to (1024, 1024), re-laying the rows of tensor dim 1 out with a copy of
    # the whole; dim 1 first copies the half (512, 1024) instead.
    topo = Topology((2, 4), gpus_per_node=4)  # dim 0 inter-node, dim 1 intra
    t = info(1024, 1024)
    itemsize = 2
    hw = topo.hardware

    def inter(nbytes: float) -> float:
        return 1 * hw.inter_node_latency_us + 0.5 * nbytes / hw.inter_node_bandwidth * 1e6

    def intra(nbytes: float) -> float:
        return 3 * hw.intra_node_latency_us + 0.75 * nbytes / hw.intra_node_bandwidth * 1e6

    full, half = 1024 * 1024 * itemsize, 512 * 1024 * itemsize
    dim_0_first = inter(half / 2) + intra(full) + copy_cost_us(2 * full, hw)
    dim_1_first = intra(half) + copy_cost_us(2 * half, hw) + inter(full)
    got = redistribution_cost_us(t, (Shard(0), Shard(1)), (R, R), topo)
    assert got == pytest.approx(min(dim_0_first, dim_1_first))


def test_shrinking_steps_run_before_collectives() -> None:
    # (P, R) -> (S(0), S(1)): slicing dim 1 first makes the reduce-scatter 4x smaller.
    topo = Topology((2, 4))
    t = info(1024, 1024)
    got = redistribution_cost_us(t, (P, R), (Shard(0), Shard(1)), topo)
    assert got == pytest.approx(reduce_scatter_us(t.nbytes / 4, 0, topo))
    # (P, S(0)) -> (R, R): all-reduce on the sharded buffer before gathering.
    got = redistribution_cost_us(t, (P, Shard(0)), (R, R), topo)
    assert got == pytest.approx(
        all_reduce_us(t.nbytes / 4, 0, topo) + all_gather_us(t.nbytes, 1, topo)
    )


def test_redistribution_rejects_wrong_placement_length() -> None:
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        redistribution_cost_us(info(8, 8), (R,), (R, R), Topology((2, 4)))


def test_transition_cost_is_a_tiny_tie_breaker() -> None:
    src, dst = (Shard(0), R), (R, Shard(1))
    assert 0.0 < transition_cost_us(src, (R, R)) < transition_cost_us(src, dst) < 0.1
    smallest_real = all_gather_us(2, 1, Topology((1, 2)))
    assert transition_cost_us(src, dst) * 100 <= smallest_real


# ------------------------------------------------------------------ compute
def _mm_cost(m: int, k: int, n: int, hardware: Hardware = H100) -> float:
    return compute_cost_us(aten.mm.default, (info(m, k), info(k, n)), {}, info(m, n), hardware)


def test_matmul_cost_is_compute_bound_roofline() -> None:
    flops = 2 * 8192**3
    assert _mm_cost(8192, 8192, 8192) == pytest.approx(flops / H100.flops_bf16 * 1e6)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_matmul_cost_scales_inversely_with_sharding(n: int) -> None:
    full = _mm_cost(8192, 8192, 8192)
    assert _mm_cost(8192 // n, 8192, 8192) == pytest.approx(full / n, rel=0.02)
    assert _mm_cost(8192, 8192, 8192 // n) == pytest.approx(full / n, rel=0.02)


def test_fp32_matmul_slower_than_bf16() -> None:
    a32, b32 = info(4096, 4096, dtype=torch.float32), info(4096, 4096, dtype=torch.float32)
    fp32 = compute_cost_us(aten.mm.default, (a32, b32), {}, a32, H100)
    assert fp32 > 5 * _mm_cost(4096, 4096, 4096)


def test_tiny_op_costs_at_least_a_kernel_launch() -> None:
    assert _mm_cost(2, 2, 2) == H100.kernel_launch_us
    assert _mm_cost(2, 2, 2, CPU) == CPU.kernel_launch_us


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.view.default, (info(64, 64), [4096])),
        (aten._unsafe_view.default, (info(64, 64), [4096])),
        (aten.t.default, (info(64, 64),)),
        (aten.transpose.int, (info(64, 64), 0, 1)),
        (aten.permute.default, (info(64, 64), [1, 0])),
        (aten.expand.default, (info(64, 1), [64, 64])),
        (aten.split.Tensor, (info(64, 64), 32)),
        (aten.detach.default, (info(64, 64),)),
        (aten.as_strided.default, (info(64, 64), [64, 64], [64, 1])),
        # Not in any name list: recognised through the schema (op.is_view).
        (aten.diagonal.default, (info(64, 64),)),
        (aten.unfold.default, (info(64, 64), 0, 8, 8)),
    ],
)
def test_view_ops_are_free(op, args) -> None:
    assert compute_cost_us(op, args, {}, info(64, 64), H100) == 0.0


def test_memory_bound_op_priced_by_bytes() -> None:
    x = info(8192, 8192)
    expected = 2 * x.nbytes / H100.memory_bandwidth * 1e6
    assert compute_cost_us(aten.gelu.default, (x,), {}, x, H100) == pytest.approx(expected)


def test_op_without_formula_or_with_bad_args_does_not_raise() -> None:
    x = info(1024, 1024)
    # No FLOP formula: priced as memory-bound.
    assert compute_cost_us(aten.cumsum.default, (x, 0), {}, x, H100) > 0.0
    # Formula exists but cannot handle the (inconsistent) shapes: falls back, no raise.
    bad = compute_cost_us(aten.mm.default, (info(4, 5), info(6, 7)), {}, info(4, 7), H100)
    assert bad == H100.kernel_launch_us
    # Not even an aten op.
    assert compute_cost_us(lambda x: x, (x,), {}, x, H100) > 0.0  # type: ignore[arg-type]


def test_sdpa_flops_including_cpu_variant() -> None:
    b, h, s, d = 4, 16, 4096, 128
    q = info(b, h, s, d)
    lse = info(b, h, s, dtype=torch.float32)
    expected_fwd = 4 * b * h * s * s * d / H100.flops_bf16 * 1e6
    cpu_fwd = compute_cost_us(
        aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {}, (q, lse), H100
    )
    assert cpu_fwd == pytest.approx(expected_fwd)
    cuda_out = (
        q,
        lse,
        None,
        None,
        s,
        s,
        info(2, dtype=torch.int64),
        info(dtype=torch.int64),
        info(0),
    )
    cuda_fwd = compute_cost_us(
        aten._scaled_dot_product_flash_attention.default, (q, q, q), {}, cuda_out, H100
    )
    assert cuda_fwd == pytest.approx(expected_fwd)
    cpu_bwd = compute_cost_us(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        (q, q, q, q, q, lse, 0.0, True),
        {},
        (q, q, q),
        H100,
    )
    assert cpu_bwd == pytest.approx(2.5 * expected_fwd)
    # Sharding heads divides the cost.
    qh = info(b, h // 4, s, d)
    lse_h = info(b, h // 4, s, dtype=torch.float32)
    sharded = compute_cost_us(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        (qh, qh, qh),
        {},
        (qh, lse_h),
        H100,
    )
    assert sharded == pytest.approx(expected_fwd / 4)


# ------------------------------------------------------------------ fast pair pricing
def _dijkstra_prices(tensor, topology, states, source):
    """Reference for the route model, written independently of RouteTable: Dijkstra from
    ``source`` over single-mesh-dim steps priced by the direct model, each step also paying
    the tie-breaker. Returns {state: (comm, steps)} for the reachable states."""
    import heapq

    best = {source: (0.0, 0.0, 0)}
    queue = [(0.0, 0, source)]
    counter = 1
    while queue:
        total, _, state = heapq.heappop(queue)
        if total > best[state][0]:
            continue
        for mesh_dim in range(len(state)):
            for value in {s[mesh_dim] for s in states}:
                if value == state[mesh_dim]:
                    continue
                target = state[:mesh_dim] + (value,) + state[mesh_dim + 1 :]
                step = direct_redistribution_cost_us(tensor, state, target, topology)
                if step == math.inf:
                    continue
                candidate = total + step + TRANSITION_COST_US
                if target not in best or candidate < best[target][0] * (1 - 1e-12):
                    best[target] = (candidate, best[state][1] + step, best[state][2] + 1)
                    heapq.heappush(queue, (candidate, counter, target))
                    counter += 1
    return {state: (comm, steps) for state, (_, comm, steps) in best.items()}


def test_pair_pricer_prices_the_cheapest_route_of_single_steps() -> None:
    """Every pair of Shard/Replicate/Partial(sum) tuples on a 3-D mesh (an uneven dim, a
    negative shard dim, several dtypes, intra- and inter-node dims) is priced as the
    cheapest route of single-dim steps, and the route it returns costs exactly that; a
    Partial other than sum falls back to the direct model."""
    import itertools

    from autoparallel.cost import PairPricer

    topology = Topology((2, 4, 3), H100, gpus_per_node=4)
    for tensor in (
        info(8, 12, 6),
        info(6, 5, 7, dtype=torch.float32),
        info(24, 8, 9, dtype=torch.int64),
    ):
        singles = [R, P, Shard(0), Shard(1), Shard(2)]
        states = list(itertools.product(singles, repeat=3))
        pricer = PairPricer(tensor, topology)
        for src in states[::7]:
            reference = _dijkstra_prices(tensor, topology, states, src)
            for dst in states:
                comm, transition = pricer.price(src, dst)
                if dst not in reference:
                    assert comm == math.inf, (src, dst)
                    continue
                ref_comm, ref_steps = reference[dst]
                assert comm == pytest.approx(ref_comm, rel=1e-9, abs=1e-9), (tensor, src, dst)
                assert transition == pytest.approx(ref_steps * TRANSITION_COST_US)
                route = pricer.route(src, dst)
                assert route[0] == src and route[-1] == dst and len(route) == ref_steps + 1
                walked = sum(
                    direct_redistribution_cost_us(tensor, a, b, topology)
                    for a, b in zip(route, route[1:])
                )
                assert walked == pytest.approx(comm, rel=1e-9, abs=1e-9)
                assert all(sum(x != y for x, y in zip(a, b)) == 1 for a, b in zip(route, route[1:]))
        # negative shard dims are the same state; other Partials are priced directly
        assert pricer.price((Shard(-1), R, R), (Shard(2), R, R)) == (0.0, 0.0)
        src, dst = (Partial("max"), R, R), (R, R, R)
        assert pricer.price(src, dst) == (
            direct_redistribution_cost_us(tensor, src, dst, topology),
            transition_cost_us(src, dst),
        )
    with pytest.raises(ValueError):
        PairPricer(info(8, 8), topology).price((R,), (R, R, R))


def test_the_optimizer_steps_fixed_cost_follows_the_memory_the_step_touches() -> None:
    """A step that stays in little memory pays the warm fixed cost, one past the churn the
    cold figure was timed after pays that, and one between is priced between (log scale)."""
    hardware = Hardware(
        **{
            **vars(CPU),
            "optimizer_step_us": 2000.0,
            "optimizer_step_warm_us": 500.0,
            "optimizer_warm_bytes": float(16 << 20),
            "optimizer_cold_bytes": float(256 << 20),
        }
    )
    assert hardware.optimizer_fixed_us(1 << 20) == 500.0
    assert hardware.optimizer_fixed_us(1 << 30) == 2000.0
    assert hardware.optimizer_fixed_us(64 << 20) == pytest.approx(1250.0)  # halfway in log
    # a profile without the warm figures (older, or a preset) pays one fixed cost
    older = Hardware(**{**vars(CPU), "optimizer_step_us": 2000.0})
    assert older.optimizer_fixed_us(1 << 20) == 2000.0
