"""Our own strategy rules, for nodes DTensor's registry does not cover.

Rules are written for ONE mesh dimension, as lists of placements ``[outputs..., inputs...]``,
and expanded to the full mesh as their Cartesian product (every mesh dimension may pick any
single-dim rule independently). The all-Replicate rule is always included.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel.trace.sharding_constraint import sharding_constraint_op
from autoparallel.types.placements import OutputPlacements, Placements
from autoparallel.types.strategies import Strategy

aten = torch.ops.aten

SingleDimRule = list[Placement | None]
RuleFunction = Callable[[fx.Node], "tuple[list[SingleDimRule], int] | None"]

# op -> rule, filled by @rule_for where each rule is defined (as DTensor's
# @register_op_strategy does), only while this module is imported; read-only afterwards.
OWN_RULES: dict[object, RuleFunction] = {}


# op name (``str(op)``, e.g. "transformers.grouped_mm_fallback.default") -> rule, for ops a
# library registers when it is imported (after this module may have been): filled by
# @rule_for_name the same way, read-only afterwards.
OWN_RULES_BY_NAME: dict[str, RuleFunction] = {}


# op -> rule asked only where DTensor's registry cannot split the op: it has no strategy
# (older torch releases that still describe the op by a propagation rule: torch 2.11's
# ``index.Tensor``, ``convolution``, ``constant_pad_nd``) or only the replicated one (2.11's
# ``scatter``). Where DTensor splits the op, the plans stay DTensor's. Filled by
# @where_dtensor_cannot_split, read-only afterwards.
RULES_WHERE_DTENSOR_CANNOT_SPLIT: dict[object, RuleFunction] = {}


def rule_of(target: object) -> RuleFunction | None:
    """Our rule for ``target`` (an op), or None."""
    return OWN_RULES.get(target) or OWN_RULES_BY_NAME.get(str(target))


def rule_where_dtensor_cannot_split(target: object) -> RuleFunction | None:
    """Our rule for ``target`` to use where DTensor cannot split it, or None."""
    return RULES_WHERE_DTENSOR_CANNOT_SPLIT.get(target)


def _registering(table: dict, keys: Sequence[object]) -> Callable[[RuleFunction], RuleFunction]:
    """A decorator putting its rule in ``table`` under each key (None keys, ops this torch
    build lacks, are skipped)."""

    def register(rule: RuleFunction) -> RuleFunction:
        for key in keys:
            if key is not None:
                table[key] = rule
        return rule

    return register


def rule_for_name(*names: str) -> Callable[[RuleFunction], RuleFunction]:
    """Register the decorated rule for the ops named ``names`` (``str(op)``)."""
    return _registering(OWN_RULES_BY_NAME, names)


def rule_for(*ops: object) -> Callable[[RuleFunction], RuleFunction]:
    """Register the decorated rule for ``ops``."""
    return _registering(OWN_RULES, ops)


def where_dtensor_cannot_split(*ops: object) -> Callable[[RuleFunction], RuleFunction]:
    """Register the decorated rule for ``ops``, asked only where DTensor cannot split them."""
    return _registering(RULES_WHERE_DTENSOR_CANNOT_SPLIT, ops)


def _aten_default(name: str) -> object | None:
    packet = getattr(aten, name, None)
    return packet.default if packet is not None else None


def expand_single_dim_rules(
    rules: Sequence[SingleDimRule], num_outputs: int, multi_output: bool, mesh_ndim: int
) -> list[Strategy]:
    """Cartesian product of single-mesh-dim rules over ``mesh_ndim`` dimensions."""
    width = len(rules[0]) if rules else num_outputs
    replicate: SingleDimRule = [Replicate()] * width
    all_rules = [replicate] + [list(r) for r in rules if list(r) != replicate]
    strategies = []
    for combo in itertools.product(all_rules, repeat=mesh_ndim):
        columns = [tuple(rule[i] for rule in combo) for i in range(width)]
        columns = [None if any(p is None for p in col) else col for col in columns]
        outputs, inputs = columns[:num_outputs], columns[num_outputs:]
        output: OutputPlacements = tuple(outputs) if multi_output else outputs[0]
        strategies.append(Strategy(output=output, inputs=tuple(inputs)))
    return strategies


def all_shard_replicate(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Placements]:
    """Every Shard/Replicate combination the shape allows (see :func:`shardable`)."""
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(shape))]
    result = []
    for combo in itertools.product(choices, repeat=len(mesh_shape)):
        if shardable(combo, shape, mesh_shape):
            result.append(tuple(combo))
    return result


def shardable(
    placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]
) -> bool:
    """True if the planner offers ``placements`` for a tensor of ``shape``.

    A tensor dim sharded over one mesh dim of size n may be uneven, as DTensor allows: the
    ranks hold ``torch.chunk`` pieces of ceil(size / n), the last ones smaller, and the cost
    model prices the largest. Every rank must get a non-empty piece, and an uneven piece at
    least ``MIN_UNEVEN_PIECE`` long: what uneven shards are for is a large dim that happens
    not to divide (a vocabulary of 50257); offering them for every small odd dim (a sequence
    of 33, 3 heads) would enlarge every 3-D problem and its solve for nothing. A tensor dim sharded
    over several mesh dims must divide evenly (nested uneven pieces are not offered).
    """
    ndim = len(shape)
    sharding: dict[int, list[int]] = {}
    for mesh_size, placement in zip(mesh_shape, placements):
        if type(placement).__name__ == "_StridedShard":
            return False
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                return False
            sharding.setdefault(placement.dim % ndim, []).append(mesh_size)
    for dim, sizes in sharding.items():
        size = int(shape[dim])
        if len(sizes) > 1:
            if size % math.prod(sizes):
                return False
            continue
        pieces = sizes[0]
        if size % pieces == 0:
            continue
        chunk = -(-size // pieces)
        if chunk < MIN_UNEVEN_PIECE or chunk * (pieces - 1) >= size:
            return False  # a small dim, or some rank would hold an empty piece
    return True


MIN_UNEVEN_PIECE = 64
"""The smallest piece (ceil(size / n)) for which an uneven shard is offered."""


def evenly_divisible(
    placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]
) -> bool:
    """True if every sharded tensor dim divides evenly by the mesh dims sharding it: what
    the runtime's coalesced collectives (gradient buckets, layer gathers) need."""
    ndim = len(shape)
    divisor = [1] * ndim
    for mesh_size, placement in zip(mesh_shape, placements):
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                return False
            divisor[placement.dim % ndim] *= mesh_size
        elif type(placement).__name__ == "_StridedShard":
            return False
    return all(int(size) % div == 0 for size, div in zip(shape, divisor))


