"""Run the planned joint graph on one rank: DTensors in, the plan's collectives in between.

The joint graph is evaluated in two phases. The *forward phase* evaluates every node that
does not depend on a tangent and keeps the values the backward will read; the *backward
phase* evaluates the rest from those values and the incoming gradients.

Each node is evaluated on DTensors carrying the planned placements:

1. every tensor argument is redistributed from its producer's placement to the placement
   the chosen strategy requires (``DTensor.redistribute``: all-gather, all-reduce,
   reduce-scatter or all-to-all through torch's functional collectives);
2. the op runs: through DTensor's dispatch for ops DTensor knows (it rewrites shape
   arguments of views to local sizes), or directly on the local shards for ops our own rules
   or the replicate fallback cover (their strategies are local by construction);
3. if DTensor produced a placement other than the planned one, it is redistributed to the
   plan, so downstream nodes always see what the solver priced.

A redistribution returns a fresh tensor laid out in its logical order, and a result wrapped
from a local tensor gets global strides derived from the local layout, so the strides an op
sees at run time may differ from the trace: a ``view`` that was legal on the traced strides
(a transposed attention output) may not be on a gathered copy. The graph is functional (no
op writes through an alias), so a ``view`` whose input is not contiguous at run time gets a
contiguous copy of it (what ``reshape`` would do; DTensor runs ``reshape`` as a local view).
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from autoparallel import _torch_internals as internals
from autoparallel._torch_internals import tree_map
from autoparallel.graph.fill_ops import fill_value, is_fill
from autoparallel.graph.fx_args import tensor_input_nodes
from autoparallel.graph.layers import forward_layers, layer_members, layer_recompute
from autoparallel.runtime.param_gathers import Gather, GatherPlan, ParameterGathers, plan_gather
from autoparallel.runtime.shards import contiguous_strides, wrap_shard
from autoparallel.runtime.vocab_lookup import held_rows, masks_ids, plain_partials, unmasked_ids
from autoparallel.trace.sharding_constraint import sharding_constraint_op
from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import is_multi
from autoparallel.types.plan import Plan
from autoparallel.types.tensors import local_shape_at

logger = logging.getLogger(__name__)
aten = torch.ops.aten

_STRIDED_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
"""Views that need their input's strides to allow them (see the module doc)."""


@dataclass
class NodeProgram:
    """What one node needs at run time, precomputed from the plan."""

    node: fx.Node
    input_placements: dict[int, Any]  # slot -> required placements
    output_placements: Any
    run_locally: bool
    input_routes: dict[int, tuple] = field(default_factory=dict)  # slot -> placements in between
    fill: bool = False  # made as this rank's piece directly (graph/fill_ops.py)
    local_op: Callable[..., torch.Tensor] | None = None  # run instead of the node's target


