"""DTensor's whole-mesh strategies for views, slice_backward, cat and linear reductions,
enumerated by us without DTensor's redistribution pricing (strategies/view_rules.py), must be
exactly DTensor's: same strategies, same order, node by node, or the plan could change."""

from __future__ import annotations

import pytest
import torch
from conftest import meta

from autoparallel.models import Llama, llama_config
from autoparallel.strategies import dtensor_adapter
from autoparallel.strategies import space as space_module
from autoparallel.strategies.space import build_strategy_space
from autoparallel.trace.export import trace_joint

# one narrow layer: every op kind of a deeper LLaMA, with fewer evenly dividing shards per
# tensor, so DTensor's own whole-mesh pricing (the oracle here) stays short on (2, 4)
CONFIG = llama_config(
    "tiny", dim=36, n_heads=3, n_kv_heads=1, ffn_hidden=90, vocab_size=250, n_layers=1
)
MIRRORED = (
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "permute",
    "transpose",
    "unsqueeze",
    "slice_backward",
    "cat",
    "sum",
    "mean",
)


class HeadsAndHalves(torch.nn.Module):
    """Every op kind the fast path mirrors in a few dozen nodes, for a 3-D mesh where DTensor's
    own pricing of the LLaMA takes most of a minute: a head split (view, transpose, permute,
    reshape), rotary-style halves (slices and cat: slice_backward in the backward), a
    broadcast (unsqueeze, expand) and the reductions (sum, mean)."""

    def __init__(self, dim: int = 12, heads: int = 3):
        super().__init__()
        self.heads = heads
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(dim // heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.proj(x).view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
        half = h.shape[-1] // 2
        rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
        h = h + rotated * self.scale.unsqueeze(0).expand(seq, -1)
        out = h.permute(0, 2, 1, 3).reshape(batch, seq, dim)
        return out.sum(-1) + out.mean(-1)


def _traced(model_name: str):
    if model_name == "llama":
        model = meta(lambda: Llama(CONFIG))
        inputs = lambda: torch.randint(0, CONFIG.vocab_size, (8, 32))  # noqa: E731
    else:
        model = meta(HeadsAndHalves)
        inputs = lambda: torch.randn(4, 8, 12)  # noqa: E731
    return trace_joint(model, inputs, torch.device("cpu"))


def _key(strategies) -> list[str]:
    # repr, not ==: a _MaskPartial equals only placements sharing its mask buffer
    return [repr((s.output, s.inputs)) for s in strategies]


def _build(joint, mesh, monkeypatch):
    """The strategy space, DTensor's raw answer per node, and the nodes DTensor was asked."""
    raw: dict = {}
    asked: list = []
    real_strategies, real_call = space_module.dtensor_strategies, dtensor_adapter._call

    def record(node, *args):
        found = real_strategies(node, *args)
        raw[node] = _key(found)
        return found

    def spy(strategy_fn, node, *args):
        asked.append(node)
        return real_call(strategy_fn, node, *args)

    monkeypatch.setattr(space_module, "dtensor_strategies", record)
    monkeypatch.setattr(dtensor_adapter, "_call", spy)
    built = build_strategy_space(joint, mesh)
    monkeypatch.setattr(space_module, "dtensor_strategies", real_strategies)
    monkeypatch.setattr(dtensor_adapter, "_call", real_call)
    return built, raw, asked


def _base_name(node) -> str:
    target = node.target
    return target._schema.name.split("::")[-1] if isinstance(target, torch._ops.OpOverload) else ""


@pytest.mark.parametrize(
    ("model_name", "shape"), [("heads-and-halves", (2, 2, 2)), ("llama", (2, 4))]
)
def test_unpriced_whole_mesh_strategies_match_dtensor(fake_mesh, monkeypatch, model_name, shape):
    mesh = fake_mesh(shape)
    joint = _traced(model_name)

    ours, ours_raw, asked = _build(joint, mesh, monkeypatch)
    monkeypatch.setattr(dtensor_adapter, "_USE_DTENSOR_WHOLE_MESH", True)
    theirs, theirs_raw, _ = _build(joint, mesh, monkeypatch)

    # the fast path answered every mirrored op of this model (DTensor was never asked)
    mirrored = [n for n in ours_raw if _base_name(n) in MIRRORED]
    assert not [n.name for n in asked if n in mirrored]
    assert {_base_name(n) for n in mirrored} >= {
        "view",
        "_unsafe_view",
        "expand",
        "slice_backward",
        "cat",
        "sum",
        "mean",
    }

    assert list(ours_raw) == list(theirs_raw)
    for node, mine in ours_raw.items():
        assert mine == theirs_raw[node], node.name  # DTensor's raw answer, order included
    assert list(ours.nodes) == list(theirs.nodes)
    for node, strategies in ours.nodes.items():
        assert _key(strategies.strategies) == _key(theirs.nodes[node].strategies), node.name
        assert strategies.source == theirs.nodes[node].source, node.name
    assert ours.fallbacks == theirs.fallbacks
