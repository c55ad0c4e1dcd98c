"""Stage 6: the parallel module (apply_placement).

The parallel module is a structural copy of the user's model whose parameters and buffers
are DTensors with the planned placements (on the meta device if the model was), and whose
``forward`` runs the planned joint graph on local per-rank tensors:

* inputs are the rank's local shards, checked against the planned input placements;
* outputs are local tensors laid out as the output constraints say;
* ``loss.backward()`` runs the backward phase and leaves each ``param.grad`` as a DTensor
  with the parameter's placement;
* under ``torch.no_grad()`` only the nodes the outputs need run, and nothing is kept.

Keeping the user's class (a subclass of it, with our ``forward``) means its own methods, such
as ``init_weights()``, and its state-dict keys keep working on the parallel module.
"""

from __future__ import annotations

import copy
import logging
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from autoparallel import _torch_internals as internals
from autoparallel._torch_internals import tree_flatten, tree_unflatten
from autoparallel.graph.view_ops import parameter_views
from autoparallel.regions.context import RegionScope, register_running_scope
from autoparallel.runtime.coalesce import reduce_gradients
from autoparallel.runtime.dynamic import ShapeVariants
from autoparallel.runtime.executor import JointExecutor
from autoparallel.runtime.faults import (
    PeerPorts,
    set_collective_timeout,
    share_peer_addresses,
    translate_rank_loss,
)
from autoparallel.runtime.gloo import check_process_groups
from autoparallel.runtime.init import (
    INIT_METHODS,
    InitError,
    data_assignment_error,
    run_under_full_value_init,
)
from autoparallel.runtime.local_graph import SavedSlot, TracedPhase, flatten_saved, rebuild_saved
from autoparallel.runtime.shards import wrap_shard
from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import placement_str
from autoparallel.types.plan import Plan
from autoparallel.types.strategies import StrategySpace
from autoparallel.types.tensors import local_shape_at

logger = logging.getLogger(__name__)

LOCAL_SOURCES = ("rule", "fallback", "factory", "local_map")


class InputMismatchError(ValueError):
    """A local input does not match what the plan expects on this rank."""


def apply_placement(
    model: nn.Module,
    joint: JointGraph,
    space: StrategySpace,
    plan: Plan,
    mesh: DeviceMesh,
    dynamic: bool = False,
    mp_policy: Any = None,
    collective_timeout: float | timedelta | None = None,
) -> nn.Module:
    """Build the parallel module of ``model`` for ``plan`` (see the module docstring).

    With ``dynamic`` the module also accepts inputs of other sizes (see runtime/dynamic.py);
    ``mp_policy`` is then needed to trace the model again as it was planned.
    ``collective_timeout`` (seconds or a timedelta) bounds every later collective on the
    mesh's process groups (None leaves their timeouts as they are); a rank lost during a
    step raises ``RankLostError`` on the others (runtime/faults.py). On a real gloo mesh
    this is collective: every rank of the mesh calls it. A mesh on gloo groups with several
    worker threads is refused (``UnsafeProcessGroupError``, runtime/gloo.py says why).
    """
    check_process_groups(mesh)
    if collective_timeout is not None:
        set_collective_timeout(mesh, collective_timeout)
    peers = share_peer_addresses(mesh)
    device = torch.device(mesh.device_type)
    local_sources = {node.name for node, ns in space.nodes.items() if ns.source in LOCAL_SOURCES}

    def make_runtime(graph: JointGraph) -> _Runtime:
        executor = JointExecutor(graph, plan, mesh, local_sources, device)
        return _Runtime(graph, plan, mesh, executor, peers)

    runtime = make_runtime(joint)
    if dynamic:
        runtime.variants = ShapeVariants(
            model, mp_policy, joint, plan, tuple(mesh.shape), make_runtime
        )
    parallel = _copy_with_dtensors(model, plan, mesh)
    parallel.__class__ = _parallel_class(type(model))
    object.__setattr__(parallel, "_autoparallel", runtime)
    return parallel


# user class -> its parallel subclass. A pure function of the class (the subclass holds no
# plan or state: that lives on each instance), memoized as FSDP2's fully_shard does, so that
# every parallel module of one class shares one type (torch.compile guards on the type, and
# isinstance/pickling see one class). Weak keys: a user class that goes away is dropped.
_PARALLEL_CLASSES: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def _parallel_class(cls: type) -> type:
    """The subclass of the user's class whose ``forward`` runs the plan."""
    parallel_cls = _PARALLEL_CLASSES.get(cls)
    if parallel_cls is None:
        namespace = {
            "forward": _parallel_forward,
            "load_state_dict": _load_state_dict,
            "__module__": cls.__module__,
        }
        for name in INIT_METHODS:  # written for full tensors: run them on full values
            method = getattr(cls, name, None)
            if callable(method):
                namespace[name] = run_under_full_value_init(method)
        parallel_cls = type(f"AutoParallel{cls.__name__}", (cls,), namespace)
        _PARALLEL_CLASSES[cls] = parallel_cls
    return parallel_cls


