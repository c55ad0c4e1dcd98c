"""Pipeline parallelism: a "pp" mesh dim cuts the model at its layer stack, each rank plans
its stage on the other dims, torch.distributed.pipelining's schedule runs the stages."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.pipeline_cases import CONFIG, initialized_model, reference, train_pipelined
from helpers.planning import run_cli
from helpers.runtime_cases import TOLERANCE
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.files.plan_json import plan_json
from autoparallel.models import Llama, llama_config
from autoparallel.report import render_html
from autoparallel.trace.stages import find_layer_stack, split_stages, stage_layer_counts
from autoparallel.types.pipeline import PipelineConfig, PipelineError


def test_pipelined_training_equals_one_device(ranks, tmp_path):
    """2 stages (pp) x 2 ranks splitting the rows (dp), 1F1B over 2 microbatches, the model
    planned on the meta device and each stage initialized by the model's init_weights: the
    initial values, the losses, the gradients of the first step and the parameters after two
    AdamW steps equal the single-device run, and a DCP checkpoint of the stages loads them
    back."""
    expected = reference()
    one_device = _initial_values()
    results = ranks(4).run(
        train_pipelined, "1f1b", 2, str(tmp_path), False, False, True, timeout_s=600
    )
    assert all(r["reloaded_equal"] for r in results)
    # the stages' checkpoint is the model's: its keys, no non-persistent buffer
    assert {k for r in results for k in r["state_keys"]} == set(initialized_model().state_dict())
    for result in results:  # the rotary tables too: the losses would differ otherwise
        assert result["initial"] and all(
            torch.equal(value, one_device[name]) for name, value in result["initial"].items()
        )
        assert result["whole_model_on_meta"]
    dp = 2
    assert [r["stage"] for r in results] == [0] * dp + [1] * dp  # pp is the outer dim
    assert results[0]["stages"] == (("layers.0",), ("layers.1",))
    last = [r for r in results if r["stage"] == 1]
    # the step's loss: the dp ranks' losses (each 1/dp of the mean) summed
    losses = [sum(r["losses"][step] for r in last) for step in range(len(expected["losses"]))]
    assert losses == pytest.approx(expected["losses"], abs=TOLERANCE)
    # the first stage holds the embedding and layer 0, the last layer 1, the norm and head
    assert set(results[0]["params"]) == {n for n in expected["params"] if ".1." not in n} - {
        "norm.weight",
        "output.weight",
    }
    for result in results:
        for name, value in result["params"].items():
            assert torch.allclose(value, expected["params"][name], atol=TOLERANCE), name
            assert torch.allclose(result["grads"][name], expected["grads"][name], atol=TOLERANCE)
    # on real ranks the stages' times are exchanged: every rank prices the same step
    costs = {r["pipeline"].cost for r in results}
    assert len(costs) == 1 and None not in costs
    (cost,) = costs
    assert len(cost.stage_microbatch_us) == 2 and cost.step_us > 2 * max(cost.stage_microbatch_us)
    # the cut's hidden states split by rows over dp on both sides
    assert "Shard(dim=0)" in last[0]["input_placements"][0]


def test_stages_split_over_tp_train_equal_to_one_device(ranks, tmp_path):
    """(pp, tp) = (2, 2): each stage's parameters as sharded over tp as they can be, both
    ranks of a stage fed the same rows, 1F1B over 2 microbatches: the losses, the first
    step's gradients and the parameters after the AdamW steps equal the single-device run."""
    expected = reference()
    results = ranks(4).run(train_pipelined, "1f1b", 2, str(tmp_path), inner="tp", timeout_s=600)
    assert any("Shard" in p for r in results for p in r["param_placements"].values())
    for result in results:
        if result["stage"] == 1:
            assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
        for name, value in result["params"].items():
            assert torch.allclose(value, expected["params"][name], atol=TOLERANCE), name
            assert torch.allclose(result["grads"][name], expected["grads"][name], atol=TOLERANCE)