class JointExecutor:
    """Evaluates the forward and backward phases of a planned joint graph on one rank."""

    def __init__(
        self,
        joint: JointGraph,
        plan: Plan,
        mesh: DeviceMesh,
        local_sources: set[str],
        device: torch.device,
    ):
        self.joint = joint
        self.plan = plan
        self.mesh = mesh
        self.device = device
        graph = joint.graph
        self.programs: dict[fx.Node, NodeProgram] = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.name not in plan.nodes:
                continue
            self.programs[node] = self._program(node, node.name in local_sources)
        # routes of the boundary edges (gradients into their parameter/input, outputs into
        # their tangent), read once here rather than on every call
        self.boundary_routes = {
            (name, a.kind): tuple(plain_partials(step) for step in a.route)
            for name, node_plan in plan.nodes.items()
            for a in node_plan.arguments
            if a.kind != "arg" and a.route
        }
        self.forward_order = [
            n for n in graph.nodes if n in joint.forward_nodes and n in self.programs
        ]
        self.backward_order = [
            n for n in graph.nodes if n not in joint.forward_nodes and n in self.programs
        ]
        backward_set = set(self.backward_order)
        # forward values the backward phase reads: the "saved activations"
        self.saved_for_backward = {
            inp for n in self.backward_order for inp in n.all_input_nodes if inp not in backward_set
        } | {
            g
            for g in list(joint.param_grads.values()) + list(joint.input_grads.values())
            if g not in backward_set
        }
        self.saved_for_backward -= set(joint.tangents.values())
        self._recompute(plan.recompute)
        self.inference_order = self._needed_for_outputs()
        self.gather_plans = {
            id(order): self._plan_gathers(order)
            for order in (self.forward_order, self.backward_order, self.inference_order)
        }

    def _program(self, node: fx.Node, run_locally: bool) -> NodeProgram:
        """``node``'s placements as the executor runs them: a ``_MaskPartial`` is the plain
        Partial it is once masked, and a vocabulary-parallel lookup runs on local pieces
        with its ids replicated (runtime/vocab_lookup.py)."""
        node_plan = self.plan.nodes[node.name]
        arguments = [a for a in node_plan.arguments if a.kind == "arg"]
        slots = {a.slot: plain_partials(a.dst) for a in arguments}
        routes = {a.slot: tuple(plain_partials(s) for s in a.route) for a in arguments if a.route}
        local_op = None
        ids = next((a for a in arguments if a.slot == 1), None)
        if node.target is aten.embedding.default and ids is not None and masks_ids(ids.dst):
            slots[1] = unmasked_ids(ids.dst)
            routes[1] = tuple(unmasked_ids(step) for step in ids.route)
            coordinate = self.mesh.get_coordinate()
            local_op = held_rows(node, slots[0], tuple(self.mesh.shape), coordinate)
            run_locally = True
        output = plain_partials(node_plan.strategy.output)
        return NodeProgram(
            node,
            slots,
            output,
            run_locally,
            routes,
            fill=is_fill(node) and not is_multi(output),
            local_op=local_op,
        )

    def _recompute(self, layers: Sequence[str]) -> None:
        """Move each of ``layers``' forward regions into the backward (graph/layers.py):
        its ops run again just before the first backward op that reads one of their values,
        and the forward saves the region's inputs instead of those values."""
        if not layers:
            return
        labels = forward_layers(self.joint)
        members = layer_members(labels)
        regions = tuple(
            layer_recompute(self.joint, labels, layer, self.saved_for_backward, members)
            for layer in layers
        )
        inserted: dict[int, list[fx.Node]] = {}
        for region in regions:
            first = next(
                index
                for index, node in enumerate(self.backward_order)
                if any(a in region.dropped for a in node.all_input_nodes)
            )
            inserted.setdefault(first, []).extend(n for n in region.nodes if n in self.programs)
            self.saved_for_backward -= region.dropped
            self.saved_for_backward |= region.inputs - set(self.joint.tangents.values())
        order: list[fx.Node] = []
        for index, node in enumerate(self.backward_order):
            order.extend(inserted.get(index, ()))
            order.append(node)
        self.backward_order = order

    def _plan_gathers(self, order: Sequence[fx.Node]) -> GatherPlan:
        """Which parameter reads of ``order`` are gathered a layer at a time (param_gathers.py):
        reads of a parameter or of its mixed-precision cast. A group is gathered at its first
        read, so a member whose value this phase computes only later is left to itself."""
        sources = self.joint.parameter_sources()
        position = {node: index for index, node in enumerate(order)}
        mesh_shape = tuple(self.mesh.shape)
        reads: list[tuple[tuple, Gather, int]] = []
        for index, node in enumerate(order):
            program = self.programs[node]
            for slot, producer in enumerate(tensor_input_nodes(node)):
                wanted = program.input_placements.get(slot)
                name = sources.get(producer)
                if (
                    name is None
                    or wanted is None
                    or is_multi(wanted)
                    or program.input_routes.get(slot)
                ):
                    continue
                value = producer.meta["val"]
                group = plan_gather(
                    name,
                    tuple(self._placement_of(producer, name)),
                    tuple(wanted),
                    tuple(value.shape),
                    value.dtype,
                    mesh_shape,
                )
                if group is not None:
                    reads.append(((producer, tuple(wanted)), group, index))
        first_read: dict[Gather, int] = {}
        for _, group, index in reads:
            first_read.setdefault(group, index)
        ready = [
            (key, group)
            for key, group, _ in reads
            if position.get(key[0], -1) < first_read[group]  # computed before, or saved
        ]
        return GatherPlan.of_reads(ready)

    def _placement_of(self, node: fx.Node, name: str) -> tuple:
        if node.op == "placeholder":
            return tuple(self.plan.param_placements[name])
        return tuple(self.plan.nodes[node.name].strategy.output)

    def _needed_for_outputs(self) -> list[fx.Node]:
        needed: set[fx.Node] = set()
        stack = [o for o in self.joint.user_outputs if o is not None]
        while stack:
            node = stack.pop()
            if node in needed:
                continue
            needed.add(node)
            stack.extend(node.all_input_nodes)
        return [n for n in self.forward_order if n in needed]

    # ------------------------------------------------------------------ phases

    def run(self, env: dict[fx.Node, Any], order: Sequence[fx.Node]) -> None:
        plan = self.gather_plans.get(id(order))
        gathers = ParameterGathers(plan, self.mesh) if plan is not None and plan.group_of else None
        for node in order:
            env[node] = self._evaluate(self.programs[node], env, gathers)

    def leave(
        self, value: DTensor, consumer: fx.Node, kind: str, placements: Sequence
    ) -> torch.Tensor:
        """The local tensor of ``value`` once it has followed the planned boundary route
        (``kind`` "param_grad", "input_grad" or "output") into ``consumer``'s placements."""
        return redistribute_along(value, self.boundary_route(consumer, kind), placements).to_local()

    def boundary_route(self, consumer: fx.Node, kind: str) -> tuple:
        """The placements in between of the planned boundary move into ``consumer``."""
        return self.boundary_routes.get((consumer.name, kind), ())

    def _evaluate(
        self, program: NodeProgram, env: dict[fx.Node, Any], gathers: ParameterGathers | None = None
    ) -> Any:
        node = program.node
        if node.target is operator.getitem:
            producer, index = node.args
            return env[producer][index]
        if program.fill:
            return self._filled(node, program.output_placements)
        slot_counter = itertools.count()  # tensor inputs in flatten order = plan slots

        def prepare(arg: Any) -> Any:
            if not isinstance(arg, fx.Node):
                return arg
            slot = next(slot_counter)
            value = env[arg]
            wanted = program.input_placements.get(slot)
            if gathers is not None and wanted is not None and not is_multi(wanted):
                gathered = gathers.take(arg, tuple(wanted), env)
                value = value if gathered is None else gathered
            if isinstance(value, DTensor) and wanted is not None and not is_multi(wanted):
                value = redistribute_along(value, program.input_routes.get(slot, ()), wanted)
            return value.to_local() if program.run_locally and isinstance(value, DTensor) else value

        args = tree_map(prepare, node.args)
        kwargs = tree_map(prepare, dict(node.kwargs))
        traced = node.meta.get("val")
        if node.target is sharding_constraint_op:  # an identity: its input is already in place
            return self._conform(args[0], program.output_placements, traced)
        if "device" in kwargs:
            kwargs["device"] = self.device
        if node.target in _STRIDED_VIEWS:
            args = (_contiguous(args[0]), *args[1:])
        result = (program.local_op or node.target)(*args, **kwargs)
        return self._conform(result, program.output_placements, traced)

    def _filled(self, node: fx.Node, planned: Sequence) -> DTensor:
        """A fill op's output (graph/fill_ops.py) as this rank's piece of the planned
        placements, made here: no input is read or redistributed. Shard/Replicate only: a
        Partial piece of ones would not sum to ones."""
        if any(isinstance(p, Partial) for p in planned):
            raise ValueError(f"{node.name}: a fill op's output cannot be {tuple(planned)}")
        traced = node.meta["val"]
        coordinate = self.mesh.get_coordinate()
        shape = local_shape_at(traced.shape, planned, self.mesh.shape, coordinate)
        local = torch.empty(shape, dtype=traced.dtype, device=self.device)
        value = fill_value(node)
        if value is not None:
            local.fill_(value)
        return wrap_shard(local, self.mesh, planned, traced.shape)

    def _conform(self, result: Any, planned: Any, traced: Any) -> Any:
        """Bring an op's result to the planned placement(s); a local result becomes this
        rank's piece of the traced global value (``traced``: the node's meta value)."""
        if isinstance(result, (tuple, list)):
            multi = planned if is_multi(planned) else [planned] * len(result)
            values = traced if isinstance(traced, (tuple, list)) else [None] * len(result)
            return type(result)(self._conform(*item) for item in zip(result, multi, values))
        if not isinstance(result, torch.Tensor) or planned is None:
            return result
        if isinstance(result, DTensor):
            return redistribute(result, planned)
        if not isinstance(traced, torch.Tensor):
            return DTensor.from_local(result, self.mesh, planned, run_check=False)
        return wrap_shard(result, self.mesh, planned, traced.shape)


