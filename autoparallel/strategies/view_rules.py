"""A few of DTensor's whole-mesh strategy functions, enumerated without DTensor's pricing.

DTensor's strategies for view-like ops (view, reshape, expand, permute, ...), slice_backward,
cat and linear reductions (sum, mean, ...) price every candidate they produce against every
option of every input with ``generate_redistribute_costs``: quadratic in the options, which
number in the hundreds on a 3-D mesh. That pricing is most of the strategies stage there,
and we throw it away (pricing is our cost model's job). The functions below yield exactly
the OpSpecs those DTensor functions yield (same placements, same input specs, same order, same deduplication) with no
redistribution costs. They reuse DTensor's own pieces (its view dim maps and
``propagate_shape_and_sharding``, its shard helpers) through autoparallel._torch_internals.

Contract: :func:`strategies_without_pricing` answers with the OpSpecs the adapter would have
got from DTensor for that schema (including its option-by-option retry, see
dtensor_adapter._call_per_option), or None whenever that is not certain: an op we do not
mirror, an argument shape we did not expect, or any error (DTensor then answers, errors
included, as it does without this module).
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.tensor.placement_types import Replicate

from autoparallel import _torch_internals as internals

logger = logging.getLogger(__name__)


def strategies_without_pricing(
    strategy_fn: Any, schema: Any, max_option_retries: int
) -> list | None:
    """DTensor's OpSpecs of ``strategy_fn`` on ``schema`` (redistribute costs left None).

    ``schema`` is the OpSchema the adapter would pass DTensor (every producer option at once).
    ``max_option_retries`` mirrors the adapter's limit on asking DTensor option by option after
    a refusal: views refuse single options (see :func:`_view_strategies`).
    """
    try:
        rule = internals.view_rule_of(strategy_fn)
        if rule is not None:
            return _view_strategies(rule, schema, max_option_retries)
        if internals.is_dtensor_strategy(strategy_fn, "slice_backward_rules"):
            return _slice_backward_strategies(schema)
        if internals.is_dtensor_strategy(strategy_fn, "cat_strategy"):
            return _cat_strategies(schema)
        if internals.is_dtensor_strategy(strategy_fn, "linear_reduction_strategy"):
            return _option_by_option(strategy_fn, schema)
    except Exception as error:  # anything unexpected: DTensor answers itself
        logger.debug("no unpriced strategies for %s (%s): asking DTensor", schema.op, error)
    return None


def _single_input(schema: Any) -> Any | None:
    """The OpStrategy of the op's first argument, if it is the schema's only tensor input."""
    first = schema.args_schema[0] if schema.args_schema else None
    if not isinstance(first, internals.OpStrategy) or not first.strategies:
        return None
    others = (*schema.args_schema[1:], *schema.kwargs_schema.values())
    if any(isinstance(a, (internals.OpStrategy, internals.TupleStrategy)) for a in others):
        return None  # e.g. symbolic sizes traced as graph inputs: not what we mirror
    return first


def _view_strategies(rule: internals.ViewRule, schema: Any, max_option_retries: int) -> list | None:
    """DTensor's ``reshape_strategy`` (torch/distributed/tensor/_ops/_view_ops.py), unpriced.

    One OpSpec per input option, in option order: input target placements and output
    placements from ``propagate_shape_and_sharding``. A strict view raises for an option it
    would have to redistribute; DTensor's call then fails as a whole and the adapter retries
    option by option (at most ``max_option_retries`` options), keeping the ones that work,
    which is what we return. Beyond that limit, or if no option works, None: DTensor's own
    call reproduces the adapter's error.
    """
    input_strategy = _single_input(schema)
    if input_strategy is None or input_strategy.shape is None:
        return None
    dim_map = rule.dim_map(*schema.args_schema, **schema.kwargs_schema)
    mesh = schema.get_mesh_from_args(validate=False)
    shape = tuple(input_strategy.shape)
    found: list = []
    refused = False
    for option in input_strategy.strategies:
        try:
            found.append(_view_spec(option.output_spec, shape, dim_map, mesh, rule.strict_view))
        except Exception:
            refused = True
    if refused and (len(input_strategy.strategies) > max_option_retries or not found):
        return None
    return found


def _view_spec(
    source: Any, shape: tuple[int, ...], dim_map: Any, mesh: Any, strict_view: bool
) -> Any:
    """The OpSpec DTensor's view strategy builds for one input option ``source``."""
    target, output = internals.propagate_view_sharding(
        source.placements, shape, dim_map, mesh.shape, strict_view
    )
    input_spec = internals.DTensorSpec(
        placements=target,
        mesh=mesh,
        tensor_meta=source.tensor_meta,
        use_strided_shard_as_shard_order=False,
    )
    output_spec = internals.DTensorSpec(
        mesh=mesh, placements=output, use_strided_shard_as_shard_order=False
    )
    return internals.OpSpec(output_specs=output_spec, input_specs=(input_spec,))


