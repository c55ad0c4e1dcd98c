"""A LLaMA-3 style decoder written for tracing and sharding.

Design choices that matter to the planner:

* Rotary embedding uses real-valued cos/sin tables and the "rotate half"
  layout (no complex numbers, which trace and shard badly).
* The tables are non-persistent buffers, so a model built under
  ``torch.device("meta")`` is materialized with ``to_empty`` followed by
  ``init_weights``, which recomputes them.
* Grouped-query attention repeats k/v heads with expand+reshape and calls
  ``scaled_dot_product_attention(is_causal=True)``.
* Head counts are recovered from tensor shapes in ``forward`` (``view(..., -1,
  head_dim)``), so the module also runs on local shards of a head-sharded
  projection.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from autoparallel.models.mlp import copy_full_, seeded_generator

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

INIT_STD = 0.02
"""Standard deviation of the normal init used for every matrix."""


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a LLaMA-style decoder.

    ``n_kv_heads`` defaults to ``n_heads`` (plain multi-head attention).
    ``ffn_hidden`` defaults to the LLaMA rule: ``2/3 * 4 * dim``, scaled by
    ``ffn_dim_multiplier`` when given, rounded up to ``multiple_of``.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    ffn_hidden: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    dropout: float = 0.0  # on each block's residual branches (in training mode); 0: none

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", self._llama_ffn_hidden())
        self._validate()

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def _llama_ffn_hidden(self) -> int:
        """SwiGLU hidden width by the rule used for the released LLaMA models."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def _validate(self) -> None:
        """Reject shapes the model cannot be built with, naming the culprit."""
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        assert self.n_kv_heads is not None
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embedding")


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
    "tiny": LLAMA_TINY,
    "small": LLAMA_SMALL,
}

_FFN_INPUTS = frozenset({"dim", "multiple_of", "ffn_dim_multiplier"})


def llama_config(name: str, **overrides: object) -> LlamaConfig:
    """Return the preset ``name`` ("llama3-8b", "llama3-70b", "tiny", "small") with overrides.

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


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float32 ``(cos, sin)``, each ``[max_seq_len, head_dim // 2]``.

    Row ``t`` holds the angles ``t * theta ** (-2i / head_dim)``. ``device``
    None follows the ambient default device (meta under ``torch.device("meta")``).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[batch, seq, heads, head_dim]`` by position.

    Uses the "rotate half" pairing (dimension ``i`` with ``i + head_dim/2``);
    ``cos``/``sin`` are ``[seq, head_dim // 2]``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each head of ``[batch, kv_heads, seq, head_dim]`` ``n_rep`` times."""
    if n_rep == 1:
        return x
    b, kv_heads, s, d = x.shape
    return x[:, :, None].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``x``; the output keeps ``x``'s dtype."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Set the scale to one."""
        copy_full_(self.weight, torch.ones(self.weight.shape))


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.n_kv_heads is not None
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Map ``[batch, seq, dim]`` to ``[batch, seq, dim]``."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[..., dim]`` to ``[..., dim]``."""
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then feed-forward."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Map ``[batch, seq, dim]`` to ``[batch, seq, dim]``."""
        h = x + self._drop(self.attention(self.attention_norm(x), cos, sin))
        return h + self._drop(self.feed_forward(self.ffn_norm(h)))

    def _drop(self, branch: torch.Tensor) -> torch.Tensor:
        if not self.dropout:
            return branch
        return nn.functional.dropout(branch, self.dropout, self.training)


class Llama(nn.Module):
    """LLaMA-style decoder: ``forward(tokens[batch, seq]) -> logits[batch, seq, vocab]``.

    Parameters are left uninitialized by the constructor; call
    ``init_weights`` (also after ``to_empty``) before use.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return next-token logits for integer ``tokens`` of shape ``[batch, seq]``."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def init_weights(self, seed: int | None = None) -> None:
        """Initialize all parameters and the rotary buffers in place.

        Matrices (embedding and every Linear) get N(0, INIT_STD^2) drawn on
        CPU from a generator seeded with ``seed`` (the global RNG when None),
        visiting modules in ``self.modules()`` order; RMSNorm scales get 1.
        The same seed gives the same values on any device and sharding.
        """
        generator = seeded_generator(seed)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                _normal_(module.weight, INIT_STD, generator)
                if getattr(module, "bias", None) is not None:
                    copy_full_(module.bias, torch.zeros(module.bias.shape))
        self.reset_rotary()

    def reset_rotary(self) -> None:
        """Recompute the rotary cos/sin buffers (needed after ``to_empty``)."""
        cfg = self.config
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device="cpu")
        copy_full_(self.rope_cos, cos)
        copy_full_(self.rope_sin, sin)


def _normal_(tensor: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    """Fill ``tensor`` in place with N(0, std^2) drawn on CPU in float32."""
    values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
    values.normal_(0.0, std, generator=generator)
    copy_full_(tensor, values)
