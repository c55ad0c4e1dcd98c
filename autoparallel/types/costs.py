"""The priced options: the cost stage's output (:class:`CostTables`).

Two kinds of price, both in microseconds: compute per (node, strategy), and per *edge*
(producer, consumer, input slot) the price of every distinct (producer placement, required
placement) pair. The pricing itself lives in ``autoparallel/cost/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch.fx as fx

from autoparallel.types.kinds import EdgeKind
from autoparallel.types.placements import OutputPlacements


class Topology(Protocol):
    """What later stages read of the cost stage's ``cost.topology.Topology``: the mesh and
    the hardware its prices came from (a Protocol: types import no stage)."""

    @property
    def mesh_shape(self) -> tuple[int, ...]: ...

    @property
    def hardware(self) -> Any: ...  # cost.hardware.Hardware

    @property
    def gpus_per_node(self) -> int: ...


class RouteTable(Protocol):
    """What later stages read of ``cost.routes.RouteTable``: one tensor's placement states
    and the single-step arcs between them, each with its price."""

    arc_src: np.ndarray
    arc_dst: np.ndarray
    arc_comm: np.ndarray

    @property
    def num_arcs(self) -> int: ...

    def price(self, src: int, dst: int) -> tuple[float, float]: ...


class PairPricer(Protocol):
    """What later stages read of ``cost.redistribution.PairPricer``: the route table of a
    tensor and the placements of its states."""

    @property
    def routes(self) -> RouteTable | None: ...

    def state_of(self, placements: object) -> int | None: ...

    def placements_of_state(self, state: int) -> tuple: ...

    def route(self, src: tuple, dst: tuple) -> list[tuple]: ...


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
    kind: EdgeKind
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
