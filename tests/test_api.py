"""User-facing contract of AutoParallel: argument checks, the plan's shape and the log."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import meta
from helpers.planning import Replicate, Shard
from torch.distributed.tensor import DTensor

from autoparallel import AutoParallel
from autoparallel.models import MLP


def mlp():
    return meta(lambda: MLP(16, 64))


def test_bad_arguments_fail_before_tracing(fake_mesh):
    mesh = fake_mesh((4,))
    with pytest.raises(TypeError, match="nn.Module"):
        AutoParallel(object(), lambda: torch.randn(8, 16), mesh)
    with pytest.raises(TypeError, match="callable"):
        AutoParallel(mlp(), torch.randn(8, 16), mesh)
    with pytest.raises(TypeError, match="DeviceMesh"):
        AutoParallel(mlp(), lambda: torch.randn(8, 16), (4,))


def test_non_tensor_input_is_named(fake_mesh):
    mesh = fake_mesh((4,))
    with pytest.raises(TypeError, match="input leaf 1 .* is a str"):
        with AutoParallel(mlp(), lambda: (torch.randn(8, 16), "oops"), mesh):
            pass


@pytest.mark.parametrize(
    "constraint,error,match",
    [
        ([(Shard(0), Replicate())], ValueError, "2 placements given for a 1-D mesh"),
        ([(Shard(2),)], ValueError, r"Shard\(2\) is out of range for a 2-D tensor"),
        ([Shard(0)], TypeError, "expected a tuple of 1 placements"),
        ([(Shard(0),), (Shard(0),)], ValueError, "2 input constraints given but the model has 1"),
        ([("S0",)], TypeError, "use Shard"),
    ],
)
def test_bad_input_constraints_are_explained(fake_mesh, constraint, error, match):
    mesh = fake_mesh((4,))
    with AutoParallel(mlp(), lambda: torch.randn(8, 16), mesh) as autop:
        with pytest.raises(error, match=match):
            autop.add_input_constraints(constraint)


def test_plan_gives_placements_by_parameter_name(fake_mesh):
    mesh = fake_mesh((4,))
    with AutoParallel(mlp(), lambda: torch.randn(8, 16), mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
    assert set(plan.param_placements) == {"w1.weight", "w1.bias", "w2.weight", "w2.bias"}
    assert all(len(p) == 1 for p in plan.param_placements.values())
    assert plan.totals.total_us == pytest.approx(plan.solver.objective, rel=1e-6)
    assert plan.totals.total_us == pytest.approx(
        plan.totals.comm_us + plan.totals.compute_us + plan.totals.transition_us
    )


def test_meta_parameters_are_never_materialized(fake_mesh):
    mesh = fake_mesh((2,))
    model = mlp()
    with AutoParallel(model, lambda: torch.randn(8, 16), mesh) as autop:
        autop.optimize_placement()
    assert all(p.is_meta for p in model.parameters())


def test_attributes_set_on_a_parameter_follow_it_into_the_parallel_module(fake_mesh):
    """What a library or the user marks on a parameter (an optimizer's no-weight-decay flag,
    Hugging Face's initialized flag) is on the parallel module's DTensor parameter too."""
    model = mlp()
    model.w1.bias._no_weight_decay = True
    with AutoParallel(model, lambda: torch.randn(8, 16), fake_mesh((2,))) as autop:
        parallel = autop.apply_placement(autop.optimize_placement())
    assert isinstance(parallel.w1.bias, DTensor) and parallel.w1.bias._no_weight_decay is True
    assert not hasattr(parallel.w2.bias, "_no_weight_decay")


def test_verbose_log_shows_placements_costs_and_solver(fake_mesh, caplog):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with caplog.at_level(logging.INFO, logger="autoparallel.plan"):
        with AutoParallel(mlp(), lambda: torch.randn(8, 16), mesh) as autop:
            autop.add_input_constraints([(Shard(0), Replicate())])
            autop.optimize_placement(verbose=True)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "dp=2, tp=2" in text
    assert "aten.addmm.default" in text and " -> " in text and "S(0)R" in text
    assert "(comm, compute, transition)" in text
    assert "total cost:" in text and "comm" in text and "compute" in text and "transition" in text
    assert "solver: status Optimal" in text and "bound" in text and "time" in text


def test_input_fn_may_return_kwargs(fake_mesh):
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x, *, scale):
            return self.linear(x) * scale

    mesh = fake_mesh((2,))
    model = meta(TwoInputs)
    with AutoParallel(
        model,
        lambda: {"args": (torch.randn(8, 16),), "kwargs": {"scale": torch.randn(8, 16)}},
        mesh,
    ) as autop:
        autop.add_input_constraints([(Shard(0),), (Shard(0),)])
        plan = autop.optimize_placement()
    assert plan.input_placements == [(Shard(0),), (Shard(0),)]


def test_one_producer_feeding_two_arguments_is_priced_per_argument(fake_mesh):
    class Square(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            y = self.linear(x)
            return y * y

    mesh = fake_mesh((2,))
    with AutoParallel(meta(Square), lambda: torch.randn(8, 16), mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        plan = autop.optimize_placement()
    mul = next(
        n for n in plan.nodes.values() if n.target == "aten.mul.Tensor" and n.phase == "forward"
    )
    args = [a for a in mul.arguments if a.kind == "arg"]
    assert [a.slot for a in args] == [0, 1]
    assert args[0].producer == args[1].producer
