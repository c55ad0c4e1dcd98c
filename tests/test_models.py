"""Tests for the reference models in ``autoparallel.models``.

Besides eager behaviour, every model must trace with
``aot_export_joint_with_descriptors`` on fake CPU tensors from parameters
that were built on the meta device: that is the contract the trace stage
relies on.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autoparallel.models import LLAMA3_8B, LLAMA3_70B, MLP, Llama, llama_config

SDPA_FWD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_BWD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


# ---------------------------------------------------------------- helpers


def fake_cpu_copy(model: nn.Module, fake_mode: FakeTensorMode) -> nn.Module:
    """Deep-copy a meta-device model with every parameter/buffer a fake CPU tensor.

    No real storage is allocated. Tied parameters stay tied because the
    ``deepcopy`` memo maps each original tensor (by id) to one replacement.
    """
    memo: dict[int, torch.Tensor] = {}
    with fake_mode:
        for t in itertools.chain(model.parameters(), model.buffers()):
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            if isinstance(t, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=t.requires_grad)
            memo[id(t)] = fake
    return copy.deepcopy(model, memo)


def trace_joint(
    make: Callable[[], nn.Module], example: Callable[[], torch.Tensor]
) -> tuple[nn.Module, torch.fx.GraphModule]:
    """Build ``make()`` on meta, fakeify it on CPU and export the joint graph."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with torch.device("meta"):
        model = make()
    fake_model = fake_cpu_copy(model, fake_mode)
    with fake_mode:
        inp = example()
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, fake_model, (inp,))
        return fake_model, joint.graph_module


def placeholder_descs(gm: torch.fx.GraphModule) -> list[object]:
    return [n.meta["desc"] for n in gm.graph.nodes if n.op == "placeholder"]


def output_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "output")


def call_targets(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def tiny_tokens(vocab: int = 256, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------- MLP


def test_mlp_forward_backward_shapes() -> None:
    model = MLP(16, 32)
    model.init_weights(seed=0)
    x = torch.randn(4, 8, 16)
    out = model(x)
    assert out.shape == (4, 8, 16)
    out.sum().backward()
    assert model.w1.weight.grad is not None and model.w1.weight.grad.shape == (32, 16)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["w1.weight", "w1.bias", "w2.weight", "w2.bias"]


def test_mlp_init_deterministic_across_meta() -> None:
    ref = MLP(16, 32)
    ref.init_weights(seed=7)
    with torch.device("meta"):
        model = MLP(16, 32)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    assert params_equal(ref, model)
    other = MLP(16, 32)
    other.init_weights(seed=8)
    assert not torch.equal(other.w1.weight, ref.w1.weight)


def test_mlp_without_bias() -> None:
    model = MLP(8, 8, bias=False)
    model.init_weights(seed=0)
    assert [n for n, _ in model.named_parameters()] == ["w1.weight", "w2.weight"]


# ---------------------------------------------------------------- Llama


def test_tiny_llama_forward_backward() -> None:
    cfg = llama_config("tiny")
    model = Llama(cfg)
    model.init_weights(seed=0)
    tokens = tiny_tokens(cfg.vocab_size, 2, 16)
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_tiny_llama_is_causal() -> None:
    """Changing a later token must not change logits at earlier positions."""
    model = Llama(llama_config("tiny"))
    model.init_weights(seed=0)
    tokens = tiny_tokens(batch=1, seq=8)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_llama_init_same_seed_same_params() -> None:
    cfg = llama_config("tiny")
    a, b, c = Llama(cfg), Llama(cfg), Llama(cfg)
    a.init_weights(seed=1)
    b.init_weights(seed=1)
    c.init_weights(seed=2)
    assert params_equal(a, b)
    assert not torch.equal(a.output.weight, c.output.weight)
    assert torch.equal(a.norm.weight, torch.ones(cfg.dim))


def test_llama_meta_to_empty_matches_cpu() -> None:
    cfg = llama_config("tiny")
    ref = Llama(cfg)
    ref.init_weights(seed=3)
    with torch.device("meta"):
        model = Llama(cfg)
    assert model.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    assert params_equal(ref, model)
    assert torch.equal(model.rope_cos, ref.rope_cos)
    assert torch.equal(model.rope_sin, ref.rope_sin)
    tokens = tiny_tokens(cfg.vocab_size, 1, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens))


def test_rotary_buffers_are_not_persistent() -> None:
    model = Llama(llama_config("tiny"))
    assert "rope_cos" not in model.state_dict()
    assert "rope_cos" in dict(model.named_buffers())


def test_llama_rejects_too_long_sequence() -> None:
    model = Llama(llama_config("tiny", max_seq_len=8))
    model.init_weights(seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tiny_tokens(seq=9))


# ---------------------------------------------------------------- configs


def test_llama_config_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError) as info:
        llama_config("nope")
    message = str(info.value)
    assert "nope" in message
    for name in ("llama3-8b", "llama3-70b", "tiny"):
        assert name in message


