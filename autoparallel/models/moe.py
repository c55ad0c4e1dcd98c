"""A DeepSeek-style mixture-of-experts decoder whose token dispatch is a ``local_map`` region.

The skeleton (embedding, pre-norm attention, the stack, ``init_weights``) is
:mod:`autoparallel.models.decoder`'s, shared with LLaMA; this module adds the second half of
each block, a mixture of experts: a router picks ``top_k`` of ``num_experts`` routed experts
per token, every token also goes through a shared expert, and the routed experts are stacked
weights ``[num_experts, ...]`` run as one grouped matmul. Which expert a token goes to depends on the data, so no sharding rule can
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
from autoparallel.models.decoder import (
    Decoder,
    DecoderBlock,
    DecoderConfig,
    FeedForward,
    RMSNorm,
    fill_normal_,
)
from autoparallel.regions import collectives, current_mesh, local_map

__all__ = ["MOE_16B", "MOE_TINY", "MoEConfig", "MoETransformer", "moe_config", "routed_experts"]


@dataclass(frozen=True)
class MoEConfig(DecoderConfig):
    """Hyper-parameters of the mixture-of-experts decoder (every block has an MoE).

    The shared fields default to DeepSeek-V2-Lite-like shapes; ``n_kv_heads`` None stays
    None and means ``n_heads`` (``kv_heads``).
    """

    dim: int = 2048
    n_layers: int = 27
    n_heads: int = 16
    vocab_size: int = 102400
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    num_experts: int = 64
    top_k: int = 6
    expert_hidden: int = 1408
    shared_hidden: int = 2816
    ep_dim: str = "ep"  # the mesh dim the routed experts are sharded over

    def __post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        super().__post_init__()


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


class MoEBlock(DecoderBlock):
    """Pre-norm residual block: attention then mixture of experts."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.moe_norm = RMSNorm(config.dim, config.norm_eps)
        self.moe = MoE(config)

    def feed_forward_half(self, h: torch.Tensor) -> torch.Tensor:
        """``moe(moe_norm(h))``."""
        return self.moe(self.moe_norm(h))


class MoETransformer(Decoder):
    """``forward(tokens[batch, seq]) -> logits[batch, seq, vocab]``; parameters are left
    uninitialized by the constructor: call ``init_weights`` (also after ``to_empty``)."""

    config: MoEConfig

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, MoEBlock)

    def init_module(self, module: nn.Module, generator: torch.Generator | None) -> None:
        """The routed experts' stacks get N(0, INIT_STD^2) (``w1``, ``w2``, ``w3`` in turn);
        everything else as :meth:`Decoder.init_module` does."""
        if isinstance(module, GroupedExperts):
            for weight in (module.w1, module.w2, module.w3):
                fill_normal_(weight, generator)
        else:
            super().init_module(module, generator)
