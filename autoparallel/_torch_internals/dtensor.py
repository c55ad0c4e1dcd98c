"""DTensor's private parts: its spec and local-tensor wrappers, and its sharding strategy
registry (single-mesh-dim rules, view propagation, the helpers its cat rule uses).

The strategy registry has no public equivalent in torch 2.13, yet it is exactly what the
strategies stage builds on rather than re-implements (strategies/dtensor_adapter.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor._api import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import (
    _expand_single_dim_strategy_to_mesh,
    _ShardingPlaceholder,
)
from torch.distributed.tensor.placement_types import Partial, Shard

try:  # shard-like but not a Shard subclass: what DTensor's view rules make of a split of a
    # sharded dim, and FSDP + TP's parameters
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
except ImportError:  # torch without it: every shard is a plain Shard
    from torch.distributed.tensor.placement_types import Shard as StridedShard

try:  # mirrored without their pricing by strategies/view_rules.py (see view_rule_of)
    from torch.distributed.tensor._ops import _math_ops as _dtensor_math_ops
    from torch.distributed.tensor._ops import _tensor_ops as _dtensor_tensor_ops
    from torch.distributed.tensor._ops import _view_ops as _dtensor_view_ops
    from torch.distributed.tensor._ops.utils import is_tensor_dim_sharded as _is_tensor_dim_sharded
    from torch.distributed.tensor._ops.utils import normalize_dim as _normalize_dim
except ImportError:  # torch moved them: every op keeps DTensor's own (priced) strategy
    _dtensor_math_ops = _dtensor_tensor_ops = _dtensor_view_ops = None

try:
    from torch.distributed.tensor.placement_types import _is_shard_like
except ImportError:  # torch 2.11: its slice_backward and cat rules test for a plain Shard

    def _is_shard_like(placement: Any) -> bool:
        return isinstance(placement, Shard)


try:  # torch 2.11 describes pointwise ops by whole-mesh strategies (see pointwise_single_dim_rules)
    from torch.distributed.tensor._ops import _pointwise_ops as _dtensor_pointwise_ops
except ImportError:
    _dtensor_pointwise_ops = None

try:  # DTensor's rowwise embedding marks ids and result with it (runtime/vocab_lookup.py)
    from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial
except ImportError:  # torch renamed it: no strategy produces it, so nothing to recognize
    MaskPartial = None

__all__ = [
    "DTensor",
    "DTensorSpec",
    "MaskPartial",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "StridedShard",
    "TensorMeta",
    "TupleStrategy",
]


# ---------------------------------------------------------------------------- DTensor wrappers
# ``DTensor.to_local()`` and ``from_local()`` build one autograd node per tensor and
# normalize placements on every call, a cost paid per parameter on every step. The runtime
# unwraps all parameters in one autograd node instead, which needs a DTensor's spec and the
# constructor that wraps a local tensor in a known spec; both are private.


def dtensor_spec(tensor: DTensor) -> Any:
    """The (private) ``DTensorSpec`` of ``tensor``: mesh, placements, global shape/stride."""
    return tensor._spec


def local_tensor_of(tensor: DTensor) -> torch.Tensor:
    """``tensor``'s local tensor itself (no autograd node, no copy)."""
    return tensor._local_tensor


def wrap_local(local: torch.Tensor, spec: Any) -> DTensor:
    """A DTensor of ``local`` with the given spec, no checks and no autograd node (the
    caller guarantees ``local`` is this rank's shard of a tensor with that spec)."""
    return DTensor(local, spec, requires_grad=False)


def is_mask_partial(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's ``_MaskPartial`` (its rowwise embedding's mark: a
    Partial whose reduction first applies a mask kept inside the placement object)."""
    return MaskPartial is not None and isinstance(placement, MaskPartial)


# ---------------------------------------------------------------------------- DTensor strategies


def has_single_dim_strategy(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor describes ``op`` by single-mesh-dim rules.

    Those rules do not depend on the inputs' placements, and DTensor's expander insists on
    exactly one candidate per input; callers pass a single representative placement.
    """
    return op in DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs


def pointwise_single_dim_rules(
    strategy_fn: Any, op: torch._ops.OpOverload, args_schema: tuple
) -> list[list[Any]] | None:
    """DTensor's single-mesh-dim rules for a pointwise op that this torch registers by its
    whole-mesh ``pointwise_strategy`` (torch 2.11), as ``[output, *tensor inputs]`` lists; None
    where ``strategy_fn`` is not that (2.13 on: pointwise ops are single-dim strategies).

    Why private: 2.11's whole-mesh pointwise strategy makes every input follow the most
    sharded input option, so it never offers a layout no producer already has (e.g. a
    broadcast operand split along the other's dim), and plans on 2.11 lose those; its own
    single-dim form, ``single_mesh_dim_common_pointwise_strategy``, is written but not
    registered, and is what later releases register. ``args_schema`` holds TensorMeta for
    tensor arguments. Placeholders become plain Shards, as for inputs with no _StridedShard.
    """
    module = _dtensor_pointwise_ops
    single_dim = getattr(module, "single_mesh_dim_common_pointwise_strategy", None)
    whole_mesh = (
        getattr(module, "pointwise_strategy", None),
        getattr(module, "linear_pointwise_strategy", None),
    )
    if single_dim is None or strategy_fn not in whole_mesh:
        return None
    tensors = sum(isinstance(arg, TensorMeta) for arg in args_schema)
    linearity = module.linear_pointwise_ops.get(op, -1)
    # its linearity kinds assume a tensor count: mul/div by a scalar are unary linear (0),
    # a sum with a scalar is not linear in the partial sense (-1)
    if linearity == 2 and tensors == 1:
        linearity = 0
    elif (linearity == 0 and tensors != 1) or (linearity == 1 and tensors != 2):
        linearity = -1
    rules = [
        [Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in rule]
        for rule in single_dim(args_schema, linearity)
    ]
    if op.name().startswith("aten::div"):  # a / (b1 + b2) is no sum of a / b_i: numerator only
        rules = [rule for rule in rules if not (len(rule) > 2 and isinstance(rule[2], Partial))]
    return rules


def dtensor_strategy_function(
    op: torch._ops.OpOverload, mesh: Any, output_meta: Any
) -> Callable[[OpSchema], Any] | None:
    """DTensor's registered strategy for ``op`` as a function of an OpSchema of OpStrategy args.

    DTensor keeps two registries: whole-mesh strategy functions and single-mesh-dim rules that
    it expands to the full mesh (preferred, as DTensor itself does). Returns None when the op
    has neither.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    single_dim = propagator.op_single_dim_strategy_funcs.get(op)
    if single_dim is not None:

        def expand(schema: OpSchema) -> Any:
            expanded = _expand_single_dim_strategy_to_mesh(mesh, schema, single_dim, output_meta)
            return expanded(op, schema.args_meta, schema.kwargs_meta)

        return expand
    return propagator.op_strategy_funcs.get(op)


class SingleDimRules(NamedTuple):
    """DTensor's single-mesh-dim rules for one op, placeholders filled (see single_dim_rules)."""

    rules: list[list[Any]]  # each: [*output placements, *input placements], None = no tensor
    num_outputs: int
    allow_uneven_sharding: bool
    shardable: Callable[[int, tuple], bool]  # (tensor input index, placements) -> DTensor's check
    input_placements: list[tuple]  # the placements the schema gave each tensor input
    # (input placements, output placements or None per output) -> the op's own full-mesh
    # filter (torch >= 2.14: mean, argmax/argmin, convolution, grouped_mm); None: no filter
    accepts: Callable[[list[tuple], list[tuple | None]], bool] | None
    list_output: bool  # a Tensor[] return: the output is a tuple even for one tensor


