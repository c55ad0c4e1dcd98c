"""The LLaMA-style model and Hugging Face models plan on 1-D, 2-D and 3-D meshes."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import meta
from helpers.planning import Replicate, Shard, batch_sharded, plan_model

from autoparallel import AutoParallel, InfeasibleConstraintsError
from autoparallel.models import Llama, llama_config

CONFIG = llama_config("tiny")  # 2 layers


def tokens(batch: int = 8, seq: int = 32):
    return lambda: torch.randint(0, CONFIG.vocab_size, (batch, seq))


# On a 3-D mesh the exact problem grows fast (about 60 placements per 2-D tensor, priced
# pairwise on every edge): one narrow layer keeps this test short until the 3-D problem is
# compacted (issue 46); the layer holds every op kind of the deeper configs.
NARROW = llama_config(
    "tiny", dim=36, n_heads=3, n_kv_heads=1, ffn_hidden=90, vocab_size=250, n_layers=1
)

NARROW_3D_VARIABLES = 272_007
"""The 3-D case's problem size at commit 6cc2310 (issue 46): twice as many is a regression of
the planning time, caught here without timing anything."""


@pytest.mark.parametrize(
    "shape,config,batch,seq",
    [((4,), CONFIG, 8, 32), ((2, 2), CONFIG, 8, 32), ((2, 2, 2), NARROW, 2, 33)],
    ids=["1d", "2d", "3d"],
)
def test_llama_plans_on_meshes_and_honours_constraints(fake_mesh, shape, config, batch, seq):
    mesh = fake_mesh(shape)
    model = meta(lambda: Llama(config))
    inp = batch_sharded(len(shape))
    input_fn = lambda: torch.randint(0, config.vocab_size, (batch, seq))  # noqa: E731
    plan = plan_model(model, input_fn, mesh, [inp], [inp], memory=True)
    assert plan.input_placements == [inp]
    assert plan.output_placements == [inp]
    assert set(plan.param_placements) == {name for name, _ in model.named_parameters()}
    assert plan.solver.status == "Optimal"
    assert not plan.fallbacks
    # memory constraint: the big matrices are sharded on every mesh dimension
    if len(shape) == 3:  # what the 3-D planning time follows, bounded without a clock
        assert plan.solver.num_variables < 2 * NARROW_3D_VARIABLES, plan.solver
        assert plan.solver.method in ("lp", "lp+dive", "lp+fix"), plan.solver  # no bare MIP
    for name in (
        "layers.0.attention.wq.weight",
        f"layers.{config.n_layers - 1}.feed_forward.w2.weight",
        "output.weight",
    ):
        assert any(isinstance(p, Shard) for p in plan.param_placements[name]), name


def test_attention_can_shard_heads(fake_mesh):
    """With the input replicated, attention is parallel over heads (the CPU flash op included)."""
    mesh = fake_mesh((2,))
    model = meta(lambda: Llama(CONFIG))
    with AutoParallel(model, tokens(), mesh) as autop:
        autop.add_input_constraints([(Replicate(),)])
        attention = [
            n
            for n in autop.sharding_optimizer.problem.space.nodes
            if "scaled_dot_product" in str(n.target)
        ]
        assert attention
        for node in attention:
            outputs = autop.sharding_optimizer.problem.space[node].output_placements()
            width = len(outputs[0])
            assert ((Shard(0),),) * width in outputs  # batch
            assert ((Shard(1),),) * width in outputs  # heads


def test_contradictory_constraints_name_the_conflict(fake_mesh):
    mesh = fake_mesh((4,))
    model = meta(lambda: Llama(CONFIG))
    with AutoParallel(model, tokens(), mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        optimizer = autop.sharding_optimizer
        # the embedding weight cannot be both replicated and sharded, and memory needs it sharded
        optimizer.add_node_constraint(
            optimizer.problem.joint.params["tok_embeddings.weight"], (Replicate(),)
        )
        autop.add_parameter_memory_constraint()
        with pytest.raises(InfeasibleConstraintsError) as error:
            autop.optimize_placement()
    message = str(error.value)
    assert "parameter_memory" in message and "tok_embeddings" in message
    assert "input:0" not in message  # not part of the conflict


def test_impossible_placement_is_rejected_with_the_valid_choices(fake_mesh):
    mesh = fake_mesh((4,))
    model = meta(lambda: Llama(CONFIG))
    with AutoParallel(model, tokens(batch=2), mesh) as autop:
        with pytest.raises(ValueError, match="possible placements"):
            autop.add_input_constraints([(Shard(0),)])  # batch 2 does not split 4 ways


# ---------------------------------------------------------------------------- fallback

_LIB = torch.library.Library("autoparallel_test", "DEF")
_LIB.define("row_scale(Tensor x) -> Tensor")


@torch.library.impl(_LIB, "row_scale", "CompositeExplicitAutograd")
def _row_scale(x):
    return x * 2


@torch.library.register_fake("autoparallel_test::row_scale")
def _row_scale_fake(x):
    return torch.empty_like(x)


def _row_scale_backward(ctx, grad):
    return grad * 2


torch.library.register_autograd("autoparallel_test::row_scale", _row_scale_backward)


class WithCustomOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.ops.autoparallel_test.row_scale(self.linear(x))


def test_op_without_strategy_falls_back_to_replicate_with_a_warning(fake_mesh, caplog):
    mesh = fake_mesh((2,))
    model = meta(WithCustomOp)
    with caplog.at_level(logging.WARNING, logger="autoparallel"):
        plan = plan_model(model, lambda: torch.randn(8, 16), mesh, [(Shard(0),)])
    assert any("row_scale" in f for f in plan.fallbacks)
    assert any(
        "no sharding strategy" in r.message and "row_scale" in r.message for r in caplog.records
    )
    node = next(n for n in plan.nodes.values() if "row_scale" in n.target)
    assert node.strategy.output == (Replicate(),)


# ---------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("builder", ["hf_gpt2", "hf_llama"])
def test_hugging_face_models_plan(fake_mesh, builder):
    pytest.importorskip("transformers")
    from autoparallel import models

    mesh = fake_mesh((2, 2))
    model = meta(getattr(models, builder))
    inp = batch_sharded(2)
    plan = plan_model(
        model, lambda: torch.randint(0, 256, (4, 32)), mesh, [inp], [inp], memory=True
    )
    assert plan.input_placements == [inp]
    assert plan.solver.status == "Optimal"
    assert not plan.fallbacks
    sharded = [n for n, p in plan.param_placements.items() if any(isinstance(x, Shard) for x in p)]
    assert len(sharded) > len(plan.param_placements) // 2


def test_a_solve_stopped_before_any_feasible_plan_is_a_clear_error(fake_mesh):
    """A time limit too short to find any plan meeting the constraints raises, saying what
    to change, instead of reading a plan off an infeasible point."""
    mesh = fake_mesh((2, 2))
    model = meta(lambda: Llama(CONFIG))
    with AutoParallel(model, tokens(), mesh, time_limit_s=1e-4) as autop:
        with pytest.raises(RuntimeError, match=r"before it found a plan.*time_limit_s"):
            autop.optimize_placement()
