"""A DeepSeek-style mixture-of-experts decoder whose token dispatch is a ``local_map`` region.

Each block is pre-norm attention (the LLaMA one) followed by a mixture of experts: a router
picks ``top_k`` of ``num_experts`` routed experts per token, every token also goes through a
shared expert, and the routed experts are stacked weights ``[num_experts, ...]`` run as one
grouped matmul. Which expert a token goes to depends on the data, so no sharding rule can
derive the dispatch: it is written for local tensors in :func:`routed_experts` and wrapped
with :func:`autoparallel.local_map`, with these placements on the mesh being planned for:

* tokens, routing weights and chosen experts: sharded on the token dim over the mesh dim
  named ``config.ep_dim``, and free over the others (``None``: each token is routed on its
  own, so the planner splits them or replicates them there, see ``types/regions.py``);
* the routed experts' weights: sharded on the expert dim over the mesh dim named
  ``config.ep_dim`` (expert parallelism: each rank of it holds ``num_experts / ep`` experts),
  replicated over the others (their gradients are Partial there: the planner reduces them,
  and may store the weights FSDP-sharded and gather them before the region).

Dispatch is dropless: each rank sends every chosen (token, expert) row to the rank holding
that expert (an all-to-all whose split sizes are counted from the data), the experts run,
and a second all-to-all brings the rows back. Attention, the router and the shared expert are
ordinary ops the planner shards as it likes. The routed experts' parameters carry
``experts`` in their names; the shared expert's and the router's do not.

Without a mesh (the model on one device) the region is a plain call and its collectives are
identities, so the same module is the single-device reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard

from autoparallel import _torch_internals as internals
from autoparallel.models.llama import (
    INIT_STD,
    Attention,
    FeedForward,
    LlamaConfig,
    RMSNorm,
    rotary_tables,
)
from autoparallel.models.mlp import copy_full_, seeded_generator
from autoparallel.regions import collectives, current_mesh, local_map

__all__ = ["MOE_16B", "MOE_TINY", "MoEConfig", "MoETransformer", "moe_config", "routed_experts"]


@dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of the mixture-of-experts decoder (every block has an MoE)."""

    dim: int = 2048
    n_layers: int = 27
    n_heads: int = 16
    n_kv_heads: int | None = None
    vocab_size: int = 102400
    num_experts: int = 64
    top_k: int = 6
    expert_hidden: int = 1408
    shared_hidden: int = 2816
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    ep_dim: str = "ep"  # the mesh dim the routed experts are sharded over

    def __post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        self.attention_config()  # validates the attention shapes

    def attention_config(self) -> LlamaConfig:
        """The attention's hyper-parameters, as the LLaMA attention reads them."""
        return LlamaConfig(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab_size,
            ffn_hidden=self.shared_hidden,
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
            max_seq_len=self.max_seq_len,
        )


MOE_TINY = MoEConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    num_experts=8,
    top_k=2,
    expert_hidden=32,
    shared_hidden=64,
    max_seq_len=64,
)
"""A tiny MoE for tests: 8 routed experts, top-2, one shared expert."""

MOE_16B = MoEConfig()
"""~16 B parameters with DeepSeek-V2-Lite-like shapes (27 layers of 64 routed experts of
width 1408, top-6, a shared expert of width 2816, vocabulary 102400); attention is the
LLaMA grouped-query attention, not multi-head latent attention."""

_PRESETS = {"tiny": MOE_TINY, "16b": MOE_16B}


def moe_config(name: str, **overrides: object) -> MoEConfig:
    """The preset ``name`` ("tiny", "16b") with field overrides."""
    key = name.lower().removeprefix("moe-")
    if key not in _PRESETS:
        raise ValueError(f"unknown moe config {name!r}; valid names: moe-tiny, moe-16b")
    return dataclasses.replace(_PRESETS[key], **overrides)