def _copy_with_dtensors(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> nn.Module:
    memo: dict[int, Any] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in memo:
            continue
        placements = plan.param_placements[name]
        memo[id(param)] = _with_attributes_of(
            param,
            nn.Parameter(
                _to_dtensor(param.detach(), mesh, placements), requires_grad=param.requires_grad
            ),
        )
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if id(buffer) in memo:
            continue
        placements = plan.buffer_placements.get(name, tuple(_replicate(mesh)))
        memo[id(buffer)] = _to_dtensor(buffer, mesh, placements)
    return copy.deepcopy(model, memo)


def _with_attributes_of(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``target`` with the Python attributes set on ``source`` that it lacks: what a library
    or the user marked on a parameter (Hugging Face's ``_is_hf_initialized`` on weights it
    loaded or tied, which its ``init_weights`` then leaves alone; ``_no_weight_decay`` and
    the like) follows it into the parallel module."""
    for key, value in vars(source).items():
        if key not in vars(target):
            setattr(target, key, value)
    return target


def _replicate(mesh: DeviceMesh) -> list:
    from torch.distributed.tensor import Replicate

    return [Replicate()] * mesh.ndim


def _to_dtensor(tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    """Shard a full tensor by the plan; a meta tensor stays meta (only its local shape)."""
    if tensor.is_meta:
        shape = local_shape_at(tensor.shape, placements, mesh.shape, mesh.get_coordinate())
        local = torch.empty(shape, dtype=tensor.dtype, device="meta")
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    return distribute_tensor(tensor.to(mesh.device_type), mesh, placements, src_data_rank=None)


class _Runtime:
    """Per-module state of the parallel forward: the executor and the boundary placements."""

    def __init__(
        self,
        joint: JointGraph,
        plan: Plan,
        mesh: DeviceMesh,
        executor: JointExecutor,
        peers: PeerPorts,
    ):
        self.joint = joint
        self.plan = plan
        self.mesh = mesh
        self.executor = executor
        self.peers = peers  # names a lost rank in RankLostError (runtime/faults.py)
        self.input_shapes = [tuple(n.meta["val"].shape) for n in joint.user_inputs]
        self.input_dtypes = [n.meta["val"].dtype for n in joint.user_inputs]
        self.local_input_shapes = [
            local_shape_at(shape, placements, mesh.shape, mesh.get_coordinate())
            for shape, placements in zip(self.input_shapes, plan.input_placements)
        ]
        order = {node: i for i, node in enumerate(joint.graph.nodes)}
        self.saved_nodes = sorted(executor.saved_for_backward, key=order.__getitem__)
        self.saved_slots: list[SavedSlot] = []
        self.output_indices = [i for i, out in enumerate(joint.user_outputs) if out is not None]
        self.params_with_grad = [name for name in joint.params if name in joint.param_grads]
        backward = {node: i for i, node in enumerate(executor.backward_order)}
        # when each gradient is final in the backward: the order its reductions fill buckets
        self.gradient_ready = [
            backward.get(joint.param_grads[name], len(backward)) for name in self.params_with_grad
        ]
        self.inputs_with_grad = sorted(joint.input_grads)
        # tensors the model created while traced (``torch.tensor(...)`` in its forward): the
        # graph reads them as attributes; every rank holds them whole
        self.constants = {
            node: getattr(joint.graph_module, node.target).to(executor.device)
            for node in joint.graph.find_nodes(op="get_attr")
        }
        regions = RegionScope(mesh, dict(joint.regions)) if joint.regions else None
        if regions is not None:  # compiled code runs the region ops outside any phase
            register_running_scope(regions)
        self.forward_phase = TracedPhase(
            "forward", self._forward_program, lambda: range(len(joint.params)), regions
        )
        self.backward_phase = TracedPhase(
            "backward", self._backward_program, self._saved_parameter_positions, regions
        )
        self.inference_phase = TracedPhase("inference", self._inference_program, tuple, regions)
        self.variants: ShapeVariants | None = None  # set when planned with dynamic=True
        self.initializing = False  # inside full_value_init (runtime/init.py)

    # torch.compile guards on a constant by equality: one runtime equals only itself.
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def _saved_parameter_positions(self) -> list[int]:
        """Positions among the backward's inputs (the saved tensors first) of the saved
        parameters, their casts and views: the backward's re-gathers read these. Known once
        the forward has been traced (it lays the saved tensors out)."""
        readers = parameter_views(self.joint)
        return [
            i
            for i, slot in enumerate(self.saved_slots)
            if slot.index is None and slot.node in readers
        ]

    # ------------------------------------------------------------------ inputs

    def for_inputs(self, leaves: list[Any], spec: Any) -> _Runtime:
        """The runtime that runs these inputs: this one, or (dynamic) the one for their sizes."""
        self._check_structure(leaves, spec)
        if self.variants is not None and torch.compiler.is_compiling():
            raise InputMismatchError(
                "a module planned with dynamic=True runs eagerly only (other input sizes are traced again at "
                "run time, which torch.compile cannot follow): plan without dynamic=True to compile it"
            )
        if self.variants is not None and any(
            tuple(leaf.shape) != expected for leaf, expected in zip(leaves, self.local_input_shapes)
        ):
            return self.variants.runtime_for(leaves)  # traced for exactly these local shapes
        self.check_inputs(leaves)
        return self

    def _check_structure(self, leaves: list[Any], spec: Any) -> None:
        if spec != self.joint.in_spec:
            raise InputMismatchError(
                f"inputs have structure {spec} but the model was planned with {self.joint.in_spec}; "
                "pass the same arguments (positional/keyword) as input_fn() returned"
            )
        for index, (leaf, shape, dtype) in enumerate(
            zip(leaves, self.input_shapes, self.input_dtypes)
        ):
            if not isinstance(leaf, torch.Tensor):
                raise InputMismatchError(
                    f"input {index} must be a tensor, got {type(leaf).__name__}"
                )
            if leaf.dtype != dtype:
                raise InputMismatchError(f"input {index}: expected dtype {dtype}, got {leaf.dtype}")
            if leaf.ndim != len(shape):
                raise InputMismatchError(
                    f"input {index}: expected {len(shape)} dimensions, got shape {tuple(leaf.shape)}"
                )

    def check_inputs(self, leaves: list[Any]) -> None:
        for index, (leaf, shape, placements, expected) in enumerate(
            zip(leaves, self.input_shapes, self.plan.input_placements, self.local_input_shapes)
        ):
            if tuple(leaf.shape) != expected:
                raise InputMismatchError(
                    f"input {index}: expected local shape {expected} on this rank, got {tuple(leaf.shape)}; "
                    f"{self._explain_local(shape, placements)}"
                    + (
                        ""
                        if self.variants is not None
                        else "; plan with dynamic=True to accept other sizes"
                    )
                )

    def _explain_local(self, shape: tuple, placements: tuple) -> str:
        names = self.mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(self.mesh.ndim))
        parts = []
        for mesh_dim, placement in enumerate(placements):
            dim = getattr(placement, "dim", None)
            if dim is not None:
                size = self.mesh.shape[mesh_dim]
                parts.append(
                    f"tensor dim {dim} ({shape[dim]}) sharded over {names[mesh_dim]}={size}"
                )
        how = ", ".join(parts) if parts else "replicated: every rank gets the whole tensor"
        return f"global shape {shape} with placements {placement_str(placements)}: {how}"

    # ------------------------------------------------------------------ phase programs
    # Each program maps flat local tensors to flat local tensors; TracedPhase traces it into
    # a local graph on first use (see local_graph.py).

    def _environment(self, flat: tuple) -> dict[fx.Node, Any]:
        joint, plan, mesh = self.joint, self.plan, self.mesh
        num_params, num_buffers = len(joint.params), len(joint.buffers)
        params, buffers, inputs = (
            flat[:num_params],
            flat[num_params : num_params + num_buffers],
            flat[num_params + num_buffers :],
        )
        env: dict[fx.Node, Any] = {}
        for (name, node), local in zip(joint.params.items(), params):
            env[node] = wrap_shard(local, mesh, plan.param_placements[name], _shape(node))
        for (name, node), local in zip(joint.buffers.items(), buffers):
            env[node] = wrap_shard(local, mesh, plan.buffer_placements[name], _shape(node))
        for node, local, placements in zip(joint.user_inputs, inputs, plan.input_placements):
            env[node] = wrap_shard(local, mesh, placements, _shape(node))
        for node, constant in self.constants.items():
            env[node] = DTensor.from_local(constant, mesh, _replicate(mesh), run_check=False)
        return env

    def _outputs(self, env: dict) -> list[torch.Tensor]:
        joint, plan = self.joint, self.plan
        found = []
        for index, (output, placements) in enumerate(
            zip(joint.user_outputs, plan.output_placements)
        ):
            if output is None:
                continue
            tangent = joint.tangents.get(index)
            consumer = tangent if tangent is not None else output  # no tangent: no planned route
            found.append(self.executor.leave(env[output], consumer, "output", placements))
        return found

    def _forward_program(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        env = self._environment(flat)
        self.executor.run(env, self.executor.forward_order)
        saved, self.saved_slots = flatten_saved(env, self.saved_nodes)
        return self._outputs(env) + saved

    def _inference_program(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        env = self._environment(flat)
        self.executor.run(env, self.executor.inference_order)
        return self._outputs(env)

    def _backward_program(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        joint, plan, mesh = self.joint, self.plan, self.mesh
        num_saved = len(self.saved_slots)
        env = rebuild_saved(list(flat[:num_saved]), self.saved_slots, mesh)
        for index, grad in zip(self.output_indices, flat[num_saved:]):
            tangent = joint.tangents.get(index)
            if tangent is not None:
                env[tangent] = wrap_shard(
                    grad.contiguous(), mesh, plan.output_placements[index], _shape(tangent)
                )
        self.executor.run(env, self.executor.backward_order)
        leave = self.executor.leave
        grads = reduce_gradients(
            [env[joint.param_grads[name]] for name in self.params_with_grad],
            [
                self.executor.boundary_route(joint.params[name], "param_grad")
                for name in self.params_with_grad
            ],
            [plan.param_placements[name] for name in self.params_with_grad],
            mesh,
            self.gradient_ready,
        )
        grads += [
            leave(
                env[joint.input_grads[i]],
                joint.user_inputs[i],
                "input_grad",
                plan.input_placements[i],
            )
            for i in self.inputs_with_grad
        ]
        return grads


def _shape(node: fx.Node) -> tuple[int, ...]:
    """The traced global shape of a tensor node."""
    return tuple(node.meta["val"].shape)


internals.register_pytree_constant(_Runtime)


class _JointFunction(torch.autograd.Function):
    """The traced forward phase in ``forward``, the traced backward phase in ``backward``."""

    @staticmethod
    def forward(ctx, runtime: _Runtime, num_params: int, num_buffers: int, *flat: torch.Tensor):
        with translate_rank_loss(runtime.peers):
            results = runtime.forward_phase(*flat)
        num_outputs = len(runtime.output_indices)
        ctx.runtime = runtime
        ctx.counts = (num_params, num_buffers, len(flat) - num_params - num_buffers)
        ctx.save_for_backward(*results[num_outputs:])
        return tuple(results[:num_outputs])

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        runtime: _Runtime = ctx.runtime
        num_params, num_buffers, num_inputs = ctx.counts
        with translate_rank_loss(runtime.peers):
            grads = iter(runtime.backward_phase(*ctx.saved_tensors, *grad_outputs))
        with_grad = set(runtime.params_with_grad)
        param_grads = [next(grads) if name in with_grad else None for name in runtime.joint.params]
        inputs_with_grad = set(runtime.inputs_with_grad)
        input_grads = [next(grads) if i in inputs_with_grad else None for i in range(num_inputs)]
        return (None, None, None, *param_grads, *([None] * num_buffers), *input_grads)


# Under torch.compile, Dynamo records these two calls opaquely and AOTAutograd traces them
# (through the executor and DTensor) into the graph Inductor compiles; eagerly they are plain
# calls. The runtime passes through as a constant (identity equality).


@internals.nonstrict_trace
def _run_joint(
    runtime: _Runtime, num_params: int, num_buffers: int, *flat: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return _JointFunction.apply(runtime, num_params, num_buffers, *flat)


@internals.nonstrict_trace
def _run_inference(runtime: _Runtime, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with translate_rank_loss(runtime.peers):
        return tuple(runtime.inference_phase(*flat))


class _UnwrapParameters(torch.autograd.Function):
    """The local tensors of DTensor parameters, in ONE autograd node; its backward wraps
    each gradient in its parameter's spec. What ``to_local()`` per parameter does, without
    an autograd node and a placement normalization per tensor, paid every step."""

    @staticmethod
    def forward(ctx, *params: DTensor) -> tuple[torch.Tensor, ...]:
        ctx.specs = [internals.dtensor_spec(p) for p in params]
        # a view, so autograd's metadata lands on it and not on the parameter's own storage
        return tuple(
            internals.local_tensor_of(p).view_as(internals.local_tensor_of(p)) for p in params
        )

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[DTensor | None, ...]:
        return tuple(
            None if grad is None else internals.wrap_local(grad.contiguous(), spec)
            for grad, spec in zip(grads, ctx.specs)
        )


def _local_tensors(module: nn.Module, names: list[str], get: Any) -> list[torch.Tensor]:
    tensors = [get(name) for name in names]
    eager = not torch.compiler.is_compiling()
    for name, tensor in zip(names, tensors):  # one pass per step: both checks are cheap
        if tensor.is_meta:
            raise InitError(
                f"{name} is still on the meta device: call parallel_model.to_empty(device=...) and "
                "initialize it (init_weights() / load_state_dict(...)) before running"
            )
        if eager and isinstance(tensor, DTensor) and internals.has_wrapper_storage(tensor):
            raise data_assignment_error(name)
    batched = eager and torch.is_grad_enabled()  # Dynamo
    trained = [  # traces to_local() itself; without grad, to_local() builds no node
        i for i, t in enumerate(tensors) if batched and isinstance(t, DTensor) and t.requires_grad
    ]
    skip = set(trained)
    locals_ = [
        _local_of(t, eager) if isinstance(t, DTensor) and i not in skip else t
        for i, t in enumerate(tensors)
    ]
    if trained:
        unwrapped = _UnwrapParameters.apply(*(tensors[i] for i in trained))
        for i, local in zip(trained, unwrapped):
            locals_[i] = local
    return locals_


def _local_of(tensor: DTensor, eager: bool) -> torch.Tensor:
    """The local tensor of a DTensor no gradient flows to (a buffer, a frozen parameter):
    eagerly the tensor itself (``to_local()`` goes through DTensor's dispatch every step, for
    the same tensor); under a tracer ``to_local()``, which the tracer follows."""
    if eager and not tensor.requires_grad:
        return internals.local_tensor_of(tensor)
    return tensor.to_local()


def _parallel_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    runtime: _Runtime = self._autoparallel.for_inputs(leaves, spec)
    # one walk over the modules per step (``get_parameter`` per name walks the path again for
    # each name), and never a cached tensor: the user may assign new parameters between steps
    named_params = dict(self.named_parameters(remove_duplicate=False))
    named_buffers = dict(self.named_buffers(remove_duplicate=False))
    params = _local_tensors(self, list(runtime.joint.params), named_params.__getitem__)
    buffers = _local_tensors(self, list(runtime.joint.buffers), named_buffers.__getitem__)
    _check_devices(leaves, params + buffers)
    if torch.is_grad_enabled():
        results = list(_run_joint(runtime, len(params), len(buffers), *params, *buffers, *leaves))
    else:
        results = list(_run_inference(runtime, *params, *buffers, *leaves))
    outputs: list[Any] = [None] * len(runtime.joint.user_outputs)
    for index, value in zip(runtime.output_indices, results):
        outputs[index] = value
    return tree_unflatten(outputs, runtime.joint.out_spec)


def _check_devices(leaves: list[Any], state: list[torch.Tensor]) -> None:
    """InputMismatchError for an input on another kind of device than the module's local
    parameters and buffers (a meta input to a materialized module, a CPU one to a CUDA one)."""
    if not state:
        return
    device = state[0].device
    for index, leaf in enumerate(leaves):
        if leaf.device.type != device.type:
            raise InputMismatchError(
                f"input {index} is on {leaf.device} but the module's parameters are on "
                f"{device}; move the input there"
            )


def _load_state_dict(
    self: nn.Module, state_dict: Any, strict: bool = True, assign: bool = False
) -> Any:
    """``load_state_dict`` accepting full (unsharded) tensors as well as DTensors.

    A plain tensor loaded into a DTensor parameter or buffer is sharded on the way in: every
    rank holds the full value and keeps its own shard (no communication).
    """
    current = dict(self.state_dict(keep_vars=True))
    converted = {}
    for key, value in state_dict.items():
        target = current.get(key)
        if (
            isinstance(target, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
        ):
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"{key}: checkpoint shape {tuple(value.shape)} != model shape {tuple(target.shape)}"
                )
            value = distribute_tensor(
                value.to(device=target.device, dtype=target.dtype),
                target.device_mesh,
                target.placements,
                src_data_rank=None,
            )
        converted[key] = value
    return nn.Module.load_state_dict(self, converted, strict=strict, assign=assign)
