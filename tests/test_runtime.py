"""The parallel module trains to the same numbers as the single-device model (gloo ranks)."""

from __future__ import annotations

import pytest
from helpers.collective_cases import (
    collectives_per_call,
    gradients_reduced_together,
    parameters_gathered_by_layer,
    plan_is_shared,
    route_is_executed,
)
from helpers.runtime_cases import (
    TOLERANCE,
    check_parallel_training,
    dynamic_batch_sizes,
    inference_and_state,
    init_matches_reference,
    simple_api,
)


@pytest.mark.parametrize(
    "model_name,shape,kind",
    [
        ("mlp", (2,), "ddp"),
        ("mlp-constrained", (2,), "ddp"),
        ("mlp", (4,), "fsdp"),
        ("mlp", (2, 2), "tp"),
        ("llama", (2,), "fsdp"),
        ("llama", (2,), "ddp-pinned"),  # two gradient buckets, the first overlapped
        ("llama", (2, 2), "tp"),
        ("llama", (2, 2), "ddp-pinned"),  # gradients summed over both dims in one bucket
        ("llama", (2, 2), "fsdp"),  # parameters gathered, gradients scattered over both dims
        ("llama", (2,), "gathered-heads"),  # a traced view on a gathered copy
        ("llama", (2, 2), "vocab-parallel"),  # the table's rows split, its result read twice
        ("llama-deep", (2,), "fsdp"),  # its graph is built from 3 and 4 traced layers
        ("llama", (2,), "recompute"),  # layers the solver chose to recompute in the backward
        ("moe", (2, 2), "expert-parallel"),  # local_map dispatch: all-to-alls over "ep"
        ("moe", (2, 2), "tokens-replicated"),  # the same region, its free dp dim replicated
    ],
)
def test_parallel_training_matches_single_device(ranks, references, model_name, shape, kind):
    check_parallel_training(ranks, references(model_name), model_name, shape, kind)


def test_inference_state_dict_and_input_checks(ranks):
    results = ranks(2).run(inference_and_state, timeout_s=240)
    for result in results:
        assert result["inference_error"] < TOLERANCE
        assert result["requires_grad"] is False
        assert result["state_is_dtensor"]
        assert result["dcp_error"] < TOLERANCE
        message = result["input_error"]
        assert "expected local shape (4, 64)" in message and "got (8, 64)" in message
        assert "sharded over dim0=2" in message


def test_to_empty_and_init_weights_match_the_original(ranks):
    assert max(ranks(2).run(init_matches_reference, timeout_s=120)) == 0.0


def test_simple_api_auto_parallel(ranks):
    assert max(ranks(2).run(simple_api, timeout_s=120)) < TOLERANCE


def test_dynamic_batch_sizes_run_without_replanning(ranks):
    for errors in ranks(2).run(dynamic_batch_sizes, timeout_s=240):
        assert sorted(errors) == [4, 8, 12]
        for output_error, grad_error in errors.values():
            assert output_error < TOLERANCE and grad_error < TOLERANCE


def test_one_rank_solves_and_every_rank_applies_its_plan(ranks):
    first, second = ranks(2).run(plan_is_shared, timeout_s=120)
    assert (first["solved_here"], second["solved_here"]) == (True, False)
    assert first["placements"] == second["placements"]


def test_the_runtime_follows_the_planned_route(ranks):
    """Hierarchical all-reduce: the cost model's route for P over the inter-node dim is
    slice, all-reduce, all-gather, and the runtime issues exactly one all-reduce and one
    all-gather (no whole-tensor all-reduce), with the exact sum as the result."""
    results = ranks(4).run(route_is_executed, timeout_s=240)
    for result in results:
        assert result["route"] == ["P(sum)R", "P(sum)S(0)", "RS(0)", "RR"], result["route"]
        assert sorted(result["comms"].values()) == [1, 1]
        assert any("all_reduce" in op for op in result["comms"]) and any(
            "all_gather" in op for op in result["comms"]
        )
        assert result["error"] < 1e-5


def test_parameter_gradients_are_reduced_together(ranks):
    """Two pending sums bound for R share one all-reduce, two bound for S(0) one
    reduce-scatter; S(1) and an uneven shard keep their own; all equal DTensor's result."""
    for result in ranks(2).run(gradients_reduced_together, timeout_s=240):
        assert sorted(result["comms"].values()) == [1, 1], result["comms"]
        assert any("all_reduce" in op for op in result["comms"])
        assert any("reduce_scatter" in op for op in result["comms"])
        assert result["shapes_match"]
        assert result["error"] < 1e-6 and result["coalescable_error"] < 1e-6


