"""A LLaMA-3 style decoder written for tracing and sharding.

The skeleton (embedding, attention, RMSNorm, rotary tables, the stack, ``init_weights``)
is :mod:`autoparallel.models.decoder`'s, and its design notes apply; this module adds what is
LLaMA's own: the dense SwiGLU feed-forward in every block, its width rule, residual dropout,
and the released models' presets. The shared names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from autoparallel.models.decoder import INIT_STD as INIT_STD  # re-exported
from autoparallel.models.decoder import (
    Attention,
    Decoder,
    DecoderBlock,
    DecoderConfig,
    FeedForward,
    RMSNorm,
    apply_rotary,
    rotary_tables,
)

__all__ = [
    "LLAMA3_70B",
    "LLAMA3_8B",
    "LLAMA_TINY",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rotary",
    "llama_config",
    "rotary_tables",
]


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Hyper-parameters of a LLaMA-style decoder.

    ``n_kv_heads`` None is filled in as ``n_heads`` (plain multi-head attention), here at
    construction, so ``dataclasses.replace`` of ``n_heads`` keeps the filled-in count.
    ``ffn_hidden`` defaults to the LLaMA rule: ``2/3 * 4 * dim``, scaled by
    ``ffn_dim_multiplier`` when given, rounded up to ``multiple_of``.
    """

    ffn_hidden: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    dropout: float = 0.0  # on each block's residual branches (in training mode); 0: none

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", self._llama_ffn_hidden())
        super().__post_init__()

    def _llama_ffn_hidden(self) -> int:
        """SwiGLU hidden width by the rule used for the released LLaMA models."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


LLAMA3_8B = LlamaConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=1024,
    ffn_dim_multiplier=1.3,
    norm_eps=1e-5,
    rope_theta=500000.0,
    max_seq_len=8192,
)
"""LLaMA-3 8B (ffn_hidden works out to 14336)."""

LLAMA3_70B = LlamaConfig(
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=4096,
    ffn_dim_multiplier=1.3,
    norm_eps=1e-5,
    rope_theta=500000.0,
    max_seq_len=8192,
)
"""LLaMA-3 70B (ffn_hidden works out to 28672)."""

LLAMA3_405B = LlamaConfig(
    dim=16384,
    n_layers=126,
    n_heads=128,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=4096,
    ffn_dim_multiplier=1.2,
    norm_eps=1e-5,
    rope_theta=500000.0,
    max_seq_len=8192,
)
"""LLaMA-3 405B (ffn_hidden works out to 53248)."""

LLAMA_TINY = LlamaConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_hidden=128,
    rope_theta=10000.0,
    max_seq_len=64,
)
"""A few-thousand-parameter model with the full architecture, for tests."""

LLAMA_SMALL = LlamaConfig(
    dim=512,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    vocab_size=8192,
    ffn_hidden=1536,
    rope_theta=10000.0,
    max_seq_len=256,
)
"""About 21 M parameters: big enough that compute, not per-op overhead, sets a CPU step's
time (the benchmarks' ``llama-small``)."""

_PRESETS: dict[str, LlamaConfig] = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": LLAMA3_70B,
    "llama3-405b": LLAMA3_405B,
    "tiny": LLAMA_TINY,
    "small": LLAMA_SMALL,
}

_FFN_INPUTS = frozenset({"dim", "multiple_of", "ffn_dim_multiplier"})


def llama_config(name: str, **overrides: object) -> LlamaConfig:
    """Return the preset ``name`` ("llama3-8b", "llama3-70b", "llama3-405b", "tiny",
    "small") with overrides.

    Overriding ``dim``, ``multiple_of`` or ``ffn_dim_multiplier`` without
    ``ffn_hidden`` recomputes ``ffn_hidden`` by the LLaMA rule, so e.g.
    ``llama_config("llama3-8b", n_layers=2)`` keeps 14336 while
    ``llama_config("llama3-8b", dim=1024)`` gets a consistent width.
    Raises ValueError for an unknown name or field.
    """
    key = name.lower()
    if key not in _PRESETS:
        raise ValueError(
            f"unknown llama config {name!r}; valid names: {', '.join(sorted(_PRESETS))}"
        )
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig field(s) {unknown}; valid: {sorted(fields)}")
    if _FFN_INPUTS & set(overrides) and "ffn_hidden" not in overrides:
        overrides["ffn_hidden"] = None
    return dataclasses.replace(_PRESETS[key], **overrides)


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block: attention then the dense SwiGLU feed-forward."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, dropout=config.dropout)
        assert config.ffn_hidden is not None
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)

    def feed_forward_half(self, h: torch.Tensor) -> torch.Tensor:
        """``feed_forward(ffn_norm(h))``."""
        return self.feed_forward(self.ffn_norm(h))


class Llama(Decoder):
    """LLaMA-style decoder: ``forward(tokens[batch, seq]) -> logits[batch, seq, vocab]``.

    Parameters are left uninitialized by the constructor; call ``init_weights`` (also after
    ``to_empty``) before use: matrices get N(0, INIT_STD^2), RMSNorm scales 1 (see
    :meth:`Decoder.init_weights`).
    """

    config: LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, TransformerBlock)
