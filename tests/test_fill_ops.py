"""Ops whose outputs do not depend on their inputs' values (``new_zeros``, ``zeros_like``,
``full``...): made in whatever placement their consumers want, never moved."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.graph.fill_ops import is_fill
from autoparallel.models.moe import MOE_TINY, MoETransformer


def test_a_tensor_of_zeros_is_made_where_it_is_needed_not_moved(fake_mesh):
    """The MoE's top-k backward starts from zeros: they get every Shard/Replicate option and
    no input edge, so the plan never gathers them nor their input (it all-gathered them
    over "ep" before, which torch 2.14.1's Inductor then merged and overwrote)."""
    with torch.device("meta"):
        model = MoETransformer(MOE_TINY)
    mesh = fake_mesh((2, 2), ("dp", "ep"))
    with AutoParallel(model, lambda: torch.randint(0, 256, (8, 16)), mesh) as autop:
        autop.add_input_constraints([(Shard(0), Replicate())])
        plan = autop.optimize_placement()
        space = autop.sharding_optimizer.problem.space
    fills = [node for node in space.nodes if is_fill(node)]
    # new_zeros on torch 2.13, zeros on 2.11
    assert any("zeros" in str(node.target) for node in fills)
    for node in fills:
        options = {tuple(s.output) for s in space.nodes[node].strategies}
        assert space.nodes[node].source == "fill" and len(options) > 1
        assert all(not s.inputs for s in space.nodes[node].strategies)
        assert not plan.nodes[node.name].arguments
    names = {node.name for node in fills}
    moved = [
        (consumer, a.producer) for consumer, a in plan.redistributions() if a.producer in names
    ]
    assert not moved, moved