def test_llama_config_unknown_field() -> None:
    with pytest.raises(ValueError, match="n_layer"):
        llama_config("tiny", n_layer=3)


def test_llama_presets() -> None:
    assert LLAMA3_8B.ffn_hidden == 14336
    assert LLAMA3_70B.ffn_hidden == 28672
    cfg = LLAMA3_8B
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.vocab_size) == (8, 500000.0, 128256)
    assert llama_config("llama3-8b") == LLAMA3_8B
    assert llama_config("LLaMA3-70B").n_layers == 80
    tiny = llama_config("tiny")
    assert (tiny.dim, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads) == (64, 2, 4, 2)
    assert tiny.vocab_size == 256
    assert (tiny.ffn_hidden, tiny.max_seq_len) == (128, 64)


def test_llama_config_overrides() -> None:
    assert llama_config("llama3-8b", n_layers=2).ffn_hidden == 14336
    small = llama_config("llama3-8b", dim=1024, n_heads=8)
    assert small.ffn_hidden == 1024 * 4  # 2/3*4*1024*1.3 = 3549 -> rounded up to 1024s
    with pytest.raises(ValueError, match="n_kv_heads"):
        llama_config("tiny", n_kv_heads=3)


@pytest.mark.parametrize(("config", "expected"), [(LLAMA3_8B, 8.03e9), (LLAMA3_70B, 70.55e9)])
def test_llama_parameter_count(config: object, expected: float) -> None:
    with torch.device("meta"):
        model = Llama(config)  # type: ignore[arg-type]
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(expected, rel=0.005)


# ---------------------------------------------------------------- tracing


def check_joint(
    fake_model: nn.Module, gm: torch.fx.GraphModule, out_shape: tuple[int, ...]
) -> None:
    """Placeholders: params, buffers, one input, one tangent; outputs: value + grads."""
    descs = placeholder_descs(gm)
    param_names = [n for n, _ in fake_model.named_parameters(remove_duplicate=False)]
    buffer_names = [n for n, _ in fake_model.named_buffers()]
    assert [d.target for d in descs if isinstance(d, ParamAOTInput)] == param_names
    assert [d.target for d in descs if isinstance(d, BufferAOTInput)] == buffer_names
    kinds = Counter(type(d) for d in descs)
    assert kinds[PlainAOTInput] == 1 and kinds[TangentAOTInput] == 1
    assert len(descs) == len(param_names) + len(buffer_names) + 2
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            assert isinstance(node.meta["val"], FakeTensor)
            assert node.meta["val"].device.type == "cpu"

    out = output_node(gm)
    values, out_descs = out.args[0], out.meta["desc"]
    assert len(values) == len(out_descs)
    plain = [v for v, d in zip(values, out_descs) if isinstance(d, PlainAOTOutput)]
    assert len(plain) == 1 and tuple(plain[0].meta["val"].shape) == out_shape
    grads = [d.grad_of.target for d in out_descs if isinstance(d, GradAOTOutput)]
    assert grads == param_names
    # buffers and the integer/float input get no gradient: None, with desc None
    assert all(v is None for v, d in zip(values, out_descs) if d is None)


def test_trace_mlp() -> None:
    fake_model, gm = trace_joint(lambda: MLP(16, 32), lambda: torch.randn(4, 16))
    check_joint(fake_model, gm, (4, 16))
    expected = {"aten.addmm.default", "aten.gelu.default", "aten.gelu_backward.default"}
    assert expected <= call_targets(gm)


