"""Strategies taken from PyTorch DTensor's own per-op registry.

DTensor's strategy functions take an OpSchema whose tensor arguments are ``OpStrategy``
objects (the candidate placements of each input). We hand each input the distinct output
placements of its producer, so ops whose strategies follow their inputs (pointwise, views)
see every option the producer can offer. We keep DTensor's input/output placements and drop
its redistribution costs: pricing is our cost model's job.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel import _torch_internals as internals
from autoparallel._torch_internals import OpOverload, tree_map
from autoparallel.graph.fx_args import tensor_input_nodes
from autoparallel.strategies import rules as own_rules
from autoparallel.strategies import view_rules
from autoparallel.types.placements import OutputPlacements, Placements
from autoparallel.types.strategies import Strategy

logger = logging.getLogger(__name__)


class NoDTensorStrategy(Exception):
    """DTensor has no strategy for this op, or its strategy function rejected our schema."""


def tensor_meta_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return internals.TensorMeta(value.shape, value.stride(), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(tensor_meta_of(v) for v in value)
    return None


def dtensor_strategies(
    node: fx.Node,
    mesh: DeviceMesh,
    producer_options: dict[fx.Node, list[OutputPlacements]],
) -> list[Strategy]:
    """Strategies of ``node`` from DTensor's registry.

    ``producer_options[p]`` lists the distinct output placements producer ``p`` may take.
    Raises :class:`NoDTensorStrategy` if DTensor cannot answer for this node.
    """
    op = node.target
    if not isinstance(op, OpOverload):
        raise NoDTensorStrategy(f"{node.target} is not an ATen op")
    output_meta = tensor_meta_of(node.meta.get("val"))
    strategy_fn = internals.dtensor_strategy_function(op, mesh, output_meta)
    if strategy_fn is None:
        raise NoDTensorStrategy(f"DTensor has no sharding strategy registered for {op}")

    num_inputs = len(tensor_input_nodes(node))
    pointwise = _pointwise_single_dim(strategy_fn, node)
    if pointwise is not None:
        expanded = own_rules.expand_single_dim_rules(pointwise, 1, False, mesh.ndim)
        return [s for s in expanded if _only_sum_partials(s)]
    single_dim = internals.has_single_dim_strategy(op)
    if single_dim:
        candidates = {n: [_representative(n, mesh.ndim)] for n in tensor_input_nodes(node)}
        expanded = (
            None
            if _USE_DTENSOR_EXPANDER
            else _expand_single_dim(node, mesh, candidates, output_meta, num_inputs)
        )
        if expanded is not None:
            return [s for s in expanded if _only_sum_partials(s)]
        op_strategy = _call(strategy_fn, node, mesh, candidates)
    else:
        op_strategy = _call_per_option(strategy_fn, node, mesh, producer_options)
    converted = (_convert(spec, num_inputs) for spec in op_strategy)
    return [s for s in converted if s is not None and _only_sum_partials(s)]


def _pointwise_single_dim(strategy_fn: Any, node: fx.Node) -> list | None:
    """torch 2.11's single-mesh-dim rules for a pointwise ``node`` (see
    internals.pointwise_single_dim_rules), or None: a later torch, another op, or arguments
    those rules were not written for (tensor keyword arguments, several outputs)."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return None
    if any(isinstance(a, (list, tuple)) for a in node.args):
        return None
    args = tuple(
        tensor_meta_of(a.meta.get("val")) if isinstance(a, fx.Node) else a for a in node.args
    )
    try:
        return internals.pointwise_single_dim_rules(strategy_fn, node.target, args)
    except Exception as error:  # its asserts: DTensor's whole-mesh strategy answers instead
        logger.debug("no single-dim pointwise rules for %s (%s)", node.target, error)
        return None


# Internal switch (tests): expand single-mesh-dim rules with DTensor's own expander, which
# also prices every strategy (slow on 3-D meshes), instead of our plain product below.
_USE_DTENSOR_EXPANDER = False