def single_dim_rules(
    op: torch._ops.OpOverload, mesh: Any, schema: OpSchema, output_meta: Any
) -> SingleDimRules | None:
    """DTensor's single-mesh-dim rules for ``op`` on ``schema``, to expand to the mesh ourselves.

    Why private: DTensor's own expander (``_expand_single_dim_strategy_to_mesh``) prices every
    full-mesh strategy with its redistribute_cost, which we drop; on 3-D meshes that pricing is
    most of the strategies stage. ``_PreparedSingleDimStrategy`` gives the same rules that
    expander multiplies out (Replicate rule inserted, ShardingPlaceholders filled from the
    inputs' placements), and ``is_tensor_shardable`` is the input filter it applies.
    Returns None wherever the expander does more than a plain product and filter (foreach
    ops, in-place and out= ops, inputs on other meshes) or the private API is gone: callers
    then keep using DTensor's expander. Other list inputs (``cat``, a single-dim op from torch
    2.14 on) are a plain product over the list's tensors, flattened as DTensor flattens them.
    """
    try:
        from torch.distributed.tensor._ops.utils import is_tensor_shardable
    except ImportError:
        return None
    try:
        from torch.distributed.tensor._ops.single_dim_strategy import _PreparedSingleDimStrategy
    except ImportError:  # torch 2.11: the same steps, as its expander takes them
        _PreparedSingleDimStrategy = _PreparedAsTorch211
    info = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs.get(op)
    if info is None or getattr(info, "different_mesh_args", None) is not None:
        return None
    # DTensor expands foreach ops per list element (its own loop, not a product)
    if any(isinstance(a, TupleStrategy) for a in schema.args_schema) and op.name().startswith(
        ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")
    ):
        return None
    base_name = op.name().split("::")[-1].split(".")[0]
    if base_name.endswith("_") or schema.is_out_variant_op():
        return None
    prepared = _PreparedSingleDimStrategy(info, schema, output_meta)
    if prepared.element_mesh is not None and prepared.element_mesh != mesh:
        return None
    inputs = schema.args_strategy + schema.kwargs_strategy
    if len(inputs) != prepared.num_inputs:
        return None
    allow_unbacked = prepared.allow_unbacked_sharding

    def shardable(index: int, placements: tuple) -> bool:
        spec = DTensorSpec(
            mesh, tuple(placements), tensor_meta=inputs[index].strategies[0].output_spec.tensor_meta
        )
        return is_tensor_shardable(
            inputs[index].shape, spec, allow_unbacked_sharding=allow_unbacked
        )

    # A Tensor[] return (torch 2.14's split rules; in 2.13 only foreach ops, handled above,
    # return lists) stays a tuple of outputs even when it holds one tensor.
    list_output = schema.return_type_list_tensor_like() and isinstance(output_meta, (tuple, list))
    # torch >= 2.14: some rules come with a filter of the full-mesh candidates
    full_mesh_filter = getattr(prepared, "full_mesh_strategy_filter", None)
    accepts = None
    if full_mesh_filter is not None:
        filter_mesh = prepared.element_mesh or mesh
        input_metas = [inp.tensor_meta for inp in inputs]
        if output_meta is None or isinstance(output_meta, TensorMeta):
            output_metas: list = [output_meta]
        else:
            output_metas = list(output_meta)

        def accepts(input_placements: list[tuple], output_placements: list[tuple | None]) -> bool:
            input_specs = [
                DTensorSpec(filter_mesh, tuple(p), tensor_meta=meta)
                for p, meta in zip(input_placements, input_metas)
            ]
            # as DTensor's expander: the k-th output that has placements gets the k-th meta
            metas = iter(output_metas)
            output_specs = [
                None
                if p is None
                else DTensorSpec(filter_mesh, tuple(p), tensor_meta=next(metas, None))
                for p in output_placements
            ]
            outputs = (
                output_specs[0]
                if len(output_specs) == 1 and not list_output
                else tuple(output_specs)
            )
            return bool(full_mesh_filter(filter_mesh, schema, input_specs, outputs))

    return SingleDimRules(
        [list(rule) for rule in prepared.expanded_strategies],
        prepared.num_outputs,
        bool(prepared.allow_uneven_sharding),
        shardable,
        [tuple(inp.strategies[0].output_spec.placements) for inp in inputs],
        accepts,
        list_output,
    )


class _PreparedAsTorch211:
    """What torch 2.11's ``_expand_single_dim_strategy_to_mesh`` computes before its product:
    the rules for this schema with the all-Replicate rule first and Shard placeholders filled
    from the inputs' placements (2.11 has no ``_PreparedSingleDimStrategy`` to ask). 2.11's
    rules never shard unevenly beyond what ``is_tensor_shardable`` allows, run on one mesh
    and have no full-mesh filter."""

    element_mesh = None
    allow_uneven_sharding = False

    def __init__(self, info: Any, schema: OpSchema, output_meta: Any):
        from torch.distributed.tensor._ops import single_dim_strategy as single_dim

        if output_meta is None:
            self.num_outputs = 0
        elif isinstance(output_meta, TensorMeta):
            self.num_outputs = 1
        else:
            self.num_outputs = len(output_meta)
        self.num_inputs = single_dim._get_num_tensor_inputs(schema)
        self.allow_unbacked_sharding = info.allow_unbacked_sharding
        rules = info.func(schema.op, schema.args_meta, schema.kwargs_meta)
        rules = single_dim._insert_single_dim_replication_strategy(
            rules, self.num_outputs, self.num_inputs
        )
        self.expanded_strategies = single_dim._fill_single_dim_strategy_placeholders(
            single_dim._get_unique_placements(schema), rules
        )


