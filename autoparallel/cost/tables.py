"""Stage 3: price every option of a StrategySpace (CostTables).

Two kinds of price, both in microseconds:

* compute, per (node, strategy): the roofline time of the op on the local shapes the
  strategy implies; for a trained parameter, its share of the optimizer step on the local
  shard its placement leaves (0 where the hardware does not price the step);
* redistribution, per edge and per distinct (producer placement, required placement) pair,
  priced by :class:`~autoparallel.cost.redistribution.PairPricer` (the reference model on
  integer codes with memoized local sizes: the same numbers, several times faster).

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

from autoparallel._torch_internals import OpOverload
from autoparallel.cost.compute import compute_cost_us
from autoparallel.cost.redistribution import PairPricer
from autoparallel.cost.regions import region_cost_us
from autoparallel.cost.topology import Topology
from autoparallel.graph.fx_args import flat_args, map_args
from autoparallel.regions.local_map import region_backward_op
from autoparallel.types.costs import CostTables, EdgeCost, EdgeRoutes
from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import OutputPlacements, is_multi
from autoparallel.types.strategies import NodeStrategies, StrategySpace
from autoparallel.types.tensors import TensorInfo, local_shape


@dataclass
class PriceCache:
    """Prices already computed in this build, keyed by everything they depend on.

    Repeated layers produce the same (op, shapes, options) over and over; pricing each once
    is most of the speed of this stage. The mesh shape and topology are fixed for one build,
    and the cache lives only as long as the build (no state is shared between sessions).
    """

    compute: dict[tuple, list[float]] = field(default_factory=dict)
    pairs: dict[tuple, list[tuple[int, int, float, float]]] = field(default_factory=dict)
    # Strategy lists are shared between nodes that asked the same question, so their
    # identity is a cheap key; the lists outlive this cache (the StrategySpace holds them).
    required: dict[tuple, tuple[list, list[int]]] = field(default_factory=dict)
    option_ids: dict[int, int] = field(default_factory=dict)
    option_lists: dict[tuple, int] = field(default_factory=dict)
    pricers: dict[TensorInfo, PairPricer] = field(default_factory=dict)
    states: dict[tuple, list[int] | None] = field(default_factory=dict)

    def canonical(self, options: list) -> int:
        """One small integer per distinct option list (hashed once per list object)."""
        found = self.option_ids.get(id(options))
        if found is None:
            found = self.option_lists.setdefault(tuple(options), len(self.option_lists))
            self.option_ids[id(options)] = found
        return found


def build_cost_tables(joint: JointGraph, space: StrategySpace, topology: Topology) -> CostTables:
    cache = PriceCache()
    compute = {node: _compute_costs(ns, topology, cache) for node, ns in space.nodes.items()}
    for name in joint.param_grads:  # trained parameters: their share of the optimizer step
        node = joint.params[name]
        if node in space:
            compute[node] = _optimizer_costs(space[node], topology)
    edges: list[EdgeCost] = []
    for ns in space.nodes.values():
        for slot, producer in enumerate(ns.input_nodes):
            edges.append(_edge(space[producer], ns, slot, "arg", topology, cache))
    for boundary, kind in _boundary_edges(joint):
        producer, consumer = boundary
        if producer not in space or consumer not in space:
            continue
        edges.append(_edge(space[producer], space[consumer], 0, kind, topology, cache))
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
    consumer: NodeStrategies,
    slot: int,
    kind: str,
    topology: Topology,
    cache: PriceCache,
) -> EdgeCost:
    """Price one edge. ``kind`` "arg" reads the consumer's required input placement of
    ``slot``; the boundary kinds require the consumer's own output placement."""
    src_options = producer.output_placements()
    dst_options, dst_of_strategy = _required(consumer, slot if kind == "arg" else None, cache)
    value = producer.node.meta["val"]
    info = TensorInfo(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
    key = (info, cache.canonical(src_options), cache.canonical(dst_options))
    pricer = None
    if info is not None:
        pricer = cache.pricers.get(info)
        if pricer is None:
            pricer = cache.pricers[info] = PairPricer(info, topology)
    pairs = cache.pairs.get(key)
    if pairs is None:
        pairs = cache.pairs[key] = _price_pairs(pricer, src_options, dst_options)
    src_index = cache.required.get(("src", id(producer.strategies)))
    if src_index is None:
        index = _index(src_options)
        src_index = cache.required[("src", id(producer.strategies))] = (
            [],
            [index[s.output] for s in producer.strategies],
        )
    return EdgeCost(
        producer=producer.node,
        consumer=consumer.node,
        slot=slot,
        kind=kind,
        src_options=src_options,
        src_of_strategy=src_index[1],
        dst_options=dst_options,
        dst_of_strategy=dst_of_strategy,
        pairs=pairs,
        routes=_edge_routes(pricer, info, src_options, dst_options, cache),
    )


def _edge_routes(
    pricer: PairPricer | None,
    info: TensorInfo | None,
    src_options: list,
    dst_options: list,
    cache: PriceCache,
) -> EdgeRoutes | None:
    if pricer is None or pricer.routes is None:
        return None
    src_states = _states(pricer, info, src_options, cache)
    dst_states = _states(pricer, info, dst_options, cache)
    if src_states is None or dst_states is None:
        return None
    return EdgeRoutes(pricer, src_states, dst_states)


def _states(
    pricer: PairPricer, info: TensorInfo | None, options: list, cache: PriceCache
) -> list[int] | None:
    """Route state of each option (one shared list per distinct option list); None if an
    option is not a state."""
    key = (id(pricer), cache.canonical(options))  # one pricer per TensorInfo, kept by the cache
    if key not in cache.states:
        states = [pricer.state_of(p) for p in options]
        cache.states[key] = None if None in states else states  # type: ignore[assignment]
    return cache.states[key]


def _required(
    consumer: NodeStrategies, slot: int | None, cache: PriceCache
) -> tuple[list, list[int]]:
    """Distinct placements the consumer requires (on ``slot``, or of its output if None),
    and the index of each consumer strategy's requirement among them."""
    key = (id(consumer.strategies), slot)
    found = cache.required.get(key)
    if found is None:
        required = [s.output if slot is None else s.inputs[slot] for s in consumer.strategies]
        options = list(dict.fromkeys(required))
        index = _index(options)
        found = cache.required[key] = (options, [index[p] for p in required])
    return found


def _price_pairs(
    pricer: PairPricer | None, src_options: list, dst_options: list
) -> list[tuple[int, int, float, float]]:
    """Feasible (src index, dst index, comm us, transition us) of one edge (``pricer`` is
    None for a non-tensor value). Tuples (multi-output values) are never redistributed as a
    whole: only identical ones pair up."""
    if (
        pricer is None
        or any(is_multi(p) for p in src_options)
        or any(is_multi(p) for p in dst_options)
    ):
        return [
            (i, j, 0.0, 0.0)
            for i, src in enumerate(src_options)
            for j, dst in enumerate(dst_options)
            if src == dst
        ]
    return pricer.price_table(src_options, dst_options)


def _compute_costs(ns: NodeStrategies, topology: Topology, price_cache: PriceCache) -> list[float]:
    node = ns.node
    region = node.meta.get("local_map_region")
    if region is not None:  # a strategy per layout, priced from its profile
        key = ("local_map", region.key, node.target is region_backward_op)
        if key not in price_cache.compute:
            price_cache.compute[key] = [
                region_cost_us(layout, key[2], topology) for layout in region.layouts
            ]
        return price_cache.compute[key]
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return [0.0] * len(ns.strategies)
    node_key = (
        node.target,
        _shape_signature(node.args),
        _shape_signature(node.kwargs),
        id(ns.strategies),
    )
    if node_key in price_cache.compute:
        return price_cache.compute[node_key]
    mesh_shape = topology.mesh_shape
    leaves = flat_args((node.args, dict(node.kwargs)))
    output_value = node.meta["val"]
    by_local_shapes: dict[tuple, float] = {}
    costs = []
    for strategy in ns.strategies:
        placement_of: dict[fx.Node, Any] = {}
        for producer, placements in zip(ns.input_nodes, strategy.inputs):
            placement_of.setdefault(producer, placements)
        # a fill op's tensor input has no edge (its values are never read): priced as absent
        local_leaves = [
            (
                _local_value(leaf.meta.get("val"), placement_of[leaf], mesh_shape)
                if leaf in placement_of
                else None
            )
            if isinstance(leaf, fx.Node)
            else leaf
            for leaf in leaves
        ]
        output = _local_value(output_value, strategy.output, mesh_shape)
        shapes_key = (tuple(x for x in local_leaves if isinstance(x, (TensorInfo, tuple))), output)
        if shapes_key not in by_local_shapes:  # strategies with equal local shapes cost the same
            local_of = iter(local_leaves)
            args, kwargs = map_args(
                lambda _, leaves=local_of: next(leaves), (node.args, dict(node.kwargs))
            )
            by_local_shapes[shapes_key] = compute_cost_us(
                node.target, args, kwargs, output, topology.hardware
            )
        costs.append(by_local_shapes[shapes_key])
    price_cache.compute[node_key] = costs
    return costs


def _optimizer_costs(ns: NodeStrategies, topology: Topology) -> list[float]:
    """The optimizer step's time on this parameter's local shard, per strategy."""
    value = ns.node.meta["val"]
    costs = []
    for strategy in ns.strategies:
        shape = local_shape(value.shape, strategy.output, topology.mesh_shape)
        costs.append(topology.hardware.optimizer_us(math.prod(shape)))
    return costs


def _shape_signature(args: Any) -> str:
    """The args with every tensor replaced by its (shape, dtype): what compute cost reads."""

    def describe(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            value = arg.meta.get("val")
            if isinstance(value, torch.Tensor):
                return ("T", tuple(value.shape), str(value.dtype))
            if isinstance(value, (tuple, list)):
                return tuple(
                    ("T", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
                    for v in value
                )
            return None
        return arg

    return repr(map_args(describe, args))


def _local_value(value: Any, placements: Any, mesh_shape: tuple[int, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorInfo(local_shape(value.shape, placements, mesh_shape), value.dtype)
    if isinstance(value, (tuple, list)):
        multi = placements if is_multi(placements) else [placements] * len(value)
        return tuple(
            _local_value(v, p, mesh_shape) if p is not None else None for v, p in zip(value, multi)
        )
    return value
