"""``dynamic=True``: run one plan on other input sizes without planning again.

A plan is a choice of placement per node of the traced joint graph. When a batch of another
size arrives, the model is traced again for the new *global* shapes (on meta tensors: no
memory, no communication) and the plan is carried over node by node, which is exact when:

1. the new graph has the same structure: the same nodes, in the same order, with the same
   ops and inputs (only shapes may differ). A model whose control flow depends on the batch
   size fails this check with an error naming the first node that differs;
2. every planned placement can still hold the new shapes (strategies/rules.shardable: a dim
   sharded over one mesh dim may be uneven but not leave a rank empty; one sharded over
   several must divide evenly). If a batch does not, the error names the tensor, its global
   shape, its placements and the divisor it needs.

Each input size is traced once and kept, per module, like the eager phases themselves.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Shard

from autoparallel.strategies.rules import shardable
from autoparallel.trace.export import trace_joint
from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import is_multi, placement_str
from autoparallel.types.plan import Plan

logger = logging.getLogger(__name__)


class DynamicShapeError(ValueError):
    """An input size the plan cannot run: its structure or divisibility differs."""


def meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` holding only meta tensors of the same shapes: enough to
    trace it again, without keeping the user's weights alive."""
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in memo:
            meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            memo[id(tensor)] = (
                nn.Parameter(meta, requires_grad=tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else meta
            )
    return copy.deepcopy(model, memo)


def global_shape(
    local: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Inverse of local_shape for even shards: each sharded dim times its shard count."""
    sizes = list(local)
    for mesh_size, placement in zip(mesh_shape, placements):
        if isinstance(placement, Shard):
            sizes[placement.dim % len(sizes)] *= mesh_size
    return tuple(sizes)


class ShapeVariants:
    """The runtimes of one plan for input sizes other than the planned ones."""

    def __init__(
        self,
        model: nn.Module,
        mp_policy: Any,
        planned: JointGraph,
        plan: Plan,
        mesh_shape: tuple[int, ...],
        make_runtime: Callable[[JointGraph], Any],
    ):
        self.model = meta_copy(model)
        self.mp_policy = mp_policy
        self.planned = planned
        self.plan = plan
        self.mesh_shape = mesh_shape
        self.make_runtime = make_runtime
        self.runtimes: dict[tuple, Any] = {}

    @torch.compiler.disable  # tracing again is eager work that torch.compile must not capture
    def runtime_for(self, leaves: list[torch.Tensor]) -> Any:
        key = tuple(tuple(leaf.shape) for leaf in leaves)
        if key not in self.runtimes:
            self.runtimes[key] = self.make_runtime(self._trace(leaves))
        return self.runtimes[key]

    def _trace(self, leaves: list[torch.Tensor]) -> JointGraph:
        shapes = [
            global_shape(leaf.shape, p, self.mesh_shape)
            for leaf, p in zip(leaves, self.plan.input_placements)
        ]
        described = ", ".join(
            f"{tuple(leaf.shape)} (global {shape})" for leaf, shape in zip(leaves, shapes)
        )
        logger.info("dynamic: tracing the model again for local inputs %s", described)
        dtypes = [leaf.dtype for leaf in leaves]
        spec = self.planned.in_spec

        def input_fn() -> Any:
            args, kwargs = spec.unflatten([torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)])
            return {"args": args, "kwargs": kwargs}

        joint = trace_joint(self.model, input_fn, self.planned.device, self.mp_policy)
        check_same_structure(self.planned, joint, described)
        check_divisible(joint, self.plan, self.mesh_shape, described)
        return joint


def check_same_structure(planned: JointGraph, new: JointGraph, inputs: str) -> None:
    planned_nodes, new_nodes = list(planned.graph.nodes), list(new.graph.nodes)
    for old, node in zip(planned_nodes, new_nodes):
        same = (
            old.name == node.name
            and old.op == node.op
            and old.target == node.target
            and [n.name for n in old.all_input_nodes] == [n.name for n in node.all_input_nodes]
        )
        if not same:
            raise DynamicShapeError(
                f"with inputs {inputs} the model's graph differs from the planned one at node {old.name} "
                f"({old.target} became {node.name}: {node.target}); dynamic=True needs a graph whose structure "
                "does not depend on the input sizes: plan for this size instead"
            )
    if len(planned_nodes) != len(new_nodes):
        raise DynamicShapeError(
            f"with inputs {inputs} the model's graph has {len(new_nodes)} nodes instead of {len(planned_nodes)}; "
            "dynamic=True needs a graph whose structure does not depend on the input sizes: plan for this size instead"
        )


def check_divisible(
    joint: JointGraph, plan: Plan, mesh_shape: tuple[int, ...], inputs: str
) -> None:
    """Every planned placement (outputs and required inputs) can hold the new shapes."""
    for node, placements, role in _planned_layouts(joint, plan):
        value = node.meta.get("val")
        values = value if isinstance(value, (tuple, list)) else [value]
        layouts = placements if is_multi(placements) else [placements]
        for item, layout in zip(values, layouts):
            if not isinstance(item, torch.Tensor) or layout is None:
                continue
            if not shardable(layout, item.shape, mesh_shape):
                raise DynamicShapeError(
                    _not_divisible(node.name, role, tuple(item.shape), layout, mesh_shape, inputs)
                )


def _planned_layouts(joint: JointGraph, plan: Plan) -> list[tuple[fx.Node, Any, str]]:
    nodes = {node.name: node for node in joint.graph.nodes}
    layouts: list[tuple[fx.Node, Any, str]] = []
    for index, node in enumerate(joint.user_inputs):
        layouts.append((node, plan.input_placements[index], f"input {index}"))
    for name, node_plan in plan.nodes.items():
        node = nodes.get(name)
        if node is None or node.op != "call_function":
            continue
        layouts.append((node, node_plan.strategy.output, "output"))
        for argument in node_plan.arguments:
            producer = nodes.get(argument.producer)
            if argument.kind == "arg" and producer is not None and not is_multi(argument.dst):
                layouts.append((producer, argument.dst, f"as input of {name}"))
    return layouts


def _not_divisible(
    name: str, role: str, shape: tuple, placements: Any, mesh_shape: tuple, inputs: str
) -> str:
    divisors, splits = [1] * len(shape), [0] * len(shape)
    for mesh_size, placement in zip(mesh_shape, placements):
        if isinstance(placement, Shard):
            divisors[placement.dim % len(shape)] *= mesh_size
            splits[placement.dim % len(shape)] += 1
    bad = [
        d
        for d, (size, div) in enumerate(zip(shape, divisors))
        if splits[d] and not shardable(tuple(placements), shape, mesh_shape) and size % div
    ]
    needs = "; ".join(
        f"dim {d} is {shape[d]}, not a multiple of {divisors[d]}"
        if splits[d] > 1
        else f"dim {d} is {shape[d]}, which leaves a rank of {divisors[d]} without a piece"
        for d in bad
    )
    return (
        f"inputs {inputs} do not divide as the plan requires: {name} ({role}) has global shape {shape} "
        f"laid out {placement_str(tuple(placements))}: {needs}. Use sizes whose global dims are multiples of "
        f"{math.lcm(*[divisors[d] for d in bad])} there, or plan for this size"
    )
