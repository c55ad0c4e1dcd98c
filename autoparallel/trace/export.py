"""Stage 1: trace a model into one joint forward+backward ATen graph on fake tensors.

The result, :class:`JointGraph`, is the FX graph plus the *roles* of its boundary: which
placeholders are parameters, buffers, user inputs or tangents, and which outputs are user
outputs, parameter gradients or input gradients. Every later stage reads roles from here
instead of re-deriving them from node names.

Parameters that live on the meta device are never materialized: the model is shallow-copied
with each parameter and buffer replaced by a fake tensor of the same shape and dtype, so
tracing a 70B model allocates nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autoparallel import _torch_internals as internals
from autoparallel._torch_internals import TreeSpec, tree_flatten
from autoparallel.graph.restrides import rewrite_contiguous_restrides
from autoparallel.regions.context import RegionScope, region_scope
from autoparallel.regions.local_map import LocalMapError, region_backward_op, region_forward_op
from autoparallel.regions.profile import check_free_dims, profile_region
from autoparallel.trace.errors import trace_error
from autoparallel.trace.layer_stamping import (
    CHECK_LAYERS,
    TEMPLATE_LAYERS,
    CannotRepeatLayers,
    stamp_verified,
)
from autoparallel.trace.mixed_precision import (
    WRAPPED_PREFIX,
    MixedPrecisionModule,
    place_casts_in_their_layers,
)
from autoparallel.trace.repeated_layers import (
    LayerIndexRead,
    find_repeated_layers,
    with_first_layers,
)
from autoparallel.types.graph import JointGraph, RepeatedLayers

logger = logging.getLogger(__name__)


def trace_device(mesh_device_type: str) -> torch.device:
    """Device on which fake tensors are created for tracing.

    We trace on the mesh's device type when this process can use it; otherwise (planning for
    a CUDA cluster on a CPU-only laptop) on CPU. Placement decisions do not depend on it.
    """
    if mesh_device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh_device_type, None)
    if module is not None and hasattr(module, "is_available") and module.is_available():
        return torch.device(mesh_device_type)
    logger.info("tracing on cpu: device type %r is not available in this process", mesh_device_type)
    return torch.device("cpu")


def _fake_copy_of_model(model: nn.Module, fake_mode: Any, device: torch.device) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake tensors.

    The copy shares no storage with the user's model and allocates none: the deep copy's
    memo is pre-filled with fake replacements, so real or meta tensors are never copied.
    """
    memo: dict[int, Any] = {}
    with fake_mode:
        for param in model.parameters():
            if id(param) in memo:
                continue
            fake = torch.empty(param.shape, dtype=param.dtype, device=device)
            memo[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
        for buffer in model.buffers():
            if id(buffer) in memo:
                continue
            memo[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return copy.deepcopy(model, memo)


def normalize_inputs(raw: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Turn what ``input_fn()`` returned into (args, kwargs).

    A tensor becomes a 1-tuple; a tuple/list is positional args; a dict whose keys are
    'args'/'kwargs' is split, any other dict is keyword arguments.
    """
    if isinstance(raw, torch.Tensor):
        return (raw,), {}
    if isinstance(raw, (tuple, list)):
        return tuple(raw), {}
    if isinstance(raw, dict):
        if set(raw) <= {"args", "kwargs"}:
            return tuple(raw.get("args", ())), dict(raw.get("kwargs", {}))
        return (), dict(raw)
    raise TypeError(
        f"input_fn() must return a tensor, a tuple/list of inputs or a dict of keyword inputs; "
        f"got {type(raw).__name__}"
    )


def _fake_inputs(
    args: tuple, kwargs: dict, fake_mode: Any, device: torch.device
) -> tuple[tuple, dict]:
    leaves, spec = tree_flatten((args, kwargs))
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise TypeError("input_fn() returned no tensor: the model needs at least one tensor input")
    fake_leaves = []
    with fake_mode:
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"input leaf {index} returned by input_fn() is a {type(leaf).__name__}, "
                    "not a tensor; pass non-tensor settings through the model's constructor"
                )
            fake = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
            fake.requires_grad_(leaf.requires_grad)
            fake_leaves.append(fake)
    return spec.unflatten(fake_leaves)


def trace_joint(
    model: nn.Module,
    input_fn: Callable[[], Any],
    device: torch.device,
    mp_policy: Any = None,
    trace_layers_once: bool = True,
    mesh: DeviceMesh | None = None,
) -> JointGraph:
    """Trace ``model`` on the global inputs of ``input_fn`` into a :class:`JointGraph`.

    With a (checked) ``mp_policy`` the model is traced inside
    :class:`~autoparallel.trace.mixed_precision.MixedPrecisionModule`, so the graph holds the
    precision casts; parameter names are still the model's own.

    With ``trace_layers_once``, a model whose layers are identical modules is traced with
    only 3 and 4 of them and the full graph is built from those (repeated_layers.py,
    layer_stamping.py); where that cannot be verified, every layer is traced.

    ``mesh`` is the mesh being planned for: the model's ``local_map`` regions
    (autoparallel/regions) read it, and each region's body is profiled on it afterwards.
    """
    # input_fn runs under a fake mode of its own so that it allocates nothing even for huge
    # global inputs, yet may still read real tensors it closes over; only shapes are kept.
    with internals.new_fake_mode(allow_non_fake_inputs=True):
        raw_inputs = input_fn()
    args, kwargs = normalize_inputs(raw_inputs)
    scope = RegionScope(mesh, recording=True)
    joint = None
    with region_scope(scope):
        if trace_layers_once:
            layers = find_repeated_layers(model)
            if layers is not None:
                joint = _trace_layers_once(model, layers, args, kwargs, device, mp_policy)
        if joint is None:
            joint = _trace(model, args, kwargs, device, mp_policy)
    # After the whole graph exists (stamping copies the traced order) and before any stage
    # reads positions: folding, the layer regions and the runtime's order all want each
    # layer's casts inside the layer. No recompile: later stages read the nodes, and the
    # runtime builds graphs of its own.
    place_casts_in_their_layers(joint)
    # before strategies: a contiguous as_strided is a view DTensor knows how to shard
    rewrite_contiguous_restrides(joint)
    joint.tied_params = _tied_parameter_groups(model)
    _attach_regions(joint, scope, mesh)
    return joint


def _attach_regions(joint: JointGraph, scope: RegionScope, mesh: DeviceMesh | None) -> None:
    """Give the joint graph its regions, each profiled on ``mesh``, and each region op node
    its region (``node.meta["local_map_region"]``)."""
    region_ops = (region_forward_op, region_backward_op)
    nodes = [n for n in joint.graph.nodes if n.op == "call_function" and n.target in region_ops]
    if not nodes:
        return
    used = {node.args[0] for node in nodes}
    joint.regions = {key: region for key, region in scope.regions.items() if key in used}
    for region in joint.regions.values():
        region.layouts = tuple(
            dataclasses.replace(layout, profile=profile_region(region, layout, mesh))
            for layout in region.layouts
        )
        check_free_dims(region)
    for node in nodes:
        node.meta["local_map_region"] = joint.regions[node.args[0]]
    logger.info(
        "%d local_map region(s): %s",
        len(joint.regions),
        ", ".join(f"{r.key} ({r.source})" for r in joint.regions.values()),
    )


def _trace(
    model: nn.Module, args: tuple, kwargs: dict, device: torch.device, mp_policy: Any
) -> JointGraph:
    fake_mode = internals.new_fake_mode()
    fake_args, fake_kwargs = _fake_inputs(args, kwargs, fake_mode, device)
    fake_model = _fake_copy_of_model(model, fake_mode, device)
    # the copy is ours: a hook on it leaves the user's model untouched
    fake_model.register_forward_hook(_without_state_objects)
    name_prefix = _name_prefix(mp_policy)
    if mp_policy is not None:
        fake_model = MixedPrecisionModule(fake_model, mp_policy)

    # The export's contexts only matter for compiling the graph; we read it and close them.
    with contextlib.ExitStack() as stack:
        try:
            export = internals.export_joint(stack, fake_model, fake_args, fake_kwargs)
        except Exception as exc:
            own = _own_error(exc)
            if own is not None:
                raise own from exc
            raise trace_error(exc, model) from exc
    _, in_spec = tree_flatten((args, kwargs))
    return _assign_roles(
        export.graph_module, fake_mode, in_spec, export.out_spec, device, name_prefix
    )


def _own_error(exc: BaseException) -> LocalMapError | None:
    """A LocalMapError raised inside the trace (torch may wrap it), already in user terms."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, LocalMapError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def _without_state_objects(module: nn.Module, args: Any, output: Any) -> Any:
    """``output`` with every leaf that is neither a tensor nor a plain value set to None.

    Such leaves are state objects a forward returns beside its tensors, such as the
    key/value cache of a ``transformers`` model (``past_key_values``, on by default). A
    training step does not read them and the joint graph cannot return them, so the parallel
    module returns None in their place (logged once per trace)."""
    leaves, spec = tree_flatten(output)
    dropped = sorted(
        {type(leaf).__name__ for leaf in leaves if not isinstance(leaf, _PLAIN_LEAVES)}
    )
    if not dropped:
        return output
    logger.info(
        "the model's output holds %s (not tensors): the parallel module returns None there; "
        "pass the model's own switch (e.g. use_cache=False) to leave them out",
        ", ".join(dropped),
    )
    return spec.unflatten([leaf if isinstance(leaf, _PLAIN_LEAVES) else None for leaf in leaves])


def _name_prefix(mp_policy: Any) -> str:
    return "" if mp_policy is None else WRAPPED_PREFIX


def _trace_layers_once(
    model: nn.Module,
    layers: RepeatedLayers,
    args: tuple,
    kwargs: dict,
    device: torch.device,
    mp_policy: Any,
) -> JointGraph | None:
    """The full joint graph built from traces with 3 and 4 layers, or None (logged) when
    those do not determine it."""
    name_prefix = _name_prefix(mp_policy)
    short_traces = []
    for count in (TEMPLATE_LAYERS, CHECK_LAYERS):
        try:
            short = _trace(with_first_layers(model, layers, count), args, kwargs, device, mp_policy)
        except Exception as exc:  # the model may not run with fewer layers: trace it whole
            logger.info(
                "tracing all %d layers of `%s`: %s",
                layers.count,
                layers.path,
                _short_trace_failure(exc, count),
            )
            return None
        short_traces.append(short)
    template, check = short_traces
    try:
        graph_module = stamp_verified(
            template.graph_module, check.graph_module, layers, name_prefix
        )
    except CannotRepeatLayers as exc:
        logger.info("tracing all %d layers of `%s`: %s", layers.count, layers.path, exc)
        return None
    except Exception as exc:  # a case stamping does not handle must never stop planning
        logger.warning(
            "tracing all %d layers of `%s`: building their graph from 3 and 4 traced layers failed (%s: %s)",
            layers.count,
            layers.path,
            type(exc).__name__,
            exc,
        )
        return None
    logger.info(
        "traced %d and %d of the %d identical layers of `%s` and repeated the checked layer for the rest",
        TEMPLATE_LAYERS,
        CHECK_LAYERS,
        layers.count,
        layers.path,
    )
    joint = _assign_roles(
        graph_module, template.fake_mode, template.in_spec, template.out_spec, device, name_prefix
    )
    joint.layers_traced_once = layers
    return joint


def _short_trace_failure(exc: BaseException, count: int) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, LayerIndexRead):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    return f"with {count} layers the model fails ({type(exc).__name__}: {exc})"


def _tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    names_by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(param), []).append(name)
    return [names for names in names_by_tensor.values() if len(names) > 1]


def _assign_roles(
    graph_module: fx.GraphModule,
    fake_mode: Any,
    in_spec: TreeSpec,
    out_spec: TreeSpec,
    device: torch.device,
    name_prefix: str = "",
) -> JointGraph:
    params: dict[str, fx.Node] = {}
    buffers: dict[str, fx.Node] = {}
    inputs_by_index: dict[int, fx.Node] = {}
    tangent_nodes: list[tuple[Any, fx.Node]] = []
    for node in graph_module.graph.find_nodes(op="placeholder"):
        kind, key = internals.describe_input(node.meta.get("desc"))
        if kind in ("param", "buffer"):
            key = key.removeprefix(name_prefix)
        if kind == "param":
            params[key] = node
        elif kind == "buffer":
            buffers[key] = node
        elif kind == "input":
            inputs_by_index[key] = node
        elif kind == "tangent":
            tangent_nodes.append((key, node))
        else:
            raise NotImplementedError(
                f"unsupported graph input {node.name} ({node.meta.get('desc')!r})"
            )

    output_node = graph_module.graph.output_node()
    user_outputs: dict[int, fx.Node | None] = {}
    param_grads: dict[str, fx.Node] = {}
    input_grads: dict[int, fx.Node] = {}
    for value, desc in zip(output_node.args[0], output_node.meta.get("desc", [])):
        kind, key = internals.describe_output(desc)
        if kind == "output":
            user_outputs[key] = value
        elif kind == "grad" and value is not None:
            grad_kind, grad_key = key
            if grad_kind == "param":
                grad_key = grad_key.removeprefix(name_prefix)
            (param_grads if grad_kind == "param" else input_grads)[grad_key] = value

    tangents: dict[int, fx.Node] = {}
    for output_desc, node in tangent_nodes:
        kind, index = internals.describe_output(output_desc)
        tangents[index] = node

    joint = JointGraph(
        graph_module=graph_module,
        fake_mode=fake_mode,
        params=params,
        buffers=buffers,
        user_inputs=[inputs_by_index[i] for i in sorted(inputs_by_index)],
        tangents=tangents,
        user_outputs=[user_outputs.get(i) for i in range(len(user_outputs))],
        param_grads=param_grads,
        input_grads=input_grads,
        forward_nodes=_forward_nodes(graph_module.graph, tangents.values()),
        in_spec=in_spec,
        out_spec=out_spec,
        device=device,
    )
    logger.debug(
        "traced joint graph: %d nodes, %d params, %d buffers, %d inputs, %d outputs",
        len(graph_module.graph.nodes),
        len(params),
        len(buffers),
        len(joint.user_inputs),
        len(joint.user_outputs),
    )
    return joint


def _forward_nodes(graph: fx.Graph, tangents: Any) -> set[fx.Node]:
    """Nodes that do not depend on any tangent: the forward pass."""
    backward: set[fx.Node] = set(tangents)
    forward: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if any(inp in backward for inp in node.all_input_nodes):
            backward.add(node)
        else:
            forward.add(node)
    return forward
