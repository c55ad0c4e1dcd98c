"""Calibration: the fit recovers known figures, a profile round-trips, a measured profile prices plans."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
import statistics
import time

import pytest
import torch
from conftest import meta
from helpers.planning import TINY_PLAN_ARGS, Replicate, Shard
from torch.distributed.tensor import Partial

from autoparallel import AutoParallel
from autoparallel.calibrate import measure
from autoparallel.calibrate.fit import CollectiveSample, fit_collective
from autoparallel.calibrate.run import _calibrate_rank
from autoparallel.calibrate.settings import CalibrationSettings
from autoparallel.cli import main
from autoparallel.cost import all_gather_us, all_reduce_us, reduce_scatter_us
from autoparallel.cost.compute import compute_cost_us, priced_by_table
from autoparallel.cost.hardware import CPU, CollectiveFit
from autoparallel.cost.matmul_table import MatmulTable
from autoparallel.cost.profile import ProfileError, load_profile, write_profile
from autoparallel.cost.topology import Topology
from autoparallel.models import MLP
from autoparallel.report.summary import hardware_lines
from autoparallel.runtime.timing import graph_clock
from autoparallel.types.tensors import TensorInfo

QUICK = CalibrationSettings(
    max_bytes=16 << 10,
    repeats=2,
    rounds=1,
    matmul_sizes=(64, 256),
    memory_probe_bytes=1 << 20,
    skinny_matmul_dim=8,
    optimizer_numel=1 << 14,
    optimizer_large_numel=1 << 16,
    runtime_parameters=(2, 8),
    matmul_grid=(16, 64),
    matmul_grid_calls=3,
)


def _ring_time(
    collective: str, ranks: int, nbytes: float, latency_us: float, bandwidth: float
) -> float:
    passes = 2 if collective == "all_reduce" else 1
    return (
        passes * (ranks - 1) * latency_us + passes * (ranks - 1) / ranks * nbytes / bandwidth * 1e6
    )


@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
def test_the_fit_recovers_latency_and_bandwidth_from_noisy_timings(collective):
    noise = random.Random(0)
    samples = [
        CollectiveSample(
            collective,
            ranks,
            nbytes,
            _ring_time(collective, ranks, nbytes, 300.0, 2e9) * noise.uniform(0.95, 1.05),
        )
        for ranks in (2, 4)
        for nbytes in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26)
    ]
    fit = fit_collective("intra", collective, samples)
    assert fit.latency_us == pytest.approx(300.0, rel=0.1)
    assert fit.bandwidth == pytest.approx(2e9, rel=0.1)
    assert 0.0 < fit.max_error < 0.1


def test_a_send_receive_is_fitted_as_one_message_each_way():
    """A point-to-point exchange pays its fixed cost once and moves its bytes once, whatever
    the dim's size: the pipeline's price of a cut (cost/pipeline.py's transfer_us)."""
    noise = random.Random(1)
    samples = [
        CollectiveSample("send_recv", 2, n, (40.0 + n / 3e9 * 1e6) * noise.uniform(0.97, 1.03))
        for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26)
    ]
    fit = fit_collective("intra", "send_recv", samples)
    assert fit.latency_us == pytest.approx(40.0, rel=0.1)
    assert fit.bandwidth == pytest.approx(3e9, rel=0.1)


def test_the_fit_stays_physical_at_the_ends():
    flat = [CollectiveSample("all_reduce", 2, n, 500.0) for n in (1 << 10, 1 << 12, 1 << 14)]
    latency_only = fit_collective("intra", "all_reduce", flat)
    assert latency_only.latency_us == pytest.approx(250.0) and latency_only.bandwidth > 1e15
    linear = [CollectiveSample("all_gather", 2, n, n / 1e3) for n in (1 << 20, 1 << 22, 1 << 24)]
    bandwidth_only = fit_collective("intra", "all_gather", linear)
    assert bandwidth_only.latency_us == pytest.approx(0.0, abs=1e-3)  # times proportional to bytes
    assert bandwidth_only.bandwidth == pytest.approx(0.5e9, rel=1e-6)  # (n-1)/n of 1 GB/s
    with pytest.raises(ValueError, match="no timing"):
        fit_collective("intra", "all_gather", [CollectiveSample("all_gather", 1, 1024, 5.0)])


