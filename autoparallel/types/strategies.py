"""Plain types of the strategy stage.

A *strategy* of a node is one valid way to run it on the mesh: the placements each tensor
input must arrive in and the placement(s) its output leaves in. Placements are tuples of
DTensor placements in mesh-dimension order, e.g. ``(Shard(0), Replicate())``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.fx as fx

from autoparallel.types.placements import OutputPlacements


@dataclass(frozen=True)
class Strategy:
    """One option of a node: required placement per input slot -> produced placement."""

    output: OutputPlacements
    inputs: tuple[OutputPlacements, ...]


StrategySource = Literal[
    "placeholder", "getitem", "fill", "factory", "local_map", "rule", "dtensor", "fallback"
]
"""Where a node's options came from: its role (a graph input, an item of a multi-output op,
a constant fill, a factory op, a ``local_map`` region), our own rules (``strategies/rules.py``),
DTensor's registry, or the replicate-everything fallback when neither had a valid option."""


@dataclass
class NodeStrategies:
    """All options of one node.

    ``input_nodes[i]`` is the producer feeding input slot ``i``; the same producer may feed
    several slots (``x * x``) and every slot is priced separately. ``source`` says where the
    options came from (:data:`StrategySource`).
    """

    node: fx.Node
    input_nodes: list[fx.Node]
    strategies: list[Strategy]
    source: StrategySource
    multi_output: bool = False
    _outputs: tuple | None = field(default=None, repr=False, compare=False)

    def output_placements(self) -> list[OutputPlacements]:
        """Distinct output placements over all strategies, in first-seen order (memoized:
        nodes with equal strategies share one list object, see build_strategy_space)."""
        if self._outputs is None or self._outputs[0] is not self.strategies:
            self._outputs = (
                self.strategies,
                list(dict.fromkeys(s.output for s in self.strategies)),
            )
        return self._outputs[1]

    def input_placements(self, slot: int) -> list[OutputPlacements]:
        """Distinct placements required on input ``slot``, in first-seen order."""
        return list(dict.fromkeys(s.inputs[slot] for s in self.strategies))


@dataclass
class StrategySpace:
    """Strategies of every node that takes part in the plan, in graph order."""

    nodes: dict[fx.Node, NodeStrategies]
    mesh_shape: tuple[int, ...]
    fallbacks: list[str] = field(default_factory=list)

    def __getitem__(self, node: fx.Node) -> NodeStrategies:
        return self.nodes[node]

    def __contains__(self, node: object) -> bool:
        return node in self.nodes

    @property
    def num_strategies(self) -> int:
        return sum(len(n.strategies) for n in self.nodes.values())