def test_trace_tiny_llama() -> None:
    cfg = llama_config("tiny")
    fake_model, gm = trace_joint(lambda: Llama(cfg), lambda: tiny_tokens(cfg.vocab_size, 2, 16))
    check_joint(fake_model, gm, (2, 16, cfg.vocab_size))
    targets = call_targets(gm)
    assert {SDPA_FWD, SDPA_BWD} <= targets
    assert not any("complex" in t or "view_as_real" in t for t in targets)
    assert sum(1 for n in gm.graph.nodes if str(n.target) == SDPA_FWD) == cfg.n_layers


def test_trace_real_tokens_are_fakeified() -> None:
    """A real (non-fake) input tensor is accepted: the exporter fakeifies it."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with torch.device("meta"):
        model = MLP(8, 8)
    fake_model = fake_cpu_copy(model, fake_mode)
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, fake_model, (torch.randn(2, 8),))
        assert isinstance(placeholder_descs(joint.graph_module)[-2], PlainAOTInput)


def test_trace_hf_gpt2() -> None:
    pytest.importorskip("transformers")
    from autoparallel.models import hf_gpt2

    fake_model, gm = trace_joint(lambda: hf_gpt2(), lambda: tiny_tokens(256, 2, 16))
    check_joint(fake_model, gm, (2, 16, 256))
    assert {SDPA_FWD, SDPA_BWD} <= call_targets(gm)
    # GPT-2 ties lm_head to wte: one object, but a placeholder per name
    assert fake_model.model.lm_head.weight is fake_model.model.transformer.wte.weight
    names = [d.target for d in placeholder_descs(gm) if isinstance(d, ParamAOTInput)]
    assert "model.lm_head.weight" in names and "model.transformer.wte.weight" in names


def test_trace_hf_llama() -> None:
    pytest.importorskip("transformers")
    from autoparallel.models import hf_llama

    fake_model, gm = trace_joint(lambda: hf_llama(), lambda: tiny_tokens(256, 2, 16))
    check_joint(fake_model, gm, (2, 16, 256))
    assert {SDPA_FWD, SDPA_BWD} <= call_targets(gm)


# ---------------------------------------------------------------- Hugging Face eager


def test_hf_models_match_builtin_sdpa() -> None:
    """The traceable attention gives the same logits as transformers' "sdpa"."""
    pytest.importorskip("transformers")
    from autoparallel.models import hf_gpt2, hf_llama

    tokens = tiny_tokens(256, 2, 16)
    for build in (hf_gpt2, hf_llama):
        ours = build()
        ours.init_weights(seed=0)
        theirs = build(attn_implementation="sdpa")
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad():
            logits = ours(tokens)
            assert logits.shape == (2, 16, 256)
            torch.testing.assert_close(logits, theirs(tokens))


def test_hf_llama_meta_to_empty_init() -> None:
    pytest.importorskip("transformers")
    from autoparallel.models import hf_llama

    ref = hf_llama()
    ref.init_weights(seed=5)
    with torch.device("meta"):
        model = hf_llama()
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    assert params_equal(ref, model)
    for (name, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), name
    tokens = tiny_tokens(256, 1, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens))


def test_hf_missing_transformers_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from autoparallel.models import hf_gpt2

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        hf_gpt2()


# ---------------------------------------------------------------- DTensor init


def test_init_weights_on_dtensor_matches_unsharded() -> None:
    """init_weights writes each rank's shard of the same global values."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no existing process group")
    from torch.distributed.tensor import Shard, distribute_tensor

    from autoparallel import fake_mesh

    mesh = fake_mesh((2,), rank=1)
    try:
        model = MLP(8, 16)
        for module in (model.w1, model.w2):
            for name, param in list(module.named_parameters()):
                sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(sharded))
        model.init_weights(seed=3)
        ref = MLP(8, 16)
        ref.init_weights(seed=3)
        assert torch.equal(model.w1.weight.to_local(), ref.w1.weight[8:])
        assert torch.equal(model.w2.bias.to_local(), ref.w2.bias[4:])
    finally:
        dist.destroy_process_group()