# ---------------------------------------------------------------------------- attention


def _attention_rules(
    num_outputs: int, num_inputs: int, mask: fx.Node | None
) -> list[SingleDimRule]:
    """Attention is independent per batch element and per head: shard both on every tensor.

    Every tensor of the CPU flash-attention ops is laid out [batch, heads, ...], logsumexp
    included, so Shard(0) and Shard(1) apply uniformly. An attention mask (the last tensor
    input: it is a keyword argument) broadcasts over batch and heads where its dim is 1: it
    is sharded with the others where it has that dim, replicated where it broadcasts.
    """
    rules = []
    for dim in (0, 1):
        rule: SingleDimRule = [Shard(dim)] * (num_outputs + num_inputs)
        if mask is not None:
            broadcast = mask.meta["val"].dim() <= dim or mask.meta["val"].shape[dim] == 1
            rule[-1] = Replicate() if broadcast else Shard(dim)
        rules.append(rule)
    return rules


@rule_for(
    _aten_default("_scaled_dot_product_flash_attention_for_cpu"),
    _aten_default("_scaled_dot_product_flash_attention_for_cpu_backward"),
)
def sdpa_cpu_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """Rules for the CPU flash-attention forward and backward, which DTensor lacks, with or
    without an attention mask of shape [batch or 1, heads or 1, q, k]."""
    tensor_inputs = [a for a in node.args if isinstance(a, fx.Node)]
    mask = node.kwargs.get("attn_mask")
    if mask is not None and not isinstance(mask, fx.Node):
        return None
    if mask is not None and mask.meta["val"].dim() != 4:
        return None
    num_inputs = len(tensor_inputs) + (mask is not None)
    num_outputs = len(node.meta["val"])
    return _attention_rules(num_outputs, num_inputs, mask), num_outputs


# ---------------------------------------------------------------------------- identities


@rule_for(sharding_constraint_op, _aten_default("lift_fresh_copy"))
def identity_rules(node: fx.Node) -> tuple[list[SingleDimRule], int]:
    """Output placement = input placement: ``with_sharding_constraint``'s op (any layout
    change the constraint implies is priced on the input edge) and ``lift_fresh_copy`` (the
    copy of a tensor the model created in its forward, e.g. ``torch.tensor(...)``)."""
    ndim = node.meta["val"].ndim
    return [[Shard(d), Shard(d)] for d in range(ndim)], 1


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


# ---------------------------------------------------------------------------- pointwise


@rule_for(_aten_default("floor_divide"), _aten_default("copy"))
def same_shape_pointwise_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """A pointwise op DTensor has no rule for (``floor_divide``; ``copy(dst, src)`` of equal
    shapes, which functionalization leaves): split along any dim its tensor inputs share
    with the output (a scalar operand is no input)."""
    shape = tuple(node.meta["val"].shape)
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if any(tuple(t.meta["val"].shape) != shape for t in tensors):
        return None
    return [[Shard(d)] * (1 + len(tensors)) for d in range(len(shape))], 1


