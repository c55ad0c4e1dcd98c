"""Trace the planned program once into plain local FX graphs.

Interpreting the joint graph op by op through DTensor costs Python dispatch on every op of
every step. The first call of each phase (forward, backward, inference) is therefore traced
with ``make_fx`` on this rank's real tensors: DTensor's dispatch and redistributions unfold
into plain ATen ops on local shapes and torch's functional collectives
(``_c10d_functional.all_gather_into_tensor`` and friends). Later calls run that graph.

Tracing runs the phase once (with its collectives) on real data; every rank reaches the
first call together, as in any SPMD program, so the collectives match.

Under ``torch.compile`` the phases are not traced here: AOTAutograd traces them itself
(see runtime/module.py and runtime/compile.py) and Inductor compiles the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx


@dataclass
class SavedSlot:
    """Where one saved local tensor goes back in the backward environment."""

    node: fx.Node
    index: int | None  # position inside a multi-output value, or None
    placements: tuple
    arity: int  # length of the multi-output value (0 for a single tensor)


def flatten_saved(
    env: dict[fx.Node, Any], nodes: list[fx.Node]
) -> tuple[list[torch.Tensor], list[SavedSlot]]:
    """Local tensors of the saved values, and how to rebuild them as DTensors."""
    tensors, slots = [], []
    for node in nodes:
        value = env[node]
        if isinstance(value, DTensor):
            tensors.append(value.to_local())
            slots.append(SavedSlot(node, None, tuple(value.placements), 0))
            continue
        for index, item in enumerate(value):
            if isinstance(item, DTensor):
                tensors.append(item.to_local())
                slots.append(SavedSlot(node, index, tuple(item.placements), len(value)))
    return tensors, slots


def rebuild_saved(
    tensors: list[torch.Tensor], slots: list[SavedSlot], mesh: Any
) -> dict[fx.Node, Any]:
    env: dict[fx.Node, Any] = {}
    for tensor, slot in zip(tensors, slots):
        value = DTensor.from_local(tensor, mesh, slot.placements, run_check=False)
        if slot.index is None:
            env[slot.node] = value
            continue
        items = env.setdefault(slot.node, [None] * slot.arity)
        items[slot.index] = value
    return env


class TracedPhase:
    """A phase function, traced into a local graph on its first call."""

    def __init__(self, name: str, function: Callable[..., list[torch.Tensor]]):
        self.name = name
        self.function = function
        self.graph_module: fx.GraphModule | None = None

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        if get_proxy_mode() is not None:
            # Already being traced (torch.compile's AOTAutograd): let that tracer see the
            # phase itself rather than a graph we traced for other tensors.
            return list(self.function(*tensors))
        if self.graph_module is None:
            self._trace(*tensors)
        return list(self.graph_module(*tensors))

    # Our own tracing must never be captured by torch.compile (a frame Dynamo skipped can
    # still reach here eagerly while compile is active).
    @torch.compiler.disable
    def _trace(self, *tensors: torch.Tensor) -> None:
        with torch.no_grad():
            self.graph_module = make_fx(self.function)(*tensors)
