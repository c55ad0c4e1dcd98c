"""The priced options: the cost stage's output (:class:`CostTables`).

Two kinds of price, both in microseconds: compute per (node, strategy), and per *edge*
(producer, consumer, input slot) the price of every distinct (producer placement, required
placement) pair. The pricing itself lives in ``autoparallel/cost/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from autoparallel.types.placements import OutputPlacements

if TYPE_CHECKING:  # the pricer is a cost-stage object this type only holds
    from autoparallel.cost.redistribution import PairPricer
    from autoparallel.cost.routes import RouteTable
    from autoparallel.cost.topology import Topology


@dataclass
class EdgeCost:
    """Prices of one edge, on distinct placements rather than on strategy pairs.

    ``src_options`` are the producer's distinct output placements and ``src_of_strategy[s]``
    the index of producer strategy ``s``'s output among them; likewise ``dst_*`` for the
    placement the consumer requires on this slot. ``pairs`` lists the feasible
    (src index, dst index, comm_us, transition_us); impossible pairs are absent.
    """

    producer: fx.Node
    consumer: fx.Node
    slot: int
    kind: str  # "arg", "param_grad", "input_grad" or "output"
    src_options: list[OutputPlacements]
    src_of_strategy: list[int]
    dst_options: list[OutputPlacements]
    dst_of_strategy: list[int]
    pairs: list[tuple[int, int, float, float]]
    routes: EdgeRoutes | None = None

    @property
    def name(self) -> str:
        return f"{self.producer.name}->{self.consumer.name}[{self.kind}:{self.slot}]"


@dataclass
class EdgeRoutes:
    """The route states of an edge's options, when all of them are states of the tensor's
    route table: ``src_states[i]`` is ``src_options[i]``'s state, likewise ``dst_states``.
    The solver may then price the edge as a flow over the table's single-step arcs."""

    pricer: PairPricer
    src_states: list[int]
    dst_states: list[int]

    @property
    def table(self) -> RouteTable:
        return self.pricer.routes  # type: ignore[return-value]


@dataclass
class CostTables:
    compute_us: dict[fx.Node, list[float]]
    edges: list[EdgeCost]
    topology: Topology
    incoming: dict[fx.Node, list[EdgeCost]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for edge in self.edges:
            self.incoming.setdefault(edge.consumer, []).append(edge)