@rule_for(_aten_default("stack"))
def stack_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``stack(tensors, dim)``: every input split along the same dim d, the output along d
    (d + 1 from the new dim on), or every input a partial sum, the output one too. DTensor's
    own stack strategy offers one placement only, the inputs' most common one."""
    tensors = node.args[0]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, fx.Node) for t in tensors):
        return None
    ndim = tensors[0].meta["val"].dim()
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = dim % (ndim + 1)
    count = len(tensors)
    rules: list[SingleDimRule] = [
        [Shard(d if d < dim else d + 1)] + [Shard(d)] * count for d in range(ndim)
    ]
    rules.append([Partial()] * (count + 1))
    return rules, 1


# ---------------------------------------------------------------------------- grouped matmul


@rule_for_name("transformers.grouped_mm_fallback.default")
def grouped_mm_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """transformers' grouped matmul ``(input [S, K], weight [E, K, N], offs [E]) -> [S, N]``:
    the rows of ``input`` are grouped by expert through the cumulative counts ``offs``,
    which every rank needs whole, so the tokens are not split; each expert's features are:
    N (column parallel: output split the same way) or K (row parallel: partial sums)."""
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if len(tensors) != 3:
        return None
    return [
        [Shard(1), Replicate(), Shard(2), Replicate()],
        [Partial(), Shard(1), Shard(1), Replicate()],
    ], 1


@rule_for_name("transformers.grouped_mm_fallback_backward.default")
def grouped_mm_backward_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """The backward ``(input, weight, offs, grad_output) -> (grad_input, grad_weight)`` of
    :func:`grouped_mm_rules`, split the way its forward was."""
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if len(tensors) != 4:
        return None
    return [
        # column parallel: grad_output split by N, grad_input partial, grad_weight split by N
        [Partial(), Shard(2), Replicate(), Shard(2), Replicate(), Shard(1)],
        # row parallel: input and weight split by K, grad_output whole
        [Shard(1), Shard(1), Shard(1), Shard(1), Replicate(), Replicate()],
    ], 2


# ---------------------------------------------------------------------------- layer norm


def _normalized_from(node: fx.Node, input_index: int, shape_index: int) -> int:
    """The first dim ``native_layer_norm`` normalizes over: the dims before it are rows."""
    ndim = node.args[input_index].meta["val"].ndim
    return ndim - len(tuple(node.args[shape_index]))


@rule_for(_aten_default("native_layer_norm"))
def layer_norm_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean,
    rstd)``: rows are independent, so every tensor splits along any dim before the
    normalized ones; the scale and shift stay whole. Ours, not DTensor's: its strategy
    differs across torch releases (2.11 pairs the weight's options with the input's by
    index and fails when their counts differ)."""
    affine = [a for a in node.args[2:4] if isinstance(a, fx.Node)]
    rows = _normalized_from(node, 0, 1)
    return [[Shard(d)] * 4 + [Replicate()] * len(affine) for d in range(rows)], 3


@rule_for(_aten_default("native_layer_norm_backward"))
def layer_norm_backward_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?,
    bias?, output_mask) -> (grad_input, grad_weight, grad_bias)``, split as its forward:
    the weight's and bias's gradients are partial sums over the rows each rank holds (None
    where the op does not compute them)."""
    outputs = node.meta["val"]
    affine = [a for a in node.args[5:7] if isinstance(a, fx.Node)]
    rows = _normalized_from(node, 1, 2)
    return [
        [Shard(d)]
        + [None if grad is None else Partial() for grad in outputs[1:]]
        + [Shard(d)] * 4
        + [Replicate()] * len(affine)
        for d in range(rows)
    ], 3


# ---------------------------------------------------------------------------- indexing


