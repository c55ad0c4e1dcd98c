"""Folding of repeated layers: found from the graph, and it does not change the optimum."""

from __future__ import annotations

import pytest
import torch
from conftest import meta
from helpers.planning import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.models import Llama, llama_config
from autoparallel.problem.folding import find_repeated_nodes

CONFIG = llama_config("tiny", n_layers=4)


def _plan(mesh, fold: bool):
    model = meta(lambda: Llama(CONFIG))
    inp = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
    with AutoParallel(
        model, lambda: torch.randint(0, CONFIG.vocab_size, (8, 32)), mesh, fold=fold
    ) as autop:
        autop.add_input_constraints([inp])
        autop.add_output_constraints([inp])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        return plan, autop.sharding_optimizer.problem


def test_folding_keeps_the_optimum_and_shrinks_the_problem(fake_mesh):
    mesh = fake_mesh((2,))
    folded_plan, folded = _plan(mesh, fold=True)
    full_plan, full = _plan(mesh, fold=False)
    assert folded_plan.solver.objective == pytest.approx(full_plan.solver.objective, rel=1e-6)
    assert (
        folded.num_variables < 0.85 * full.num_variables
    )  # 2 of 4 layers fold: the ends stay free
    # interior layers (1 and 2 of 0..3) share their choices
    for name in ("attention.wq.weight", "feed_forward.w2.weight"):
        assert (
            folded_plan.param_placements[f"layers.1.{name}"]
            == folded_plan.param_placements[f"layers.2.{name}"]
        )


def test_folding_finds_the_llama_blocks_but_not_across_phases(fake_mesh):
    mesh = fake_mesh((2,))
    _, problem = _plan(mesh, fold=True)
    folding = problem.folding
    joint = problem.joint
    rep = folding.representative
    # the interior blocks' parameters fold onto layer 1's; boundary layers stay free
    assert (
        rep[joint.params["layers.2.attention.wq.weight"]]
        is joint.params["layers.1.attention.wq.weight"]
    )
    assert (
        rep[joint.params["layers.0.attention.wq.weight"]]
        is joint.params["layers.0.attention.wq.weight"]
    )
    assert (
        rep[joint.params["layers.3.attention.wq.weight"]]
        is joint.params["layers.3.attention.wq.weight"]
    )
    # different parameters of one layer never fold together
    assert (
        rep[joint.params["layers.1.attention.wk.weight"]]
        is not rep[joint.params["layers.1.attention.wq.weight"]]
    )
    # forward and backward nodes never share a class
    for node, representative in rep.items():
        assert (node in joint.forward_nodes) == (representative in joint.forward_nodes)
    assert folding.num_folded > 0.15 * len(rep)


def test_folding_finds_hugging_face_blocks(fake_mesh):
    pytest.importorskip("transformers")
    from autoparallel.models import hf_llama
    from autoparallel.strategies.space import build_strategy_space
    from autoparallel.trace.export import trace_joint

    mesh = fake_mesh((2,))
    model = meta(lambda: hf_llama(num_hidden_layers=4))
    joint = trace_joint(model, lambda: torch.randint(0, 256, (4, 16)), torch.device("cpu"))
    space = build_strategy_space(joint, mesh)
    folding = find_repeated_nodes(joint, space)
    params = {
        name.split("layers.")[-1]: node for name, node in joint.params.items() if ".layers." in name
    }
    assert (
        folding.representative[params["2.self_attn.q_proj.weight"]]
        is params["1.self_attn.q_proj.weight"]
    )
    assert folding.num_folded > 0