def _expand_single_dim(
    node: fx.Node,
    mesh: DeviceMesh,
    candidates: dict[fx.Node, list],
    output_meta: Any,
    num_inputs: int,
) -> list[Strategy] | None:
    """DTensor's single-mesh-dim rules for ``node``, multiplied out over the mesh by us.

    Yields exactly the placements of DTensor's expander (same rules, same order, same
    filters: mixed-partial specs, unshardable inputs, the op's own full-mesh filter) without
    its redistribution pricing.
    None whenever that equivalence is not certain; the caller then asks DTensor's expander.
    """
    try:
        schema = _schema(node, mesh, candidates)
        found = internals.single_dim_rules(node.target, mesh, schema, output_meta)
    except Exception as error:  # anything unusual: let DTensor's own expander answer
        logger.debug(
            "single-dim rules of %s unavailable (%s): using DTensor's expander", node.target, error
        )
        return None
    if found is None or not found.rules:
        return None
    rules, num_outputs = found.rules, found.num_outputs
    width = len(rules[0])
    if any(len(rule) != width for rule in rules) or num_outputs < 0 or num_outputs > width:
        return None
    if num_outputs == 1 and any(rule[0] is None for rule in rules):
        return None  # DTensor's expander raises for this: keep its answer
    representatives = found.input_placements
    shardable_cache: dict[tuple[int, tuple], bool] = {}

    def shardable(index: int, placements: tuple) -> bool:
        key = (index, placements)
        known = shardable_cache.get(key)
        if known is None:
            known = shardable_cache[key] = found.shardable(index, placements) or (
                found.allow_uneven_sharding and placements == representatives[index]
            )
        return known

    strategies: list[Strategy] = []
    for combo in itertools.product(rules, repeat=mesh.ndim):
        columns = [
            None if combo[0][pos] is None else tuple(rule[pos] for rule in combo)
            for pos in range(width)
        ]
        if any(col is not None and None in col for col in columns):
            return None  # a position with a tensor on some mesh dims only: DTensor decides
        if any(col is not None and _mixed_partials(col) for col in columns):
            continue
        inputs = [col for col in columns[num_outputs:] if col is not None]
        if len(inputs) != len(representatives):
            return None  # DTensor's expander asserts here: keep its answer
        if not all(shardable(i, col) for i, col in enumerate(inputs)):
            continue
        if len(inputs) != num_inputs:
            continue  # as _convert drops it
        if (
            found.accepts is not None
            and num_outputs > 0
            and not found.accepts(inputs, columns[:num_outputs])
        ):
            continue  # the op's own full-mesh filter
        if num_outputs == 0:
            output: OutputPlacements | None = None
        elif num_outputs == 1 and not found.list_output:
            output = columns[0]
        else:
            output = tuple(columns[:num_outputs])
        strategies.append(Strategy(output=output, inputs=tuple(inputs)))
    # none left: DTensor's expander raises (torch 2.14) or answers empty; let it
    return strategies or None


def _mixed_partials(placements: tuple) -> bool:
    """DTensor's expander skips specs mixing partial kinds (sum with avg of one type excepted)."""
    kinds = {(type(p), p.reduce_op) for p in placements if isinstance(p, Partial)}
    if len(kinds) <= 1:
        return False
    return not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"})


def _only_sum_partials(strategy: Strategy) -> bool:
    """Keep Partial(sum) only: max/min partials add options no producer of ours creates."""
    return all(
        not isinstance(p, Partial) or p.reduce_op == "sum"
        for placements in strategy_placements(strategy)
        for p in placements
    )


MAX_OPTION_COMBINATIONS = 256