def _contiguous(value: Any) -> Any:
    """``value`` laid out contiguously, locally and in its global strides.

    A DTensor's own ``contiguous()`` reads the global strides it was built with, not its
    local tensor's; and DTensor checks a ``view`` against those global strides, which for a
    result wrapped from a local tensor (``from_local``) are derived from the local layout
    and may not be the traced ones. Either way the traced view needs the logical order."""
    if not isinstance(value, DTensor):
        return value.contiguous()
    local = internals.local_tensor_of(value)
    strides = contiguous_strides(tuple(value.shape))
    if local.is_contiguous() and tuple(value.stride()) == strides:  # no traced op for the check
        return value
    return DTensor.from_local(
        value.to_local().contiguous(),
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=strides,
    )


def redistribute_along(value: DTensor, route: Sequence, placements: Sequence) -> DTensor:
    """Redistribute through the planned intermediate placements (each step changes one mesh
    dim, so each is one collective), then to ``placements``: the route the cost model priced.
    Skipped when the value already has the target placements."""
    if tuple(value.placements) == tuple(placements):
        return value
    for step in route:
        value = redistribute(value, step)
    return redistribute(value, placements)


def redistribute(value: DTensor, placements: Sequence) -> DTensor:
    """DTensor.redistribute, plus Replicate -> Partial, which DTensor keeps internal.

    The planner prices Replicate -> Partial(sum) as free: the rank at coordinate 0 of that
    mesh dimension keeps the value and the others hold zeros, so the pending sum is exact.
    """
    placements = tuple(placements)
    if tuple(value.placements) == placements:
        return value
    to_partial = [
        dim
        for dim, (src, dst) in enumerate(zip(value.placements, placements))
        if isinstance(dst, Partial) and not isinstance(src, Partial)
    ]
    if not to_partial:
        return value.redistribute(value.device_mesh, placements)
    mesh = value.device_mesh
    staging = tuple(Replicate() if dim in to_partial else p for dim, p in enumerate(placements))
    local = redistribute(value, staging).to_local()
    coordinate = mesh.get_coordinate()
    if any(coordinate[dim] != 0 for dim in to_partial):
        local = torch.zeros_like(local)
    return wrap_shard(local, mesh, placements, value.shape)