def test_tracing_a_phase_issues_no_collective(ranks):
    """The first call of each phase, which traces its local graph, issues exactly the
    collectives every later call does: the graph is traced on fake tensors (no collective
    runs, no buffer is handed to gloo while the tracer runs) and then run once for real."""
    for result in ranks(2).run(collectives_per_call, timeout_s=240):
        first, *later = result["steps"]
        assert first > 0 and later == [first] * len(later), result["steps"]
        assert result["inference"][0] == result["inference"][1] > 0, result["inference"]
        assert result["fake_values"]


def test_parameters_are_gathered_a_layer_at_a_time(ranks):
    """Two layers of two sharded parameters each and a root parameter: three all-gathers for
    five parameters (one per layer, the root alone), each value the full tensor, and nothing
    kept after its last read. The unevenly sharded one is not planned for coalescing."""
    for result in ranks(2).run(parameters_gathered_by_layer, timeout_s=240):
        assert result["groups"] == ["", "layers.0.", "layers.1."]
        assert not result["uneven_planned"]
        assert result["all_gathers"] == 3
        assert result["error"] == 0.0
        assert result["placements"] == ["(Replicate(),)"]
        assert result["released"]


def test_a_bound_local_graph_computes_what_its_graph_module_does():
    """The eager runtime runs each local graph with its ops bound once (runtime/bound_graph.py):
    same results as the GraphModule, for multi-output ops, a constant the graph reads from
    its module and an op that writes in place, and no op left to look up through
    ``torch.ops`` at each call."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoparallel.runtime.bound_graph import bound_program

    scale = torch.tensor([0.5, 2.0, 3.0, 4.0])

    def phase(a, b):
        top, index = torch.topk(a, 2, dim=-1)
        summed = (a * scale).sum(dim=0)
        b = b.clone()
        b.add_(summed)
        return [top, index, b, torch.var_mean(a, dim=1)[0]]

    inputs = (torch.randn(3, 4), torch.randn(4))
    graph_module = make_fx(phase)(*inputs)
    program = bound_program(graph_module)
    assert "ops" not in program.forward.__code__.co_names  # no op looked up per call
    fresh = (torch.randn(3, 4), torch.randn(4))
    for got, expected in zip(program(*fresh), graph_module(*fresh)):
        assert torch.equal(got, expected)


def test_identity_views_leave_the_local_graph():
    """The views DTensor wrapping leaves (an input viewed as its own shape) are dropped from
    a traced phase; a view that changes the shape, and one returned as an output, stay."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoparallel.runtime.local_graph import drop_identity_views

    def phase(a):
        same = a.view(a.shape)
        flat = same.view(-1)
        return [same * 2, flat, a.view(a.shape)]

    graph_module = make_fx(phase)(torch.ones(3, 4))
    assert drop_identity_views(graph_module) == 1
    views = [n for n in graph_module.graph.nodes if n.target == torch.ops.aten.view.default]
    assert [tuple(n.meta["val"].shape) for n in views] == [(12,), (3, 4)]
    doubled, flat, returned = graph_module(torch.arange(12.0).view(3, 4))
    assert torch.equal(doubled, torch.arange(12.0).view(3, 4) * 2)
    assert torch.equal(flat, torch.arange(12.0))
    assert returned.shape == (3, 4)


def test_a_collective_starts_when_its_inputs_are_ready_and_is_waited_for_last():
    """issue_collectives_early on a hand-built graph: the all-reduce of ``a`` moves with its
    packing view to just after ``a``, ahead of the matmuls that do not need it, and its wait
    moves to just before the one op that reads the result."""
    import torch
    import torch.fx as fx

    from autoparallel.runtime.local_graph import issue_collectives_early

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.mm.default, (x, x))
    b = graph.call_function(torch.ops.aten.mm.default, (x, x))
    c = graph.call_function(torch.ops.aten.mm.default, (b, b))
    flat = graph.call_function(torch.ops.aten.view.default, (a, [-1]))
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (flat, "sum", "0"))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    d = graph.call_function(torch.ops.aten.mm.default, (c, c))
    total = graph.call_function(torch.ops.aten.add.Tensor, (d, waited))
    graph.output(total)
    module = fx.GraphModule(torch.nn.Module(), graph)
    assert issue_collectives_early(module) == 1
    order = list(module.graph.nodes)
    assert order.index(flat) == order.index(a) + 1
    assert order.index(reduced) == order.index(flat) + 1
    assert order.index(reduced) < order.index(c) < order.index(d) < order.index(waited)
    assert order.index(waited) == order.index(total) - 1