def test_the_forward_share_of_the_runtimes_work_is_a_fraction():
    from autoparallel.calibrate.fit import fit_forward_share

    assert fit_forward_share([60.0, 140.0], [100.0, 300.0]) == pytest.approx(0.5)
    assert fit_forward_share([50.0], [0.0]) == 0.0  # nothing outside the graphs: no split
    assert fit_forward_share([120.0], [100.0]) == 1.0  # noise never makes it above 1
    assert fit_forward_share([-30.0], [100.0]) == 0.0


def _power_law_table(dims=(16, 64, 256)) -> MatmulTable:
    """A table whose warm time is m*k*n ns and cold time twice that: log-log interpolation
    is exact on a power law, so any shape's price is known."""
    shapes = [(m, k, n) for m in dims for k in dims for n in dims]
    warm = tuple(m * k * n * 1e-3 for m, k, n in shapes)
    return MatmulTable("float32", dims, warm, tuple(2 * t for t in warm), cold_bytes=1 << 20)


def test_the_matmul_table_prices_its_grid_and_interpolates_between():
    table = _power_law_table()
    assert table.time_us(64, 16, 256, nbytes=0) == pytest.approx(64 * 16 * 256e-3)  # warm
    assert table.time_us(64, 16, 256, nbytes=1 << 21) == pytest.approx(2 * 64 * 16 * 256e-3)
    assert table.time_us(64, 16, 256, nbytes=1 << 19) == pytest.approx(1.5 * 64 * 16 * 256e-3)
    assert table.time_us(32, 100, 200, nbytes=0) == pytest.approx(32 * 100 * 200e-3)
    # below the grid: the smallest dimension's time; above it: in proportion
    assert table.time_us(4, 16, 16, nbytes=0) == pytest.approx(16 * 16 * 16e-3)
    assert table.time_us(1024, 16, 16, nbytes=0) == pytest.approx(1024 * 16 * 16e-3)
    with pytest.raises(ValueError, match="warm_us has 2 times; 27 expected"):
        MatmulTable("float32", (16, 64, 256), (1.0, 2.0), table.cold_us, 1.0)


def test_a_calibrated_matmul_table_prices_matmuls():
    """Where the profile has a table, a matmul costs the table's time (no launch cost added
    on a synchronous host: the timings include it), scaled to its dtype's peak, times its
    batch; other ops keep the roofline."""
    table = _power_law_table()
    hardware = dataclasses.replace(CPU, matmul_table=table, synchronous_ops=True)
    a, b = TensorInfo((64, 256), torch.float32), TensorInfo((256, 16), torch.float32)
    out = TensorInfo((64, 16), torch.float32)
    nbytes = a.nbytes + b.nbytes + out.nbytes
    mm = compute_cost_us(torch.ops.aten.mm.default, (a, b), {}, out, hardware)
    assert mm == pytest.approx(table.time_us(64, 256, 16, nbytes))
    half = [TensorInfo(t.shape, torch.bfloat16) for t in (a, b, out)]
    bf16 = compute_cost_us(torch.ops.aten.mm.default, tuple(half[:2]), {}, half[2], hardware)
    assert bf16 == pytest.approx(
        table.time_us(64, 256, 16, nbytes / 2) * hardware.flops_fp32 / hardware.flops_bf16
    )
    batched = [TensorInfo((3, *t.shape), torch.float32) for t in (a, b, out)]
    bmm = compute_cost_us(torch.ops.aten.bmm.default, tuple(batched[:2]), {}, batched[2], hardware)
    assert bmm == pytest.approx(3 * mm)
    assert priced_by_table(torch.ops.aten.mm.default, (a, b), hardware)
    assert not priced_by_table(torch.ops.aten.mm.default, (a, b), CPU)
    assert compute_cost_us(torch.ops.aten.mm.default, (a, b), {}, out, CPU) != pytest.approx(mm)


def test_the_rounds_spread_names_the_widest_figures_and_flags_a_noisy_machine():
    from autoparallel.calibrate.run import NOISY_SPREAD, round_spread

    quiet = [
        {"what": "all_reduce", "nbytes": 1024, "mesh_dim": 0, "rounds_us": [100.0, 101.0, 99.0]},
        {"what": "matmul_rounds", "shape": [64, 64], "rounds_us": [10.0, 10.5, 10.0]},
        {"what": "block", "shape": [8, 32], "rounds_us": [50.0, 80.0, 60.0]},
        {"what": "view_op", "time_us": 3.0},  # timed once: no spread
    ]
    spread = round_spread(quiet)
    assert spread["figures"] == 3
    # the middle half of each figure's rounds over their median: 15 / 60 for the block
    assert spread["widest"][0] == {"figure": "block (8, 32)", "spread": 0.25}
    assert spread["median"] == 0.025 and not spread["noisy"]
    noisy = [dict(sample, rounds_us=[10.0, 20.0, 15.0]) for sample in quiet[:3]]
    assert round_spread(noisy)["median"] > NOISY_SPREAD and round_spread(noisy)["noisy"]
    assert round_spread(quiet[3:]) == {}


