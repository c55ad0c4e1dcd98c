"""The plan JSON's sections that read the traced graph, and :func:`get_json`, the whole document.

:func:`get_json` is the one place that turns a (Problem, Plan) pair into the plan JSON (schema
in :mod:`autoparallel.files.plan_json`, which writes the sections a Plan alone gives and reads
a file back). What needs the Problem is here: which module each node belongs to, what
collective each redistribution is (:func:`collective_kind`), the bytes each parameter holds
per device, the shapes of the inputs and outputs, the cost per module and the ``local_map``
regions.

``module`` of a parameter is the module holding it (``layers.0.attention.wq``). ``module``
of a node, a collective and a ``layers`` row is an *attribution*: the traced graph carries
no module-stack metadata, so each node is attributed to a module by the parameters near it
(:func:`node_modules`), at the granularity of :func:`module_of_parameter`
(``layers.0.attention``); the per-layer costs are sums over the nodes so attributed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel.cost.regions import region_cost_parts_us
from autoparallel.cost.topology import Topology
from autoparallel.files.plan_json import hardware_json, json_float, node_rows, plan_json
from autoparallel.regions.layouts import declared_str
from autoparallel.regions.local_map import region_backward_op
from autoparallel.strategies.regions import layout_strategy
from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import OutputPlacements, is_multi, placement_str
from autoparallel.types.plan import ArgumentCost, NodePlan, Plan
from autoparallel.types.problem import Problem
from autoparallel.types.tensors import local_shape

__all__ = [
    "collective_kind",
    "get_json",
    "module_of_parameter",
    "node_modules",
    "owner_of_parameter",
]


# ---------------------------------------------------------------------------- modules


def owner_of_parameter(fqn: str) -> str:
    """The module holding a parameter: ``layers.0.attention.wq.weight`` -> ``layers.0.attention.wq``
    (``""`` for a parameter of the root module)."""
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def module_of_parameter(fqn: str) -> str:
    """The module a parameter is attributed to: the parent of the module that owns it.

    ``layers.0.attention.wq.weight`` is owned by ``layers.0.attention.wq`` and attributed to
    ``layers.0.attention``: one level up groups a layer's projections together. The parent
    is not taken when it would be the root (``output.weight`` -> ``output``, MLP
    ``w1.weight`` -> ``w1``) or when the owner is an entry of a container
    (``blocks.3.weight`` -> ``blocks.3``). A parameter of the root itself gives ``""``.
    """
    owner = owner_of_parameter(fqn).split(".")
    if len(owner) >= 2 and not owner[-1].isdigit():
        owner = owner[:-1]
    return ".".join(owner)


def _common_prefix(a: str, b: str) -> str:
    """Longest common dotted prefix: ``layers.0.attention`` and ``layers.0.feed_forward``
    -> ``layers.0``."""
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


@dataclass(frozen=True)
class _Nearest:
    """The parameters nearest to a node: the graph position where they meet its chain
    (``distance`` is that position's distance from the node) and their common module."""

    distance: float
    module: str

    def merged(self, other: _Nearest) -> _Nearest:
        if other.distance < self.distance:
            return other
        if other.distance > self.distance:
            return self
        return _Nearest(self.distance, _common_prefix(self.module, other.module))


_NONE = _Nearest(math.inf, "")


def node_modules(joint: JointGraph) -> dict[str, str]:
    """Node name -> the module it most likely belongs to (``""`` when none).

    The graph has no module stack, so nodes are attributed by the parameters near them,
    with graph distance measured in graph (execution) order, which the FX graph follows:

    * a parameter placeholder belongs to :func:`module_of_parameter` of its name;
    * a forward node belongs to the module of the parameters that entered its ancestry
      *last*: a parameter enters at the node that consumes the placeholder. So the residual
      stream after layer 5 is layer 5's (not the embedding's, which is fewer edges away but
      entered long before), and a matmul is its weight's;
    * a backward node belongs to the module of the parameter gradient it reaches *first*
      (the nearest gradient output among its descendants). Its ancestors are the wrong
      place to look in the backward: the incoming gradient has passed through every later
      layer, while the next gradient produced downstream is its own layer's. A backward
      node that reaches no parameter gradient falls back to the forward rule;
    * nodes reached by several parameters at the same position get their modules' longest
      common dotted prefix (``layers.0`` for ``layers.0.attention`` and ``layers.0.ffn``).

    Cost: two passes over the graph (one forward, one reversed), one memo entry per node.
    """
    position = {node: index for index, node in enumerate(joint.graph.nodes)}
    entered = _last_entered(joint, position)
    reached = _first_gradient(joint, position)
    modules = {}
    for node, nearest in entered.items():
        if node.op == "call_function" and node not in joint.forward_nodes and node in reached:
            nearest = reached[node]
        modules[node.name] = nearest.module
    return modules


def _last_entered(joint: JointGraph, position: dict[fx.Node, int]) -> dict[fx.Node, _Nearest]:
    """Per node, the parameters that entered its ancestry last (distance = -position)."""
    param_of = joint.param_name_of()
    found: dict[fx.Node, _Nearest] = {}
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            found[node] = (
                _Nearest(-1, module_of_parameter(param_of[node])) if node in param_of else _NONE
            )
            continue
        if node.op != "call_function":
            continue
        nearest = _NONE
        for producer in node.all_input_nodes:
            if producer in param_of:
                nearest = nearest.merged(_Nearest(-position[node], found[producer].module))
            else:
                nearest = nearest.merged(found.get(producer, _NONE))
        found[node] = nearest
    return found


def _first_gradient(joint: JointGraph, position: dict[fx.Node, int]) -> dict[fx.Node, _Nearest]:
    """Per backward node, the parameter gradient produced first among it and its
    descendants (distance = that gradient's position); nodes reaching none are absent."""
    grad_of: dict[fx.Node, _Nearest] = {}
    for name, grad in joint.param_grads.items():
        mine = _Nearest(position[grad], module_of_parameter(name))
        grad_of[grad] = grad_of[grad].merged(mine) if grad in grad_of else mine
    found: dict[fx.Node, _Nearest] = {}
    for node in reversed(joint.graph.nodes):
        if node.op != "call_function" or node in joint.forward_nodes:
            continue
        nearest = grad_of.get(node, _NONE)
        for user in node.users:
            nearest = nearest.merged(found.get(user, _NONE))
        if not math.isinf(nearest.distance):
            found[node] = nearest
    return found


# ---------------------------------------------------------------------------- collectives


def _placement_kind(src: Placement, dst: Placement) -> str:
    """Name the step that turns ``src`` into ``dst`` on one mesh dim."""
    if isinstance(dst, Replicate):
        if isinstance(src, Partial):
            return "all_reduce"
        return "all_gather"
    if isinstance(dst, Partial):
        return "local" if isinstance(src, Replicate) else "impossible"
    if isinstance(src, Replicate):
        return "local"
    if isinstance(src, Partial):
        return "reduce_scatter"
    # strided shards (FSDP+TP) are shard-like without subclassing Shard in some torch versions
    return "all_to_all" if isinstance(src, Shard) or "Shard" in type(src).__name__ else "unknown"


def collective_kind(
    src: OutputPlacements, dst: OutputPlacements, route: tuple[OutputPlacements, ...] = ()
) -> tuple[str, list[int]]:
    """(kind, changed mesh dims) of a redistribution, e.g. ``("all_gather+local", [0, 1])``.

    Per changed mesh dim: S->R ``all_gather``, P->R ``all_reduce``, P->S ``reduce_scatter``,
    S(a)->S(b) ``all_to_all``, R->S and R->P ``local`` (no communication); several changed
    dims list one kind per dim, in mesh-dim order, joined by ``+``. Multi-output values are
    never redistributed as a whole: ``("none", [])``. With a ``route`` (the placements
    visited in between), one kind per step, in execution order.
    """
    if is_multi(src) or is_multi(dst):
        return "none", []
    states = [src, *route, dst]
    kinds, dims = [], []
    for before, after in zip(states, states[1:]):
        for d, (s, t) in enumerate(zip(before, after)):
            if s != t:
                kinds.append(_placement_kind(s, t))
                dims.append(d)
    return "+".join(kinds) or "none", dims


def _collective_phase(consumer: NodePlan, arg: ArgumentCost) -> str:
    """Gradients reach their parameter/input at the end of the backward; a user output
    leaves at the end of the forward; everything else runs where its consumer runs."""
    if arg.kind in ("param_grad", "input_grad"):
        return "backward"
    if arg.kind == "output":
        return "forward"
    return consumer.phase


def _collective_module(consumer: NodePlan, arg: ArgumentCost, modules: dict[str, str]) -> str:
    if arg.kind == "output":
        return modules.get(arg.producer, "")
    return modules.get(consumer.name, "")


def _collectives(plan: Plan, modules: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for consumer_name, arg in plan.redistributions():
        consumer = plan.nodes[consumer_name]
        kind, dims = collective_kind(arg.src, arg.dst, arg.route)
        rows.append(
            {
                "consumer": consumer_name,
                "producer": arg.producer,
                "kind": kind,
                "mesh_dims": dims,
                "src": placement_str(arg.src),
                "dst": placement_str(arg.dst),
                "route": [placement_str(p) for p in arg.route],
                "comm_us": json_float(arg.comm_us),
                "phase": _collective_phase(consumer, arg),
                "module": _collective_module(consumer, arg, modules),
            }
        )
    return rows


# ---------------------------------------------------------------------------- sections


def _placements(placements: OutputPlacements | None) -> str | None:
    return None if placements is None else placement_str(placements)


def _shape(node: fx.Node | None) -> list[int] | None:
    value = node.meta.get("val") if node is not None else None
    return [int(s) for s in value.shape] if isinstance(value, torch.Tensor) else None


def _parameters(problem: Problem, plan: Plan) -> list[dict[str, Any]]:
    rows = []
    mesh_shape = problem.space.mesh_shape
    for name, node in problem.joint.params.items():
        value = node.meta["val"]
        placements = plan.param_placements[name]
        numel = math.prod(local_shape(value.shape, placements, mesh_shape))
        rows.append(
            {
                "name": name,
                "shape": _shape(node),
                "dtype": str(value.dtype).removeprefix("torch."),
                "placements": placement_str(placements),
                "bytes_per_device": int(numel * value.element_size()),
                "module": owner_of_parameter(name),
            }
        )
    return rows


def _boundary(nodes: Iterable[fx.Node | None], placements: Iterable[Any]) -> list[dict[str, Any]]:
    return [
        {"index": index, "shape": _shape(node), "placements": _placements(p)}
        for index, (node, p) in enumerate(zip(nodes, placements))
    ]


COALESCED = "(coalesced collectives)"
"""The ``layers`` row of the fixed costs of coalesced collectives, which span modules."""


def _layers(plan: Plan, modules: dict[str, str]) -> list[dict[str, Any]]:
    """Cost per attributed module (a node's compute plus the redistributions into it); the
    latency of coalesced collectives, which belongs to no one module, in a row of its own."""
    sums: dict[str, list[float]] = {}
    for node in plan.nodes.values():
        row = sums.setdefault(modules.get(node.name, ""), [0.0, 0.0, 0.0])
        row[0] += node.compute_us
        row[1] += node.comm_us
        row[2] += node.transition_us
    if plan.buckets:
        sums[COALESCED] = [0.0, sum(b.latency_us for b in plan.buckets), 0.0]
    return [
        {
            "module": module,
            "compute_us": json_float(c),
            "comm_us": json_float(m),
            "transition_us": json_float(t),
        }
        for module, (c, m, t) in sorted(sums.items())
    ]


def get_json(problem: Problem, plan: Plan) -> dict[str, Any]:
    """The plan as JSON-serializable data, schema version 1 (see :mod:`autoparallel.files.plan_json`).

    ``problem`` must be the one ``plan`` was solved from (node and parameter names are
    looked up in it). ``constraints`` lists the user constraints in force in ``problem``
    now, which are the plan's own unless constraints were changed after solving.
    """
    joint = problem.joint
    topology = problem.tables.topology
    modules = node_modules(joint)
    outputs = [joint.tangents.get(i, out) for i, out in enumerate(joint.user_outputs)]
    data = plan_json(plan)
    return {
        "version": data["version"],
        "mesh": data["mesh"],
        "hardware": hardware_json(topology),
        "totals": data["totals"],
        "solver": data["solver"],
        "parameters": _parameters(problem, plan),
        "inputs": _boundary(joint.user_inputs, plan.input_placements),
        "outputs": _boundary(outputs, plan.output_placements),
        "nodes": node_rows(plan, modules),
        "collectives": _collectives(plan, modules),
        "layers": _layers(plan, modules),
        "buckets": data["buckets"],
        "overlaps": data["overlaps"],
        "memory": data["memory"],
        "fallbacks": data["fallbacks"],
        "constraints": {name: c.description for name, c in problem.user_constraints.items()},
        "regions": _regions(joint, plan, topology),
        "pipeline": data["pipeline"],
        "parameter_uses": data["parameter_uses"],
    }


def _regions(joint: JointGraph, plan: Plan, topology: Topology) -> list[dict[str, Any]]:
    """One entry per ``local_map`` region (identical layers share one), in graph order: its
    placements and prices in the layout most of its calls run in (``layouts`` lists every
    layout when the region leaves mesh dims free, with how many calls the plan runs in it)."""
    regions: dict[str, Any] = {}
    chosen: dict[str, list[int]] = {}  # key -> calls per layout
    for node in joint.graph.nodes:
        region = node.meta.get("local_map_region")
        if region is None or node.target is region_backward_op:
            continue
        regions.setdefault(region.key, region)
        calls = chosen.setdefault(region.key, [0] * len(region.layouts))
        calls[_layout_of(node, region, plan)] += 1
    return [_region(region, chosen[key], topology) for key, region in regions.items()]


def _layout_of(node: Any, region: Any, plan: Plan) -> int:
    strategy = plan.nodes[node.name].strategy
    return next(
        (
            i
            for i, layout in enumerate(region.layouts)
            if layout_strategy(node, region, layout) == strategy
        ),
        0,
    )


def _region(region: Any, calls: list[int], topology: Topology) -> dict[str, Any]:
    index = max(range(len(calls)), key=lambda i: calls[i])
    layout = region.layouts[index]
    entry = {
        "key": region.key,
        "function": getattr(region.func, "__qualname__", repr(region.func)),
        "source": region.source,
        "instances": sum(calls),
        "free_mesh_dims": list(region.free_mesh_dims),
        "inputs": [
            {
                "placements": placement_str(tuple(placements)),
                "declared": declared_str(declared),
                "gradient": placement_str(tuple(grad)) if differentiable else None,
                "local_shape": list(info.shape),
            }
            for placements, declared, grad, differentiable, info in zip(
                layout.in_placements,
                region.in_placements,
                layout.in_grad_placements,
                region.differentiable,
                layout.local_inputs,
            )
        ],
        "outputs": [
            {"placements": placement_str(tuple(p)), "declared": declared_str(d)}
            for p, d in zip(layout.out_placements, region.out_placements)
        ],
        "forward": _region_op(layout, False, topology),
        "backward": _region_op(layout, True, topology),
    }
    if len(region.layouts) > 1:
        entry["layouts"] = [
            {
                "free": {str(d): p for d, p in other.free},
                "instances": count,
                "forward": _region_op(other, False, topology),
                "backward": _region_op(other, True, topology),
            }
            for other, count in zip(region.layouts, calls)
        ]
    return entry


def _region_op(layout: Any, backward: bool, topology: Topology) -> dict[str, Any]:
    compute, comm = region_cost_parts_us(layout, backward, topology)
    profile = layout.profile
    records = (
        ()
        if profile is None
        else (profile.backward_collectives if backward else profile.forward_collectives)
    )
    return {
        "compute_us": json_float(compute),
        "comm_us": json_float(comm),
        "collectives": [
            {"kind": c.kind, "mesh_dim": c.mesh_dim, "bytes": c.nbytes} for c in records
        ],
    }