@where_dtensor_cannot_split(getattr(aten.index, "Tensor", None))
def index_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``index.Tensor(values, indices)``, ``values[i0, :, i2]`` with a list of index tensors
    and Nones: the result has the indices' broadcast dims where the indexed dims were (at the
    front when the indexed dims are not adjacent) and the other dims of ``values`` around
    them. Three ways to split it: ``values`` along a dim that is not indexed (indices whole);
    the indices along one of their broadcast dims (``values`` whole; an index of size 1 there
    broadcasts and stays whole); or ``values`` a partial sum, and so the result."""
    values = node.args[0]
    indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices")
    if not isinstance(values, fx.Node) or not isinstance(indices, (list, tuple)):
        return None
    indexed = [d for d, index in enumerate(indices) if index is not None]
    index_nodes = [index for index in indices if index is not None]
    if not indexed or not all(isinstance(index, fx.Node) for index in index_nodes):
        return None
    if any(index.meta["val"].dtype == torch.bool for index in index_nodes):
        return None  # a mask consumes as many dims as it has, its result's length is data
    index_shapes = [tuple(index.meta["val"].shape) for index in index_nodes]
    broadcast_ndim = max(len(shape) for shape in index_shapes)
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    first = indexed[0] if adjacent else 0  # where the broadcast dims land in the result

    def result_dim(values_dim: int) -> int:
        if values_dim < first:
            return values_dim
        return values_dim + broadcast_ndim - sum(values_dim > d for d in indexed)

    whole = [Replicate()] * len(index_nodes)
    rules: list[SingleDimRule] = [
        [Shard(result_dim(d)), Shard(d)] + whole
        for d in range(values.meta["val"].ndim)
        if d not in indexed
    ]
    for dim in range(broadcast_ndim):
        per_index: list[Placement | None] = []
        for shape in index_shapes:
            own = dim - (broadcast_ndim - len(shape))  # indices align on their last dims
            per_index.append(Shard(own) if own >= 0 and shape[own] > 1 else Replicate())
        if all(isinstance(p, Replicate) for p in per_index):
            continue
        rules.append([Shard(first + dim), Replicate()] + per_index)
    rules.append([Partial(), Partial()] + whole)
    return rules, 1


# ---------------------------------------------------------------------------- convolution


def _splits_output_channels(node: fx.Node, transposed_index: int, groups_index: int) -> bool:
    """Output channels split as a column-parallel linear's features: a plain convolution
    only (a grouped one reads a block of input channels per output block; a transposed one
    keeps its output channels on the weight's dim 1)."""
    return not node.args[transposed_index] and node.args[groups_index] == 1


@where_dtensor_cannot_split(_aten_default("convolution"))
def convolution_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``convolution(input, weight, bias?, stride, padding, dilation, transposed,
    output_padding, groups)``: the batch splits (weight and bias whole) and, for a plain
    convolution, the output channels (weight and bias split along theirs, input whole)."""
    has_bias = isinstance(node.args[2], fx.Node)
    bias: SingleDimRule = [Replicate()] if has_bias else []
    rules: list[SingleDimRule] = [[Shard(0), Shard(0), Replicate()] + bias]
    if _splits_output_channels(node, 6, 8):
        rules.append([Shard(1), Replicate(), Shard(0)] + ([Shard(0)] if has_bias else []))
    return rules, 1


@where_dtensor_cannot_split(_aten_default("convolution_backward"))
def convolution_backward_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``convolution_backward(grad_output, input, weight, bias_sizes, stride, padding,
    dilation, transposed, output_padding, groups, output_mask) -> (grad_input,
    grad_weight, grad_bias)``, split as its forward: by batch (the weight's and bias's
    gradients partial sums) or by output channel (the input's gradient a partial sum)."""
    outputs = node.meta["val"]

    def computed(placement: Placement, index: int) -> Placement | None:
        return placement if outputs[index] is not None else None

    rules: list[SingleDimRule] = [
        [computed(Shard(0), 0), computed(Partial(), 1), computed(Partial(), 2)]
        + [Shard(0), Shard(0), Replicate()]
    ]
    if _splits_output_channels(node, 7, 9):
        rules.append(
            [computed(Partial(), 0), computed(Shard(0), 1), computed(Shard(0), 2)]
            + [Shard(1), Replicate(), Shard(0)]
        )
    return rules, 3


# ---------------------------------------------------------------------------- scatter and pad


@where_dtensor_cannot_split(_aten_default("constant_pad_nd"))
def constant_pad_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``constant_pad_nd(input, pad, value)``: ``pad`` holds (before, after) pairs from the
    last dim backwards; every dim it leaves alone splits, input and output alike."""
    ndim = node.meta["val"].ndim
    pad = list(node.args[1])
    padded = {ndim - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}
    return [[Shard(d), Shard(d)] for d in range(ndim) if d not in padded], 1


@where_dtensor_cannot_split(
    getattr(aten.scatter, "src", None), getattr(aten.scatter, "value", None)
)
def scatter_rules(node: fx.Node) -> tuple[list[SingleDimRule], int] | None:
    """``scatter(self, dim, index, src | value)`` writes along ``dim`` only: every other dim
    where ``self``, ``index`` (and ``src``) have the same size splits, all of them alike."""
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    shapes = [tuple(t.meta["val"].shape) for t in tensors]
    ndim = len(shapes[0])
    dim = node.args[1] % ndim if ndim else 0
    same = [d for d in range(ndim) if d != dim and len({shape[d] for shape in shapes}) == 1]
    return [[Shard(d)] * (1 + len(tensors)) for d in same], 1