def test_the_graph_clock_refuses_a_module_that_is_not_parallel():
    with pytest.raises(TypeError, match="not a parallel module from apply_placement"):
        with graph_clock(MLP(4, 8)):
            pass


def test_a_profile_round_trips_through_json(tmp_path):
    fits = (
        CollectiveFit("intra", "all_reduce", 350.0, 2.5e9, 0.2),
        CollectiveFit("inter", "all_gather", 900.0, 1e8, 0.1),
    )
    hardware = dataclasses.replace(
        CPU,
        name="my-cluster",
        collectives=fits,
        devices_per_node=4,
        matmul_table=_power_law_table(),
    )
    path = tmp_path / "profile.json"
    write_profile(hardware, path, {"backend": "gloo"}, [{"what": "all_reduce", "time_us": 1.0}])
    loaded = load_profile(path)
    assert loaded == dataclasses.replace(hardware, source=str(path))
    data = json.loads(path.read_text())
    assert data["measured_on"] == {"backend": "gloo"} and len(data["samples"]) == 1


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda d: d.update(format="something else"), "not a hardware profile"),
        (lambda d: d.update(version=2), "version 2.*upgrade"),
        (lambda d: d["hardware"].update(flops_fp32=-1.0), r"hardware\.flops_fp32 must be positive"),
        (lambda d: d["hardware"]["collectives"][0].update(link="pcie"), r"collectives\[0\]\.link"),
        (
            lambda d: d["hardware"].update(overlap_fraction=1.5),
            r"hardware\.overlap_fraction must be within \[0, 1\]",
        ),
        (
            lambda d: d["hardware"].update(runtime_forward_share=-0.1),
            r"hardware\.runtime_forward_share must be within \[0, 1\]",
        ),
        (
            lambda d: d["hardware"].update(matmul_table={"dtype": "float32", "dims": [16, 64]}),
            r"hardware\.matmul_table lacks warm_us, cold_us, cold_bytes",
        ),
        (
            lambda d: d["hardware"].update(
                matmul_table={
                    "dtype": "float32",
                    "dims": [16, 64],
                    "warm_us": [1.0] * 8,
                    "cold_us": [1.0] * 7,
                    "cold_bytes": 1024,
                }
            ),
            r"hardware\.matmul_table: matmul table cold_us has 7 times; 8 expected",
        ),
    ],
)
def test_a_bad_profile_says_what_is_wrong(tmp_path, change, needle):
    path = tmp_path / "profile.json"
    fits = (CollectiveFit("intra", "all_reduce", 350.0, 2.5e9),)
    write_profile(dataclasses.replace(CPU, collectives=fits), path)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=needle):
        load_profile(path)


def _time_after_a_slow_gap(rank: int, world_size: int) -> tuple[float, int, int]:
    """A 2-rank all-reduce timed after a 200 ms gap on rank 1 only: (figure, gaps, calls)."""
    import torch.distributed as dist

    counts = {"gap": 0, "work": 0}
    buffer = torch.ones(4)

    def gap() -> None:
        counts["gap"] += 1
        if rank == 1:
            time.sleep(0.2)

    def work() -> None:
        counts["work"] += 1
        dist.all_reduce(buffer)

    figure = measure._mean_after_gap_us(work, gap, 2, torch.device("cpu"))
    return figure, counts["gap"], counts["work"]


def test_a_collective_is_timed_after_compute_with_the_wait_for_the_last_rank(ranks):
    """Each timed call follows the gap on every rank, the gap itself off the clock; rank 0,
    which arrives 200 ms early, waits for rank 1 on the clock, and the figure is the mean of
    the two ranks' (every rank gets the same figure): about 100 ms. Were the gap on the clock
    the figure would be about 200 ms; were rank 0's wait off it, about 0."""
    (figure_0, gaps_0, calls_0), (figure_1, gaps_1, calls_1) = ranks(2).run(
        _time_after_a_slow_gap, timeout_s=120
    )
    assert figure_0 == figure_1
    assert gaps_0 == calls_0 and gaps_1 == calls_1 and calls_0 > 1  # the warm-up's too
    # rank 0's wait (~200 ms) counts half; the sleep itself is not on rank 1's clock (the
    # bounds sit 50 ms either side of the two wrong answers: room for a loaded host)
    assert 50_000 < figure_0 < 150_000


