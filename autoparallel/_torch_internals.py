"""Every private PyTorch API autoparallel relies on, wrapped in one place.

Why private APIs at all: the joint forward+backward export with input/output descriptors
(AOTAutograd) and DTensor's per-op sharding strategy registry have no public equivalent in
torch 2.13, yet they are exactly the foundation this library is meant to build on rather than
re-implement. Keeping every such import in this file means a torch upgrade that moves them
breaks one file, not twenty.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed._functional_collectives as _funcol
import torch.fx as fx
import torch.nn as nn
from torch._export.utils import _compiling_state_context
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import (
    DataDependentOutputException as _DataDependentOutputException,
)
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException as _DynamicOutputShapeException,
)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor._api import DTensor
from torch.distributed.tensor._collective_utils import shard_dim_alltoall as _shard_dim_alltoall
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode as _GuardOnDataDependentSymNode,
)
from torch.utils._python_dispatch import TorchDispatchMode  # a mode sees every aten op first

try:  # mirrored without their pricing by strategies/view_rules.py (see view_rule_of)
    from torch.distributed.tensor._ops import _math_ops as _dtensor_math_ops
    from torch.distributed.tensor._ops import _tensor_ops as _dtensor_tensor_ops
    from torch.distributed.tensor._ops import _view_ops as _dtensor_view_ops
    from torch.distributed.tensor._ops.utils import is_tensor_dim_sharded as _is_tensor_dim_sharded
    from torch.distributed.tensor._ops.utils import normalize_dim as _normalize_dim
    from torch.distributed.tensor.placement_types import _is_shard_like
except ImportError:  # torch moved them: every op keeps DTensor's own (priced) strategy
    _dtensor_math_ops = _dtensor_tensor_ops = _dtensor_view_ops = None

__all__ = [
    "DTensorSpec",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "TensorMeta",
    "TorchDispatchMode",
    "TupleStrategy",
    "new_fake_mode",
    "trace_on_fake",
    "export_joint",
    "describe_input",
    "describe_output",
    "retarget_descriptor",
    "dtensor_strategy_function",
    "single_dim_rules",
    "view_rule_of",
    "propagate_view_sharding",
    "is_dtensor_strategy",
    "nonstrict_trace",
    "register_pytree_constant",
    "lookup_compile_backend",
    "all_gather_rows",
    "all_reduce_sum",
    "reduce_scatter_sum",
    "FUNCTIONAL_ALL_REDUCE",
    "FUNCTIONAL_ALL_REDUCE_IN_PLACE",
]


# ---------------------------------------------------------------------------- tracing


# ---------------------------------------------------------------------------- collectives
# torch's functional collectives (what DTensor itself emits) live in a private module; the
# runtime's coalesced gradient reductions call them directly (runtime/coalesce.py).


FUNCTIONAL_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
FUNCTIONAL_ALL_REDUCE_IN_PLACE = torch.ops._c10d_functional.all_reduce_.default
"""The functional all-reduce as DTensor traces it (it copies its input, then reduces the
copy) and its in-place twin (reduces the input itself), for runtime/local_graph.py's
``reduce_in_place``: the ops are registered by torch but have no public handle."""


def all_reduce_sum(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Sum of ``tensor`` over the ranks of ``mesh_dim``, waited on."""
    return _funcol.wait_tensor(_funcol.all_reduce(tensor, "sum", (mesh, mesh_dim)))