def _option_by_option(strategy_fn: Any, schema: Any) -> list | None:
    """DTensor's own strategy function, asked once per input option, results concatenated.

    For strategy functions that build one OpSpec per input option from that option alone
    (``linear_reduction_strategy``: sum, mean, ... over dims; every option goes through
    ``common_reduction_strategy`` on its own) this is exactly their answer for all options at
    once, while their pricing shrinks from every option against every option to each option
    against itself. If DTensor refuses any option we return None: its all-at-once call then
    fails too and the adapter's retry answers as it does without this module.
    """
    input_strategy = _single_input(schema)
    if input_strategy is None:
        return None
    rest = schema.args_schema[1:]
    found: list = []
    for option in input_strategy.strategies:
        single = internals.OpSchema(
            schema.op,
            (internals.OpStrategy([option]), *rest),
            schema.kwargs_schema,
            schema_info=schema.schema_info,
        )
        answer = strategy_fn(single)
        if not isinstance(answer, internals.OpStrategy):
            return None
        found.extend(answer.strategies)
    return found


def _slice_backward_strategies(schema: Any) -> list | None:
    """DTensor's ``slice_backward_rules`` (_ops/_tensor_ops.py), unpriced.

    One OpSpec per option of the incoming gradient, in order: that option with shards of
    the sliced dim replicated; no input specs (the input follows the output).
    """
    input_strategy = _single_input(schema)
    if input_strategy is None or len(schema.args_schema) < 3:
        return None
    dim = schema.args_schema[2]
    found = []
    for option in input_strategy.strategies:
        spec = option.output_spec
        placements = tuple(
            Replicate() if internals.is_shard_like(p) and p.dim == dim else p
            for p in spec.placements
        )
        found.append(internals.OpSpec(output_specs=internals.DTensorSpec(spec.mesh, placements)))
    return found


def _cat_strategies(schema: Any) -> list | None:
    """DTensor's ``cat_strategy`` (_ops/_tensor_ops.py), unpriced.

    Every option of every input, in input then option order, is an exemplar (with its shards
    of the cat dim replicated); the first occurrence of each exemplar becomes one OpSpec
    whose inputs and output all take it.
    """
    tuple_strategy = schema.args_schema[0] if schema.args_schema else None
    if not isinstance(tuple_strategy, internals.TupleStrategy) or not tuple_strategy.children:
        return None
    children = tuple_strategy.children
    if not all(isinstance(c, internals.OpStrategy) and c.strategies for c in children):
        return None
    mesh = children[0].mesh
    if any(c.mesh != mesh for c in children):
        return None  # DTensor raises here
    dim = schema.args_schema[1] if len(schema.args_schema) > 1 else 0
    dim = internals.normalize_dim(dim, children[0].ndim)
    metas = [c.strategies[0].output_spec.tensor_meta for c in children]
    seen: set = set()
    found = []
    for child in children:
        for option in child.strategies:
            exemplar = option.output_spec
            if internals.is_tensor_dim_sharded(exemplar, dim):
                placements = internals.unshard_tensor_dim(exemplar.placements, dim)
            else:
                placements = exemplar.placements
            if placements in seen:
                continue
            seen.add(placements)
            input_specs = tuple(
                internals.DTensorSpec(mesh, placements, tensor_meta=meta) for meta in metas
            )
            found.append(
                internals.OpSpec(
                    output_specs=internals.DTensorSpec(mesh, placements), input_specs=input_specs
                )
            )
    return found
