"""Every private PyTorch API autoparallel relies on, wrapped in one place.

Why private APIs at all: the joint forward+backward export with input/output descriptors
(AOTAutograd) and DTensor's per-op sharding strategy registry have no public equivalent in
torch 2.13, yet they are exactly the foundation this library is meant to build on rather than
re-implement. Keeping every such import in this file means a torch upgrade that moves them
breaks one file, not twenty.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor._api import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh

__all__ = [
    "DTensorSpec",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "TensorMeta",
    "TupleStrategy",
    "new_fake_mode",
    "export_joint",
    "describe_input",
    "describe_output",
    "dtensor_strategy_function",
    "nonstrict_trace",
    "register_pytree_constant",
    "lookup_compile_backend",
]


# ---------------------------------------------------------------------------- tracing


def new_fake_mode(allow_non_fake_inputs: bool = False) -> FakeTensorMode:
    """A fresh fake mode per session: no state is shared between two planning sessions."""
    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def export_joint(stack: contextlib.ExitStack, model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Joint forward+backward export; the returned object has ``graph_module`` and ``out_spec``."""
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


def dtensor_strategy_function(op: torch._ops.OpOverload, mesh: Any, output_meta: Any) -> Callable[[OpSchema], Any] | None:
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


def schema_info(op: torch._ops.OpOverload) -> Any:
    propagator = DTensor._op_dispatcher.sharding_propagator
    return propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)


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
