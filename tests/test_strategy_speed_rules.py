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

# 2 layers, narrow: every op kind of the LLaMA, with fewer evenly dividing shards per tensor,
# so DTensor's own whole-mesh pricing (the oracle here) takes ~25 s on (2, 2, 2), not ~60 s
# one layer: every op kind of a deeper model, half the strategies DTensor expands slowly
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


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4)])
def test_unpriced_whole_mesh_strategies_match_dtensor(fake_mesh, monkeypatch, shape):
    mesh = fake_mesh(shape)
    model = meta(lambda: Llama(CONFIG))
    joint = trace_joint(
        model, lambda: torch.randint(0, CONFIG.vocab_size, (8, 32)), torch.device("cpu")
    )

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
