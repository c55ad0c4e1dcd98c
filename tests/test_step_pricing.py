"""What a step costs beyond the collectives: fixed cost per op on a synchronous host, small
matmuls, the optimizer step on each parameter's local shard, and the runtime's gradient
buckets; plus measure_step beside the plan's prediction."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import meta
from helpers.planning import Replicate, Shard

from autoparallel import AutoParallel, measure_step
from autoparallel.calibrate.fit import fit_optimizer_step, fit_runtime_overhead
from autoparallel.cost.compute import compute_cost_us
from autoparallel.cost.hardware import CPU
from autoparallel.models import MLP
from autoparallel.types.bucketing import capped_buckets
from autoparallel.types.tensors import TensorInfo

aten = torch.ops.aten
SYNCHRONOUS = dataclasses.replace(
    CPU, name="host", synchronous_ops=True, kernel_launch_us=10.0, view_op_us=3.0
)


def _add_cost(hardware, numel: int) -> float:
    x = TensorInfo((numel,), torch.float32)
    return compute_cost_us(aten.add.Tensor, (x, x), {}, x, hardware)


def test_a_synchronous_host_adds_the_fixed_cost_and_charges_views():
    numel = 1 << 20  # 12 MiB moved: well above the launch cost
    roofline_us = 3 * 4 * numel / CPU.memory_bandwidth * 1e6
    assert _add_cost(CPU, numel) == pytest.approx(roofline_us)  # max(roofline, launch)
    assert _add_cost(SYNCHRONOUS, numel) == pytest.approx(roofline_us + 10.0)
    assert _add_cost(CPU, 1) == pytest.approx(CPU.kernel_launch_us)
    x = TensorInfo((4, 8), torch.float32)
    assert compute_cost_us(aten.view.default, (x, [32]), {}, x, CPU) == 0.0
    assert compute_cost_us(aten.view.default, (x, [32]), {}, x, SYNCHRONOUS) == 3.0


def test_small_matmuls_run_below_the_peak():
    half = dataclasses.replace(CPU, matmul_half_dim=64.0)  # compute-bound shapes on CPU
    skinny_a, b = TensorInfo((64, 4096), torch.float32), TensorInfo((4096, 4096), torch.float32)
    out = TensorInfo((64, 4096), torch.float32)
    at_peak = compute_cost_us(aten.mm.default, (skinny_a, b), {}, out, CPU)
    assert at_peak == pytest.approx(2 * 64 * 4096 * 4096 / CPU.flops_fp32 * 1e6)
    assert compute_cost_us(aten.mm.default, (skinny_a, b), {}, out, half) == pytest.approx(
        2 * at_peak  # M = 64 = the half dim: half the rate
    )
    square = TensorInfo((4096, 4096), torch.float32)
    slower = compute_cost_us(aten.mm.default, (square, square), {}, square, half)
    assert slower == pytest.approx(
        compute_cost_us(aten.mm.default, (square, square), {}, square, CPU) * (4096 + 64) / 4096
    )


def test_the_optimizer_fit_recovers_its_parts():
    def step_us(tensors, numel):
        return 500.0 + 40.0 * tensors + 0.006 * tensors * numel

    fit = fit_optimizer_step({(4, 256): step_us(4, 256), (32, 256): step_us(32, 256),
                              (4, 1 << 20): step_us(4, 1 << 20)})  # fmt: skip
    assert fit.step_us == pytest.approx(500.0)
    assert fit.us_per_tensor == pytest.approx(40.0)
    assert fit.ns_per_element == pytest.approx(6.0)
    with pytest.raises(ValueError, match="need"):
        fit_optimizer_step({(4, 256): 1.0})


def test_the_optimizer_fit_recovers_a_higher_rate_on_large_tensors():
    """A host that pays 6 ns per element up to 1 Mi elements and 9 ns on 4 Mi-element
    tensors: the fit gives both rates, and the priced step follows the size of the tensor
    (the base rate below, the large rate above, in between in log size)."""
    rate = {256: 6.0, 1 << 20: 6.0, 1 << 22: 9.0}

    def step_us(tensors, numel):
        return 500.0 + 40.0 * tensors + rate[numel] * 1e-3 * tensors * numel

    runs = {(t, n): step_us(t, n) for t, n in ((4, 256), (32, 256), (4, 1 << 20), (4, 1 << 22))}
    fit = fit_optimizer_step(runs)
    assert (fit.base_numel, fit.large_numel) == (1 << 20, 1 << 22)
    assert fit.ns_per_element == pytest.approx(6.0)
    assert fit.ns_per_element_large == pytest.approx(9.0, rel=1e-3)
    host = dataclasses.replace(
        CPU,
        optimizer_us_per_tensor=40.0,
        optimizer_ns_per_element=6.0,
        optimizer_base_numel=float(1 << 20),
        optimizer_large_numel=float(1 << 22),
        optimizer_ns_per_element_large=9.0,
    )
    assert host.optimizer_us(1 << 10) == pytest.approx(40.0 + 6.0 * (1 << 10) / 1e3)
    assert host.optimizer_us(1 << 23) == pytest.approx(40.0 + 9.0 * (1 << 23) / 1e3)
    assert host.optimizer_ns_per_element_at(1 << 21) == pytest.approx(7.5)
    with pytest.raises(ValueError, match="need the runs"):
        fit_optimizer_step({**runs, (32, 1 << 22): 1.0})


def test_the_op_model_fits_recover_a_known_host():
    """Timings made by the model itself on a known host (fixed cost 12 us per op, 3 GB/s for
    small ops) give back that fixed cost from the tiny block and that bandwidth from the
    training-sized one, from a roofline that starts at the streaming probe's 20 GB/s."""
    from autoparallel.calibrate.fit import block_charge_us, fit_graph_bandwidth, fit_op_overhead
    from autoparallel.calibrate.measure_device import TINY_BLOCK, TRAINING_BLOCK, traced_block

    host = dataclasses.replace(SYNCHRONOUS, kernel_launch_us=12.0, memory_bandwidth=3e9)
    probe = dataclasses.replace(host, kernel_launch_us=0.0, memory_bandwidth=20e9)
    tiny = traced_block(TINY_BLOCK, torch.device("cpu")).graph
    training = traced_block(TRAINING_BLOCK, torch.device("cpu")).graph
    # the tiny block priced at the probe's bandwidth: its roofline is a small part of it
    tiny_us = block_charge_us(tiny, dataclasses.replace(host, memory_bandwidth=20e9))[0]
    overhead = fit_op_overhead(tiny, tiny_us, probe)
    assert overhead == pytest.approx(12.0)
    training_us = block_charge_us(training, host)[0]
    bandwidth = fit_graph_bandwidth(
        training, training_us, dataclasses.replace(probe, kernel_launch_us=overhead)
    )
    assert bandwidth == pytest.approx(3e9, rel=1e-3)
    # a graph faster than the probe predicts keeps the probe's figure
    assert fit_graph_bandwidth(training, 1.0, probe) == probe.memory_bandwidth


