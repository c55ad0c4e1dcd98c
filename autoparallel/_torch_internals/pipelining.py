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
from dataclasses import dataclass
from inspect import signature
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn


@dataclass(frozen=True)
class MarkedProgram:
    """An exported program with cut markers, and the calling convention of the model's
    forward (its code generator and parameter count), read once."""

    program: Any  # torch.export.ExportedProgram
    codegen: Any
    inputs: int


def export_with_cut_markers(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], before: Sequence[str]
) -> MarkedProgram:
    """torch.export's program of ``model`` with torch.distributed.pipelining's cut marker
    before each submodule named in ``before`` (in forward order: marker ``i`` is before
    ``before[i]``). The markers replace the named modules' ``forward`` on the model, as
    ``pipeline`` does; the caller puts them back."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import annotate_split_points

    annotate_split_points(model, {name: SplitPoint.BEGINNING for name in before})
    program = torch.export.export(model, args, kwargs)
    traced = program.module()
    return MarkedProgram(program, traced.graph._codegen, len(signature(traced.forward).parameters))


def split_at_markers(model: nn.Module, marked: MarkedProgram, keep: Collection[int]) -> Any:
    """torch's ``Pipe`` of ``exported`` cut at the markers numbered ``keep`` only (0: the
    first marker), as ``pipeline`` would have cut the model with those split points; the
    first stage takes the model's keyword arguments too, as ``pipeline``'s does. Reads the
    model's tensors by name, so it runs under the same registrations as the export."""
    from torch.distributed.pipelining._IR import MultiUseParameterConfig, Pipe

    def only_kept(traced: fx.GraphModule) -> fx.GraphModule:
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
        model, marked.program, MultiUseParameterConfig.REPLICATE, split_policy=only_kept
    )
    _first_stage_takes_keywords(pipe, marked)
    return pipe


def _first_stage_takes_keywords(pipe: Any, marked: MarkedProgram) -> None:
    """``Pipe.from_tracing``'s last step: the first stage's code takes the model's inputs
    as the model does (positional and keyword), where it takes as many."""
    first = next(iter(pipe.split_gm.children()))
    if marked.inputs != len(signature(first.forward).parameters):
        return
    first.graph._codegen = copy.deepcopy(marked.codegen)
    first.graph._codegen.pytree_info = first.graph._codegen.pytree_info._replace(out_spec=None)
    first.recompile()
