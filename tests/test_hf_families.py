"""Hugging Face models as they come: every family of the README plans on a fake (2, 4) mesh
with its default attention, cache and mask code, from ``from_config`` on the meta device."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from autoparallel import AutoParallel  # noqa: E402
from autoparallel.cost.hardware import H100  # noqa: E402
from autoparallel.models.hf_families import (  # noqa: E402
    HF_FAMILIES,
    build_hf_family,
    hf_family,
    hf_family_inputs,
)


@pytest.mark.parametrize("family", HF_FAMILIES, ids=lambda family: family.name)
def test_the_family_plans_as_it_comes(fake_mesh, family):
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    model = build_hf_family(family)
    inputs = hf_family_inputs(family)
    with AutoParallel(model, lambda: inputs, mesh) as autop:
        plan = autop.optimize_placement()
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # tied: both
    assert set(plan.param_placements) == names
    assert all(len(placements) == 2 for placements in plan.param_placements.values())


def test_an_unknown_family_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: gpt2, llama"):
        hf_family("gpt5")


def test_a_padded_causal_lm_plans_without_replicated_fallbacks(fake_mesh):
    """Attention with a padding mask and the constants transformers creates in its forward
    (``lift_fresh_copy``) have sharding rules: nothing falls back to replicated."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    family = hf_family("llama")
    inputs = hf_family_inputs(family, padded=True)
    with AutoParallel(build_hf_family(family), lambda: inputs, mesh) as autop:
        plan = autop.optimize_placement()
    assert plan.fallbacks == []


@pytest.mark.parametrize("name", ["qwen3-moe", "olmoe", "mixtral"])
def test_mixtures_of_experts_have_rules_for_their_grouped_matmuls(fake_mesh, name):
    """transformers' grouped matmul of the routed experts (and the floor division of its
    routing) have our rules: nothing falls back to replicated, and the experts' weights may
    be split by their features for the compute."""
    from torch.distributed.tensor import Shard

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    family = hf_family(name)
    with AutoParallel(build_hf_family(family), lambda: hf_family_inputs(family), mesh) as autop:
        space = autop.sharding_optimizer.problem.space
        grouped = [n for n in space.nodes if str(n.target).startswith("transformers.grouped_mm")]
    assert space.fallbacks == []  # what the plan would run replicated
    assert grouped
    forward = [n for n in grouped if str(n.target).endswith("fallback.default")]
    weights = {s.inputs[1][1] for n in forward for s in space[n].strategies}
    assert Shard(2) in weights and Shard(1) in weights  # column and row parallel experts


def test_swins_window_buffers_are_planned_as_views(fake_mesh):
    """Swin writes its shifted windows into buffers in place; functionalized, those are
    as_strided reads and as_strided_scatter writes that only reshape a contiguous tensor.
    Rewritten as the views they are, nothing falls back to replicated."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    family = hf_family("swin")
    with AutoParallel(build_hf_family(family), lambda: hf_family_inputs(family), mesh) as autop:
        problem = autop.sharding_optimizer.problem
    targets = {str(node.target) for node in problem.joint.graph.nodes}
    assert not {"aten.as_strided.default", "aten.as_strided_scatter.default"} & targets
    assert problem.space.fallbacks == []


def test_stacked_projections_keep_their_shards(fake_mesh):
    """ModernBERT stacks its query, key and value gradients: every input split along one
    dim stacks into the output split along it (DTensor's own stack strategy offers one
    placement only, which left the view after it none), so nothing falls back."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    family = hf_family("modernbert")
    with AutoParallel(build_hf_family(family), lambda: hf_family_inputs(family), mesh) as autop:
        space = autop.sharding_optimizer.problem.space
    stacks = [n for n in space.nodes if str(n.target) == "aten.stack.default"]
    assert stacks and all(len(space[n].output_placements()) > 1 for n in stacks)
    assert space.fallbacks == []


def test_gpt2_shards_its_vocabulary_of_50257_over_tp(fake_mesh):
    """tp 4 does not divide GPT-2's 50257 tokens; the embedding (tied with the output) is
    still sharded on the vocabulary over tp, 12565 rows per rank but the last (12562)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    family = hf_family("gpt2")
    inputs = hf_family_inputs(family, batch=8, seq=64)
    model = build_hf_family(family, vocab_size=50257)
    # with the gradient all-reduce charged in full (no overlap), sharding the 154 MB table
    # pays; with overlap priced, replicating it does at this small batch
    hardware = dataclasses.replace(H100, name="h100-no-overlap", overlap_fraction=0.0)
    with AutoParallel(model, lambda: inputs, mesh, hardware=hardware) as autop:
        autop.add_input_constraints([(Shard(0), Replicate())] * len(inputs))
        plan = autop.optimize_placement()
    embedding = plan.param_placements["transformer.wte.weight"]
    assert embedding[1] == Shard(0), embedding