def test_an_all_reduce_of_a_private_temporary_reduces_it_in_place():
    """reduce_in_place on a hand-built graph: the all-reduce of a bucket (a view of a cat
    only it reads) becomes the in-place all-reduce; one of a graph input, and one of a
    matmul result that another op also reads, keep their copy."""
    import torch
    import torch.fx as fx

    from autoparallel.runtime.local_graph import reduce_in_place

    all_reduce = torch.ops._c10d_functional.all_reduce.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    bucket = graph.call_function(torch.ops.aten.cat.default, ([x, y],))
    flat = graph.call_function(torch.ops.aten.view.default, (bucket, [-1]))
    private = graph.call_function(all_reduce, (flat, "sum", "0"))
    of_input = graph.call_function(all_reduce, (x, "sum", "0"))
    product = graph.call_function(torch.ops.aten.mm.default, (x, y))
    shared = graph.call_function(all_reduce, (product, "sum", "0"))
    waits = [graph.call_function(wait, (n,)) for n in (private, of_input, shared)]
    graph.output([*waits, product])
    module = fx.GraphModule(torch.nn.Module(), graph)
    assert reduce_in_place(module) == 1
    assert private.target == torch.ops._c10d_functional.all_reduce_.default
    assert of_input.target == shared.target == all_reduce


def test_the_next_layers_parameter_gather_starts_before_this_layers_compute():
    """Gathers of graph inputs (parameters) move one ahead, FSDP's prefetch: layer 2's
    all-gather starts where layer 1's was, before layer 1's matmul; the first stays."""
    import torch
    import torch.fx as fx

    from autoparallel.runtime.local_graph import issue_collectives_early

    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    graph = fx.Graph()
    x, first, second = (graph.placeholder(name) for name in ("x", "w1", "w2"))
    gathered_first = graph.call_function(gather, (first, 2, "0"))
    full_first = graph.call_function(wait, (gathered_first,))
    hidden = graph.call_function(torch.ops.aten.mm.default, (x, full_first))
    gathered_second = graph.call_function(gather, (second, 2, "0"))
    full_second = graph.call_function(wait, (gathered_second,))
    out = graph.call_function(torch.ops.aten.mm.default, (hidden, full_second))
    graph.output(out)
    module = fx.GraphModule(torch.nn.Module(), graph)
    assert issue_collectives_early(module) == 0  # not parameters: stay
    assert issue_collectives_early(module, parameter_positions=[1, 2]) == 1
    order = list(module.graph.nodes)
    assert order.index(gathered_first) < order.index(gathered_second) < order.index(hidden)
    assert order.index(full_first) == order.index(hidden) - 1
    assert order.index(full_second) == order.index(out) - 1


def test_a_gradient_reduction_is_not_held_behind_a_later_layers_gather():
    """In a backward that re-gathers parameters (layers 3, 2, 1), the reduction of layer 3's
    gradient starts right after it, ahead of layer 1's gather, which the graph lists before
    it and which is prefetched to just after layer 3's gradient (every rank reorders the same
    graph the same way, so the ranks still agree on the order)."""
    import torch
    import torch.fx as fx

    from autoparallel.runtime.local_graph import issue_collectives_early

    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    reduce = torch.ops._c10d_functional.reduce_scatter_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    mm = torch.ops.aten.mm.default
    graph = fx.Graph()
    grad, *weights = (graph.placeholder(name) for name in ("grad", "w3", "w2", "w1"))
    gathers, grads, value = [], [], grad
    for weight in weights:  # layer 3 first, as the backward runs
        gathers.append(graph.call_function(gather, (weight, 2, "0")))
        value = graph.call_function(mm, (value, graph.call_function(wait, (gathers[-1],))))
        grads.append(value)
    reduced = graph.call_function(reduce, (grads[0], "sum", 2, "0"))
    done = graph.call_function(wait, (reduced,))
    graph.output([value, done])
    module = fx.GraphModule(torch.nn.Module(), graph)
    issue_collectives_early(module, parameter_positions=[1, 2, 3])
    order = list(module.graph.nodes)
    assert order.index(gathers[1]) < order.index(grads[0])  # layer 2's, prefetched
    assert order.index(grads[0]) < order.index(gathers[2]) < order.index(grads[1])
    assert order.index(reduced) == order.index(grads[0]) + 1  # right after its input
    assert order.index(reduced) < order.index(gathers[2])  # not held behind layer 1's gather
    assert order.index(grads[2]) < order.index(done)
