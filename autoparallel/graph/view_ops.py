"""Which ATen ops of a traced graph only re-describe their input (views and metadata).

One list, read by every stage that needs the fact: the cost model prices these ops at zero
(no kernel, no data movement), the prefetch discount follows a parameter through them to
the matmul that reads it, and the mixed-precision rule follows a gradient through them (and
through casts) back to the op that computed it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from autoparallel._torch_internals import OpOverload
from autoparallel.types.graph import JointGraph

# ATen packets that only produce views or read metadata; ``op.is_view`` catches the rest
# (and is what makes ``reshape``-style aliases free).
VIEW_OP_NAMES = frozenset(
    {
        "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute",
        "expand", "expand_as", "slice", "select", "squeeze", "unsqueeze", "alias", "split",
        "split_with_sizes", "unbind", "as_strided", "detach", "view_as", "flatten",
        "unflatten", "narrow", "chunk", "tensor_split", "movedim", "lift_fresh",
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
        "numel", "dim", "is_contiguous",
    }
)  # fmt: skip

# Ops that change a value's dtype or storage but not what it is: a gradient passes through
# them unchanged between the op that computed it and the parameter-gradient output.
_VALUE_COPIES = frozenset({"_to_copy", "clone"})


def _aten_name(op: Any) -> str | None:
    packet = getattr(op, "overloadpacket", None)
    if packet is None or getattr(op, "namespace", None) != "aten":
        return None
    return getattr(packet, "__name__", "")


def is_view_op(op: Any) -> bool:
    """True for FX tuple unpacking and for ATen view/metadata ops."""
    if op is operator.getitem:
        return True
    if getattr(op, "is_view", False):
        return True
    return _aten_name(op) in VIEW_OP_NAMES


def is_view_node(node: fx.Node) -> bool:
    """A call of a view/metadata op on tensors (not a getitem of a multi-output op)."""
    return (
        node.op == "call_function"
        and node.target is not operator.getitem
        and is_view_op(node.target)
    )


def passes_gradient_through(node: fx.Node) -> bool:
    """A view or a value copy (cast, clone): the gradient's value is unchanged by it."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    return is_view_node(node) or _aten_name(node.target) in _VALUE_COPIES


def parameter_views(joint: JointGraph) -> dict[fx.Node, str]:
    """Nodes that are a parameter as the forward reads it, with the parameter's name: its
    placeholder, its mixed-precision cast, and the view/transpose chains of those (one
    pass). A collective on one of them reads parameters only, so the runtime can issue it
    ahead of the compute (runtime/local_graph.py)."""
    found = joint.parameter_sources()
    for node in joint.graph.nodes:
        if node in joint.forward_nodes and is_view_node(node) and node.all_input_nodes:
            names = {found.get(producer) for producer in node.all_input_nodes}
            if len(names) == 1 and None not in names:
                found[node] = names.pop()
    return found


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose output's storage ``node``'s output is (itself unless a view, or an
    item of a splitting view)."""
    while True:
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if base is None:
            return node
        if is_view_node(node) or (node.target is operator.getitem and is_view_node(base)):
            node = base
            continue
        return node