PRICED_OPTIMIZER = dataclasses.replace(
    CPU,
    name="cpu-with-optimizer",
    optimizer_step_us=500.0,
    optimizer_us_per_tensor=40.0,
    optimizer_ns_per_element=6.0,
)


@pytest.mark.parametrize("placement, share", [(Replicate(), 1.0), (Shard(0), 0.5)])
def test_the_optimizer_step_is_priced_on_each_local_shard(fake_mesh, placement, share):
    model, mesh = meta(lambda: MLP(64, 256)), fake_mesh((2,))
    with AutoParallel(model, lambda: torch.randn(32, 64), mesh, hardware=PRICED_OPTIMIZER) as autop:
        autop.add_input_constraints([(Shard(0),)])
        joint = autop.sharding_optimizer.problem.joint
        for node in joint.params.values():
            autop.sharding_optimizer.add_node_constraint(node, (placement,))
        plan = autop.optimize_placement()
        data = autop.sharding_optimizer.get_json()
    numels = [math.prod(node.meta["val"].shape) for node in joint.params.values()]
    expected = 500.0 + sum(40.0 + share * numel * 6.0 / 1e3 for numel in numels)
    assert plan.totals.optimizer_us == pytest.approx(expected)
    assert plan.priced_on == "cpu-with-optimizer"
    assert data["totals"]["optimizer_us"] == pytest.approx(expected)
    # the optimizer step is part of compute, and so of the total
    assert plan.totals.compute_us >= plan.totals.optimizer_us
    assert plan.totals.total_us == pytest.approx(
        plan.totals.compute_us + plan.totals.comm_us + plan.totals.transition_us
    )


def test_the_presets_do_not_price_the_optimizer_step(fake_mesh):
    model, mesh = meta(lambda: MLP(64, 256)), fake_mesh((2,))
    with AutoParallel(model, lambda: torch.randn(32, 64), mesh, hardware="cpu") as autop:
        plan = autop.optimize_placement()
    assert plan.totals.optimizer_us == 0.0 and plan.priced_on == "cpu"
    assert plan.totals.runtime_us == 0.0


