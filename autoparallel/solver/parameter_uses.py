"""Where the forward reads each parameter, for the plan's readers (the torch-code export).

A parameter reaches the op that uses it through casts (the mixed-precision policy's
``_to_copy``), transposes and views: ``x @ w.t()`` is ``mm(view(x), t(w))``. Those are walked
through; the first other op is the parameter's use. Its kind (:data:`ParameterOp`) and the
placement that op's chosen strategy requires of its activation operand say how torch's
tensor-parallel styles could express the plan's choice for that parameter.
"""

from __future__ import annotations

import torch.fx as fx

from autoparallel.types.graph import JointGraph
from autoparallel.types.kinds import ParameterOp
from autoparallel.types.plan import NodePlan, ParameterUse

_PASS_THROUGH = frozenset(
    {"_to_copy", "t", "transpose", "permute", "view", "_unsafe_view", "reshape", "alias"}
    | {"detach", "expand", "unsqueeze", "clone", "contiguous"}
)
"""Ops that only recast or relabel a tensor's elements: the use is past them."""

RESHAPES = frozenset({"view", "_unsafe_view", "reshape"})
"""The ops a linear flattens its input with and unflattens its result with: the edges of
its module in the graph."""

OPS: dict[str, ParameterOp] = {
    "mm": "linear",
    "addmm": "linear",
    "bmm": "linear",
    "matmul": "linear",
    "linear": "linear",
    "embedding": "embedding",
    "mul": "scale",
}


def op_name(node: fx.Node) -> str:
    """``aten.mm.default`` -> ``mm``; ``""`` for nodes that call no op."""
    if node.op != "call_function":
        return ""
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def parameter_uses(joint: JointGraph, nodes: dict[str, NodePlan]) -> dict[str, ParameterUse]:
    """Parameter name -> its first use in the forward (parameters the forward never reads
    are left out)."""
    outputs = {node for node in joint.user_outputs if node is not None}
    uses: dict[str, ParameterUse] = {}
    for name, placeholder in joint.params.items():
        found = first_use(placeholder, joint.forward_nodes)
        if found is None:
            continue
        use, via = found
        kind = OPS.get(op_name(use), "other")
        uses[name] = ParameterUse(
            op=kind,
            node=use.name,
            activation=_required(use, via, nodes),
            feeds_output=_reaches(use, outputs, joint.forward_nodes),
            arrives=_arrival(use, via, nodes),
            at_use=read_as(placeholder, joint.forward_nodes, nodes),
            leaves=_departure(use, joint.forward_nodes, nodes),
            boundary=_boundary(use, via, joint.forward_nodes),
            placeholder=placeholder.name,
        )
    return uses


def first_use(
    placeholder: fx.Node, forward: set[fx.Node] | frozenset[fx.Node]
) -> tuple[fx.Node, fx.Node] | None:
    """(the op that uses the parameter, the input node it reads it through), breadth first
    through pass-through ops; None when no forward op reads it."""
    path = use_path(placeholder, forward)
    return None if path is None else (path[-1], path[-2])


def use_path(
    placeholder: fx.Node, forward: set[fx.Node] | frozenset[fx.Node]
) -> list[fx.Node] | None:
    """The nodes from the parameter's placeholder to its first use: the placeholder, the
    pass-through ops between, the use (breadth first); None when no forward op reads it."""
    parent: dict[fx.Node, fx.Node] = {}
    frontier = [placeholder]
    while frontier:
        following = []
        for node in frontier:
            for user in node.users:
                if user not in forward or user in parent:
                    continue
                parent[user] = node
                if op_name(user) in _PASS_THROUGH:
                    following.append(user)
                    continue
                path = [user]
                while path[-1] is not placeholder:
                    path.append(parent[path[-1]])
                return path[::-1]
        frontier = following
    return None


def _activation_argument(use: fx.Node, via: fx.Node, nodes: dict[str, NodePlan]):
    """The argument of ``use`` that feeds its first tensor operand other than the parameter
    (read through ``via``); None where it has none."""
    plan = nodes.get(use.name)
    if plan is None:
        return None
    for argument in sorted(plan.arguments, key=lambda a: a.slot):
        if argument.producer == via.name:
            continue
        if op_name(use) == "addmm" and argument.slot == 0:  # addmm(bias, x, w): no activation
            continue
        return argument
    return None


def _required(use: fx.Node, via: fx.Node, nodes: dict[str, NodePlan]):
    """The placement the op requires of its activation operand; None where it has none."""
    argument = _activation_argument(use, via, nodes)
    return None if argument is None else argument.dst


def _arrival(use: fx.Node, via: fx.Node, nodes: dict[str, NodePlan]):
    """The activation's placement as the module receives it: a linear flattens its input
    with one view before the matmul, so past that view, as its producer left it."""
    argument = _activation_argument(use, via, nodes)
    if argument is None:
        return None
    producer = nodes.get(argument.producer)
    if producer is None or not _is_view(producer) or not producer.arguments:
        return argument.src
    return min(producer.arguments, key=lambda a: a.slot).src


def _departure(use: fx.Node, forward, nodes: dict[str, NodePlan]):
    """The placement the module's output is read in by its first consumer: past the one
    view that unflattens a linear's result, in that output's own coordinates."""
    node = use
    users = [u for u in node.users if u in forward and u.name in nodes]
    if len(users) == 1 and op_name(users[0]) in RESHAPES:
        node = users[0]
        users = [u for u in node.users if u in forward and u.name in nodes]
    if not users:
        return None
    for argument in nodes[users[0].name].arguments:
        if argument.producer == node.name:
            return argument.dst
    return None


def _is_view(plan: NodePlan) -> bool:
    name = plan.target.split(".")
    return len(name) > 1 and name[1] in _PASS_THROUGH - {"_to_copy"}


def first_reader(placeholder: fx.Node, forward) -> fx.Node | None:
    """The first forward node that reads the parameter (a cast, a transpose, or its use)."""
    return next((user for user in placeholder.users if user in forward), None)


def read_as(placeholder: fx.Node, forward, nodes: dict[str, NodePlan]):
    """The placement the parameter's first forward reader requires of it."""
    reader = first_reader(placeholder, forward)
    if reader is None or reader.name not in nodes:
        return None
    for argument in nodes[reader.name].arguments:
        if argument.producer == placeholder.name:
            return argument.dst
    return None


def _boundary(use: fx.Node, via: fx.Node, forward) -> tuple[str, ...]:
    """The names of the view before ``use`` on its activation operand, ``use``, and the
    views right after it."""
    names = [use.name]
    for operand in use.all_input_nodes:
        if operand is not via and op_name(operand) in RESHAPES:
            names.append(operand.name)
    names += [u.name for u in use.users if u in forward and op_name(u) in RESHAPES]
    return tuple(names)


def _reaches(use: fx.Node, outputs: set[fx.Node], forward) -> bool:
    """Whether ``use``'s result is a model output, itself or through views only."""
    node = use
    while node not in outputs:
        followers = [u for u in node.users if u in forward and op_name(u) in _PASS_THROUGH]
        if len(followers) != 1:
            return False
        node = followers[0]
    return True