def test_a_profile_measured_on_gloo_ranks_prices_the_plan(ranks, fake_mesh, tmp_path):
    calibration = ranks(2).run(_calibrate_rank, QUICK, timeout_s=240)[0]
    hardware = calibration.hardware
    assert {(f.link, f.collective) for f in hardware.collectives} == {
        ("intra", c)
        for c in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
    }
    # a pipeline's cut is priced on the measured send-receive, not on a collective's fit
    from autoparallel.cost.pipeline import transfer_us

    exchange = hardware.collective_fit("intra", "send_recv")
    topology = Topology((2,), hardware, gpus_per_node=2)
    assert transfer_us(1 << 20, topology) == pytest.approx(
        exchange.latency_us + (1 << 20) / exchange.bandwidth * 1e6
    )
    assert (
        hardware.flops_fp32 > 0 and hardware.kernel_launch_us > 0 and hardware.devices_per_node == 2
    )
    # a CPU host runs its ops synchronously; views and the optimizer step are measured
    assert hardware.synchronous_ops and hardware.view_op_us > 0
    # (each part of the fit alone may clamp to 0 when the ranks share a loaded host)
    optimizer = (
        hardware.optimizer_step_us
        + hardware.optimizer_us_per_tensor
        + hardware.optimizer_ns_per_element
    )
    assert optimizer > 0
    # the step's fixed part after little other work: timed, never above the churned one
    assert 0.0 <= hardware.optimizer_step_warm_us <= hardware.optimizer_step_us
    assert 0 < hardware.optimizer_warm_bytes < hardware.optimizer_cold_bytes
    assert any(s.get("churn_bytes") == hardware.optimizer_warm_bytes for s in calibration.samples)
    # the parallel module's own work outside its graphs: its probe ran at every count
    assert hardware.runtime_us_per_parameter + hardware.runtime_step_us > 0
    probes = [s for s in calibration.samples if s["what"] == "runtime_step"]
    assert [s["parameters"] for s in probes] == list(QUICK.runtime_parameters)
    # (measured against priced: a loaded host can time the roofline's probes slower than
    # the step itself, so only that both were taken)
    assert all(s["time_us"] > 0 and s["graphs_us"] > 0 for s in probes)
    # the graphs' time is measured inside the step (runtime/timing.graph_clock): a part of it
    assert all(
        s["graphs_us"] < s["time_us"] and s["forward_graphs_us"] < s["forward_us"] for s in probes
    )
    assert all(0 < s["forward_us"] and 0 < s["forward_graphs_us"] < s["graphs_us"] for s in probes)
    # the forward's share of that work is read off the same probes
    forward_outside = sum(s["forward_us"] - s["forward_graphs_us"] for s in probes)
    outside = sum(s["time_us"] - s["graphs_us"] for s in probes)
    expected_share = min(1.0, max(0.0, forward_outside / outside)) if outside > 0 else 0.0
    assert hardware.runtime_forward_share == pytest.approx(expected_share)
    # how much of an all-reduce hides behind compute: the median of the rounds measured
    overlaps = [s for s in calibration.samples if s["what"] == "overlap"]
    assert len(overlaps) == QUICK.rounds
    fractions = [
        measure.OverlapSample(s["comm_us"], s["compute_us"], s["both_us"]).fraction
        for s in overlaps
    ]
    assert hardware.overlap_fraction == pytest.approx(statistics.median(fractions))
    # every matmul of the grid timed warm and cold (a cold one never below its warm one)
    table = hardware.matmul_table
    assert table is not None and table.dims == QUICK.matmul_grid and table.dtype == "float32"
    # how far apart each figure's rounds lie is in the profile; one round has none to compare
    assert QUICK.rounds == 1 and calibration.measured_on["round_spread"] == {}
    assert all(0 < warm <= cold for warm, cold in zip(table.warm_us, table.cold_us))
    assert table.cold_bytes > 0
    path = tmp_path / "profile.json"
    calibration.write(path)

    # the collective prices are the fits' ring model, per collective
    topology = Topology((2,), load_profile(path), 2)
    fit = {f.collective: f for f in hardware.collectives}
    for price, name in ((all_reduce_us, "all_reduce"), (all_gather_us, "all_gather")):
        expected = _ring_time(name, 2, 1 << 20, fit[name].latency_us, fit[name].bandwidth)
        assert price(1 << 20, 0, topology) == pytest.approx(expected)

    # and a plan priced on the profile says so, prices its gradient all-reduces with the
    # fit, and differs from the cpu preset's
    def plan(hardware_name):
        model, mesh = meta(lambda: MLP(64, 256)), fake_mesh((2,))
        with AutoParallel(
            model, lambda: torch.randn(32, 64), mesh, hardware=hardware_name
        ) as autop:
            autop.add_input_constraints([(Shard(0),)])
            plan = autop.optimize_placement()
            return plan, autop.sharding_optimizer.get_json(), autop.sharding_optimizer.problem

    measured, data, problem = plan(str(path))
    preset, _, _ = plan("cpu")
    assert data["hardware"]["source"] == str(path) and data["hardware"]["gpus_per_node"] == 2
    assert len(data["hardware"]["collectives"]) == 5  # four collectives and the send-receive
    # its matmuls priced by the measured table, which the plan's JSON and log name
    assert data["hardware"]["matmul_table"]["shapes"] == len(QUICK.matmul_grid) ** 3
    assert any("matmuls priced by a measured table" in line for line in hardware_lines(data))
    assert measured.totals.compute_us != pytest.approx(preset.totals.compute_us)
    assert measured.totals.optimizer_us > 0 and preset.totals.optimizer_us == 0
    # the runtime's own work, and the forward's share of it, as the profile says
    totals = measured.totals
    assert totals.runtime_forward_us == pytest.approx(
        totals.runtime_us * hardware.runtime_forward_share
    )
    assert data["totals"]["runtime_forward_us"] == pytest.approx(totals.runtime_forward_us)
    assert measured.priced_on == hardware.name
    priced = 0
    for edge in problem.tables.edges:
        if edge.kind != "param_grad":
            continue
        value = edge.producer.meta["val"]
        nbytes = value.numel() * value.element_size()
        for i, j, comm, _ in edge.pairs:
            if edge.src_options[i] == (Partial(),) and edge.dst_options[j] == (Replicate(),):
                # the cheapest route on the fits: one all-reduce, or reduce-scatter + all-gather
                two_steps = reduce_scatter_us(nbytes, 0, topology) + all_gather_us(
                    nbytes, 0, topology
                )
                expected = min(all_reduce_us(nbytes, 0, topology), two_steps)
                assert comm == pytest.approx(expected, rel=1e-6, abs=0.1)
                priced += 1
    assert priced == 4, "every gradient's reduction is priced on the fits"


