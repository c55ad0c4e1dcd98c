"""The planner's choices on the MLP: DDP-like, FSDP-like and Megatron-style plans."""

from __future__ import annotations

import torch
from conftest import meta
from helpers.planning import Partial, Replicate, Shard, batch_sharded, plan_model, transitions

from autoparallel.models import MLP


def test_no_memory_constraint_gives_ddp(fake_mesh):
    mesh = fake_mesh((4,))
    model = meta(lambda: MLP(1024, 4096))
    plan = plan_model(model, lambda: torch.randn(8192, 1024), mesh, [(Shard(0),)], [(Shard(0),)])
    assert set(plan.param_placements.values()) == {(Replicate(),)}
    # every gradient is summed over the data-parallel ranks by an all-reduce (Partial -> Replicate)
    all_reduces = transitions(plan, Partial, Replicate)
    assert len(all_reduces) >= len(plan.param_placements)
    assert all(plan.nodes[c].phase == "backward" or a.kind == "param_grad" for c, a in all_reduces)
    assert plan.input_placements == [(Shard(0),)]
    assert plan.output_placements == [(Shard(0),)]


def test_memory_constraint_gives_fsdp(fake_mesh):
    mesh = fake_mesh((4,))
    model = meta(lambda: MLP(1024, 4096))
    plan = plan_model(
        model, lambda: torch.randn(8192, 1024), mesh, [(Shard(0),)], [(Shard(0),)], memory=True
    )
    for name, placements in plan.param_placements.items():
        assert isinstance(placements[0], Shard), name
    gathers = [
        c for c, a in transitions(plan, Shard, Replicate) if plan.nodes[c].phase == "forward"
    ]
    reduce_scatters = transitions(plan, Partial, Shard)
    assert len(gathers) >= len(plan.param_placements)
    assert len(reduce_scatters) >= len(plan.param_placements)
    assert not transitions(plan, Partial, Replicate)


def test_large_hidden_on_2d_mesh_gives_megatron_tp(fake_mesh):
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    model = meta(lambda: MLP(512, 8192))
    inp = batch_sharded(2)
    plan = plan_model(model, lambda: torch.randn(2048, 512), mesh, [inp], [inp])
    params = plan.param_placements
    # column-parallel first linear (weight [hidden, dim] sharded on its output dim over tp),
    # row-parallel second linear (weight [dim, hidden] sharded on its input dim over tp)
    assert params["w1.weight"] == (Replicate(), Shard(0))
    assert params["w1.bias"] == (Replicate(), Shard(0))
    assert params["w2.weight"] == (Replicate(), Shard(1))
    assert plan.input_placements == [inp]
    # the row-parallel output is a partial sum over tp, all-reduced once before leaving
    out_arg = next(a for n in plan.nodes.values() for a in n.arguments if a.kind == "output")
    assert out_arg.src == (Shard(0), Partial()) and out_arg.dst == inp
