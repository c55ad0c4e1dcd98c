"""Mixed precision (torch's ``MixedPrecisionPolicy``) expressed in the traced graph.

FSDP2's contract, which we follow: parameters are *stored* in their own dtype (usually
float32), *computed* in ``param_dtype``, and gradients are *reduced* across ranks in
``reduce_dtype`` (``None``: in ``param_dtype``), then kept in the parameter's dtype.
``output_dtype`` casts floating outputs; ``cast_forward_inputs`` casts floating inputs to
``param_dtype``.

Rather than teaching every later stage about precision, the model is traced through
:class:`MixedPrecisionModule`, which casts each parameter on its way into the forward. The
casts are ordinary ``_to_copy`` nodes of the joint graph, so:

* the planner prices every tensor at its real dtype: it is cheaper to cast a shard and
  all-gather ``param_dtype`` bytes than the reverse, and the solver finds that by itself;
* the backward of the cast converts the gradient to ``reduce_dtype`` and then to the
  parameter's dtype, again as graph nodes.

One thing the cost model alone would get wrong: summing the pending (``Partial``) gradient
is cheapest *before* the cast to ``reduce_dtype``, in the narrow dtype, which would change
the numerics the user asked for. :func:`reduction_dtype_constraints` therefore forbids any
reduction on the edges of each parameter gradient's cast/view chain that still carry a dtype
other than ``reduce_dtype``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.func import functional_call

from autoparallel._torch_internals import tree_map
from autoparallel.graph.view_ops import passes_gradient_through
from autoparallel.types.graph import JointGraph

aten = torch.ops.aten

WRAPPED_PREFIX = "module."
"""Parameter names inside :class:`MixedPrecisionModule` carry this prefix; trace strips it."""


def check_policy(mp_policy: Any) -> MixedPrecisionPolicy | None:
    """The policy, validated; None when there is nothing to do."""
    if mp_policy is None:
        return None
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...), "
            f"got {type(mp_policy).__name__}"
        )
    for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field_name)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"mp_policy.{field_name} must be a floating dtype, got {dtype}")
    if (
        mp_policy.param_dtype is None
        and mp_policy.reduce_dtype is None
        and mp_policy.output_dtype is None
    ):
        return None
    return mp_policy


class _CastForCompute(torch.autograd.Function):
    """``param.to(param_dtype)`` whose backward reduces in ``reduce_dtype`` (see module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        param: torch.Tensor,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        ctx.param_dtype = param.dtype
        ctx.reduce_dtype = reduce_dtype
        if param_dtype is None or param_dtype == param.dtype:
            return param.view_as(param)
        return param.to(param_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.reduce_dtype is not None:
            grad = grad.to(ctx.reduce_dtype)
        return grad.to(ctx.param_dtype), None, None


class MixedPrecisionModule(nn.Module):
    """``module`` run under ``policy``: what is traced, and a single-process reference.

    Its parameters are ``module``'s own (named ``module.<name>``); ``forward`` casts them
    with :class:`_CastForCompute`, casts floating inputs when ``cast_forward_inputs`` and
    floating outputs to ``output_dtype``.
    """

    def __init__(self, module: nn.Module, policy: MixedPrecisionPolicy):
        super().__init__()
        self.module = module
        self.policy = policy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy
        # named_parameters() lists a tied tensor once; functional_call reuses it for every name.
        cast = {
            name: _CastForCompute.apply(param, policy.param_dtype, policy.reduce_dtype)
            for name, param in self.module.named_parameters()
        }
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = tree_map(lambda x: _cast_floating(x, policy.param_dtype), (args, kwargs))
        output = functional_call(self.module, cast, args, kwargs)
        if policy.output_dtype is not None:
            output = tree_map(lambda x: _cast_floating(x, policy.output_dtype), output)
        return output


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


# ---------------------------------------------------------------------------- planning


def place_casts_in_their_layers(joint: JointGraph) -> int:
    """Move the policy's casts of parameters and of their gradients next to the ops that
    read or compute them; returns how many nodes moved.

    :class:`MixedPrecisionModule` casts every parameter before the model's forward starts,
    and autograd runs those casts' backward last (they were recorded first), so the traced
    graph opens with a cast per parameter of the whole model and ends with a cast per
    parameter gradient. Run in that order, every layer's ``param_dtype`` copy would be
    alive from the first op on and every gradient would wait for the end of the backward
    to be reduced; and the graph would not repeat layer by layer (a layer's ops read casts
    that sit in the prefix), which keeps the planner from folding identical layers. Placed
    where they are used, as FSDP2 runs them, each layer's graph holds its own casts. A
    cast reads one value, so any position after that value and before its first reader
    computes the same result."""
    return _sink_parameter_casts(joint) + _hoist_gradient_casts(joint)


def _sink_parameter_casts(joint: JointGraph) -> int:
    """Each parameter's forward cast just before the first op that reads it."""
    casts = [node for node in joint.parameter_sources() if node.op == "call_function"]
    position = {node: index for index, node in enumerate(joint.graph.nodes)}
    moved = 0
    for cast in casts:
        if not cast.users:
            continue
        first_reader = min(cast.users, key=position.__getitem__)
        if cast.next is not first_reader:
            first_reader.prepend(cast)
            moved += 1
    return moved


def _hoist_gradient_casts(joint: JointGraph) -> int:
    """Each parameter gradient's chain of casts and views just after the op computing it."""
    moved = 0
    for gradient in joint.param_grads.values():
        chain = []
        node = gradient
        while passes_gradient_through(node) and len(node.all_input_nodes) == 1:
            chain.append(node)
            node = node.all_input_nodes[0]
        for link in reversed(chain):  # from the computing op outwards
            computed = link.all_input_nodes[0]
            if computed.next is not link:
                computed.append(link)
                moved += 1
    return moved