def test_the_runtime_fit_recovers_its_parts():
    outside = {count: 150.0 + 12.5 * count for count in (4, 16, 64)}
    fit = fit_runtime_overhead(outside)
    assert fit.step_us == pytest.approx(150.0) and fit.us_per_parameter == pytest.approx(12.5)
    assert fit.max_error == pytest.approx(0.0, abs=1e-9)
    noisy = fit_runtime_overhead({4: 200.0, 16: 330.0, 64: 950.0})
    assert noisy.max_error > 0.01 and noisy.us_per_parameter > 0
    # a run that says "less work with more parameters" must not price parameters negative
    assert fit_runtime_overhead({4: 300.0, 64: 100.0}).us_per_parameter == 0.0
    with pytest.raises(ValueError, match="two parameter counts"):
        fit_runtime_overhead({4: 100.0})


def test_the_runtimes_own_work_is_part_of_the_step(fake_mesh):
    """Its fixed part once per step and its part per trained parameter, in compute and the
    total, in the JSON and the summary; the placements it does not depend on stay."""
    from autoparallel.report.summary import summary_lines

    host = dataclasses.replace(
        CPU, name="host-with-runtime", runtime_step_us=300.0, runtime_us_per_parameter=20.0
    )
    model, mesh = meta(lambda: MLP(64, 256)), fake_mesh((2,))
    plans = {}
    for hardware in ("cpu", host):
        with AutoParallel(model, lambda: torch.randn(32, 64), mesh, hardware=hardware) as autop:
            autop.add_input_constraints([(Shard(0),)])
            plans[hardware if isinstance(hardware, str) else "host"] = autop.optimize_placement()
            data = autop.sharding_optimizer.get_json()
    plan, preset = plans["host"], plans["cpu"]
    parameters = len(plan.param_placements)
    assert plan.totals.runtime_us == pytest.approx(300.0 + 20.0 * parameters)
    assert plan.totals.compute_us == pytest.approx(
        preset.totals.compute_us + plan.totals.runtime_us
    )
    assert plan.totals.total_us == pytest.approx(preset.totals.total_us + plan.totals.runtime_us)
    assert plan.param_placements == preset.param_placements
    assert data["totals"]["runtime_us"] == pytest.approx(plan.totals.runtime_us)
    assert data["hardware"]["runtime_us_per_parameter"] == 20.0
    summary = "\n".join(summary_lines(data))
    assert "runtime's own work outside its graphs" in summary
    assert "per trained parameter" in summary


def test_gradient_buckets_close_in_order_once_full():
    """As DDP's: a bucket closes with the gradient that fills it, so a large gradient goes
    out as soon as it is final; the first bucket closes at its own, smaller cap."""
    mib = 1 << 20
    sizes = [10 * mib, 10 * mib, 10 * mib, 40 * mib, 1 * mib]
    assert capped_buckets([0, 1, 2, 3, 4], sizes, 25 * mib) == [[0, 1, 2], [3], [4]]
    assert capped_buckets([7, 8], [mib, mib], 25 * mib) == [[7, 8]]
    assert capped_buckets([0, 1, 2], [4096, 16 * mib, 4096], 25 * mib, mib) == [[0, 1], [2]]


def test_measure_step_times_the_step_beside_the_prediction(fake_mesh):
    calls = []
    timing = measure_step(lambda: calls.append(1), None, steps=4, warmup=2)
    assert len(calls) == 6 and len(timing.step_ms) == 4
    assert timing.predicted_ms is None and timing.error is None
    assert str(timing).startswith("measured")
    # this rank's own median is the only one here: no skew between ranks
    assert timing.rank_median_ms[0] == pytest.approx(timing.median_ms) and timing.skew == 0.0

    model, mesh = meta(lambda: MLP(64, 256)), fake_mesh((2,))
    with AutoParallel(model, lambda: torch.randn(32, 64), mesh, hardware="cpu") as autop:
        plan = autop.optimize_placement()
    timing = measure_step(lambda: None, plan, steps=2, warmup=0)
    assert timing.predicted_ms == pytest.approx(plan.totals.total_us / 1e3)
    assert timing.first_step_ms is None and timing.error > 0  # a no-op beats any plan
    assert "priced on cpu" in str(timing)
    with pytest.raises(ValueError, match="steps >= 1"):
        measure_step(lambda: None, steps=0)


def _uneven_steps(rank: int, world_size: int) -> tuple:
    """Rank 1's step takes 20 ms longer than rank 0's: its own median says so."""
    import time as clock

    timing = measure_step(lambda: clock.sleep(0.02 * rank), steps=3, warmup=1)
    return timing.rank_median_ms, timing.median_ms, timing.skew


def test_measure_step_reports_every_ranks_own_median(ranks):
    results = ranks(2).run(_uneven_steps)
    medians, slowest, skew = results[0]
    assert results[1][0] == medians  # every rank reports the same figures
    assert len(medians) == 2 and medians[1] > medians[0] + 15.0
    assert slowest >= medians[1] * 0.99 and skew >= -0.01