def routed_experts(
    tokens: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    ep_dim: str,
) -> torch.Tensor:
    """The routed experts' output for this rank's tokens (the body of the region).

    ``tokens [n, dim]``, ``weights`` and ``chosen [n, top_k]`` are this rank's tokens, their
    routing weights and expert indices; ``w1, w3 [local_experts, dim, hidden]`` and
    ``w2 [local_experts, hidden, dim]`` are the experts this rank holds: experts
    ``[r * local_experts, (r + 1) * local_experts)`` for rank r of ``ep_dim``.
    """
    ep = collectives.mesh_dim_size(ep_dim)
    n, top_k = chosen.shape
    local_experts = w1.shape[0]
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)  # the rows of every (token, slot), by expert
    rows = tokens.index_select(0, order // top_k)
    counts = torch.zeros(local_experts * ep, dtype=torch.int64, device=tokens.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))
    # received[s * local_experts + e]: rows rank s sends to this rank's expert e
    received = collectives.all_to_all(counts, ep_dim)
    sent_per_rank = counts.view(ep, local_experts).sum(1)
    received_per_rank = received.view(ep, local_experts).sum(1)
    arrived = collectives.all_to_all(rows, ep_dim, received_per_rank, sent_per_rank)
    local_ids = torch.arange(local_experts, device=tokens.device).repeat(ep)
    expert_of = local_ids.repeat_interleave(received, output_size=arrived.shape[0])
    by_expert = expert_of.argsort(stable=True)
    grouped = arrived.index_select(0, by_expert)
    offsets = received.view(ep, local_experts).sum(0).cumsum(0).to(torch.int32)
    hidden = nn.functional.silu(internals.grouped_mm(grouped, w1, offsets))
    hidden = hidden * internals.grouped_mm(grouped, w3, offsets)
    out = internals.grouped_mm(hidden, w2, offsets).index_select(0, by_expert.argsort())
    back = collectives.all_to_all(out, ep_dim, sent_per_rank, received_per_rank)
    combined = back.index_select(0, order.argsort()).view(n, top_k, -1)
    return (combined * weights.unsqueeze(-1).to(combined.dtype)).sum(1)


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked on a leading expert dim."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))


class MoE(nn.Module):
    """Router (top-k of softmax scores, renormalized), routed experts and a shared expert."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.ep_dim = config.ep_dim
        self.router = nn.Linear(config.dim, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, config.dim, config.expert_hidden)
        self.shared_expert = FeedForward(config.dim, config.shared_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[batch, seq, dim]`` to ``[batch, seq, dim]``."""
        tokens = x.reshape(-1, x.shape[-1])
        scores = self.router(tokens).float().softmax(dim=-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        experts = self.experts
        routed = self._region()(
            tokens, weights, chosen, experts.w1, experts.w2, experts.w3, self.ep_dim
        )
        return (self.shared_expert(tokens) + routed).view_as(x)

    def _region(self):
        """``routed_experts`` as a region on the current mesh (a plain call without one)."""
        mesh = current_mesh()
        if mesh is None:
            return routed_experts
        names = mesh.mesh_dim_names or ()
        # tokens split over ep (the dispatch exchanges them there); free elsewhere: each
        # token is routed on its own, so the planner may split or replicate them
        by_token = tuple(Shard(0) if name == self.ep_dim else None for name in names)
        if len(by_token) != mesh.ndim:
            by_token = (None,) * mesh.ndim
        by_expert = tuple(Shard(0) if name == self.ep_dim else Replicate() for name in names)
        if len(by_expert) != mesh.ndim:  # an unnamed mesh: no expert parallelism
            by_expert = tuple(Replicate() for _ in range(mesh.ndim))
        return local_map(
            routed_experts,
            out_placements=(by_token,),
            in_placements=(by_token, by_token, by_token, by_expert, by_expert, by_expert, None),
        )


class MoEBlock(nn.Module):
    """Pre-norm residual block: attention then mixture of experts."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config.attention_config())
        self.moe_norm = RMSNorm(config.dim, config.norm_eps)
        self.moe = MoE(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.moe(self.moe_norm(h))


class MoETransformer(nn.Module):
    """``forward(tokens[batch, seq]) -> logits[batch, seq, vocab]``; parameters are left
    uninitialized by the constructor: call ``init_weights`` (also after ``to_empty``)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        head_dim = config.dim // config.n_heads
        cos, sin = rotary_tables(head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def init_weights(self, seed: int | None = None) -> None:
        """N(0, INIT_STD^2) for every matrix and expert stack (drawn on CPU from ``seed``, in
        ``self.modules()`` order), ones for the norms; the rotary tables recomputed."""
        generator = seeded_generator(seed)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                _normal_(module.weight, generator)
            elif isinstance(module, GroupedExperts):
                for weight in (module.w1, module.w2, module.w3):
                    _normal_(weight, generator)
        head_dim = self.config.dim // self.config.n_heads
        cos, sin = rotary_tables(
            head_dim, self.config.max_seq_len, self.config.rope_theta, device="cpu"
        )
        copy_full_(self.rope_cos, cos)
        copy_full_(self.rope_sin, sin)


def _normal_(tensor: torch.Tensor, generator: torch.Generator | None) -> None:
    values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
    values.normal_(0.0, INIT_STD, generator=generator)
    copy_full_(tensor, values)