def start_all_reduce_sum(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """:func:`all_reduce_sum` issued but not waited on: pass the result to
    :func:`wait_tensor` before reading it (the collective runs meanwhile)."""
    return _funcol.all_reduce(tensor, "sum", (mesh, mesh_dim))


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, once it has finished."""
    return _funcol.wait_tensor(tensor)


def all_gather_rows(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` of ``mesh_dim`` stacked along dim 0 in rank order, waited on."""
    return _funcol.wait_tensor(_funcol.all_gather_single(tensor, 0, (mesh, mesh_dim)))


def reduce_scatter_sum(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """This rank's block of the sum of ``tensor`` over the ranks of ``mesh_dim``, where
    rank r (its coordinate along ``mesh_dim``) gets the r-th of equal blocks along dim 0."""
    return _funcol.wait_tensor(_funcol.reduce_scatter_single(tensor, "sum", 0, (mesh, mesh_dim)))


def shard_to_shard(tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """This rank's local tensor after DTensor's ``Shard(0) -> Shard(1)`` along ``mesh_dim``,
    issued as DTensor issues it: an all-to-all, except on CPU meshes, where DTensor falls back
    to an all-gather and a chunk copy (gloo has no functional all-to-all). Calibration times
    this private DTensor function so that the all-to-all it fits is the one the runtime runs."""
    return _shard_dim_alltoall(tensor, 0, 1, mesh, mesh_dim)


# ---------------------------------------------------------------------------- DTensor wrappers
# ``DTensor.to_local()`` and ``from_local()`` build one autograd node per tensor and
# normalize placements on every call (~200 us a parameter on CPU, every step). The runtime
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


# What fake tensors raise when a forward needs data they do not have (trace/errors.py turns
# them into a message about the user's code); the classes live in private modules.
DATA_DEPENDENT_VALUE_ERRORS: tuple[type[BaseException], ...] = (
    _DataDependentOutputException,
    _GuardOnDataDependentSymNode,
)
DATA_DEPENDENT_SHAPE_ERRORS: tuple[type[BaseException], ...] = (_DynamicOutputShapeException,)


def new_fake_mode(allow_non_fake_inputs: bool = False) -> FakeTensorMode:
    """A fresh fake mode per session: no state is shared between two planning sessions."""
    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def trace_on_fake(function: Callable[..., Any], *tensors: torch.Tensor) -> fx.GraphModule:
    """``function``'s ATen ops, traced on fake copies of ``tensors``: no op runs on data.

    The runtime's local graphs (runtime/local_graph.py) must be traced without running
    anything for real: on real tensors every functional collective of the phase would be
    issued, with its buffers, while the tracer runs. ``make_fx``'s fake mode converts the
    inputs itself; tensors ``function`` reads from elsewhere (the model's constants) are
    allowed in as constants of the graph, which takes a private argument of ``make_fx``."""
    return make_fx(function, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)


def unrun_graph_module(root: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of ``graph`` whose Python code is generated only if something runs it.

    The joint graph module is read node by node and never called (the runtime builds graphs
    of its own); a plain GraphModule generates its code on construction, 0.7 s for the
    20,000 nodes of LLaMA-3 70B. torch's lazy subclass is private."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def export_joint(stack: contextlib.ExitStack, model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Joint forward+backward export; the returned object has ``graph_module`` and ``out_spec``.

    The model runs with torch's "compiling / exporting" state on
    (``torch.compiler.is_compiling()`` and ``is_exporting()`` true), exactly as
    ``torch.export``'s non-strict tracing sets it around the same AOTAutograd trace. Model
    code reads that state to take its export-safe paths: ``transformers`` skips its
    data-dependent mask and padding checks (``is_tracing``), which cannot run on fake tensors.
    The state is torch's own private flag pair, set and restored by this context manager.
    """
    with _compiling_state_context():
        return aot_export_joint_with_descriptors(stack, model, args, kwargs)


def describe_input(desc: Any) -> tuple[str, Any]:
    """Map an AOTAutograd input descriptor to (role, key).

    Roles: ("param", fqn), ("buffer", fqn), ("input", flat index), ("tangent", output desc).
    """
    if isinstance(desc, _desc.ParamAOTInput):
        return "param", desc.target
    if isinstance(desc, _desc.BufferAOTInput):
        return "buffer", desc.target
    if isinstance(desc, _desc.PlainAOTInput):
        return "input", desc.idx
    if isinstance(desc, _desc.TangentAOTInput):
        return "tangent", desc.output
    return "other", desc


def retarget_descriptor(desc: Any, old_prefix: str, new_prefix: str) -> Any:
    """``desc`` with a parameter/buffer name starting ``old_prefix`` moved to ``new_prefix``.

    Used when one traced layer's nodes are repeated for another layer (trace/layer_stamping.py):
    the copy's inputs and gradients must name that layer's parameters. Descriptors of
    anything else come back unchanged.
    """
    if isinstance(desc, (_desc.ParamAOTInput, _desc.BufferAOTInput)) and desc.target.startswith(
        old_prefix
    ):
        return dataclasses.replace(desc, target=new_prefix + desc.target[len(old_prefix) :])
    if isinstance(desc, _desc.GradAOTOutput):
        return dataclasses.replace(
            desc, grad_of=retarget_descriptor(desc.grad_of, old_prefix, new_prefix)
        )
    return desc


def describe_output(desc: Any) -> tuple[str, Any]:
    """Map an AOTAutograd output descriptor to (role, key).

    Roles: ("output", flat index), ("grad", ("param", fqn) | ("input", index)), ("other", desc).
    """
    if isinstance(desc, _desc.PlainAOTOutput):
        return "output", desc.idx
    if isinstance(desc, _desc.GradAOTOutput):
        return "grad", describe_input(desc.grad_of)
    return "other", desc


# ---------------------------------------------------------------------------- DTensor strategies


def has_single_dim_strategy(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor describes ``op`` by single-mesh-dim rules.

    Those rules do not depend on the inputs' placements, and DTensor's expander insists on
    exactly one candidate per input; callers pass a single representative placement.
    """
    return op in DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs


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
        from torch.distributed.tensor._ops.single_dim_strategy import _PreparedSingleDimStrategy
        from torch.distributed.tensor._ops.utils import is_tensor_shardable
    except ImportError:
        return None
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


class ViewRule(NamedTuple):
    """What DTensor's strategy for one view-like op is made of (see view_rule_of)."""

    dim_map: Callable[..., Any]  # called like the op on its OpSchema args -> DimMap
    strict_view: bool  # True: DTensor refuses inputs the view would have to redistribute


def view_rule_of(strategy_fn: Any) -> ViewRule | None:
    """The dim map and strictness DTensor's view strategy ``strategy_fn`` was registered with.

    Why private: DTensor registers every view-like op (view, reshape, expand, permute, ...)
    through ``register_op_strategy_map``, whose strategy prices each candidate against every
    input option with ``generate_redistribute_costs``; that pricing, which we drop, was most
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


# ---------------------------------------------------------------------------- torch.compile


def nonstrict_trace(fn: Callable) -> Callable:
    """Dynamo records a call to ``fn`` without tracing its Python; AOTAutograd traces it.

    The parallel module's forward interprets a planned graph with Python-side state (the
    executor, DTensor redistributions); Dynamo cannot follow that, AOTAutograd's make_fx
    can. torch 2.13 offers this only as ``torch._dynamo.nonstrict_trace``.
    """
    return torch._dynamo.nonstrict_trace(fn)


def register_pytree_constant(cls: type) -> None:
    """Let instances of ``cls`` pass through :func:`nonstrict_trace` as constants."""
    from torch.utils._pytree import register_constant

    register_constant(cls)


def lookup_compile_backend(name: str) -> Callable:
    """A registered torch.compile backend by name ("inductor", "aot_eager", ...)."""
    from torch._dynamo import lookup_backend

    return lookup_backend(name)


# ---------------------------------------------------------------------------- initialization
# Drawing the random values of a sharded parameter as the unsharded model would needs to see
# each in-place random op on a DTensor before DTensor runs it locally (runtime/init.py); a
# dispatch mode is torch's way to do that, and its base class lives in a private module.


def is_inplace_random(func: torch._ops.OpOverload) -> bool:
    """True for aten ops that fill their first argument with random values (``normal_``)."""
    tags = getattr(func, "tags", ())
    return torch.Tag.inplace in tags and torch.Tag.nondeterministic_seeded in tags


def has_wrapper_storage(tensor: DTensor) -> bool:
    """True when ``tensor.data = x`` gave a DTensor's wrapper a storage of its own.

    A DTensor is a wrapper whose values live in its local tensor; its own storage is empty.
    Assigning ``.data`` with a plain tensor replaces only the wrapper's storage and
    metadata, so the values the runtime reads do not change: this is how it shows.
    """
    return tensor.data_ptr() != 0


# ---------------------------------------------------------------------------- local_map regions
# A local_map region is one custom op in the joint graph; its backward op re-runs the body
# under autograd to get the body's vector-Jacobian product. A custom op's kernel runs below
# the autograd dispatch keys (the dispatcher excludes them for the kernel's duration), and
# torch offers no public way to re-enter autograd there: the guard below restores them.
# The collectives a region body issues are torch's functional collectives, which live in a
# private module; grouped matmul (one matmul per expert over contiguous row groups) is only
# offered as ``torch._grouped_mm``.

_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in dir(torch._C.DispatchKey)
    if name.startswith("Autograd") or name == "ADInplaceOrView"
)


@contextlib.contextmanager
def autograd_inside_kernel() -> Any:
    """Autograd records again inside a custom op's kernel (grad mode on)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded):
        with torch.enable_grad():
            yield


def collective_all_to_all(
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    mesh: Any,
    mesh_dim: int,
) -> torch.Tensor:
    """Rows of ``tensor`` exchanged between the ranks of ``mesh_dim``, waited on."""
    return _funcol.wait_tensor(
        _funcol.all_to_all_single(tensor, output_split_sizes, input_split_sizes, (mesh, mesh_dim))
    )


def collective_all_gather(tensor: torch.Tensor, dim: int, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` of ``mesh_dim`` concatenated along ``dim``, waited on."""
    return _funcol.wait_tensor(
        _funcol.all_gather_single(tensor.contiguous(), dim, (mesh, mesh_dim))
    )


def collective_reduce_scatter(
    tensor: torch.Tensor, dim: int, mesh: Any, mesh_dim: int
) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum over the ranks of ``mesh_dim``, waited on."""
    return _funcol.wait_tensor(
        _funcol.reduce_scatter_single(tensor.contiguous(), "sum", dim, (mesh, mesh_dim))
    )


def group_name_of(mesh: Any, mesh_dim: int) -> str:
    """The process group name the functional collectives record for ``mesh_dim``."""
    return mesh.get_group(mesh_dim).group_name


COLLECTIVE_OPS = {
    "all_to_all": "_c10d_functional.all_to_all_single",
    "all_gather": "_c10d_functional.all_gather_into_tensor",
    "reduce_scatter": "_c10d_functional.reduce_scatter_tensor",
    "all_reduce": "_c10d_functional.all_reduce",
}
"""Functional collective op names (as ``str(op)`` starts) by the cost model's kind."""


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows[start_e:end_e] @ weights[e]`` for each group e, concatenated; ``offsets`` are
    the groups' cumulative ends (int32).

    On fake tensors of a dtype other than bfloat16 (torch's shape function accepts only
    that, its CPU kernel any float) one matmul of the same size stands in: same output
    shape, same FLOPs, and fake tensors carry no values to get wrong."""
    if isinstance(rows, FakeTensor) and rows.dtype != torch.bfloat16:
        return rows @ weights[0]
    return torch._grouped_mm(rows, weights, offs=offsets)


def op_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """The dispatcher entry ``op(...)`` calls. ``OpOverload.__call__`` is one Python frame
    around it; a local graph that runs every step on a CPU host pays that frame per op
    (runtime/bound_graph.py). Private: ``_op`` is the only handle on it."""
    return op._op
