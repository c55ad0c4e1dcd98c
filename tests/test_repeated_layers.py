"""Tracing identical layers once: the built graph is the full trace, or we trace in full."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoparallel.models import Llama, llama_config
from autoparallel.trace.export import trace_joint
from autoparallel.trace.layer_stamping import first_difference
from autoparallel.trace.repeated_layers import find_repeated_layers

CONFIG = llama_config("tiny", dim=64, ffn_hidden=128, vocab_size=128, n_layers=6)
CPU = torch.device("cpu")


def _tokens():
    return torch.randint(0, CONFIG.vocab_size, (4, 16))


def _deep_llama() -> nn.Module:
    with torch.device("meta"):
        return Llama(CONFIG)


def _both_traces(model, input_fn, caplog, mp_policy=None):
    with caplog.at_level(logging.INFO, logger="autoparallel.trace"):
        once = trace_joint(model, input_fn, CPU, mp_policy)
    full = trace_joint(model, input_fn, CPU, mp_policy, trace_layers_once=False)
    return once, full


@pytest.mark.parametrize(
    "mp_policy",
    [None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)],
)
def test_the_graph_built_from_three_layers_is_the_full_trace(caplog, mp_policy):
    once, full = _both_traces(_deep_llama(), _tokens, caplog, mp_policy)
    assert "traced 3 and 4 of the 6 identical layers of `layers`" in caplog.text
    assert first_difference(once.graph, full.graph) is None
    assert [n.name for n in once.graph.nodes] == [n.name for n in full.graph.nodes]
    assert list(once.params) == list(full.params)
    assert list(once.param_grads) == list(full.param_grads)
    assert {n.name for n in once.forward_nodes} == {n.name for n in full.forward_nodes}
    assert "layers.5.feed_forward.w2.weight" in once.param_grads
    assert once.layers_traced_once.path == "layers" and full.layers_traced_once is None


def test_layers_with_a_different_setting_are_not_repeated(caplog):
    model = _deep_llama()
    assert find_repeated_layers(model).count == 6
    model.layers[3].attention_norm.eps = 1e-3
    with caplog.at_level(logging.INFO, logger="autoparallel.trace.repeated_layers"):
        assert find_repeated_layers(model) is None
    assert "layer 3 differs from layer 0: `attention_norm.eps` differs" in caplog.text


def test_layers_sharing_a_parameter_are_not_repeated():
    model = _deep_llama()
    model.layers[4].ffn_norm.weight = model.layers[0].ffn_norm.weight
    assert find_repeated_layers(model) is None


class _AlternatingStack(nn.Module):
    """Identical layers, but the model's forward treats odd layers differently."""

    def __init__(self, depth: int = 6, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if index % 2 else torch.tanh(x)
        return x


class _SkipToFirstStack(nn.Module):
    """Every layer adds the first layer's output (the first adds the input): the layers do
    not read only their neighbour."""

    def __init__(self, depth: int = 6, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        anchor = x
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x)) + anchor
            if index == 0:
                anchor = x
        return x


class _CountedStack(nn.Module):
    """Indexes its layers by a depth it keeps itself: it fails with fewer layers."""

    def __init__(self, depth: int = 6, width: int = 8) -> None:
        super().__init__()
        self.depth = depth
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in range(self.depth):
            x = torch.relu(self.layers[index](x))
        return x


@pytest.mark.parametrize("model", [_AlternatingStack(), _SkipToFirstStack(), _CountedStack()])
def test_a_model_the_short_traces_do_not_describe_is_traced_whole(caplog, model):
    once, full = _both_traces(model, lambda: torch.randn(4, 8, requires_grad=True), caplog)
    assert "tracing all 6 layers of `layers`" in caplog.text
    assert once.layers_traced_once is None
    assert first_difference(once.graph, full.graph) is None
    assert len(once.params) == 12


def test_the_check_sees_a_layer_reading_the_wrong_layer():
    """The last line of defence: a copy wired to another layer's tensor of the same shape."""
    joint = trace_joint(_deep_llama(), _tokens, CPU, trace_layers_once=False)
    adds = [
        n.name
        for n in joint.graph.nodes
        if n.target == torch.ops.aten.add.Tensor
        and n in joint.forward_nodes
        and n.meta["val"].shape == (4, 16, 64)
    ]
    rewired = trace_joint(_deep_llama(), _tokens, CPU, trace_layers_once=False).graph
    by_name = {n.name: n for n in rewired.nodes}
    late, early = by_name[adds[-2]], by_name[adds[-6]]
    assert late.args[0] is not early and late.args[0].meta["val"].shape == early.meta["val"].shape
    late.args = (early, *late.args[1:])
    difference = first_difference(rewired, joint.graph)
    assert (
        difference is not None and late.name in difference and "different arguments" in difference
    )


