"""Stage 2: the StrategySpace of a JointGraph.

For each node, in graph order, the options come from the first source that answers:

1. placeholders (parameters, buffers, user inputs, tangents): any Shard/Replicate combination
   their shape allows;
2. ``getitem`` on a multi-output node: one option per distinct output of the producer;
   an op whose output values do not depend on its inputs (``new_zeros``, ``full``...,
   graph/fill_ops.py): any Shard/Replicate combination, with no input edge;
3. a ``local_map`` region's ops: the one strategy its placements state (strategies/regions.py);
   our own rules (e.g. the CPU flash-attention ops that DTensor does not cover);
4. DTensor's strategy registry; where it has none or only the replicated one, our rules for
   ops that later torch releases split (``rules.RULES_WHERE_DTENSOR_CANNOT_SPLIT``);
5. otherwise a replicate-only fallback, logged as a warning and recorded in
   ``StrategySpace.fallbacks`` so the user can see which ops limited the plan.

Options that shard a dimension into empty or nested uneven pieces (or use strided shards)
are dropped (see rules.shardable).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Replicate

from autoparallel.graph.fill_ops import is_fill
from autoparallel.graph.fx_args import map_args, tensor_input_nodes
from autoparallel.strategies import rules
from autoparallel.strategies.dtensor_adapter import (
    NoDTensorStrategy,
    dtensor_strategies,
    strategy_placements,
)
from autoparallel.strategies.regions import region_strategies
from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import OutputPlacements, is_multi
from autoparallel.types.strategies import NodeStrategies, Strategy, StrategySource, StrategySpace

logger = logging.getLogger(__name__)


def build_strategy_space(joint: JointGraph, mesh: DeviceMesh) -> StrategySpace:
    mesh_shape = tuple(mesh.shape)
    space = StrategySpace(nodes={}, mesh_shape=mesh_shape)
    options: dict[fx.Node, list[OutputPlacements]] = {}
    # Repeated layers ask the same question many times: (op, argument shapes, the options
    # of each producer) fully determines the answer on this mesh. Local to this build.
    answers: dict[Any, tuple[list[Strategy], str]] = {}
    for node in joint.graph.nodes:
        if node.op == "output" or not _has_tensor_value(node):
            continue
        node_strategies = _strategies_for(node, mesh, mesh_shape, options, space, answers)
        space.nodes[node] = node_strategies
        shared = answers.get(("outputs", id(node_strategies.strategies)))
        if shared is None:  # computed once per distinct strategy list
            shared = answers[("outputs", id(node_strategies.strategies))] = (
                node_strategies.output_placements()
            )
        node_strategies._outputs = (node_strategies.strategies, shared)
        options[node] = shared  # one list object per distinct strategy list: a cheap cache key
    logger.debug("strategy space: %d nodes, %d strategies", len(space.nodes), space.num_strategies)
    return space


def _has_tensor_value(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _strategies_for(
    node: fx.Node,
    mesh: DeviceMesh,
    mesh_shape: tuple[int, ...],
    options: dict[fx.Node, list[OutputPlacements]],
    space: StrategySpace,
    answers: dict[Any, tuple[list[Strategy], str]],
) -> NodeStrategies:
    value = node.meta["val"]
    multi = not isinstance(value, torch.Tensor)
    inputs = tensor_input_nodes(node)

    if node.op == "placeholder":
        key = ("placeholder", tuple(value.shape))
        if key not in answers:
            placements = rules.all_shard_replicate(value.shape, mesh_shape)
            answers[key] = ([Strategy(p, ()) for p in placements], "placeholder")
        return NodeStrategies(node, [], answers[key][0], "placeholder")

    if rules.is_getitem(node):
        producer, index = node.args
        key = ("getitem", id(options[producer]), index)
        if key not in answers:
            found = [
                Strategy(out[index], (out,)) for out in options[producer] if out[index] is not None
            ]
            answers[key] = (found, "getitem")
        return NodeStrategies(node, [producer], answers[key][0], "getitem")

    if is_fill(node):  # no input edge: its values are never read (see graph/fill_ops.py)
        key = ("fill", tuple(value.shape))
        if key not in answers:
            placements = rules.all_shard_replicate(value.shape, mesh_shape)
            answers[key] = ([Strategy(p, ()) for p in placements], "fill")
        return NodeStrategies(node, [], answers[key][0], "fill")

    if not inputs:
        return NodeStrategies(node, [], [_replicated(node, 0, multi, mesh_shape)], "factory", multi)

    region = node.meta.get("local_map_region")
    if region is not None:
        return NodeStrategies(node, inputs, region_strategies(node, region), "local_map", multi)

    key = _question(node, options, answers)
    if key in answers:
        valid, source = answers[key]
        if source == "fallback":
            _fallback(
                node, inputs, multi, mesh_shape, space, "same op and shapes as an earlier fallback"
            )
        return NodeStrategies(node, inputs, valid, source, multi)
    candidates, source, missing = _candidates(node, mesh, mesh_shape, options, multi, len(inputs))
    valid = [s for s in dict.fromkeys(candidates) if _is_valid(s, node, inputs, mesh_shape)]
    if not valid:
        reason = (
            missing or "every DTensor option shards a dimension into empty or nested uneven pieces"
        )
        valid = [_fallback(node, inputs, multi, mesh_shape, space, reason)]
        source = "fallback"
    answers[key] = (valid, source)
    return NodeStrategies(node, inputs, valid, source, multi)


def _question(node: fx.Node, options: dict[fx.Node, list[OutputPlacements]], answers: dict) -> Any:
    """Everything a node's strategies depend on besides the (fixed) mesh.

    A producer's options enter as one small integer per distinct option list (the lists are
    shared objects, see build_strategy_space, so each is hashed once per build): on a 3-D
    mesh a list holds ~200 placement tuples and spelling it out for every node of an
    80-layer graph would be most of this stage.
    """

    def describe(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        value = arg.meta.get("val")
        meta = (
            (tuple(value.shape), tuple(value.stride()), value.dtype)
            if isinstance(value, torch.Tensor)
            else None
        )
        return ("node", meta, _canonical(options[arg], answers))

    out = node.meta["val"]
    out_meta = (
        (tuple(out.shape), tuple(out.stride()), out.dtype)
        if isinstance(out, torch.Tensor)
        else repr(out)
    )
    try:
        return (node.target, repr(map_args(describe, (node.args, dict(node.kwargs)))), out_meta)
    except Exception:  # an argument without a stable repr: do not cache this node
        return object()


def _canonical(option_list: list, answers: dict) -> int:
    """One integer per distinct option list content (memoized per list object; ``answers``
    keeps the lists alive, so their ids are not reused within a build)."""
    key = ("canonical", id(option_list))
    found = answers.get(key)
    if found is None:
        found = answers.setdefault(("canonical-content", tuple(option_list)), len(answers))
        answers[key] = found
    return found


def _candidates(
    node: fx.Node,
    mesh: DeviceMesh,
    mesh_shape: tuple[int, ...],
    options: dict[fx.Node, list[OutputPlacements]],
    multi: bool,
    num_inputs: int,
) -> tuple[list[Strategy], StrategySource, str]:
    """The node's candidate strategies, where they came from, and why there are none (empty
    when there are some)."""
    own = _from_rule(rules.rule_of(node.target), node, multi, mesh_shape)
    if own is not None:
        return own, "rule", ""
    try:
        from_dtensor = dtensor_strategies(node, mesh, options)
    except NoDTensorStrategy as error:
        from_dtensor, missing = [], f"no strategy: {error}"
    behind_rule = rules.rule_where_dtensor_cannot_split(node.target)
    if behind_rule is not None and all(_all_replicated(s) for s in from_dtensor):
        behind = _from_rule(behind_rule, node, multi, mesh_shape)
        if behind is not None:
            return behind, "rule", ""
    if from_dtensor:
        return from_dtensor, "dtensor", ""
    return [], "fallback", missing


def _all_replicated(strategy: Strategy) -> bool:
    """Whether ``strategy`` keeps every tensor whole on every mesh dim."""
    return all(
        isinstance(p, Replicate) for placements in strategy_placements(strategy) for p in placements
    )


def _from_rule(
    rule: rules.RuleFunction | None, node: fx.Node, multi: bool, mesh_shape: tuple[int, ...]
) -> list[Strategy] | None:
    """The strategies ``rule`` gives ``node`` on this mesh, or None where it gives none."""
    found = rule(node) if rule is not None else None
    if found is None:
        return None
    single_dim_rules, num_outputs = found
    return rules.expand_single_dim_rules(single_dim_rules, num_outputs, multi, len(mesh_shape))


def _replicated(
    node: fx.Node, num_inputs: int, multi: bool, mesh_shape: tuple[int, ...]
) -> Strategy:
    replicate = tuple(Replicate() for _ in mesh_shape)
    if multi:
        output: OutputPlacements = tuple(
            replicate if isinstance(v, torch.Tensor) else None for v in node.meta["val"]
        )
    else:
        output = replicate
    return Strategy(output, tuple(replicate for _ in range(num_inputs)))


def _fallback(
    node: fx.Node,
    inputs: list[fx.Node],
    multi: bool,
    mesh_shape: tuple[int, ...],
    space: StrategySpace,
    reason: str,
) -> Strategy:
    strategy = _replicated(node, len(inputs), multi, mesh_shape)
    # A multi-output producer's consumers are getitems expecting a tuple; inputs that are
    # tuples themselves (rare) get the producer's replicated tuple.
    strategy = Strategy(
        strategy.output,
        tuple(_replicated(inp, 0, is_multi_value(inp), mesh_shape).output for inp in inputs),
    )
    logger.warning(
        "no sharding strategy for %s (%s): it runs replicated (%s)", node.name, node.target, reason
    )
    space.fallbacks.append(f"{node.name}: {node.target}")
    return strategy


def is_multi_value(node: fx.Node) -> bool:
    return not isinstance(node.meta.get("val"), torch.Tensor)


def _is_valid(
    strategy: Strategy, node: fx.Node, inputs: list[fx.Node], mesh_shape: tuple[int, ...]
) -> bool:
    if not _placements_fit(strategy.output, node.meta["val"], mesh_shape):
        return False
    return all(
        _placements_fit(p, inp.meta["val"], mesh_shape) for p, inp in zip(strategy.inputs, inputs)
    )


def _placements_fit(placements: Any, value: Any, mesh_shape: tuple[int, ...]) -> bool:
    if placements is None:
        return True
    if isinstance(value, torch.Tensor):
        if is_multi(placements):
            return False
        return rules.shardable(placements, value.shape, mesh_shape)
    if not is_multi(placements) or len(placements) != len(value):
        return False
    return all(
        _placements_fit(p, v, mesh_shape)
        for p, v in zip(placements, value)
        if isinstance(v, torch.Tensor)
    )
