"""A LLaMA written the way torchtitan writes one: a user's own model, as it comes.

It uses none of this library's helpers. Its ``init_weights`` is code written for one device:
it draws with ``nn.init`` on the parameters, assigns a new full ``nn.Parameter``, writes
through ``.data[:]``, recomputes its rotary table into a buffer that has a second name, and
loads a submodule's state dict of full tensors. On the parallel module, the same seed must
give the same values as on one device (runtime/init.py says how each pattern is handled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TitanArgs:
    """Sizes of :class:`TitanLlama`; ``tie_embeddings`` shares the embedding with the output."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 256
    ffn_hidden: int = 192
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """The rotary table ``[end, head_dim // 2, 2]``: cos and sin of each position's angles."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by the table's first ``seq`` rows."""
    batch, seq, heads, head_dim = x.shape
    pairs = x.float().view(batch, seq, heads, head_dim // 2, 2)
    cos = freqs_cis[:seq, :, 0].view(1, seq, 1, head_dim // 2)
    sin = freqs_cis[:seq, :, 1].view(1, seq, 1, head_dim // 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        shape = (batch, seq, self.n_heads, self.head_dim)
        q = apply_rotary_emb(self.wq(x).view(shape), freqs_cis)
        k = apply_rotary_emb(self.wk(x).view(shape), freqs_cis)
        v = self.wv(x).view(shape)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(batch, seq, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        device = self.w1.weight.device
        # a new full Parameter assigned to a submodule attribute
        self.w1.weight = nn.Parameter(
            torch.empty(self.w1.weight.shape, device=device).normal_(0, 0.02)
        )
        # a full tensor written through .data
        self.w2.weight.data[:] = torch.randn(self.w2.weight.shape, device=device) * init_std
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TitanArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class RotaryCache(nn.Module):
    """Holds the rotary table; the model registers the same tensor under a second name."""

    def __init__(self, args: TitanArgs):
        super().__init__()
        head_dim = args.dim // args.n_heads
        table = precompute_freqs_cis(head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("cache", table, persistent=False)


class TitanLlama(nn.Module):
    """Decoder-only LLaMA with torchtitan's layout (``layers`` a ModuleDict) and init."""

    def __init__(self, args: TitanArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", RotaryCache(args).cache, persistent=False)
        self.rope = RotaryCache(args)
        self.rope.cache = self.freqs_cis  # one tensor under two names
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's recipe: recompute the rotary table on ``buffer_device`` (the
        buffer's own device by default), then initialize every weight in place."""
        args = self.args
        if args.tie_embeddings:  # to_empty() gives each name its own tensor: tie them again
            self.output.weight = self.tok_embeddings.weight
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = precompute_freqs_cis(
                args.dim // args.n_heads, args.max_seq_len, args.rope_theta
            )
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        # a submodule's own load_state_dict of full tensors
        self.norm.load_state_dict({"weight": torch.ones(args.dim, device=self.norm.weight.device)})
        if not args.tie_embeddings:
            std = args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