def test_the_cli_plans_on_a_profile_and_refuses_a_missing_one(tmp_path):
    path = tmp_path / "profile.json"
    write_profile(dataclasses.replace(CPU, name="my-cluster", devices_per_node=2), path)
    out = tmp_path / "plan.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([*TINY_PLAN_ARGS, "--hardware", str(path), "--no-save", "--out", str(out)])
        missing = main([*TINY_PLAN_ARGS, "--hardware", str(tmp_path / "nope.json")])
        unlaunched = main(["calibrate", "--out", str(tmp_path / "p.json")])
        pinned_unlaunched = main(["calibrate", "--pin-cores", "--out", str(tmp_path / "p.json")])
        bad_grid = main(
            [
                "calibrate",
                "--nproc",
                "2",
                "--matmul-grid",
                "64,16",
                "--out",
                str(tmp_path / "p.json"),
            ]
        )
    assert code == 0, stderr.getvalue()
    assert bad_grid == 2 and "--matmul-grid '64,16': give at least two rising" in stderr.getvalue()
    assert json.loads(out.read_text())["hardware"]["name"] == "my-cluster"
    assert f"priced on my-cluster (profile {path})" in stdout.getvalue()
    assert missing == 2 and "no such hardware profile" in stderr.getvalue()
    assert unlaunched == 2 and "--nproc" in stderr.getvalue()
    assert (
        pinned_unlaunched == 2 and "--pin-cores binds the ranks --nproc spawns" in stderr.getvalue()
    )
