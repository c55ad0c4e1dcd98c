"""torch.distributed.pipelining's cut, taken apart into its export and its split.

Why private: the public ``pipeline(model, mb_args, split_spec=...)`` exports the model with
torch.export and splits the exported program in one call. The planner prices several cuts of
one model at one microbatch shape (other layer splits, two stages per rank), and the export
is most of a cut's time (a 126-layer model: ~60 %). ``annotate_split_points`` (the markers
``split_spec`` places) and ``Pipe._from_traced`` (the split of an exported program) are the
two halves of ``pipeline``; nothing public offers them apart.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from inspect import signature
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn


def export_with_cut_markers(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], before: Sequence[str]
) -> Any:
    """torch.export's program of ``model`` with torch.distributed.pipelining's cut marker
    before each submodule named in ``before`` (in forward order: marker ``i`` is before
    ``before[i]``). The markers replace the named modules' ``forward`` on the model, as
    ``pipeline`` does; the caller puts them back."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import annotate_split_points

    annotate_split_points(model, {name: SplitPoint.BEGINNING for name in before})
    return torch.export.export(model, args, kwargs)


def split_at_markers(model: nn.Module, exported: Any, keep: Collection[int]) -> Any:
    """torch's ``Pipe`` of ``exported`` cut at the markers numbered ``keep`` only (0: the
    first marker), as ``pipeline`` would have cut the model with those split points; the
    first stage takes the model's keyword arguments too, as ``pipeline``'s does. Reads the
    model's tensors by name, so it runs under the same registrations as the export."""
    from torch.distributed.pipelining._IR import MultiUseParameterConfig, Pipe

    calling: list[tuple[Any, int]] = []  # the model's code generator and its input count

    def only_kept(traced: fx.GraphModule) -> fx.GraphModule:
        codegen = copy.deepcopy(traced.graph._codegen)  # before the split changes it
        calling.append((codegen, len(signature(traced.forward).parameters)))
        markers = [
            node
            for node in traced.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.pippy._pipe_split.default
        ]
        for index, marker in enumerate(markers):
            if index not in keep:
                traced.graph.erase_node(marker)
        traced.recompile()
        return traced

    pipe = Pipe._from_traced(
        model, exported, MultiUseParameterConfig.REPLICATE, split_policy=only_kept
    )
    _first_stage_takes_keywords(pipe, *calling[0])
    return pipe


def _first_stage_takes_keywords(pipe: Any, codegen: Any, inputs: int) -> None:
    """``Pipe.from_tracing``'s last step: the first stage's code takes the model's inputs
    as the model does (positional and keyword; ``codegen`` is the model's, which takes
    ``inputs``), where it takes as many."""
    first = next(iter(pipe.split_gm.children()))
    if inputs != len(signature(first.forward).parameters):
        return
    first.graph._codegen = codegen
    first.graph._codegen.pytree_info = first.graph._codegen.pytree_info._replace(out_spec=None)
    first.recompile()
