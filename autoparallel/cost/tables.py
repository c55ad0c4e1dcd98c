"""Stage 3: price every option of a StrategySpace (CostTables).

Two kinds of price, both in microseconds:

* compute, per (node, strategy): the roofline time of the op on the local shapes the
  strategy implies;
* redistribution, per edge and per distinct (producer placement, required placement) pair.

An *edge* is one (producer, consumer, input slot) triple, so ``x * x`` has two edges. Three
boundary edges tie the backward to the forward: a parameter's gradient must arrive in the
parameter's placement (which is what turns a Partial gradient into FSDP's reduce-scatter or
DDP's all-reduce), a user input's gradient in the input's placement, and a user output must
leave in the placement its tangent (incoming gradient) has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from autoparallel.cost.compute import compute_cost_us
from autoparallel.cost.redistribution import redistribution_cost_us, transition_cost_us
from autoparallel.shapes import TensorInfo, local_shape
from autoparallel.strategies.types import NodeStrategies, OutputPlacements, StrategySpace, is_multi
from autoparallel.topology import Topology
from autoparallel.trace import JointGraph


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

    @property
    def name(self) -> str:
        return f"{self.producer.name}->{self.consumer.name}[{self.kind}:{self.slot}]"


@dataclass
class CostTables:
    compute_us: dict[fx.Node, list[float]]
    edges: list[EdgeCost]
    topology: Topology
    incoming: dict[fx.Node, list[EdgeCost]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for edge in self.edges:
            self.incoming.setdefault(edge.consumer, []).append(edge)


def build_cost_tables(joint: JointGraph, space: StrategySpace, topology: Topology) -> CostTables:
    redistribution_prices: dict[tuple, float] = {}
    compute = {node: _compute_costs(ns, topology) for node, ns in space.nodes.items()}
    edges: list[EdgeCost] = []
    for node, ns in space.nodes.items():
        for slot, producer in enumerate(ns.input_nodes):
            dst = [s.inputs[slot] for s in ns.strategies]
            edges.append(_edge(space[producer], node, slot, "arg", dst, topology, redistribution_prices))
    for boundary, kind in _boundary_edges(joint):
        producer, consumer = boundary
        if producer not in space or consumer not in space:
            continue
        dst = [s.output for s in space[consumer].strategies]
        edges.append(_edge(space[producer], consumer, 0, kind, dst, topology, redistribution_prices))
    return CostTables(compute_us=compute, edges=edges, topology=topology)


def _boundary_edges(joint: JointGraph) -> list[tuple[tuple[fx.Node, fx.Node], str]]:
    found = []
    for name, grad in joint.param_grads.items():
        found.append(((grad, joint.params[name]), "param_grad"))
    for index, grad in joint.input_grads.items():
        found.append(((grad, joint.user_inputs[index]), "input_grad"))
    for index, output in enumerate(joint.user_outputs):
        tangent = joint.tangents.get(index)
        if output is not None and tangent is not None:
            found.append(((output, tangent), "output"))
    return found


def _index(options: list[OutputPlacements]) -> dict[OutputPlacements, int]:
    return {placements: i for i, placements in enumerate(options)}


def _edge(
    producer: NodeStrategies,
    consumer: fx.Node,
    slot: int,
    kind: str,
    required: list[OutputPlacements],
    topology: Topology,
    prices: dict[tuple, float],
) -> EdgeCost:
    src_options = producer.output_placements()
    dst_options = list(dict.fromkeys(required))
    src_index, dst_index = _index(src_options), _index(dst_options)
    value = producer.node.meta["val"]
    pairs = []
    for i, src in enumerate(src_options):
        for j, dst in enumerate(dst_options):
            comm = _redistribution(value, src, dst, topology, prices)
            if math.isfinite(comm):
                transition = 0.0 if src == dst or is_multi(src) else transition_cost_us(src, dst)
                pairs.append((i, j, comm, transition))
    return EdgeCost(
        producer=producer.node,
        consumer=consumer,
        slot=slot,
        kind=kind,
        src_options=src_options,
        src_of_strategy=[src_index[s.output] for s in producer.strategies],
        dst_options=dst_options,
        dst_of_strategy=[dst_index[p] for p in required],
        pairs=pairs,
    )


def _redistribution(value: Any, src: OutputPlacements, dst: OutputPlacements, topology: Topology, prices: dict) -> float:
    if src == dst:
        return 0.0
    if is_multi(src) or is_multi(dst) or not isinstance(value, torch.Tensor):
        return math.inf  # tuples (multi-output values) are never redistributed as a whole
    info = TensorInfo(tuple(value.shape), value.dtype)
    key = (info, src, dst)
    if key not in prices:
        prices[key] = redistribution_cost_us(info, src, dst, topology)
    return prices[key]


def _compute_costs(ns: NodeStrategies, topology: Topology) -> list[float]:
    node = ns.node
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return [0.0] * len(ns.strategies)
    mesh_shape = topology.mesh_shape
    cache: dict[tuple, float] = {}
    costs = []
    for strategy in ns.strategies:
        key = (strategy.output, strategy.inputs)
        if key not in cache:
            placement_of: dict[fx.Node, Any] = {}
            for producer, placements in zip(ns.input_nodes, strategy.inputs):
                placement_of.setdefault(producer, placements)
            args, kwargs = _local_args(node, placement_of, mesh_shape)
            output = _local_value(node.meta["val"], strategy.output, mesh_shape)
            cache[key] = compute_cost_us(node.target, args, kwargs, output, topology.hardware)
        costs.append(cache[key])
    return costs


def _local_value(value: Any, placements: Any, mesh_shape: tuple[int, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorInfo(local_shape(value.shape, placements, mesh_shape), value.dtype)
    if isinstance(value, (tuple, list)):
        multi = placements if is_multi(placements) else [placements] * len(value)
        return tuple(_local_value(v, p, mesh_shape) if p is not None else None for v, p in zip(value, multi))
    return value


def _local_args(node: fx.Node, placement_of: dict[fx.Node, Any], mesh_shape: tuple[int, ...]) -> tuple[tuple, dict]:
    """The node's args with every input tensor replaced by its local TensorInfo.

    If one producer feeds several slots with different placements the first slot's placement
    is used: only the shapes matter here and they rarely differ.
    """

    def localize(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            return _local_value(arg.meta.get("val"), placement_of[arg], mesh_shape)
        return arg

    return tree_map(localize, node.args), tree_map(localize, dict(node.kwargs))