def _schema(node: fx.Node, mesh: DeviceMesh, candidates: dict[fx.Node, list]) -> Any:
    """An OpSchema of ``node`` with ``candidates[n]`` as the options of input ``n``."""
    op = node.target

    def to_strategy(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        meta = tensor_meta_of(arg.meta.get("val"))
        specs = [
            internals.OpSpec(internals.DTensorSpec(mesh, tuple(placements), tensor_meta=meta))
            for placements in candidates[arg]
        ]
        return internals.OpStrategy(specs)

    def wrap_lists(arg: Any) -> Any:
        if (
            isinstance(arg, (list, tuple))
            and arg
            and all(isinstance(a, internals.OpStrategy) for a in arg)
        ):
            return internals.TupleStrategy(list(arg))
        return arg

    args = tuple(wrap_lists(tree_map(to_strategy, a)) for a in node.args)
    kwargs = {k: wrap_lists(tree_map(to_strategy, v)) for k, v in node.kwargs.items()}
    return internals.OpSchema(op, args, kwargs, schema_info=internals.schema_info(op))


def _call(
    strategy_fn: Any, node: fx.Node, mesh: DeviceMesh, candidates: dict[fx.Node, list]
) -> list:
    """Run a DTensor strategy function with ``candidates[n]`` as the options of input ``n``."""
    op = node.target
    schema = _schema(node, mesh, candidates)
    try:
        op_strategy = strategy_fn(schema)
    except Exception as error:  # DTensor rejects some schemas it was never written for.
        raise NoDTensorStrategy(
            f"DTensor's strategy for {op} failed: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(op_strategy, internals.OpStrategy):
        raise NoDTensorStrategy(
            f"DTensor's strategy for {op} is a {type(op_strategy).__name__}, not an OpStrategy"
        )
    return list(op_strategy.strategies)


def _call_per_option(
    strategy_fn: Any, node: fx.Node, mesh: DeviceMesh, producer_options: dict
) -> list:
    """Strategies for all producer options at once, or option by option if DTensor refuses.

    Strategy functions that follow their input (views, reductions) raise for a single input
    option they cannot handle (e.g. a view that would split an unevenly sharded dim); asking
    per option keeps every option that works.
    """
    inputs = list(dict.fromkeys(tensor_input_nodes(node)))
    candidates = {n: producer_options[n] for n in inputs}
    unpriced = (
        None if _USE_DTENSOR_WHOLE_MESH else _without_pricing(strategy_fn, node, mesh, candidates)
    )
    if unpriced is not None:
        return unpriced
    try:
        return _call(strategy_fn, node, mesh, candidates)
    except NoDTensorStrategy as first_error:
        combinations = 1
        for n in inputs:
            combinations *= len(candidates[n])
        if combinations > MAX_OPTION_COMBINATIONS:
            raise
        found: list = []
        for combo in itertools.product(*(candidates[n] for n in inputs)):
            try:
                found.extend(
                    _call(strategy_fn, node, mesh, {n: [p] for n, p in zip(inputs, combo)})
                )
            except NoDTensorStrategy:
                continue
        if not found:
            raise first_error
        return found


# Internal switch (tests): ask DTensor's whole-mesh strategy functions for views,
# slice_backward, cat and linear reductions with every option at once, which prices every
# candidate against every option (slow on 3-D meshes), instead of enumerating the same
# strategies without that pricing (strategies/view_rules.py).
_USE_DTENSOR_WHOLE_MESH = False


def _without_pricing(
    strategy_fn: Any, node: fx.Node, mesh: DeviceMesh, candidates: dict[fx.Node, list]
) -> list | None:
    """What :func:`_call_per_option` would return, without DTensor's pricing; None if unsure."""
    try:
        schema = _schema(node, mesh, candidates)
    except Exception:  # DTensor's path raises the same, with the adapter's message
        return None
    return view_rules.strategies_without_pricing(strategy_fn, schema, MAX_OPTION_COMBINATIONS)


def _representative(node: fx.Node, mesh_ndim: int) -> tuple:
    """A single input placement that makes DTensor expand its Shard placeholders."""
    value = node.meta.get("val")
    first = Shard(0) if isinstance(value, torch.Tensor) and value.ndim > 0 else Replicate()
    return (first,) + (Replicate(),) * (mesh_ndim - 1)


def _placements_of(spec: Any) -> OutputPlacements | None:
    if spec is None:
        return None
    if isinstance(spec, (tuple, list)):
        return tuple(_placements_of(s) for s in spec)
    return tuple(spec.placements)


def _convert(spec: Any, num_inputs: int) -> Strategy | None:
    output = _placements_of(spec.output_specs)
    if spec.input_specs is None:
        inputs: tuple[OutputPlacements, ...] = tuple(output for _ in range(num_inputs))
    else:
        inputs = tuple(_placements_of(s) for s in spec.input_specs)
    if len(inputs) != num_inputs:
        logger.debug(
            "dropping a strategy with %d input specs for %d tensor inputs", len(inputs), num_inputs
        )
        return None
    return Strategy(output=output, inputs=inputs)


def strategy_placements(strategy: Strategy) -> Sequence[Placements]:
    """Every tensor placement a strategy mentions (outputs and inputs)."""
    found: list[Placements] = []

    def visit(p: Any) -> None:
        if p is None:
            return
        if p and isinstance(p[0], tuple) or (p and p[0] is None):
            for inner in p:
                visit(inner)
            return
        found.append(p)

    visit(strategy.output)
    for inp in strategy.inputs:
        visit(inp)
    return found
