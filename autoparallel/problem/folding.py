"""Folding of repeated structure: identical layers share one set of decision variables.

Repeated transformer blocks trace into the same run of ops, layer after layer, in the joint
graph's order. We find that repetition from the graph alone:

1. Each call node gets a signature: op, shapes, and its strategy list (lists are shared
   exactly between nodes that asked the same strategy question). The forward region of the
   graph and the backward region (from the first node that reads a tangent on) are handled
   separately and are never folded together.
2. In each phase the layer *period* p is the shift that makes the most signatures agree
   (``sig[i] == sig[i + p]``); a model without repetition has no such shift.
3. A pair (i, i + p) is aligned only if it is verified: equal signatures, and every input of
   the second is either the same node as the first's (shared, e.g. rotary tables), the node
   one period after the first's input (the next layer's counterpart), or a parameter/buffer
   of the same shape. Parameters then align when the nodes that read them align.
4. Aligned nodes form classes; the first and last member of each class (the layers next to
   the model's non-repeated ends) stay free, the interior members fold onto one choice.

Folded nodes share one choice; the problem builder counts their costs once per member. As a
check, ``AutoParallel(..., fold=False)`` builds the unreduced problem.
"""

import logging
from collections import defaultdict

import torch
import torch.fx as fx

from autoparallel.types.graph import JointGraph
from autoparallel.types.problem import Folding
from autoparallel.types.strategies import StrategySpace

logger = logging.getLogger(__name__)


def no_folding(space: StrategySpace) -> Folding:
    return Folding({node: node for node in space.nodes})


def find_repeated_nodes(joint: JointGraph, space: StrategySpace, min_repeats: int = 2) -> Folding:
    parent = {node: node for node in space.nodes}

    def find(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def union(a: fx.Node, b: fx.Node) -> None:
        root_a, root_b = find(a), find(b)
        if root_a is not root_b:
            parent[root_b] = root_a

    calls = [n for n in space.nodes if n.op == "call_function"]
    # Phases by graph region: everything from the first tangent-dependent node on is the
    # backward region (it also holds forward-only helpers such as transposed weights that
    # the backward reads), so each region keeps one clean layer period.
    first_backward = next(
        (i for i, n in enumerate(calls) if n not in joint.forward_nodes), len(calls)
    )
    for phase_nodes in (calls[:first_backward], calls[first_backward:]):
        for a, b in _verified_pairs(phase_nodes, space, joint.forward_nodes):
            union(a, b)
            for input_a, input_b in zip(space[a].input_nodes, space[b].input_nodes):
                if (
                    input_a is not input_b
                    and input_a.op == "placeholder"
                    and _same_placeholder_kind(input_a, input_b, joint, space)
                ):
                    union(input_a, input_b)

    # representative = first member in graph order, so logs name the first layer
    order = {node: i for i, node in enumerate(space.nodes)}
    members: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in space.nodes:
        members[find(node)].append(node)
    representative = {node: node for node in space.nodes}
    for group in members.values():
        # The first and last copies sit next to the non-repeated ends of the model (the
        # embedding, the output head) and may well want other placements: leave them free.
        interior = sorted(group, key=order.__getitem__)[1:-1]
        for node in interior:
            representative[node] = interior[0]
    folding = Folding(representative)
    logger.info(
        "folding: %d nodes in %d classes (%d folded)",
        len(space.nodes),
        folding.num_classes,
        folding.num_folded,
    )
    return folding


def _signature(node: fx.Node, space: StrategySpace, forward: bool) -> tuple:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        shape: object = (tuple(value.shape), value.dtype)
    else:
        shape = tuple(
            (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in value
        )
    return (node.target, shape, id(space[node].strategies), len(space[node].input_nodes), forward)


def _period(signatures: list[tuple]) -> int | None:
    """The shift under which the most signatures repeat (None if nothing repeats)."""
    positions: dict[tuple, list[int]] = defaultdict(list)
    for index, signature in enumerate(signatures):
        positions[signature].append(index)
    votes: dict[int, int] = defaultdict(int)
    for found in positions.values():
        for first, second in zip(found, found[1:]):
            votes[second - first] += 1
    if not votes:
        return None
    best = max(votes, key=lambda shift: (votes[shift] * shift, -shift))
    return best if votes[best] >= 2 else None


def _verified_pairs(
    nodes: list[fx.Node], space: StrategySpace, forward_nodes: set
) -> list[tuple[fx.Node, fx.Node]]:
    signatures = [_signature(n, space, n in forward_nodes) for n in nodes]
    period = _period(signatures)
    if period is None:
        return []
    position = {node: i for i, node in enumerate(nodes)}
    pairs = []
    for i in range(len(nodes) - period):
        a, b = nodes[i], nodes[i + period]
        if signatures[i] != signatures[i + period]:
            continue
        if all(
            _inputs_correspond(x, y, position, period)
            for x, y in zip(space[a].input_nodes, space[b].input_nodes)
        ):
            pairs.append((a, b))
    return pairs


def _inputs_correspond(x: fx.Node, y: fx.Node, position: dict[fx.Node, int], period: int) -> bool:
    if x is y:
        return True
    if x in position and y in position:
        return position[y] - position[x] == period
    if x.op == "placeholder" and y.op == "placeholder":
        vx, vy = x.meta.get("val"), y.meta.get("val")
        return getattr(vx, "shape", None) == getattr(vy, "shape", None)
    # an input from the other phase (a saved forward value read by the backward): accept it
    # when both sides agree in shape; their own folding is decided in their phase
    vx, vy = x.meta.get("val"), y.meta.get("val")
    return isinstance(vx, torch.Tensor) and isinstance(vy, torch.Tensor) and vx.shape == vy.shape


def _same_placeholder_kind(a: fx.Node, b: fx.Node, joint: JointGraph, space: StrategySpace) -> bool:
    role = joint.placeholder_role(a)
    return (
        role in ("param", "buffer")
        and role == joint.placeholder_role(b)
        and space[a].strategies is space[b].strategies
    )
