"""fx_args walks node arguments exactly as torch's pytree does, on every node of real graphs."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from autoparallel.graph.fx_args import flat_args, map_args
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.trace.export import trace_joint


def _graphs():
    config = llama_config("tiny", dim=64, ffn_hidden=128, vocab_size=128)
    with torch.device("meta"):
        llama, mlp = Llama(config), MLP(16, 32)
    cpu = torch.device("cpu")
    yield trace_joint(llama, lambda: torch.randint(0, 128, (4, 16)), cpu).graph
    yield trace_joint(mlp, lambda: torch.randn(8, 16), cpu).graph


def test_leaves_and_mapped_values_match_pytree_on_every_node():
    checked = 0
    for graph in _graphs():
        for node in graph.nodes:
            tree = (node.args, dict(node.kwargs))
            assert flat_args(tree) == tree_flatten(tree)[0], node.format_node()
            described = map_args(repr, tree)
            assert flat_args(described) == tree_flatten(tree_map(repr, tree))[0], node.format_node()
            checked += 1
    assert checked > 300
