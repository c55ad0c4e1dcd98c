"""Activation checkpointing as a choice of the solver: how many layers of each class to
recompute, in the same MIP as the placements.

Recomputing a layer frees its inner activations (the saved values that do not leave it,
``graph/layers.py``) until its backward and costs its forward compute again there.
Both depend on the layer's strategies, so "recompute k of the N layers of class C" is the
product of an integer and the strategy choice. It stays linear through a disaggregated
copy of the class's strategy columns: for every node n of the class's representative layer
and strategy s, a continuous ``z[n, s]`` in [0, N] with

    sum_s z[n, s] = k_C        (one row per node)
    z[n, s] <= N * x[n, s]     (one row per strategy)

With x integral, z[n, s] = k_C on the chosen strategy and 0 elsewhere, so
``sum bytes[n, s] * z[n, s]`` is exactly k_C times one layer's inner activations and
``sum forward_us[n, s] * z[n, s]`` k_C times its forward. The objective gets the second;
every backward-start memory row loses the first. One more row per class C* and gather
moment covers the backward of a recomputed layer: every recomputable layer's inner
activations gone, C*'s back (it is implied by the others unless k_C* > 0).

Strategies of a node with equal bytes and forward time share one copy (their x summed on
the right of the bound row: the same relaxation, fewer columns), and a node whose every
strategy costs the same needs none (k times that figure, on k itself). On a large model
that leaves a small fraction of the copies and a faster relaxation, for the same plan.

Which layers of a class are recomputed does not change these figures (they are alike); the
runtime takes the first k in forward order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch.fx as fx

from autoparallel.graph.layers import (
    draws_random_numbers,
    forward_layers,
    layer_members,
    layer_recompute,
)
from autoparallel.graph.view_ops import storage_root
from autoparallel.types.memory import NodeBytes, RecomputeClass
from autoparallel.types.problem import MIB, AuxiliaryColumns, Problem, Row

COUNT_PREFIX = "recompute "
"""An auxiliary column named ``COUNT_PREFIX + class label`` counts the class's recomputed
layers."""


def recompute_classes(
    problem: Problem, activations: Sequence[NodeBytes], saved: Collection[fx.Node]
) -> tuple[RecomputeClass, ...]:
    """The numbered layers that may be recomputed, grouped into classes of layers that
    share their columns (module doc); ``activations`` are the memory model's saved storages
    and ``saved`` the values the backward reads. A layer that draws random numbers in its
    forward is left out (recomputing it would draw other ones)."""
    joint = problem.joint
    labels = forward_layers(joint)
    members = layer_members(labels)
    by_root = {part.node: part for part in activations}
    roots_of_saved: dict[fx.Node, set[fx.Node]] = {}
    for node in saved:
        roots_of_saved.setdefault(storage_root(node), set()).add(node)
    classes: dict[tuple, list[tuple[str, tuple[NodeBytes, ...], tuple[NodeBytes, ...]]]] = {}
    for layer, nodes in members.items():
        if any(draws_random_numbers(node) for node in nodes):
            continue
        region = layer_recompute(joint, labels, layer, saved, members)
        inner = tuple(
            part
            for root, part in by_root.items()
            if labels.get(root) == layer
            and roots_of_saved.get(root)
            and roots_of_saved[root] <= region.dropped
        )
        forward = tuple(
            NodeBytes(node, np.asarray(problem.tables.compute_us[node], dtype=np.float64))
            for node in region.nodes
            if node in problem.tables.compute_us
        )
        if not inner:
            continue  # recomputing it would free nothing
        key = _signature(problem, inner, forward)
        classes.setdefault(key, []).append((layer, inner, forward))
    found = []
    for alike in classes.values():
        layers = tuple(layer for layer, _, _ in alike)
        label = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"
        found.append(RecomputeClass(label, layers, alike[0][1], alike[0][2]))
    return tuple(found)


def _signature(problem: Problem, inner: tuple[NodeBytes, ...], forward: tuple) -> tuple:
    """Layers with the same signature share every column their recomputation touches, with
    the same bytes and compute: one class."""
    return (
        tuple((int(problem.node_columns[p.node][0]), p.per_strategy.tobytes()) for p in inner),
        tuple((int(problem.node_columns[p.node][0]), p.per_strategy.tobytes()) for p in forward),
    )


# ---------------------------------------------------------------------------- the columns


def recompute_columns(
    problem: Problem, classes: Sequence[RecomputeClass], every_layer: bool = False
) -> tuple[AuxiliaryColumns, list[Row], tuple[np.ndarray, np.ndarray]]:
    """The auxiliary columns (k per class, then the z copies), their structural rows, and
    the (columns, MiB) term each backward-start memory row gets: minus the recomputed
    layers' inner activations (module doc). ``every_layer`` fixes each k at its class's
    size (recompute every layer that can be)."""
    base = problem.num_variables
    names = [COUNT_PREFIX + c.label for c in classes]
    upper = [float(len(c.layers)) for c in classes]
    objective = [0.0] * len(classes)
    rows: list[Row] = []
    saving_columns, saving_values = [], []
    for index, cls in enumerate(classes):
        count_column = base + index
        size = float(len(cls.layers))
        inner = {part.node: part.per_strategy for part in cls.inner}
        forward = {part.node: part.per_strategy for part in cls.forward_us}
        for node in dict.fromkeys([*inner, *forward]):  # ordered, each node once
            x_columns = problem.node_columns[node]
            node_bytes = inner.get(node, np.zeros(len(x_columns)))
            node_us = forward.get(node, np.zeros(len(x_columns)))
            groups = _alike_strategies(node_bytes, node_us)
            if len(groups) == 1:
                # every strategy costs the same: k layers cost k times that, no copy needed
                objective[index] += float(node_us[0])
                if node_bytes[0]:
                    saving_columns.append(np.array([count_column]))
                    saving_values.append(np.array([-node_bytes[0] / MIB]))
                continue
            z_columns = base + len(names) + np.arange(len(groups), dtype=np.int64)
            names.extend(f"{COUNT_PREFIX}{cls.label}: {node.name}{list(group)}" for group in groups)
            upper.extend([size] * len(groups))
            objective.extend(float(node_us[group[0]]) for group in groups)
            rows.append(
                Row(
                    np.append(z_columns, count_column),
                    np.append(np.ones(len(z_columns)), -1.0),
                    0.0,
                    0.0,
                )
            )
            for z, group in zip(z_columns, groups):
                rows.append(
                    Row(
                        np.append(z, x_columns[list(group)]),
                        np.append(1.0, np.full(len(group), -size)),
                        -np.inf,
                        0.0,
                    )
                )
            if node in inner:
                saving_columns.append(z_columns)
                saving_values.append(-np.array([node_bytes[group[0]] for group in groups]) / MIB)
    count = len(names)
    integral = np.zeros(count, dtype=bool)
    integral[: len(classes)] = True
    lower = np.zeros(count)
    if every_layer:
        lower[: len(classes)] = upper[: len(classes)]
    columns = AuxiliaryColumns(
        tuple(names),
        np.asarray(objective, dtype=np.float64),
        lower,
        np.asarray(upper, dtype=np.float64),
        integral,
    )
    saving = (
        (np.concatenate(saving_columns), np.concatenate(saving_values))
        if saving_columns
        else (np.zeros(0, np.int64), np.zeros(0))
    )
    return columns, rows, saving


def _alike_strategies(node_bytes: np.ndarray, node_us: np.ndarray) -> list[tuple[int, ...]]:
    """A node's strategies grouped by equal (inner bytes, forward us), in first-seen order.

    One copy column per group is as tight as one per strategy: the copies of a group sum to
    one column bounded by N times the group's x, and any split of that column in proportion
    to its strategies' x meets the per-strategy rows. On LLaMA-3 8B on (8, 8) the ~20
    strategies of a node fall into a few local sizes."""
    groups: dict[tuple[float, float], list[int]] = {}
    for strategy, key in enumerate(zip(node_bytes.tolist(), node_us.tolist())):
        groups.setdefault(key, []).append(strategy)
    return [tuple(group) for group in groups.values()]


def recompute_moment_parts(classes: Sequence[RecomputeClass]) -> list[list[NodeBytes]]:
    """Per class C*: the parts that turn a backward-start row (every layer's activations)
    into the backward of a recomputed layer of C*: every class's inner activations taken
    off for all its layers, C*'s put back for one (module doc)."""
    gone = [
        NodeBytes(part.node, -len(cls.layers) * part.per_strategy)
        for cls in classes
        for part in cls.inner
    ]
    return [gone + list(cls.inner) for cls in classes]


# ---------------------------------------------------------------------------- the plan


def recompute_counts(
    classes: Sequence[RecomputeClass], auxiliary: dict[str, float]
) -> dict[str, int]:
    """How many layers of each class (by label) the solution recomputes."""
    return {cls.label: int(round(auxiliary.get(COUNT_PREFIX + cls.label, 0.0))) for cls in classes}


def recomputed_layers(classes: Sequence[RecomputeClass], counts: dict[str, int]) -> tuple[str, ...]:
    """The layers the runtime recomputes for ``counts``, in forward order."""
    chosen = [layer for cls in classes for layer in cls.chosen(counts.get(cls.label, 0))]
    return tuple(sorted(chosen, key=_layer_number))


def _layer_number(layer: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in layer.split("."))
