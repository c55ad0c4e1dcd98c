"""Several pipeline stages per rank: interleaved 1F1B planned, priced in torch's own order,
and refused with what to change where it cannot run. (Training under it, equal to one
device: tests/test_pipeline.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.pipeline_cases import torch_order

from autoparallel import AutoParallel
from autoparallel.cost.pipeline import microbatches_in_flight, pipeline_cost, rank_order
from autoparallel.models import Llama, llama_config
from autoparallel.types.pipeline import PipelineConfig, PipelineError


def _torch_order(ranks: int, per_rank: int, microbatches: int) -> dict[int, list]:
    """torch's ScheduleInterleaved1F1B's order of every rank's passes, built on rank 0 of
    a fake process group (nothing runs)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    group = dist.new_group(list(range(ranks)))
    stages = [
        PipelineStage(torch.nn.Linear(2, 2), k * ranks, ranks * per_rank, "cpu", group=group)
        for k in range(per_rank)
    ]
    schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=lambda out, tgt: out.sum())
    return torch_order(schedule)


def test_the_priced_order_of_passes_is_torchs(fake_mesh):
    fake_mesh((4,), ("pp",))
    for ranks, per_rank, microbatches in [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 2, 3)]:
        order = _torch_order(ranks, per_rank, microbatches)
        for rank in range(ranks):
            assert order[rank] == rank_order(
                "interleaved-1f1b", rank, ranks, per_rank, microbatches
            ), (ranks, per_rank, microbatches, rank)


def test_two_stages_per_rank_halve_the_bubble_and_hold_more_in_flight():
    # 2 ranks, 4 microbatches: 1F1B with stages of f + b = 3 against 4 stages of half as much
    one = pipeline_cost("1f1b", [1.0] * 2, [2.0] * 2, [0.0] * 2, 4)
    two = pipeline_cost("interleaved-1f1b", [0.5] * 4, [1.0] * 4, [0.0] * 4, 4, 2)
    assert one.bubble_us == 3.0 and two.bubble_us == 1.5  # (ranks - 1) * (f + b) / v
    assert two.step_us == one.step_us - 1.5
    # every pass of the 4 stages is placed, each rank's stages on its own row
    assert len(two.timeline) == 4 * 4 * 2
    # rank 0 runs stages 0 and 2: its warmup holds all four microbatches of stage 0
    assert [microbatches_in_flight("interleaved-1f1b", s, 4, 4, 2) for s in range(4)] == [
        4,
        3,
        2,
        1,
    ]
    # a rank's optimizer steps every one of its stages
    stepped = pipeline_cost("interleaved-1f1b", [0.5] * 4, [1.0] * 4, [1.0, 2.0, 3.0, 4.0], 4, 2)
    assert stepped.step_us == two.step_us + 2.0 + 4.0


def _planner(fake_mesh, layers: int = 4) -> AutoParallel:
    with torch.device("meta"):
        model = Llama(llama_config("tiny", n_layers=layers))
    tokens = torch.zeros(8, 32, dtype=torch.long)
    return AutoParallel(model, lambda: tokens, fake_mesh((2, 2), ("pp", "dp")), hardware="cpu")


def test_two_stages_per_rank_are_planned_and_each_priced(fake_mesh):
    with _planner(fake_mesh) as autop:
        said = autop.add_pipeline_constraint(stages_per_rank=2, microbatches=4)
        assert said.startswith("pipeline: interleaved-1f1b, 4 microbatches, 2 stages per rank")
        plan = autop.optimize_placement()
    pipeline = plan.pipeline
    assert pipeline.schedule == "interleaved-1f1b" and pipeline.stages_per_rank == 2
    assert pipeline.stages == tuple((f"layers.{i}",) for i in range(4))
    assert pipeline.rank_stages == (0, 2) and pipeline.is_first and not pipeline.is_last
    assert [m.in_flight for m in pipeline.stage_memory] == [4, 3, 2, 1]
    # this rank's second stage is planned too, ready for apply_placement
    ((other, stage_plan),) = autop._local_stages
    assert other.stage_setup.stage.index == 2 and stage_plan.param_placements
    assert {b.stage for b in pipeline.cost.timeline} == {0, 1, 2, 3}
    # the report draws one row per pp rank, each block naming its stage and microbatch
    from autoparallel.files.plan_json import plan_json
    from autoparallel.report import render_html

    page = render_html(plan_json(plan))
    assert "rank 1</text>" in page and "rank 2</text>" not in page
    assert ">2:0</text>" in page and "(2 per pp rank" in page


def test_the_planner_prices_two_stages_per_rank_beside_one(fake_mesh):
    with _planner(fake_mesh) as autop:
        autop.add_pipeline_constraint(microbatches=2)
        plan = autop.optimize_placement()
    per_rank = {o.stages_per_rank: o for o in plan.pipeline.options}
    assert set(per_rank) == {1, 2}
    assert per_rank[2].schedule == "interleaved-1f1b" and per_rank[2].stage_layers == (1,) * 4
    kept = min(per_rank.values(), key=lambda o: o.step_us)
    assert plan.pipeline.stages_per_rank == kept.stages_per_rank
    # a stack of 2 layers has none to spare for a second stage per rank
    with _planner(fake_mesh, layers=2) as autop:
        autop.add_pipeline_constraint(microbatches=2)
        plan = autop.optimize_placement()
    assert {o.stages_per_rank for o in plan.pipeline.options} == {1}


def test_several_stages_per_rank_that_cannot_run_are_refused_with_what_to_change(fake_mesh):
    with pytest.raises(PipelineError, match="2 stages per rank need schedule='interleaved-1f1b'"):
        PipelineConfig(schedule="1f1b", stages_per_rank=2)
    with pytest.raises(PipelineError, match="stages_per_rank must be a positive int"):
        PipelineConfig(stages_per_rank=0)
    with _planner(fake_mesh) as autop:
        with pytest.raises(PipelineError, match="asks for 6 stages but the model's stack has 4"):
            autop.add_pipeline_constraint(stages_per_rank=3)
    with _planner(fake_mesh) as autop:
        with pytest.raises(PipelineError, match="rounds of 2 .* give a multiple of 2"):
            autop.add_pipeline_constraint(stages_per_rank=2, microbatches=5)
