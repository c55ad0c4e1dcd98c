"""local_map regions: the planner keeps their placements, prices their bodies, and names
their mistakes. (Training the MoE on gloo ranks is in test_runtime.py.)"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autoparallel import AutoParallel, LocalMapError, collectives, current_mesh, local_map
from autoparallel.cost.regions import region_cost_parts_us
from autoparallel.models.moe import MOE_TINY, MoETransformer
from autoparallel.regions.context import RegionScope, register_running_scope, scope_of
from autoparallel.types.placements import placement_str


def _plan_moe(mesh, inputs=None):
    with torch.device("meta"):
        model = MoETransformer(MOE_TINY)
    with AutoParallel(model, lambda: torch.randint(0, 256, (8, 16)), mesh) as autop:
        if inputs is not None:
            autop.add_input_constraints([inputs])
        plan = autop.optimize_placement()
    return autop, plan


def test_moe_experts_are_split_over_ep_and_their_gradients_reduced_over_dp(fake_mesh):
    autop, plan = _plan_moe(fake_mesh((2, 2), ("dp", "ep")), (Shard(0), Replicate()))
    experts = {k: v for k, v in plan.param_placements.items() if ".experts." in k}
    assert len(experts) == 6 and all(
        isinstance(p[1], Shard) and p[1].dim == 0 for p in experts.values()
    )
    shared = [k for k in plan.param_placements if "shared_expert" in k or "router" in k]
    assert shared and not any(".experts." in k for k in shared)
    (region,) = autop.joint.regions.values()
    forward = next(n for n in plan.nodes.values() if n.target.endswith("local_map.default"))
    backward = next(n for n in plan.nodes.values() if "local_map_backward" in n.target)
    assert placement_str(forward.strategy.inputs[3]) == "RS(0)"  # w1 arrives split over ep
    assert placement_str(forward.strategy.output) == "(S(0)S(0))"
    # the gradient of a weight replicated over dp is each dp rank's share: Partial there
    grads = [placement_str(p) for p in backward.strategy.output]
    assert grads[-3:] == ["P(sum)S(0)"] * 3
    # the dispatch's all-to-alls are profiled and priced: counts, rows, rows back; the
    # backward re-runs them and sends the two float exchanges' gradients back
    profile = region.layouts[0].profile
    assert [c.kind for c in profile.forward_collectives] == ["all_to_all"] * 3
    assert [c.kind for c in profile.backward_collectives] == ["all_to_all"] * 5
    assert {c.mesh_dim for c in profile.forward_collectives} == {1}
    assert any("grouped_mm" in str(op.op) or "mm" in str(op.op) for op in profile.forward_ops)
    # the plan counts those all-to-alls as communication, not as the region's compute
    for node, backward_op in ((forward, False), (backward, True)):
        compute, comm = region_cost_parts_us(region.layouts[0], backward_op, autop.topology)
        assert comm > 0 and node.collectives_us == pytest.approx(comm)
        assert node.compute_us == pytest.approx(compute)
        assert node.comm_us >= comm
    calls = [n for n in plan.nodes.values() if "local_map" in n.target]
    assert len(calls) == 2 * MOE_TINY.n_layers
    own = sum(n.collectives_us for n in plan.nodes.values())
    assert own == pytest.approx(
        MOE_TINY.n_layers * (forward.collectives_us + backward.collectives_us)
    )
    assert plan.totals.comm_us >= own


def test_without_an_ep_dim_the_experts_are_the_planners(fake_mesh):
    _, plan = _plan_moe(fake_mesh((4,), ("dp",)))
    experts = [p for k, p in plan.param_placements.items() if ".experts." in k]
    assert len(experts) == 6  # the region asks them replicated; storage is the planner's


def _body(x, w):
    return torch.tanh(x @ w)


class _OneRegion(nn.Module):
    def __init__(self, in_placements, out_placements):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.placements = (in_placements, out_placements)

    def forward(self, x):
        inputs, outputs = self.placements
        return local_map(_body, out_placements=outputs, in_placements=inputs)(x, self.w).sum()


@pytest.mark.parametrize(
    "in_placements,out_placements,message",
    [
        (((Shard(0),),), (Shard(0),), "in_placements has 1 entries for 2 positional arguments"),
        (((Shard(1),), (Replicate(),)), (Shard(0),), "does not divide its size 6"),
        (((Shard(0),), None), (Shard(0),), "argument 1 is a tensor: give it placements"),
        (
            ((Shard(0),), (Replicate(),)),
            ((Shard(0),), (Shard(0),)),
            "returns 1 tensors but out_placements has 2",
        ),
        (((Shard(0), Replicate()), (Replicate(),)), (Shard(0),), "2 placements for a 1-D mesh"),
    ],
)
def test_contradictory_region_placements_are_named(
    fake_mesh, in_placements, out_placements, message
):
    mesh = fake_mesh((4,), ("dp",))
    model = _OneRegion(in_placements, out_placements)
    with pytest.raises(LocalMapError, match="local_map region at .*test_local_map.py") as error:
        with AutoParallel(model, lambda: torch.randn(16, 6 if "divide" in message else 8), mesh):
            pass
    assert message in str(error.value)


class _Rows(nn.Module):
    """A linear, then a region over rows that leaves every mesh dim free for them (the
    weight stays replicated)."""

    def __init__(self, body=_body):
        super().__init__()
        self.proj = nn.Linear(256, 256)
        self.w = nn.Parameter(torch.randn(256, 256))
        self.body = body

    def forward(self, x):
        free = (None,) * current_mesh().ndim
        replicated = (Replicate(),) * current_mesh().ndim
        region = local_map(self.body, out_placements=free, in_placements=(free, replicated))
        return region(self.proj(x), self.w)


def _region_ops(plan):
    forward = next(n for n in plan.nodes.values() if n.target.endswith("local_map.default"))
    backward = next(n for n in plan.nodes.values() if "local_map_backward" in n.target)
    return forward, backward


@pytest.mark.parametrize(
    "batch,hardware,layout",
    [
        ((Shard(0),), "cpu", "S(0)"),  # the batch comes split: the region runs on its rows
        # the batch comes and goes whole, and on a GPU the rows' compute is cheaper than
        # gathering them back: every rank runs the region on all of them
        ((Replicate(),), "h100", "R"),
    ],
)
def test_the_planner_resolves_a_free_mesh_dim(fake_mesh, batch, hardware, layout):
    """A None placement leaves its mesh dim to the planner: the region's rows split there
    or replicated, whichever the plan around it makes cheaper, each priced at its own
    local shapes."""
    mesh = fake_mesh((2,), ("dp",))
    with AutoParallel(_Rows(), lambda: torch.randn(1024, 256), mesh, hardware=hardware) as autop:
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        plan = autop.optimize_placement()
    (region,) = autop.joint.regions.values()
    assert region.free_mesh_dims == (0,)
    assert [lay.free for lay in region.layouts] == [((0, "S(0)"),), ((0, "R"),)]
    assert [lay.local_inputs[0].shape for lay in region.layouts] == [(512, 256), (1024, 256)]
    forward, backward = _region_ops(plan)
    assert placement_str(forward.strategy.output) == f"({layout})"
    assert placement_str(forward.strategy.inputs[1]) == "R"  # declared: not the planner's
    # gradients are each rank's share: split rows' as the rows, replicated ones' Partial
    rows_grad = "S(0)" if layout == "S(0)" else "P(sum)"
    assert [placement_str(p) for p in backward.strategy.output] == [rows_grad, "P(sum)"]
    split, whole = (region_cost_parts_us(lay, False, autop.topology)[0] for lay in region.layouts)
    assert 0 < split <= whole and (split < whole or hardware == "h100")  # h100: per-op floor
    assert forward.compute_us == pytest.approx(split if layout == "S(0)" else whole)


def test_a_free_mesh_dim_that_cannot_split_the_rows_stays_replicated(fake_mesh):
    mesh = fake_mesh((2,), ("dp",))
    with AutoParallel(_Rows(), lambda: torch.randn(3, 256), mesh) as autop:
        plan = autop.optimize_placement()
    (region,) = autop.joint.regions.values()
    assert [lay.free for lay in region.layouts] == [((0, "R"),)]
    forward, _ = _region_ops(plan)
    assert placement_str(forward.strategy.output) == "(R)"


def _reduced_over_dp(x, w):
    return collectives.all_reduce(_body(x, w), "dp")


def test_a_collective_over_a_free_mesh_dim_is_named(fake_mesh):
    mesh = fake_mesh((2,), ("dp",))
    with pytest.raises(LocalMapError, match="issues all_reduce over mesh dim 0, which its"):
        with AutoParallel(_Rows(_reduced_over_dp), lambda: torch.randn(16, 256), mesh):
            pass


def test_outside_planning_a_region_is_a_plain_call_and_collectives_are_identities():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    region = local_map(
        _body, out_placements=(Shard(0),), in_placements=((Shard(0),), (Replicate(),))
    )
    assert torch.equal(region(x, w), _body(x, w))
    assert collectives.mesh_dim_size("ep") == 1
    assert collectives.all_to_all(x, "ep", torch.tensor([4]), torch.tensor([4])) is x
    assert collectives.all_reduce(x, "dp") is x


@pytest.mark.parametrize("rows", [Shard(0), Replicate()])
def test_on_dtensors_a_free_mesh_dim_follows_the_arguments(fake_mesh, rows):
    """Outside planning, DTensor arguments go to torch's local_map with each free mesh dim
    resolved as the free arguments lie."""
    from torch.distributed.tensor import DTensor

    mesh = fake_mesh((2,), ("dp",))
    x = DTensor.from_local(torch.randn(4, 8), mesh, (rows,))
    w = DTensor.from_local(torch.randn(8, 8), mesh, (Replicate(),))
    region = local_map(_body, out_placements=(None,), in_placements=((None,), (Replicate(),)))
    out = region(x, w)
    assert out.placements == (rows,)
    assert torch.equal(out.to_local(), _body(x.to_local(), w.to_local()))


def test_adjoint_gradient_placements():
    from autoparallel.types.regions import adjoint_placements

    assert adjoint_placements((Shard(0), Replicate(), Partial())) == (
        Shard(0),
        Partial(),
        Replicate(),
    )


def test_the_cli_plans_the_moe_with_experts_over_ep(tmp_path):
    import json

    from helpers.planning import run_cli

    out, html = tmp_path / "plan.json", tmp_path / "plan.html"
    done = run_cli(
        "plan", "--model", "moe-tiny", "--layers", "1", "--mesh", "2x2", "--mesh-names", "dp,ep",
        "--batch", "8", "--seq", "16", "--out", str(out), "--html", str(html),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    placements = {p["name"]: p["placements"] for p in data["parameters"]}
    experts = [p for name, p in placements.items() if ".experts." in name]
    assert len(experts) == 3 and all(p.endswith("S(0)") for p in experts), placements
    # the region is reported: where the model calls it, the placements it fixes, its price
    (region,) = data["regions"]
    assert region["function"] == "routed_experts" and region["instances"] == 1
    file, line = region["source"].rsplit(":", 1)
    assert file.endswith("models/moe.py") and line.isdigit()
    assert [i["placements"] for i in region["inputs"]][-3:] == ["RS(0)"] * 3  # experts over ep
    assert [o["placements"] for o in region["outputs"]] == ["S(0)S(0)"]
    # tokens are free over dp: the plan splits them there, as the batch comes
    assert region["free_mesh_dims"] == [0]
    assert [(lay["free"], lay["instances"]) for lay in region["layouts"]] == [
        ({"0": "S(0)"}, 1),
        ({"0": "R"}, 0),
    ]
    assert "free mesh dims dp: dp=S(0) x1, dp=R x0" in done.stdout
    forward = region["forward"]
    assert {c["kind"] for c in forward["collectives"]} == {"all_to_all"}
    assert all(c["mesh_dim"] == 1 for c in forward["collectives"])  # over "ep"
    assert forward["compute_us"] > 0 and forward["comm_us"] > 0
    assert "region routed_experts at" in done.stdout
    page = html.read_text()
    assert 'id="regions"' in page and "routed_experts" in page and "all_to_all over ep" in page


def test_compiled_code_finds_a_running_region_only_while_its_module_lives():
    """Compiled code runs the region ops outside any phase's scope: they find the running
    scope by key, which is registered weakly and unique to its trace, so nothing outlives
    the parallel module that owns it and two traces never share a key."""
    scope = RegionScope(None, recording=True)
    assert scope.trace_id != RegionScope(None).trace_id
    key = f"body#0@{scope.trace_id}"
    scope.regions[key] = object()
    assert scope_of(key) is None  # neither active nor registered
    register_running_scope(scope)
    assert scope_of(key) is scope
    del scope
    gc.collect()
    assert scope_of(key) is None


def test_a_region_op_never_returns_a_tensor_aliasing_its_inputs():
    """Custom ops promise outputs that alias no input (the compiler reuses buffers on that
    promise). A body that only views its argument gets, from autograd, a gradient that is a
    view of the incoming gradient: the backward op returns a copy instead, as the forward
    op does for a body that returns its argument."""
    from types import SimpleNamespace

    from autoparallel.regions.local_map import region_backward_op, region_forward_op

    scope = RegionScope(None)
    key = f"view#0@{scope.trace_id}"
    scope.regions[key] = SimpleNamespace(
        func=lambda x: x.view(-1),
        arguments=lambda tensors: tuple(tensors),
        differentiable=(True,),
        out_placements=((Replicate(),),),
        source="test",
    )
    register_running_scope(scope)
    x, grad = torch.randn(4, 8), torch.randn(32)
    (out,) = region_forward_op(key, [x])
    (grad_x,) = region_backward_op(key, [x], [grad])
    assert torch.equal(out, x.view(-1)) and torch.equal(grad_x, grad.view(4, 8))
    inputs = {t.untyped_storage().data_ptr() for t in (x, grad)}
    assert out.untyped_storage().data_ptr() not in inputs
    assert grad_x.untyped_storage().data_ptr() not in inputs
