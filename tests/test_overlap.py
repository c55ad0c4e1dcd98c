"""Communication the runtime overlaps with compute is charged only for its exposed part
(problem/overlap.py): plans, totals, reports and saved problems."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import meta
from helpers.planning import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.cost.hardware import H100
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.optimizer import ShardingOptimizer

NO_OVERLAP = dataclasses.replace(H100, name="h100-no-overlap", overlap_fraction=0.0)


def _mlp_plan(mesh, hardware):
    """The MLP 1024 -> 4096 -> 1024 of the overlap issue, batch 32 x 128, no memory limit."""
    model = meta(lambda: MLP(1024, 4096, 1024))
    autop = AutoParallel(model, lambda: torch.randn(32, 128, 1024), mesh, hardware=hardware)
    with autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        return autop, autop.optimize_placement()


def test_the_mlp_plans_ddp_once_its_gradient_reduction_hides(fake_mesh):
    """Charged in full, DDP's all-reduce loses to tensor parallelism; priced as the runtime
    runs it (the second layer's gradients reduce during the first layer's backward), the
    replicated plan wins, as it does on a real cluster."""
    mesh = fake_mesh((4,))
    _, charged = _mlp_plan(mesh, NO_OVERLAP)
    _, overlapped = _mlp_plan(mesh, "h100")
    assert any(p != (Replicate(),) for p in charged.param_placements.values())
    assert charged.totals.hidden_comm_us == 0.0 and not charged.overlaps
    assert all(p == (Replicate(),) for p in overlapped.param_placements.values())
    hidden = [o for o in overlapped.overlaps if o.phase == "backward"]
    assert hidden and "w2.weight" in hidden[0].comm
    assert overlapped.solver.objective <= charged.solver.objective + 1e-9


def test_totals_leave_the_hidden_part_out(fake_mesh):
    _, plan = _mlp_plan(fake_mesh((4,)), "h100")
    totals = plan.totals
    assert totals.hidden_comm_us == pytest.approx(sum(o.hidden_us for o in plan.overlaps))
    assert totals.hidden_comm_us > 0
    for overlap in plan.overlaps:  # fraction x the smaller of comm and compute
        assert overlap.hidden_us == pytest.approx(
            H100.overlap_fraction * min(overlap.comm_us, overlap.compute_us)
        )
    assert totals.total_us == pytest.approx(
        totals.compute_us + totals.comm_us + totals.transition_us - totals.hidden_comm_us
    )
    assert totals.exposed_comm_us == pytest.approx(totals.comm_us - totals.hidden_comm_us)
    assert totals.total_us == pytest.approx(plan.solver.objective, rel=1e-6)


def test_the_report_and_json_show_hidden_and_exposed_comm(fake_mesh):
    autop, plan = _mlp_plan(fake_mesh((4,)), "h100")
    data = autop.sharding_optimizer.get_json()
    assert data["totals"]["hidden_comm_us"] == pytest.approx(plan.totals.hidden_comm_us)
    assert data["totals"]["exposed_comm_us"] == pytest.approx(plan.totals.exposed_comm_us)
    assert data["overlaps"][0]["phase"] == "backward" and data["overlaps"][0]["hidden_us"] > 0
    from autoparallel.report.html import render_html
    from autoparallel.report.summary import totals_lines

    assert any(line.startswith("overlap: ") for line in totals_lines(data))
    assert "runs behind compute" in render_html(data)


def test_forward_gathers_hide_behind_the_previous_layer(fake_mesh):
    """An FSDP-style plan: each layer's gathers run during the previous layer's forward."""
    config = llama_config("tiny", n_layers=4)
    model = meta(lambda: Llama(config))
    autop = AutoParallel(
        model, lambda: torch.randint(0, config.vocab_size, (8, 32)), fake_mesh((2,))
    )
    with autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
    forward = [o for o in plan.overlaps if o.phase == "forward"]
    assert [o.comm for o in forward] == [f"parameter gathers of layers.{i}" for i in range(4)]
    assert forward[1].during == "forward of layers.0"
    assert all(o.hidden_us > 0 for o in forward)


def test_a_saved_problem_keeps_its_overlap(fake_mesh, tmp_path):
    autop, plan = _mlp_plan(fake_mesh((4,)), "h100")
    path = tmp_path / "problem.npz"
    autop.sharding_optimizer.save(str(path))
    loaded = ShardingOptimizer.load(str(path))
    assert loaded.get_solution().totals.hidden_comm_us == pytest.approx(plan.totals.hidden_comm_us)
    again = loaded.resolve()
    assert again.totals.total_us == pytest.approx(plan.totals.total_us, rel=1e-6)
    assert again.param_placements == plan.param_placements
