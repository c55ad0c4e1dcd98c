"""Our own single-mesh-dim rules compute what one device computes: every rule of an op, run on
two ranks' local pieces (a split tensor chunked, a partial sum split into two random
addends), reassembles into the op's result on the whole tensors. Whichever torch release
lacks DTensor's strategy for an op (torch 2.11: indexing, convolution, padding, scatter),
these rules are what the planner then offers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel.graph.fx_args import map_args, tensor_input_nodes
from autoparallel.strategies import rules

aten = torch.ops.aten
RANKS = 2


def _traced_node(function: Callable, inputs: tuple, op: object) -> tuple[fx.Node, dict]:
    """The node of ``op`` in ``function`` traced on ``inputs``, and every node's real value."""
    graph = make_fx(function, tracing_mode="fake")(*inputs)
    values: dict[fx.Node, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> object:
            values[node] = super().run_node(node)
            return values[node]

    Recorder(graph).run(*inputs)
    return next(n for n in graph.graph.nodes if n.target == op), values


def _pieces(value: torch.Tensor, placement, generator: torch.Generator) -> list[torch.Tensor]:
    if isinstance(placement, Shard):  # a copy, as DTensor's split of a whole tensor makes it
        # (CPU's native_layer_norm_backward misreads a strided view of mean or rstd)
        return [piece.contiguous() for piece in torch.chunk(value, RANKS, placement.dim)]
    if isinstance(placement, Partial):
        first = torch.randn(value.shape, generator=generator, dtype=value.dtype)
        return [first, value - first]
    return [value] * RANKS


def _whole(pieces: list[torch.Tensor], placement) -> torch.Tensor:
    if isinstance(placement, Shard):
        return torch.cat(pieces, placement.dim)
    if isinstance(placement, Partial):
        return sum(pieces[1:], pieces[0])
    for piece in pieces[1:]:
        torch.testing.assert_close(piece, pieces[0])
    return pieces[0]


def _check_every_rule(function: Callable, inputs: tuple, op: object) -> int:
    """Run each of ``op``'s rules on two ranks' pieces; return how many rules were checked."""
    node, values = _traced_node(function, inputs, op)
    rule = rules.rule_of(op) or rules.rule_where_dtensor_cannot_split(op)
    assert rule is not None, f"no rule of ours for {op}"
    found = rule(node)
    assert found is not None, f"our rule for {op} gave none for {node.format_node()}"
    single_dim_rules, num_outputs = found
    tensor_inputs = tensor_input_nodes(node)
    expected = values[node]
    expected_outputs = list(expected) if num_outputs > 1 else [expected]
    generator = torch.Generator().manual_seed(0)
    for single in single_dim_rules:
        outputs, placements = single[:num_outputs], single[num_outputs:]
        assert len(placements) == len(tensor_inputs), (single, node.format_node())
        pieces = {n: _pieces(values[n], p, generator) for n, p in zip(tensor_inputs, placements)}
        local_results = [_run_on_rank(node, op, pieces, rank, num_outputs) for rank in range(RANKS)]
        for index, (placement, want) in enumerate(zip(outputs, expected_outputs)):
            if placement is None or want is None:
                continue
            got = _whole([local[index] for local in local_results], placement)
            assert torch.allclose(got, want, atol=1e-5), f"{single}: output {index} differs"
    return len(single_dim_rules)


def _run_on_rank(node: fx.Node, op: object, pieces: dict, rank: int, num_outputs: int) -> list:
    """``op`` on one rank's pieces of its tensor arguments (other arguments as traced)."""

    def local(arg: object) -> object:
        return pieces[arg][rank] if isinstance(arg, fx.Node) else arg

    args, kwargs = map_args(local, (node.args, dict(node.kwargs)))
    result = op(*args, **kwargs)
    return list(result) if num_outputs > 1 else [result]


def _ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("indices", "expected_rules"),
    [
        pytest.param(lambda: [None, _ints(6, 2, 4)], 2 + 2 + 1, id="one-dim-adjacent"),
        pytest.param(lambda: [_ints(4, 4), None, _ints(8, 4)], 1 + 1 + 1, id="apart"),
        pytest.param(lambda: [None, _ints(6, 2, 1), _ints(8, 1, 4)], 1 + 2 + 1, id="broadcast"),
    ],
)
def test_indexing_splits_the_values_or_the_indices(indices, expected_rules):
    values = torch.randn(4, 6, 8)
    index = indices()
    tensors = [i for i in index if i is not None]

    def function(x, *idx):
        it = iter(idx)
        return aten.index.Tensor(x, [next(it) if i is not None else None for i in index])

    assert _check_every_rule(function, (values, *tensors), aten.index.Tensor) == expected_rules


@pytest.mark.parametrize("groups", [1, 3])
def test_a_convolution_splits_its_batch_and_a_plain_one_its_output_channels(groups):
    inputs = (torch.randn(4, 6, 8, 8), torch.randn(6, 6 // groups, 3, 3), torch.randn(6))

    def forward(x, w, b):
        return aten.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], groups)

    assert _check_every_rule(forward, inputs, aten.convolution.default) == (2 if groups == 1 else 1)

    def backward(grad, x, w):
        return aten.convolution_backward(
            grad, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], groups, [True, True, True]
        )

    grad = torch.randn(4, 6, 8, 8)
    checked = _check_every_rule(backward, (grad, *inputs[:2]), aten.convolution_backward.default)
    assert checked == (2 if groups == 1 else 1)


def test_padding_splits_the_dims_it_leaves_alone():
    def function(x):
        return aten.constant_pad_nd(x, [1, 2, 0, 0], 0.5)  # pads the last dim only

    assert _check_every_rule(function, (torch.randn(4, 6, 8),), aten.constant_pad_nd.default) == 2


def test_scatter_splits_every_dim_but_the_one_it_writes_along():
    def function(base, index, src):
        return aten.scatter.src(base, 1, index, src)

    inputs = (torch.zeros(8, 4, 6), _ints(4, 8, 2, 6), torch.randn(8, 2, 6))
    assert _check_every_rule(function, inputs, aten.scatter.src) == 2  # dims 0 and 2


def test_layer_norm_splits_its_rows_forward_and_backward():
    x, weight, bias = torch.randn(4, 6, 8), torch.randn(8), torch.randn(8)

    def forward(x, w, b):
        return aten.native_layer_norm(x, [8], w, b, 1e-5)

    assert _check_every_rule(forward, (x, weight, bias), aten.native_layer_norm.default) == 2
    out, mean, rstd = aten.native_layer_norm(x, [8], weight, bias, 1e-5)

    def backward(grad, x, mean, rstd, w, b):
        return aten.native_layer_norm_backward(grad, x, [8], mean, rstd, w, b, [True, True, True])

    inputs = (torch.randn_like(out), x, mean, rstd, weight, bias)
    assert _check_every_rule(backward, inputs, aten.native_layer_norm_backward.default) == 2
