"""The joint forward+backward export (AOTAutograd with input/output descriptors), fake
tensors, pytree and op overloads: what the trace stage and every reader of its graph use.

torch 2.13 has no public module for pytrees (``torch.utils._pytree`` is the one DTensor and
export use) nor a public name for the class of an ATen op overload.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._export.utils import _compiling_state_context
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import (
    DataDependentOutputException as _DataDependentOutputException,
)
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException as _DynamicOutputShapeException,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode as _GuardOnDataDependentSymNode,
)
from torch.utils._pytree import TreeSpec, register_constant, tree_flatten, tree_map, tree_unflatten

__all__ = [
    "DATA_DEPENDENT_SHAPE_ERRORS",
    "DATA_DEPENDENT_VALUE_ERRORS",
    "OpOverload",
    "TreeSpec",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]

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
    of its own); a plain GraphModule generates its code on construction, in time that grows
    with its node count, wasted on a graph nobody calls. torch's lazy subclass is private."""
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


def register_pytree_constant(cls: type) -> None:
    """Let instances of ``cls`` pass through :func:`~autoparallel._torch_internals.runtime.nonstrict_trace` as constants."""
    register_constant(cls)