def test_hugging_face_layers_numbered_by_layer_idx_are_traced_once(caplog):
    """HF layers keep their own index for the KV cache; unread without a cache, so the
    short traces run with it hidden and the graph is still the full trace."""
    from autoparallel.models.hf import hf_llama

    model = hf_llama(num_hidden_layers=6)
    with caplog.at_level(logging.INFO, logger="autoparallel.trace.repeated_layers"):
        repeated = find_repeated_layers(model)
    assert repeated is not None, caplog.text
    assert repeated.index_attributes == ("self_attn.layer_idx",)
    once, full = _both_traces(model, lambda: torch.randint(0, 256, (2, 16)), caplog)
    assert once.layers_traced_once is not None
    assert first_difference(once.graph, full.graph) is None
    assert model.model.model.layers[4].self_attn.layer_idx == 4  # the user's model is untouched


class _IndexedLinear(nn.Linear):
    """A layer whose forward uses its own number."""

    def __init__(self, index: int, width: int = 8) -> None:
        super().__init__(width, width)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1 + self.index)


class _IndexedStack(nn.Module):
    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_IndexedLinear(i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_forward_that_reads_its_layer_index_is_traced_whole(caplog):
    once, full = _both_traces(
        _IndexedStack(), lambda: torch.randn(4, 8, requires_grad=True), caplog
    )
    assert "the forward reads the layer index `index`" in caplog.text
    assert once.layers_traced_once is None
    assert first_difference(once.graph, full.graph) is None


class _StackOfStacks(nn.Module):
    """Six identical blocks, each holding eight identical experts: the blocks are repeated."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(4, 4) for _ in range(8))})
            for _ in range(6)
        )


def test_the_outer_stack_is_repeated_not_the_longer_inner_one():
    found = find_repeated_layers(_StackOfStacks())
    assert found.path == "blocks" and found.count == 6


class _PartialActivation(nn.Module):
    """Builds its activation per instance, as Hugging Face's GELUTanh does."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.act = functools.partial(nn.functional.gelu, approximate=approximate)
        self.linear = nn.Linear(4, 4)


def test_equal_partials_count_as_equal_settings_and_different_ones_do_not():
    same = nn.Module()
    same.layers = nn.ModuleList(_PartialActivation() for _ in range(6))
    assert find_repeated_layers(same).count == 6
    different = nn.Module()
    different.layers = nn.ModuleList(
        _PartialActivation("none" if i == 2 else "tanh") for i in range(6)
    )
    assert find_repeated_layers(different) is None


class _HelperModuleLayer(nn.Module):
    """Keeps a helper module in a plain dict, as Hugging Face's hub kernels do
    (``self_attn._kernel_funcs``), so it is not one of the layer's submodules."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.helpers = {"norm": nn.LayerNorm(4, eps=eps, elementwise_affine=False)}


def test_helper_modules_outside_the_submodules_are_compared_as_layers_are():
    same = nn.Module()
    same.layers = nn.ModuleList(_HelperModuleLayer() for _ in range(6))
    assert find_repeated_layers(same).count == 6
    different = nn.Module()
    different.layers = nn.ModuleList(_HelperModuleLayer(1e-3 if i == 4 else 1e-6) for i in range(6))
    assert find_repeated_layers(different) is None


def _scaling_hook(scale: float):
    def hook(module, args, output):
        return output * scale

    return hook


def _stack_of_linears() -> nn.Module:
    stack = nn.Module()
    stack.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
    return stack


def test_layers_with_the_same_hooks_repeat_and_with_other_hooks_do_not():
    same = _stack_of_linears()
    for layer in same.layers:
        layer.register_forward_hook(_scaling_hook(2.0))
    assert find_repeated_layers(same).count == 6
    one_only = _stack_of_linears()
    one_only.layers[3].register_forward_hook(_scaling_hook(2.0))
    assert find_repeated_layers(one_only) is None
    other_setting = _stack_of_linears()
    for index, layer in enumerate(other_setting.layers):
        layer.register_forward_hook(_scaling_hook(3.0 if index == 5 else 2.0))
    assert find_repeated_layers(other_setting) is None
    over_itself = _stack_of_linears()  # a hook that closes over its own layer
    for layer in over_itself.layers:
        layer.register_forward_hook(lambda module, args, output, layer=layer: output)
        layer.register_forward_pre_hook(_scaling_hook(layer))
    assert find_repeated_layers(over_itself) is None


def test_hugging_face_layers_hooked_by_an_earlier_forward_are_still_traced_once(caplog):
    """A forward that asked for hidden states leaves transformers' output-capturing hooks on
    every layer: the same hook on each, inert while tracing."""
    from autoparallel.models.hf import hf_llama

    model = hf_llama(num_hidden_layers=6, logits_only=False)
    model(torch.randint(0, 256, (2, 16)), output_hidden_states=True)
    layers = model.model.layers
    if not any(layer._forward_hooks for layer in layers):
        pytest.skip("this transformers release installs no hooks on the layers")
    assert find_repeated_layers(model) is not None
    once, full = _both_traces(model, lambda: torch.randint(0, 256, (2, 16)), caplog)
    assert once.layers_traced_once is not None
    assert first_difference(once.graph, full.graph) is None
