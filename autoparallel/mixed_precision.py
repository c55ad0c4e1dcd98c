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

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial
from torch.func import functional_call
from torch.utils._pytree import tree_map

from autoparallel.solver.problem import Problem, Row, UserConstraint
from autoparallel.strategies.types import is_multi

aten = torch.ops.aten

WRAPPED_PREFIX = "module."
"""Parameter names inside :class:`MixedPrecisionModule` carry this prefix; trace strips it."""

# Ops a gradient passes through unchanged in value between the op that produced it and the
# parameter-gradient output: layout changes and dtype casts.
_CHAIN_OPS = {
    aten._to_copy.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.alias.default,
    aten.detach.default,
    aten.clone.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
}


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
    if mp_policy.param_dtype is None and mp_policy.reduce_dtype is None and mp_policy.output_dtype is None:
        return None
    return mp_policy


class _CastForCompute(torch.autograd.Function):
    """``param.to(param_dtype)`` whose backward reduces in ``reduce_dtype`` (see module doc)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> torch.Tensor:
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


def gradient_chain_edges(grad_node: fx.Node, reduce_dtype: torch.dtype) -> list[fx.Node]:
    """Consumers whose (single) input edge must not reduce, walking back from ``grad_node``.

    From the parameter-gradient output back through casts and layout ops, every edge whose
    tensor is not yet in ``reduce_dtype`` belongs to the un-reduced part of the gradient.
    The walk stops at the op that computed the gradient (a matmul, a sum, ...).
    """
    consumers: list[fx.Node] = []
    node = grad_node
    while node.op == "call_function" and node.target in _CHAIN_OPS:
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            break
        producer = inputs[0]
        value = producer.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype != reduce_dtype:
            consumers.append(node)
        if len(producer.users) != 1:
            break
        node = producer
    return consumers


def reduction_dtype_constraints(problem: Problem, policy: MixedPrecisionPolicy) -> list[UserConstraint]:
    """Keep each parameter gradient unreduced until it is in ``reduce_dtype``.

    On each edge of :func:`gradient_chain_edges`, the placement pairs that would reduce
    (``Partial`` on a mesh dim at the producer, not at the consumer) are forbidden: one row
    holding their pair variables at zero, which the solver's presolve removes outright.
    Returns one named constraint per parameter; none when the policy does not change the
    reduction dtype.
    """
    if policy.reduce_dtype is None or policy.param_dtype is None or policy.reduce_dtype == policy.param_dtype:
        return []
    index_of = {id(edge): index for index, edge in enumerate(problem.tables.edges)}
    constraints = []
    for name, grad_node in problem.joint.param_grads.items():
        forbidden = [
            _reducing_columns(problem, index_of[id(edge)])
            for consumer in gradient_chain_edges(grad_node, policy.reduce_dtype)
            for edge in problem.tables.incoming.get(consumer, [])
            if edge.kind == "arg"
        ]
        columns = np.concatenate(forbidden) if forbidden else np.zeros(0, dtype=np.int64)
        if len(columns):
            row = Row(columns.astype(np.int64), np.ones(len(columns)), 0.0, 0.0)
            description = f"gradient of {name} reduced in {policy.reduce_dtype}"
            constraints.append(UserConstraint(f"mixed_precision:{name}", description, [row]))
    return constraints


def _reducing_columns(problem: Problem, edge_index: int) -> np.ndarray:
    """Columns of an edge (placement pairs or route steps) that sum a Partial placement."""
    reducing = [
        move.column
        for move in problem.edge_moves(edge_index)
        if any(_partial_at(move.src, d) and not _partial_at(move.dst, d) for d in range(len(move.src or ())))
    ]
    return np.array(reducing, dtype=np.int64)


def _partial_at(placements: Any, mesh_dim: int) -> bool:
    if placements is None or is_multi(placements):
        return False
    return isinstance(placements[mesh_dim], Partial)
