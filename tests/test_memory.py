"""The memory model of a whole training step (problem/memory.py): what plan.memory counts,
the memory constraint that keeps the peak within a budget, and the bytes the parallel
module really holds (gloo ranks)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import meta
from helpers.planning import (
    TINY_PLAN_ARGS,
    Replicate,
    Shard,
    budget_only_recomputing_meets,
    run_cli,
)
from helpers.runtime_cases import memory_matches_plan

from autoparallel import AutoParallel, InfeasibleConstraintsError
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.optimizer import ShardingOptimizer
from autoparallel.report.html import render_html

IN, HIDDEN, BATCH = 256, 1024, 64
MLP_PARAMS = IN * HIDDEN + HIDDEN + HIDDEN * IN + IN  # fp32 elements


def _mlp(mesh, pin=None, budget=None, optimizer="adamw"):
    model = meta(lambda: MLP(IN, HIDDEN))
    autop = AutoParallel(model, lambda: torch.randn(BATCH, IN), mesh, hardware="h100")
    with autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        if pin is not None:
            for node in autop.sharding_optimizer.problem.joint.params.values():
                autop.sharding_optimizer.add_node_constraint(node, pin)
        if budget is not None:
            autop.add_memory_constraint(budget, optimizer)
        return autop, autop.optimize_placement()


def test_replicated_and_sharded_parameters_count_their_local_bytes(fake_mesh):
    mesh = fake_mesh((4,))
    _, ddp = _mlp(mesh, pin=(Replicate(),))
    _, fsdp = _mlp(mesh, pin=(Shard(0),))
    assert ddp.memory.parameters == 4 * MLP_PARAMS
    assert ddp.memory.gradients == 4 * MLP_PARAMS
    assert ddp.memory.optimizer_state == 2 * 4 * MLP_PARAMS  # AdamW: two moments
    assert fsdp.memory.parameters == 4 * MLP_PARAMS / 4
    assert fsdp.memory.optimizer_state == 2 * 4 * MLP_PARAMS / 4
    # the saved activations of a batch-sharded MLP: its input and hidden values, local rows
    assert ddp.memory.activations >= 4 * (BATCH // 4) * (IN + HIDDEN)
    assert ddp.memory.peak == pytest.approx(
        max(
            ddp.memory.parameters
            + ddp.memory.gradients
            + ddp.memory.optimizer_state
            + ddp.memory.transient,
            ddp.memory.parameters + ddp.memory.optimizer_state + ddp.memory.activations,
        )
    )
    assert ddp.memory.budget is None and ddp.memory.fits


@pytest.mark.parametrize("optimizer, state_elements", [("sgd", 0), ("sgd-momentum", 1), (12, 3)])
def test_the_optimizer_state_follows_the_optimizer(fake_mesh, optimizer, state_elements):
    _, plan = _mlp(fake_mesh((4,)), pin=(Replicate(),), budget=1e12, optimizer=optimizer)
    assert plan.memory.optimizer_state == state_elements * 4 * MLP_PARAMS


def test_a_budget_below_the_free_plans_peak_shards_until_it_fits(fake_mesh):
    mesh = fake_mesh((4,))
    _, free = _mlp(mesh)
    assert all(p == (Replicate(),) for p in free.param_placements.values())
    budget = 0.5 * free.memory.peak
    autop, fitted = _mlp(mesh, budget=budget)
    assert fitted.memory.peak <= budget
    assert fitted.memory.budget == budget
    assert any(p != (Replicate(),) for p in fitted.param_placements.values())
    assert "memory" in autop.sharding_optimizer.constraints()


def test_a_tighter_budget_never_gives_a_larger_peak(fake_mesh):
    mesh = fake_mesh((4,))
    _, free = _mlp(mesh)
    peaks, times = [], []
    for share in (0.9, 0.6, 0.4):
        budget = share * free.memory.peak
        _, fitted = _mlp(mesh, budget=budget)
        assert fitted.memory.peak <= budget
        peaks.append(fitted.memory.peak)
        times.append(fitted.solver.objective)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < free.memory.peak
    assert times == sorted(times)  # fitting in less memory never makes the step faster


def test_an_impossible_budget_names_the_smallest_peak(fake_mesh):
    with pytest.raises(InfeasibleConstraintsError, match="smallest peak any plan can reach"):
        _mlp(fake_mesh((4,)), budget=1e5)


@pytest.mark.parametrize(
    "budget, optimizer, needle", [(0, "adamw", "positive"), (1e9, "lion", "unknown optimizer")]
)
def test_bad_memory_constraints_say_what_is_wrong(fake_mesh, budget, optimizer, needle):
    with pytest.raises(ValueError, match=needle):
        _mlp(fake_mesh((4,)), budget=budget, optimizer=optimizer)


def test_the_memory_survives_save_and_load(fake_mesh, tmp_path):
    autop, plan = _mlp(fake_mesh((4,)), budget=1e12, optimizer="sgd-momentum")
    path = str(tmp_path / "problem.npz")
    autop.sharding_optimizer.save(path)
    loaded = ShardingOptimizer.load(path).get_solution()
    assert loaded.memory == plan.memory


def test_plan_json_log_and_html_show_the_memory(fake_mesh):
    autop, plan = _mlp(fake_mesh((4,)), budget=1e12)
    data = autop.sharding_optimizer.get_json()
    memory = data["memory"]
    assert memory["peak"] == pytest.approx(plan.memory.peak)
    assert memory["budget"] == 1e12 and memory["optimizer"] == "adamw"
    assert {"parameters", "gradients", "optimizer_state", "activations", "transient"} <= set(memory)
    html = render_html(json.loads(json.dumps(data)))
    assert 'id="memory"' in html and "Predicted peak" in html


def test_the_cli_plans_within_a_memory_budget(tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli(
        *TINY_PLAN_ARGS,
        *("--parameter-memory", "none", "--memory-budget", "64MiB", "--optimizer", "sgd"),
        *("--no-save", "--out", str(out)),
    )
    assert result.returncode == 0, result.stderr
    assert "memory: peak" in result.stdout and "budget 64.00 MiB" in result.stdout
    data = json.loads(out.read_text())
    assert data["memory"]["budget"] == 64 * 2**20 and data["memory"]["optimizer"] == "sgd"
    assert data["memory"]["peak"] <= 64 * 2**20 and "memory" in data["constraints"]
    assert data["run"]["memory_budget"] == f"{64 * 2**20} bytes"


def test_layers_fold_into_identical_rows(fake_mesh):
    """A repeated layer's memory rows are the same rows: the constraint stays a handful."""
    model = meta(lambda: Llama(llama_config("tiny", n_layers=4)))
    with AutoParallel(model, lambda: torch.randint(0, 256, (8, 32)), fake_mesh((2,))) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_memory_constraint(1e12)
        rows = autop.sharding_optimizer.problem.user_constraints["memory"].rows
        assert len(rows) <= 5


