"""with_sharding_constraint: an intermediate's placement pinned from inside the model."""

from __future__ import annotations

import pytest
import torch
from conftest import meta
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, InfeasibleConstraintsError, with_sharding_constraint
from autoparallel.models import MLP

DP_TP = (Shard(0), Replicate())
HIDDEN_TP = (Shard(0), Shard(1))  # the hidden features split over tp, Megatron's layout


def _plan(fake_mesh, hidden_placements, extra=None):
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    model = meta(lambda: MLP(256, 1024, hidden_placements=hidden_placements))
    with AutoParallel(model, lambda: torch.empty(64, 256), mesh) as autop:
        autop.add_input_constraints([DP_TP])
        autop.add_output_constraints([DP_TP])
        autop.add_parameter_memory_constraint()
        if extra is not None:
            extra(autop)
        return autop, autop.optimize_placement()


def _constrained(plan):
    return {
        name: n.strategy.output
        for name, n in plan.nodes.items()
        if "sharding_constraint" in n.target
    }


def test_the_constraint_pins_the_activation_and_its_gradient(fake_mesh):
    _, free = _plan(fake_mesh, None)
    # left alone, the planner picks otherwise
    assert free.nodes["gelu"].strategy.output != HIDDEN_TP
    autop, plan = _plan(fake_mesh, HIDDEN_TP)
    # forward value and gradient
    assert list(_constrained(plan).values()) == [HIDDEN_TP, HIDDEN_TP]
    descriptions = autop.sharding_optimizer.constraints()
    assert (
        descriptions["with_sharding_constraint:sharding_constraint"]
        == "with_sharding_constraint on gelu = S(0)S(1)"
    )
    assert "(gradient)" in descriptions["with_sharding_constraint:sharding_constraint_1"]
    assert plan.totals.total_us > free.totals.total_us  # it costs something, and is obeyed anyway


def test_another_layout_is_obeyed_too(fake_mesh):
    _, plan = _plan(fake_mesh, DP_TP)
    assert list(_constrained(plan).values()) == [DP_TP] * 2


def test_contradiction_with_a_node_constraint_is_named(fake_mesh):
    def contradict(autop):
        autop.sharding_optimizer.add_node_constraint(
            "sharding_constraint", (Replicate(), Replicate()), name="mine"
        )

    with pytest.raises(
        InfeasibleConstraintsError, match="with_sharding_constraint:sharding_constraint"
    ) as info:
        _plan(fake_mesh, DP_TP, contradict)
    assert "mine" in str(info.value)


def test_wrong_number_of_placements_is_a_clear_error(fake_mesh):
    with pytest.raises(ValueError, match="gives 1 placements .* the mesh has 2 dimensions"):
        _plan(fake_mesh, (Replicate(),))


def test_bad_arguments(fake_mesh):
    x = torch.ones(4, 8)
    with pytest.raises(TypeError, match="one Shard/Replicate per mesh dimension"):
        with_sharding_constraint(x, Shard(0))
    with pytest.raises(ValueError, match="Shard\\(2\\) on a 2-D tensor"):
        with_sharding_constraint(x, (Shard(2),))
    assert torch.equal(with_sharding_constraint(x, (Shard(-1),)), x)  # plain tensors: an identity
