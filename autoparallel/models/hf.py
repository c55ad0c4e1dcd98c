"""Small Hugging Face ``transformers`` models built from a config alone.

No weights are downloaded and nothing touches the network. The models are
configured to trace cleanly: no KV cache, all dropout off, and attention
through ``CAUSAL_SDPA``, an attention function registered with
``transformers.AttentionInterface`` that calls
``scaled_dot_product_attention(is_causal=True)``.

Any ``transformers`` model also traces with its own default attention and masks (see
``hf_families.py``); ``CAUSAL_SDPA`` stays for these builders because it skips the mask
construction altogether (a smaller graph, the same logits as ``"sdpa"`` for unpadded
causal-LM input, the only input it supports) and because the planning benchmarks of
``hf-llama3-8b`` are measured on it.

``transformers`` is imported only inside the builders, so the rest of
``autoparallel`` does not depend on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoparallel.models.mlp import copy_full_, seeded_generator

__all__ = ["CAUSAL_SDPA", "HFLogits", "hf_gpt2", "hf_llama"]

CAUSAL_SDPA = "autoparallel_causal_sdpa"
"""Name under which the traceable causal attention is registered."""

INIT_STD = 0.02
"""Standard deviation of the normal init used for every matrix."""

_INSTALL_HINT = (
    "the Hugging Face reference models need the `transformers` package; "
    "install it with `pip install transformers`"
)


def _transformers() -> Any:
    """Import ``transformers`` or raise ImportError saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    _register_causal_sdpa(transformers)
    return transformers


def _register_causal_sdpa(transformers: Any) -> None:
    """Register ``_causal_sdpa`` as ``CAUSAL_SDPA`` (idempotent, additive)."""
    transformers.AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa)


def _causal_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention for ``transformers`` on ``[batch, heads, seq, head_dim]``.

    Follows the ``AttentionInterface`` contract: returns the output as
    ``[batch, seq, heads, head_dim]`` and no attention weights. Padding masks
    and dropout are rejected rather than silently ignored.
    """
    if attention_mask is not None:
        raise ValueError(f"{CAUSAL_SDPA} supports only unpadded causal input (no attention_mask)")
    if dropout:
        raise ValueError(f"{CAUSAL_SDPA} does not support attention dropout")
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        b, kv_heads, s, d = key.shape
        key = key[:, :, None].expand(b, kv_heads, n_rep, s, d).reshape(b, -1, s, d)
        value = value[:, :, None].expand(b, kv_heads, n_rep, s, d).reshape(b, -1, s, d)
    out = nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


class HFLogits(nn.Module):
    """Wrap a causal-LM so that ``forward(input_ids)`` returns only the logits.

    The wrapped model is ``self.model``, so parameter names gain a
    ``model.`` prefix. ``init_weights`` gives the same kind of contract as the
    native reference models: deterministic given a seed, usable after
    ``to_empty``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Return logits ``[batch, seq, vocab]`` for ``input_ids`` ``[batch, seq]``."""
        return self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits

    def init_weights(self, seed: int | None = None) -> None:
        """Initialize parameters in place and recompute non-persistent buffers.

        1-d ``*.weight`` parameters (norm scales) get 1, ``*.bias`` get 0,
        everything else N(0, INIT_STD^2), drawn on CPU in ``named_parameters``
        order from a generator seeded with ``seed``. Tied weights are visited
        once.
        """
        generator = seeded_generator(seed)
        for name, param in self.named_parameters():
            copy_full_(param, _initial_value(name, param, generator))
        _reset_buffers(self)


def _initial_value(
    name: str, param: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Full-size CPU float32 initial value for the parameter called ``name``."""
    if name.endswith("bias"):
        return torch.zeros(param.shape)
    if param.dim() == 1:
        return torch.ones(param.shape)
    values = torch.empty(param.shape, dtype=torch.float32, device="cpu")
    return values.normal_(0.0, INIT_STD, generator=generator)


def _reset_buffers(root: nn.Module) -> None:
    """Recompute buffers of modules that can be rebuilt from the model config.

    ``to_empty`` leaves non-persistent buffers (e.g. the rotary ``inv_freq``)
    as garbage. Such modules in ``transformers`` take just the config, so a
    CPU copy is built from it and its buffers are copied over.
    """
    config = getattr(root, "model", root).config
    for module in root.modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        try:
            with torch.device("cpu"):
                fresh = type(module)(config)
        except TypeError as exc:
            raise NotImplementedError(
                f"cannot recompute buffers {sorted(own)} of {type(module).__name__}: "
                "it is not constructible from the model config alone"
            ) from exc
        for name, buffer in own.items():
            copy_full_(buffer, getattr(fresh, name))


def _special_tokens(vocab_size: int) -> dict[str, int | None]:
    """Special-token ids valid for a small vocabulary.

    ``pad_token_id`` stays None: with a pad id and no attention mask, GPT-2
    runs a data-dependent "is there padding?" check that cannot trace.
    """
    last = vocab_size - 1
    return {"bos_token_id": last, "eos_token_id": last, "pad_token_id": None}


def hf_gpt2(
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    vocab_size: int = 256,
    n_positions: int = 128,
    *,
    attn_implementation: str = CAUSAL_SDPA,
    logits_only: bool = True,
    **overrides: Any,
) -> nn.Module:
    """Build a randomly initialized ``GPT2LMHeadModel`` for tracing.

    Dropout is off, the KV cache is disabled and attention uses
    ``attn_implementation`` (only the default traces on fake tensors, see the
    module docstring); ``overrides`` go to ``GPT2Config``. Returns an
    ``HFLogits`` wrapper (forward gives the logits tensor) unless
    ``logits_only`` is False, in which case the raw ``transformers`` model is
    returned. GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``; the
    joint graph then has one placeholder (and one gradient) per name.
    """
    transformers = _transformers()
    config = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        use_cache=False,
        attn_implementation=attn_implementation,
        **{**_special_tokens(vocab_size), **overrides},
    )
    model = transformers.GPT2LMHeadModel(config)
    return HFLogits(model) if logits_only else model


def hf_llama(
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 256,
    max_position_embeddings: int = 128,
    *,
    attn_implementation: str = CAUSAL_SDPA,
    logits_only: bool = True,
    **overrides: Any,
) -> nn.Module:
    """Build a randomly initialized ``LlamaForCausalLM`` for tracing.

    Grouped-query attention when ``num_key_value_heads < num_attention_heads``;
    dropout off, no KV cache, untied embeddings; ``overrides`` go to
    ``LlamaConfig``. Returns an ``HFLogits`` wrapper unless ``logits_only``
    is False.
    """
    transformers = _transformers()
    config = transformers.LlamaConfig(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=attn_implementation,
        **{**_special_tokens(vocab_size), **overrides},
    )
    model = transformers.LlamaForCausalLM(config)
    return HFLogits(model) if logits_only else model