@pytest.mark.parametrize(
    "schedule, layers, per_rank", [("gpipe", 2, None), ("interleaved-1f1b", 4, 2)]
)
def test_a_mesh_of_pp_alone_trains_equal_to_one_device(ranks, tmp_path, schedule, layers, per_rank):
    """Two ranks, nothing else split, 2 microbatches: GPipe with a stage per rank, and
    interleaved 1F1B with a 4-layer LLaMA cut into 4 stages, two per rank. Each rank loads
    its stages' entries of the one-device model's state dict: the losses and parameters
    equal one device's, and the order our pricing plays out is torch's schedule's own."""
    from autoparallel.cost.pipeline import rank_order

    expected = reference(n_layers=layers)
    results = ranks(2).run(
        train_pipelined,
        schedule,
        2,
        str(tmp_path),
        False,
        True,
        False,
        layers,
        per_rank,
        timeout_s=600,
    )
    per_rank = per_rank or 1
    assert [r["rank_stages"] for r in results] == [
        tuple(range(rank, 2 * per_rank, 2)) for rank in range(2)
    ]
    assert results[0]["stages"] == tuple(
        tuple(f"layers.{i}" for i in range(s, s + layers // (2 * per_rank)))
        for s in range(0, layers, layers // (2 * per_rank))
    )
    one_device = _initial_values(layers)
    for result in results:
        assert result["initial"] and all(
            torch.equal(value, one_device[name]) for name, value in result["initial"].items()
        )
    assert results[1]["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
    first, second = (set(r["params"]) for r in results)
    assert first | second == set(expected["params"]) and not first & second
    for result in results:
        assert result["reloaded_equal"]
        for name, value in result["params"].items():
            assert torch.allclose(value, expected["params"][name], atol=TOLERANCE), name
        for rank, order in result["order"].items():
            assert order == rank_order(schedule, rank, 2, per_rank, 2)


def _initial_values(n_layers: int = CONFIG.n_layers) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in initialized_model(n_layers).named_parameters()}


def test_stages_are_cut_at_the_layer_stack_and_the_model_is_left_as_it_was():
    with torch.device("meta"):
        model = Llama(CONFIG)
    assert find_layer_stack(model).keys == ("0", "1")
    tokens = torch.zeros(4, 32, dtype=torch.long)
    for _ in range(2):  # a second cut of the same model works: torch's marks were removed
        stages = split_stages(model, (tokens,), {}, 2)
    assert [s.layers for s in stages] == [("layers.0",), ("layers.1",)]
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    hidden, cos, sin = stages[1].example_inputs
    assert hidden.shape == (4, 32, CONFIG.dim) and hidden.requires_grad
    assert not stages[0].example_inputs[0].requires_grad  # integer tokens


def test_every_cut_of_one_microbatch_shape_comes_from_one_export_and_runs_the_model():
    """The planner prices several cuts of one microbatch shape: one torch.export serves them
    all, and each cut, run stage after stage, gives the model's output; values that skip a
    stage (the rotary tables) are passed on by the stages in between."""
    from autoparallel.trace.stages import StageTracer

    model = initialized_model(n_layers=4)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)
    )
    expected = model(tokens)
    tracer = StageTracer(model)
    for num_stages, layers in [(2, None), (2, (3, 1)), (4, None), (3, (1, 2, 1))]:
        stages = tracer.split((tokens,), {}, num_stages, layers)
        assert [len(s.layers) for s in stages] == list(layers or (4 // num_stages,) * num_stages)
        values = (tokens,)
        for stage in stages:
            out = stage.module(*values)
            values = out if isinstance(out, tuple) else (out,)
        assert torch.equal(values[0], expected)
    assert len(tracer._exports) == 1
    assert [len(s.example_inputs) for s in stages] == [1, 3, 3]  # the tables ride along


def test_a_tensor_held_under_two_names_is_cut_by_its_first_and_a_tie_is_named():
    """torchtitan's style keeps the rotary table as `freqs_cis` and `rope.cache`: the cut
    keeps the first name, every stage reading the table holds it, and the model keeps both
    names. Embeddings tied across the first and last stage cannot be cut: the error names
    the tie."""
    from autoparallel.models.titan_like import TitanArgs, TitanLlama

    tokens = torch.zeros(4, 32, dtype=torch.long)
    with torch.device("meta"):
        model = TitanLlama(TitanArgs())
    stages = split_stages(model, (tokens,), {}, 2)
    assert [s.layers for s in stages] == [("layers.0",), ("layers.1",)]
    assert all("freqs_cis" in dict(s.module.named_buffers()) for s in stages)
    assert model.rope.cache is model.freqs_cis
    with torch.device("meta"):
        tied = TitanLlama(TitanArgs(tie_embeddings=True))
    with pytest.raises(PipelineError, match="tok_embeddings.weight is output.weight"):
        split_stages(tied, (tokens,), {}, 2)
    assert tied.output.weight is tied.tok_embeddings.weight


def test_stage_layer_counts_and_their_errors():
    assert stage_layer_counts(10, 4) == (3, 3, 2, 2)
    assert stage_layer_counts(4, 2, (1, 3)) == (1, 3)
    with pytest.raises(PipelineError, match="asks for 3 stages but the model's stack has 2"):
        stage_layer_counts(2, 3)
    with pytest.raises(PipelineError, match="summing to the stack's 4 layers"):
        stage_layer_counts(4, 2, (1, 2))
    with pytest.raises(PipelineError, match="schedule must be one of gpipe, 1f1b"):
        PipelineConfig(schedule="zero-bubble")
    with pytest.raises(PipelineError, match="microbatches must be a positive int"):
        PipelineConfig(microbatches=0)


def _planner(fake_mesh, shape, names, batch=8):
    with torch.device("meta"):
        model = Llama(CONFIG)
    tokens = torch.zeros(batch, 32, dtype=torch.long)
    return AutoParallel(model, lambda: tokens, fake_mesh(shape, names), hardware="cpu")


def test_a_pipeline_that_cannot_run_is_refused_with_what_to_change(fake_mesh):
    with pytest.raises(PipelineError, match="must be the mesh's first"):
        _planner(fake_mesh, (2, 2), ("dp", "pp"))
    with pytest.raises(PipelineError, match="3 microbatches of the batch of 8"):
        with _planner(fake_mesh, (2, 2), ("pp", "dp")) as autop:
            autop.add_pipeline_constraint(microbatches=3)
    with pytest.raises(PipelineError, match="1F1B needs at least as many microbatches"):
        with _planner(fake_mesh, (2, 2), ("pp", "dp")) as autop:
            autop.add_pipeline_constraint(schedule="1f1b", microbatches=1)
    with _planner(fake_mesh, (2, 2), ("pp", "dp")) as autop:  # the schedule left open: GPipe
        assert autop.add_pipeline_constraint(microbatches=1).startswith("pipeline: gpipe, 1 ")
    with _planner(fake_mesh, (2, 2), ("pp", "dp")) as autop:
        autop.add_input_constraints([(Replicate(), Shard(0))])
        with pytest.raises(PipelineError, match="before the other constraints.*input:0"):
            autop.add_pipeline_constraint(schedule="gpipe")
        with pytest.raises(PipelineError, match="'pp' mesh dim must be Replicate"):
            autop.add_output_constraints([(Shard(0), Shard(0))])
    with _planner(fake_mesh, (2, 2), ("dp", "tp")) as autop:
        with pytest.raises(PipelineError, match="needs a mesh whose first dim is named 'pp'"):
            autop.add_pipeline_constraint(schedule="gpipe")


def test_a_pipelined_plan_says_its_stages(fake_mesh):
    """On a fake mesh, as one process plans for a cluster, this process is rank 0: its plan
    is the first stage's on dp, and it plans the last stage too to price the pipeline."""
    with _planner(fake_mesh, (2, 2), ("pp", "dp")) as autop:
        autop.add_pipeline_constraint(schedule="gpipe", microbatches=2)
        autop.add_input_constraints([(Replicate(), Shard(0))])
        plan = autop.optimize_placement()
    assert plan.mesh_dim_names == ("dp",) and plan.mesh_shape == (2,)
    assert plan.pipeline.describe().startswith(
        "gpipe, 2 microbatches, stage 0: layers.0, stage 1: layers.1; predicted step "
    )
    pipeline = plan_json(plan)["pipeline"]
    assert (pipeline["schedule"], pipeline["microbatches"], pipeline["stage_index"]) == (
        "gpipe",
        2,
        0,
    )
    assert pipeline["stages"] == [["layers.0"], ["layers.1"]]
    # both stages priced: the first's time is this plan's step less its optimizer; its send
    # of the hidden states delays the second stage's forward, not its own work
    cost = plan.pipeline.cost
    assert len(cost.stage_microbatch_us) == 2
    assert cost.stage_microbatch_us[0] == pytest.approx(
        plan.totals.total_us - plan.totals.optimizer_us
    )
    first = {(b.stage, b.kind, b.microbatch): b for b in cost.timeline}
    assert first[(1, "forward", 0)].start_us > first[(0, "forward", 0)].end_us
    # the schedule played out: 2 stages x 2 microbatches x (forward, backward), drawn in
    # the report's pipeline section
    assert len(cost.timeline) == 8
    assert cost.step_us >= max(b.end_us for b in cost.timeline)
    page = render_html(plan_json(plan))
    assert '<section id="pipeline">' in page and page.count("<rect ") == 8
    assert "(pp=2, dp=2), 4 devices" in page
    # GPipe: both microbatches' activations held at once, on every stage (the plan counts both)
    assert [m["in_flight"] for m in pipeline["stage_memory"]] == [2, 2]
    assert pipeline["memory"]["activations"] == pytest.approx(plan.memory.activations)
    assert "layers.1.attention.wq.weight" not in plan.param_placements
    assert "tok_embeddings.weight" in plan.param_placements
    # the hidden states leave the first stage split by rows over dp, as stage 1 takes them
    assert [str(p) for p in plan.output_placements[0]] == [str(Shard(0))]


def test_the_planner_prices_each_microbatch_count_and_keeps_the_fastest(fake_mesh):
    """Microbatches left open: every count from the stages (2) to four times that dividing
    the 4 rows each dp rank gets is planned, the user's constraints replayed on each, and
    the fastest kept (one layer per stage: no other split to try)."""
    with _planner(fake_mesh, (2, 2), ("pp", "dp")) as autop:
        autop.add_input_constraints([(Replicate(), Shard(0))])
        plan = autop.optimize_placement()
    options = plan.pipeline.options
    assert [(o.schedule, o.microbatches) for o in options[:2]] == [("1f1b", 2), ("1f1b", 4)]
    fastest = min(options, key=lambda o: o.step_us)
    assert plan.pipeline.microbatches == fastest.microbatches
    assert plan.pipeline.cost.step_us == pytest.approx(fastest.step_us)
    # the kept setting's own stage: its input rows are the chosen microbatch's, split over dp
    assert plan.input_placements[0] == (Shard(0),)
    assert autop.stage_setup.microbatch_rows == 8 // fastest.microbatches


def test_under_a_bf16_policy_a_stage_computes_in_bf16_and_owns_the_models_parameters(
    fake_mesh,
):
    """The stages are cut from the model traced computing in the policy's param_dtype: cut
    in float32, torch.export would record the norm's ``type_as`` and the rotary tables'
    ``.to(x.dtype)`` as float32 casts and the stage would compute its matmuls in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = Llama(CONFIG)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tokens = torch.zeros(8, 32, dtype=torch.long)
    mesh = fake_mesh((2, 2), ("pp", "dp"))
    with AutoParallel(model, lambda: tokens, mesh, policy, hardware="cpu") as autop:
        autop.add_pipeline_constraint(microbatches=2)
        matmuls = [n for n in autop.joint.graph.nodes if n.target is torch.ops.aten.mm.default]
        stage = autop.stage_setup.stage
    assert matmuls and {n.meta["val"].dtype for n in matmuls} == {torch.bfloat16}
    # the hidden states cross the cut in bf16 (what the next stage receives, and its price)
    assert autop.joint.user_outputs[0].meta["val"].dtype == torch.bfloat16
    for name, param in stage.module.named_parameters():
        assert param is model.get_parameter(name) and param.dtype == torch.float32, name
    assert stage.module.get_buffer("rope_cos") is model.get_buffer("rope_cos")


def test_the_command_plans_a_pipeline_stage_and_says_so(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "tiny", "--mesh", "2x2", "--mesh-names", "pp,dp"]
    result = run_cli(*args, "--batch", "8", "--seq", "32", "--no-save", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(
        r"pipeline: 2 stages, 1f1b, [24] microbatches \(stage 0: layers.0; stage 1: layers.1\)",
        result.stdout,
    )
    assert re.search(r"pipeline settings priced: 1f1b x2 .*; 1f1b x4 ", result.stdout)
    assert "mesh (pp=2, dp=2)" in result.stdout  # the whole mesh, though the plan is a stage's
    data = json.loads(out.read_text())
    assert data["pipeline"]["stage_index"] == 0 and data["mesh"]["dim_names"] == ["dp"]
    refused = run_cli(*args[:4], "2x2", "--batch", "8", "--seq", "32", "--schedule", "gpipe")
    assert refused.returncode != 0
    assert "need a mesh whose first dim is named pp" in refused.stderr
    assert data["inputs"][0]["placements"].startswith("S(0)")  # the microbatch's rows over dp


def test_the_pipeline_step_plays_out_the_schedule():
    from autoparallel.cost.pipeline import pipeline_cost, rank_order

    # 1F1B on stage 1 of 2 with 3 microbatches: one forward ahead, then B, F in turn
    assert rank_order("1f1b", 1, 2, 1, 3) == [
        (1, "forward", 0),
        (1, "backward", 0),
        (1, "forward", 1),
        (1, "backward", 1),
        (1, "forward", 2),
        (1, "backward", 2),
    ]
    assert rank_order("gpipe", 1, 2, 1, 2) == [
        (1, "forward", 0),
        (1, "forward", 1),
        (1, "backward", 0),
        (1, "backward", 1),
    ]
    # equal stages: (M + stages - 1) passes of f + b, under both schedules
    for schedule in ("gpipe", "1f1b"):
        cost = pipeline_cost(schedule, [10.0] * 3, [20.0] * 3, [1.0, 5.0, 2.0], microbatches=4)
        assert cost.step_us == (4 + 3 - 1) * 30.0 + 5.0
        assert cost.bubble_us == 6 * 30.0 - 4 * 30.0
        assert len(cost.timeline) == 3 * 4 * 2
    # by hand, 2 stages, 2 microbatches, 1F1B: stage 1 runs F0 1-2, B0 2-4, F1 4-5, B1 5-7;
    # stage 0 runs F0 0-1, F1 1-2, then B0 once stage 1's is done (4-6) and B1 (7-9)
    cost = pipeline_cost("1f1b", [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], microbatches=2)
    spans = [(b.stage, b.kind[0], b.microbatch, b.start_us, b.end_us) for b in cost.timeline]
    assert spans == [
        (0, "f", 0, 0.0, 1.0),
        (0, "f", 1, 1.0, 2.0),
        (0, "b", 0, 4.0, 6.0),
        (0, "b", 1, 7.0, 9.0),
        (1, "f", 0, 1.0, 2.0),
        (1, "b", 0, 2.0, 4.0),
        (1, "f", 1, 4.0, 5.0),
        (1, "b", 1, 5.0, 7.0),
    ]
    assert cost.step_us == 9.0


def test_a_stage_holds_the_activations_of_the_microbatches_its_schedule_keeps_in_flight(
    fake_mesh,
):
    from autoparallel.cost.pipeline import microbatches_in_flight

    # 1F1B: stage i runs (stages - i) forwards before its first backward; GPipe all of them
    assert [microbatches_in_flight("1f1b", i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight("1f1b", 0, 4, 2) == 2
    assert microbatches_in_flight("gpipe", 3, 4, 8) == 8
    # the stage's own memory model counts them: stage 0 of 2 holds 2 of 4 microbatches'
    # activations under 1F1B, all 4 under GPipe; the budget row sees the same bytes
    activations = {}
    for schedule in ("1f1b", "gpipe"):
        with _planner(fake_mesh, (2, 2), ("pp", "dp")) as autop:
            autop.add_pipeline_constraint(schedule=schedule, microbatches=4)
            plan = autop.optimize_placement()
        activations[schedule] = plan.memory.activations
        assert [m.in_flight for m in plan.pipeline.stage_memory] == (
            [2, 1] if schedule == "1f1b" else [4, 4]
        )
    assert activations["gpipe"] == pytest.approx(2 * activations["1f1b"])


def test_a_mesh_of_pp_alone_plans_each_stage_on_its_one_device(fake_mesh):
    with _planner(fake_mesh, (2,), ("pp",)) as autop:
        autop.add_pipeline_constraint(microbatches=2)
        autop.add_input_constraints([(Replicate(),)])  # written on the whole mesh: pp
        plan = autop.optimize_placement()
    assert plan.mesh_dim_names == ("dp",) and plan.mesh_shape == (1,)
    assert plan.pipeline.num_stages == 2 and len(plan.pipeline.cost.stage_microbatch_us) == 2


def test_middle_stages_are_planned_once_and_each_holds_its_own_microbatches(fake_mesh):
    """4 stages of one layer each: stages 1 and 2 plan alike and are planned once, but under
    1F1B stage 1 holds 3 microbatches' activations and stage 2 only 2."""
    with torch.device("meta"):
        model = Llama(llama_config("tiny", n_layers=4))
    tokens = torch.zeros(8, 32, dtype=torch.long)
    with AutoParallel(
        model, lambda: tokens, fake_mesh((4, 2), ("pp", "dp")), hardware="cpu"
    ) as autop:
        autop.add_pipeline_constraint(schedule="1f1b", microbatches=4)
        plan = autop.optimize_placement()
    memory, times = plan.pipeline.stage_memory, plan.pipeline.cost.stage_microbatch_us
    assert [m.in_flight for m in memory] == [4, 3, 2, 1]
    assert times[1] == times[2]
    assert memory[1].activations == pytest.approx(1.5 * memory[2].activations)
    assert memory[1].peak - memory[2].peak == pytest.approx(memory[2].activations / 2)


def test_the_layers_go_where_they_even_out_the_stages():
    import itertools

    from autoparallel.cost.pipeline import balanced_layers
    from autoparallel.types.pipeline import StagePrice

    # 2 layers each of 10 us; the first stage also runs 10 us of embedding, the last 50 of head
    prices = [StagePrice(base + 20.0, 0.0, 0.0, layer_us=10.0) for base in (10.0, 0, 0, 50.0)]
    split, slowest = balanced_layers(prices, (2, 2, 2, 2))
    assert split == (2, 3, 2, 1) and slowest == 60.0  # the head's stage, from 70

    def slowest(counts):
        return max(b + 10.0 * n for b, n in zip((10.0, 0, 0, 50.0), counts))

    every = [c for c in itertools.product(range(1, 6), repeat=4) if sum(c) == 8]
    assert slowest(split) == min(slowest(c) for c in every)
    unknown = [StagePrice(30.0, 0.0, 0.0)] * 2
    assert balanced_layers(unknown, (3, 1)) == ((3, 1), 30.0)


def test_the_planner_moves_layers_off_a_stage_its_head_slows(fake_mesh):
    """A vocabulary of 16384 makes the last stage's head outweigh several layers: after the
    even split (3, 3) the planner prices the split its stages' prices call for, and keeps
    it, being faster (one stage per rank: the schedule fixed)."""
    with torch.device("meta"):
        model = Llama(llama_config("tiny", n_layers=6, vocab_size=16384))
    tokens = torch.zeros(8, 32, dtype=torch.long)
    with AutoParallel(
        model, lambda: tokens, fake_mesh((2, 2), ("pp", "dp")), hardware="cpu"
    ) as autop:
        autop.add_pipeline_constraint(schedule="1f1b", microbatches=2)
        plan = autop.optimize_placement()
    even, balanced = plan.pipeline.options
    assert even.stage_layers == (3, 3) and balanced.stage_layers[1] < 3
    assert balanced.step_us < even.step_us
    assert tuple(len(layers) for layers in plan.pipeline.stages) == balanced.stage_layers
    assert plan.pipeline.cost.step_us == pytest.approx(balanced.step_us)


def test_the_fastest_setting_within_the_budget_is_kept():
    from autoparallel.cost.pipeline import choose_option
    from autoparallel.types.pipeline import PipelineOption

    options = [
        PipelineOption("1f1b", 2, 100.0, peak_bytes=50.0),
        PipelineOption("1f1b", 4, 80.0, peak_bytes=70.0),
        PipelineOption("1f1b", 8, None),  # a stage had no plan within the constraints
    ]
    assert choose_option(options, None) == 1
    tie = [*options, PipelineOption("1f1b", 4, 80.0, peak_bytes=60.0, stage_layers=(3, 1))]
    assert choose_option(tie, None) == 3  # as fast, less memory
    assert choose_option(options, 60.0) == 0
    assert choose_option(options, 40.0) == 0  # none fits: the smallest peak
    assert choose_option(options[2:], None) == -1


class _GlobalDrawLlama(Llama):
    """torchtitan's way: weights drawn by nn.init from torch's global generator."""

    def init_module(self, module: torch.nn.Module, generator: torch.Generator | None) -> None:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.trunc_normal_(module.weight, std=0.02)
        else:
            super().init_module(module, generator)


def test_a_stage_of_a_meta_model_is_initialized_by_the_models_own_init_weights():
    """The last stage, planned from a meta model: refused before to_empty; then the model's
    init_weights gives its norms the one-device values and its weights draws of the model's
    distribution, leaving the user's model on meta; a whole state dict
    loads this stage's entries, and one that does not fit is refused naming the keys."""
    from torch.distributed.tensor import distribute_tensor

    from autoparallel import InitError
    from autoparallel.runtime.launch import fake_mesh

    config = llama_config("tiny", n_layers=2)
    try:
        mesh = fake_mesh((2,), ("pp",), rank=1)
        with torch.device("meta"):
            model = _GlobalDrawLlama(config)
        tokens = torch.zeros(8, 32, dtype=torch.long)
        with AutoParallel(model, lambda: tokens, mesh, hardware="cpu") as autop:
            autop.add_pipeline_constraint(schedule="gpipe", microbatches=2)
            plan = autop.optimize_placement()
            pipe = autop.apply_placement(plan, loss_fn=lambda out, target: out.sum())
        assert plan.pipeline.stage_index == 1
        with pytest.raises(InitError, match="still on the meta device: call pipe.to_empty"):
            pipe.init_weights()
        pipe.to_empty(device="cpu")
        torch.manual_seed(0)
        pipe.init_weights()
        assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
        reference = _GlobalDrawLlama(config)
        torch.manual_seed(0)
        reference.init_weights()
        expected = dict(reference.named_parameters()) | dict(reference.named_buffers())
        stage = dict(pipe.module.named_parameters()) | dict(pipe.module.named_buffers())
        assert {"norm.weight", "output.weight"} <= set(stage)
        assert "rope_cos" not in stage  # the first stage slices the tables and passes them on

        def local_expected(name: str) -> torch.Tensor:
            tensor = stage[name]
            full = expected[name].detach()
            return distribute_tensor(full, tensor.device_mesh, tensor.placements).to_local()

        for name in ("norm.weight", "layers.1.ffn_norm.weight"):
            assert torch.equal(stage[name].to_local(), local_expected(name)), name
        weight = stage["layers.1.attention.wq.weight"].to_local().detach()
        assert 0.015 < float(weight.std()) < 0.025  # drawn, N(0, 0.02^2) truncated at +-2
        # the one-device model's state dict: this stage's entries, nothing else
        pipe.load_state_dict(reference.state_dict())
        for name, tensor in pipe.module.named_parameters():
            assert torch.equal(tensor.to_local(), local_expected(name)), name
        with pytest.raises(
            KeyError,
            match="missing this stage.s layers.1.attention_norm.weight, layers.1.attention.wq",
        ):
            pipe.load_state_dict({"tok_embeddings.weight": expected["tok_embeddings.weight"]})
        with pytest.raises(KeyError, match="keys of no tensor of the model: extra"):
            pipe.load_state_dict(reference.state_dict() | {"extra": torch.zeros(1)})
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_hugging_face_causal_lm_is_cut_and_planned(fake_mesh):
    """LlamaForCausalLM as it comes, on meta: its stages compute their cache positions and
    masks on the device they run on (export recorded meta), a model returning its key/value
    cache is refused with what to set, and pipe.step takes the batch by name."""
    pytest.importorskip("transformers")
    from autoparallel.models.hf_families import (
        NO_DROPOUT,
        build_hf_family,
        hf_family,
        hf_family_inputs,
    )

    family = hf_family("llama")
    inputs = hf_family_inputs(family, 8, 16, torch.Generator().manual_seed(0), False)
    model = build_hf_family(family, "meta", **NO_DROPOUT)
    with pytest.raises(PipelineError, match="set config.use_cache = False"):
        split_stages(model, (), {k: v[:4] for k, v in inputs.items()}, 2)
    model.config.use_cache = False
    mesh = fake_mesh((2, 2), ("pp", "dp"))
    with AutoParallel(model, lambda: inputs, mesh, hardware="cpu") as autop:
        plan = autop.optimize_placement()
        pipe = autop.apply_placement(plan, loss_fn=lambda output, target: output[0].sum())
    assert plan.pipeline.stages == (("model.layers.0",), ("model.layers.1",))
    assert not plan.fallbacks
    # the batch goes in by name as well (checked before anything runs)
    with pytest.raises(PipelineError, match=r"planned with inputs \['input_ids'\]; unknown"):
        pipe.step(input_ids=inputs["input_ids"], labels=inputs["input_ids"])