@pytest.mark.parametrize("kind", ["ddp-pinned", "fsdp", "recompute", "ddp-pinned-bf16"])
def test_predicted_memory_is_what_the_runtime_holds(ranks, kind):
    """Parameters, gradients, AdamW state and saved activations: the bytes plan.memory
    predicts are the bytes the parallel module holds after a step, on every rank (with
    the layers the solver chose recomputed in the backward, not saved; under a bf16
    policy, the replicated parameters' bf16 casts the backward reads among the saved
    activations)."""
    for result in ranks(2).run(memory_matches_plan, kind, timeout_s=240):
        assert bool(result["recompute"]) == (kind == "recompute")
        for name, measured in result["measured"].items():
            assert result["predicted"][name] == pytest.approx(measured, rel=1e-6), name


# ---------------------------------------------------------------------------- recomputation


def _tiny_llama_session(mesh, **config):
    model = meta(lambda: Llama(llama_config("tiny", n_layers=2, **config)))
    autop = AutoParallel(model, lambda: torch.randint(0, 256, (8, 32)), mesh, hardware="cpu")
    autop.__enter__()
    autop.add_input_constraints([(Shard(0),)])
    autop.add_output_constraints([(Shard(0),)])
    return autop


def test_the_solver_recomputes_layers_only_where_a_budget_needs_it(fake_mesh):
    autop = _tiny_llama_session(fake_mesh((2,)))
    free = autop.optimize_placement()
    autop.add_memory_constraint(1.05 * free.memory.peak, activation_checkpointing="auto")
    roomy = autop.optimize_placement()
    assert roomy.recompute == () and roomy.memory.recompute_us == 0
    autop.add_memory_constraint(1.05 * free.memory.peak, activation_checkpointing="all")
    every = autop.optimize_placement()  # every layer, whether it pays or not
    assert every.recompute == ("layers.0", "layers.1")
    assert every.totals.total_us > roomy.totals.total_us

    budget = budget_only_recomputing_meets(autop.sharding_optimizer)
    with pytest.raises(InfeasibleConstraintsError, match="smallest peak"):
        autop.add_memory_constraint(budget)  # no plan fits without recomputing
    autop.add_memory_constraint(budget, activation_checkpointing="auto")
    plan = autop.optimize_placement()
    assert plan.recompute and set(plan.recompute) <= {"layers.0", "layers.1"}
    assert plan.memory.recomputed == plan.recompute and plan.memory.peak <= budget
    by_layer = dict(plan.memory.activations_by_layer)
    kept = dict(roomy.memory.activations_by_layer)
    assert all(by_layer[layer] < kept[layer] for layer in plan.recompute)
    # recomputing costs its forward again: in the plan's compute and total
    assert plan.memory.recompute_us > 0
    compute = sum(n.compute_us for n in plan.nodes.values() if n.phase != "placeholder")
    assert plan.totals.compute_us == pytest.approx(
        compute + plan.totals.optimizer_us + plan.memory.recompute_us
    )
    autop.__exit__(None, None, None)


