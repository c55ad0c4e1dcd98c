"""Which numbered layer each forward op belongs to, and what recomputing a layer means.

A forward op belongs to the last numbered layer (``layers.3``) whose parameters the forward
read at or before it, in graph order; ops before the first layer belong to no layer (``""``).
The memory model splits saved activations by layer, and activation checkpointing
recomputes them: a recomputed layer's forward ops run again inside the backward, just before
the first backward op that reads one of their values, so the forward keeps only what the
layer reads from outside (the layer's input, its parameters) and what leaves it (its output,
read by the next layer) instead of every intermediate value.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoparallel.graph.view_ops import parameter_views
from autoparallel.types.graph import JointGraph, layer_of


class RecomputeError(ValueError):
    """A layer the plan asks to recompute cannot be recomputed."""


def forward_layers(joint: JointGraph) -> dict[fx.Node, str]:
    """The layer (``"layers.3"``, or ``""`` outside numbered layers) of every forward
    ``call_function`` node and every user input (module doc)."""
    readers = parameter_views(joint)
    layer_at: dict[fx.Node, str] = {node: "" for node in joint.user_inputs}
    layer = ""
    for node in joint.graph.nodes:
        if node in joint.forward_nodes and node.op == "call_function":
            read = [layer_of(readers[a]) for a in node.all_input_nodes if a in readers]
            layer = next((name.removesuffix(".") for name in read if name), layer)
            layer_at[node] = layer
    return layer_at


@dataclass(frozen=True)
class LayerRecompute:
    """What recomputing one layer changes in the two phases.

    ``nodes``: the layer's forward ops that run again in the backward, in graph order;
    ``dropped``: the values the forward no longer saves (the backward recomputes them);
    ``inputs``: the values from outside ``nodes`` that the recomputation reads, saved
    instead (the layer's input, its parameters, values that leave the layer).
    """

    layer: str
    nodes: tuple[fx.Node, ...]
    dropped: frozenset[fx.Node]
    inputs: frozenset[fx.Node]


def layer_members(layers: dict[fx.Node, str]) -> dict[str, list[fx.Node]]:
    """The forward ops of each numbered layer, in graph order (``forward_layers``'s map
    inverted; user inputs and ops outside layers left out)."""
    members: dict[str, list[fx.Node]] = {}
    for node, label in layers.items():
        if label and node.op == "call_function":
            members.setdefault(label, []).append(node)
    return members


def layer_outputs(
    joint: JointGraph, layers: dict[fx.Node, str], members: list[fx.Node]
) -> set[fx.Node]:
    """Those of a layer's ``members`` that a forward op outside the layer (or the model's
    output) reads: they leave the layer, so recomputing it never drops them."""
    outputs = {o for o in joint.user_outputs if o is not None}
    layer = layers[members[0]]
    return {
        node
        for node in members
        if node in outputs
        or any(
            user in outputs or (user in joint.forward_nodes and layers.get(user, layer) != layer)
            for user in node.users
        )
    }


def layer_recompute(
    joint: JointGraph,
    layers: dict[fx.Node, str],
    layer: str,
    saved: Collection[fx.Node],
    members: dict[str, list[fx.Node]] | None = None,
) -> LayerRecompute:
    """The region recomputing ``layer`` runs, given the values ``saved`` for the backward
    (``members``: ``layer_members(layers)``, when the caller has it). Raises RecomputeError
    for a layer that is not in the graph or draws random numbers in its forward
    (recomputing would draw other ones)."""
    members = members if members is not None else layer_members(layers)
    if layer not in members:
        known = list(members)
        raise RecomputeError(
            f"no numbered layer {layer!r} to recompute; the model's layers are "
            + ", ".join(known[:4])
            + (" ..." if len(known) > 4 else "")
        )
    inner = set(members[layer]) - layer_outputs(joint, layers, members[layer])
    dropped = {node for node in saved if node in inner}
    nodes: set[fx.Node] = set()
    stack = list(dropped)
    while stack:
        node = stack.pop()
        if node in nodes:
            continue
        nodes.add(node)
        stack.extend(a for a in node.all_input_nodes if a in inner)
    random = [n for n in nodes if draws_random_numbers(n)]
    if random:
        raise RecomputeError(
            f"layer {layer!r} draws random numbers in its forward ({random[0].target}): "
            "recomputing it in the backward would draw other ones; leave it saved"
        )
    inputs = {a for node in nodes for a in node.all_input_nodes if a not in nodes}
    return LayerRecompute(
        layer,
        tuple(node for node in members[layer] if node in nodes),
        frozenset(dropped),
        frozenset(inputs),
    )


def draws_random_numbers(node: fx.Node) -> bool:
    """An op tagged as drawing random numbers, unless its dropout probability is 0 or it
    runs in eval mode (attention kernels carry the tag for their ``dropout_p``)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    for name in ("dropout_p", "p"):
        if name in values or name in defaults:
            return float(values.get(name, defaults.get(name, 1.0))) != 0.0
    if "train" in values:
        return bool(values["train"])
    return True