class ViewRule(NamedTuple):
    """What DTensor's strategy for one view-like op is made of (see view_rule_of)."""

    dim_map: Callable[..., Any]  # called like the op on its OpSchema args -> DimMap
    strict_view: bool  # True: DTensor refuses inputs the view would have to redistribute


def view_rule_of(strategy_fn: Any) -> ViewRule | None:
    """The dim map and strictness DTensor's view strategy ``strategy_fn`` was registered with.

    Why private: DTensor registers every view-like op (view, reshape, expand, permute, ...)
    through ``register_op_strategy_map``, whose strategy prices each candidate against every
    input option with ``generate_redistribute_costs``; that pricing, which we drop, is most
    of the strategies stage on 3-D meshes. The op's dim map and ``strict_view`` flag exist only
    as that closure's variables, so we read them there: exactly what DTensor uses for this op.
    None when ``strategy_fn`` is not such a closure (torch changed, or another registration).
    """
    code = getattr(strategy_fn, "__code__", None)
    if (
        code is None
        or _dtensor_view_ops is None
        or getattr(strategy_fn, "__module__", None) != _dtensor_view_ops.__name__
        or getattr(strategy_fn, "__qualname__", None)
        != "register_op_strategy_map.<locals>.reshape_strategy"
        or strategy_fn.__closure__ is None
    ):
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in strategy_fn.__closure__)))
    dim_map, strict_view = cells.get("dim_map"), cells.get("strict_view")
    if not callable(dim_map) or not isinstance(strict_view, bool):
        return None
    return ViewRule(dim_map, strict_view)


def propagate_view_sharding(
    input_placements: tuple,
    global_shape: tuple[int, ...],
    dim_map: Any,
    mesh_shape: tuple[int, ...],
    strict_view: bool,
) -> tuple[tuple, tuple]:
    """(input target placements, output placements) of a view: DTensor's own propagation.

    Why private: ``propagate_shape_and_sharding`` is the heart of DTensor's view strategy
    (which placements survive a split or flatten, where _StridedShard appears); we call it
    rather than re-derive it, and only skip the pricing around it (see view_rule_of).
    """
    tgt, out = _dtensor_view_ops.propagate_shape_and_sharding(
        input_placements, global_shape, dim_map, mesh_shape, strict_view
    )
    return tuple(tgt), tuple(out)


def is_dtensor_strategy(strategy_fn: Any, name: str) -> bool:
    """Whether ``strategy_fn`` is DTensor's strategy function ``name`` (``_ops._tensor_ops``
    or ``_ops._math_ops``).

    Why private: we re-enumerate a few of those functions without their pricing (see
    strategies/view_rules.py) and must only do so for the very function we mirror.
    """
    if strategy_fn is None:
        return False
    modules = (_dtensor_tensor_ops, _dtensor_math_ops)
    return any(m is not None and getattr(m, name, None) is strategy_fn for m in modules)


def is_shard_like(placement: Any) -> bool:
    """DTensor's test for Shard or _StridedShard, as its slice_backward and cat rules use it."""
    return _is_shard_like(placement)


def unshard_tensor_dim(placements: tuple, dim: int) -> tuple:
    """DTensor's cat rule helper: ``placements`` with shards of tensor dim ``dim`` replicated."""
    return _dtensor_tensor_ops.unshard_tensor_dim(placements, dim)


def is_tensor_dim_sharded(spec: DTensorSpec, dim: int) -> bool:
    """DTensor's cat rule helper: whether ``spec`` shards tensor dim ``dim``."""
    return _is_tensor_dim_sharded(spec, dim)


def normalize_dim(dim: int, ndim: int) -> int:
    """DTensor's dim normalization (negative dims count from the end), as its cat rule does."""
    return _normalize_dim(dim, ndim)


def schema_info(op: torch._ops.OpOverload) -> Any:
    propagator = DTensor._op_dispatcher.sharding_propagator
    return propagator.op_to_schema_info.get(
        op
    ) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