def test_the_log_json_and_html_name_the_recomputed_layers(fake_mesh):
    autop = _tiny_llama_session(fake_mesh((2,)))
    budget = budget_only_recomputing_meets(autop.sharding_optimizer)
    autop.add_memory_constraint(budget, activation_checkpointing="auto")
    plan = autop.optimize_placement()
    data = json.loads(json.dumps(autop.sharding_optimizer.get_json()))
    assert data["memory"]["recomputed"] == list(plan.recompute)
    assert data["memory"]["recompute_us"] == pytest.approx(plan.memory.recompute_us)
    from autoparallel.report.summary import memory_lines

    assert any("recomputed in the backward" in line for line in memory_lines(data))
    html = render_html(data)
    assert "Recomputed in the backward" in html and "(recomputed)" in html
    autop.__exit__(None, None, None)


def test_a_layer_that_draws_random_numbers_is_never_recomputed(fake_mesh):
    """Recomputing dropout in the backward would draw another mask: such layers keep their
    activations, and a budget only recomputing could meet is reported as infeasible."""
    autop = _tiny_llama_session(fake_mesh((2,)), dropout=0.1)
    free = autop.optimize_placement()
    budget = budget_only_recomputing_meets(autop.sharding_optimizer)
    with pytest.raises(InfeasibleConstraintsError, match="smallest peak"):
        autop.add_memory_constraint(budget, activation_checkpointing="auto")
    opt = autop.sharding_optimizer
    assert opt.problem.memory.recompute == ()  # no layer to recompute
    from autoparallel.graph.layers import RecomputeError
    from autoparallel.runtime.module import apply_placement

    with pytest.raises(RecomputeError, match="draws random numbers"):
        apply_placement(
            autop.model,
            opt.problem.joint,
            opt.problem.space,
            dataclasses.replace(free, recompute=("layers.0",)),
            autop.mesh,
        )
    autop.__exit__(None, None, None)


def test_activation_checkpointing_takes_off_auto_or_all_and_the_cli_needs_a_budget(fake_mesh):
    autop = _tiny_llama_session(fake_mesh((2,)))
    with pytest.raises(ValueError, match="activation_checkpointing"):
        autop.add_memory_constraint(1e12, activation_checkpointing="sometimes")
    autop.__exit__(None, None, None)
    result = run_cli(*TINY_PLAN_ARGS, "--activation-checkpointing", "auto", "--no-save")
    assert result.returncode != 0 and "needs --memory-budget" in result.stderr


def test_a_saved_problem_keeps_what_it_recomputes(fake_mesh, tmp_path):
    autop = _tiny_llama_session(fake_mesh((2,)))
    budget = budget_only_recomputing_meets(autop.sharding_optimizer)
    autop.add_memory_constraint(budget, activation_checkpointing="auto")
    plan = autop.optimize_placement()
    path = tmp_path / "problem.npz"
    autop.sharding_optimizer.save(str(path))
    autop.__exit__(None, None, None)
    loaded = ShardingOptimizer.load(str(path))
    assert loaded.get_solution().recompute == plan.recompute
    again = loaded.resolve()
    assert again.recompute == plan.recompute and again.memory.peak <= budget
