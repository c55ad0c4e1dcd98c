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
from torch.utils._pytree import tree_map

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
