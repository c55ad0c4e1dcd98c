"""The decoder skeleton the reference transformers share, written for tracing and sharding.

``Llama`` (:mod:`autoparallel.models.llama`) and ``MoETransformer``
(:mod:`autoparallel.models.moe`) differ only in the second half of each block (a dense
SwiGLU or a mixture of experts); everything else lives here: the config fields of the
attention and the stack, rotary tables, RMSNorm, grouped-query attention, the SwiGLU, the
block's attention half, and the model around the blocks with its ``init_weights``.

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
* Parameter names are the plans' vocabulary: ``tok_embeddings``, ``layers.N.attention_norm``,
  ``layers.N.attention.{wq,wk,wv,wo}``, ``norm`` and ``output``, registered in that order
  (which is also the order ``init_weights`` draws in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autoparallel.models.mlp import copy_full_, seeded_generator

__all__ = [
    "INIT_STD",
    "Attention",
    "Decoder",
    "DecoderBlock",
    "DecoderConfig",
    "FeedForward",
    "RMSNorm",
    "apply_rotary",
    "fill_normal_",
    "repeat_kv",
    "rotary_tables",
]

INIT_STD = 0.02
"""Standard deviation of the normal init used for every matrix."""


@dataclass(frozen=True)
class DecoderConfig:
    """The hyper-parameters every decoder here has: the stack, the attention, the rotary table.

    ``n_kv_heads`` None means plain multi-head attention (``kv_heads`` is then ``n_heads``).
    Subclasses add the fields of their feed-forward half and call ``super().__post_init__()``
    to have the attention shapes checked.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        self._validate_attention()

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_heads`` when ``n_kv_heads`` is None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def _validate_attention(self) -> None:
        """Reject shapes the attention cannot be built with, naming the culprit."""
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embedding")


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


def fill_normal_(
    tensor: torch.Tensor, generator: torch.Generator | None, std: float = INIT_STD
) -> None:
    """Fill ``tensor`` in place with N(0, std^2) drawn on CPU in float32.

    Drawing on CPU and copying the full value in (``copy_full_``) is what gives one seed the
    same values on every device and sharding.
    """
    values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
    values.normal_(0.0, std, generator=generator)
    copy_full_(tensor, values)


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

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
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
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (LLaMA's feed-forward and the MoE's shared expert)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[..., dim]`` to ``[..., dim]``."""
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    """Pre-norm residual block: attention, then the subclass's feed-forward half.

    The constructor registers ``attention_norm`` and ``attention``; a subclass registers its
    own norm and feed-forward after calling it (so they come next in ``modules()`` order) and
    implements :meth:`feed_forward_half`. ``dropout`` (0: none) applies to both residual
    branches in training mode.
    """

    def __init__(self, config: DecoderConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Map ``[batch, seq, dim]`` to ``[batch, seq, dim]``."""
        h = x + self._drop(self.attention(self.attention_norm(x), cos, sin))
        return h + self._drop(self.feed_forward_half(h))

    def feed_forward_half(self, h: torch.Tensor) -> torch.Tensor:
        """The second residual branch (its norm included) of ``[batch, seq, dim]``."""
        raise NotImplementedError

    def _drop(self, branch: torch.Tensor) -> torch.Tensor:
        if not self.dropout:
            return branch
        return nn.functional.dropout(branch, self.dropout, self.training)


class Decoder(nn.Module):
    """``forward(tokens[batch, seq]) -> logits[batch, seq, vocab]`` over ``n_layers`` blocks.

    Holds ``tok_embeddings``, ``layers`` (one ``block(config)`` each), ``norm``, ``output`` and
    the rotary buffers ``rope_cos``/``rope_sin``. Parameters are left uninitialized by the
    constructor; call ``init_weights`` (also after ``to_empty``) before use.
    """

    config: DecoderConfig
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: DecoderConfig, block: type[DecoderBlock]) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(block(config) for _ in range(config.n_layers))
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

        Visits modules in ``self.modules()`` order and hands each to :meth:`init_module`,
        drawing from one CPU generator seeded with ``seed`` (the global RNG when None), so the
        same seed gives the same values on any device and sharding.
        """
        generator = seeded_generator(seed)
        for module in self.modules():
            self.init_module(module, generator)
        self.reset_rotary()

    def init_module(self, module: nn.Module, generator: torch.Generator | None) -> None:
        """Initialize ``module``'s own parameters: RMSNorm scales get 1, the weight of every
        Linear and Embedding N(0, INIT_STD^2), biases 0; other modules are left alone.

        A subclass with parameters of its own kind handles them here and defers the rest
        to this method; every N(0, .) draw consumes ``generator`` in visiting order.
        """
        if isinstance(module, RMSNorm):
            module.reset_parameters()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            fill_normal_(module.weight, generator)
            if getattr(module, "bias", None) is not None:
                copy_full_(module.bias, torch.zeros(module.bias.shape))

    def reset_rotary(self) -> None:
        """Recompute the rotary cos/sin buffers (needed after ``to_empty``)."""
        cfg = self.config
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device="cpu")
        copy_full_(self.rope_cos, cos)
        copy_full_(self.rope_sin, sin)
