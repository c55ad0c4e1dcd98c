"""Activation checkpointing as a choice of the solver: how many layers of each class to
recompute, in the same MIP as the placements.

Recomputing a layer frees its inner activations (the saved values that do not leave it,
``trace/layer_regions.py``) until its backward and costs its forward compute again there.
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

Which layers of a class are recomputed does not change these figures (they are alike); the
runtime takes the first k in forward order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch.fx as fx

from autoparallel.trace.layer_regions import (
    draws_random_numbers,
    forward_layers,
    layer_members,
    recompute_region,
)
from autoparallel.trace.view_ops import storage_root
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
        region = recompute_region(joint, labels, layer, saved, members)
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
            z_columns = base + len(names) + np.arange(len(x_columns), dtype=np.int64)
            names.extend(
                f"{COUNT_PREFIX}{cls.label}: {node.name}[{s}]" for s in range(len(x_columns))
            )
            upper.extend([size] * len(x_columns))
            objective.extend(forward.get(node, np.zeros(len(x_columns))).tolist())
            rows.append(
                Row(
                    np.append(z_columns, count_column),
                    np.append(np.ones(len(z_columns)), -1.0),
                    0.0,
                    0.0,
                )
            )
            for z, x in zip(z_columns, x_columns):
                rows.append(Row(np.array([z, x]), np.array([1.0, -size]), -np.inf, 0.0))
            if node in inner:
                saving_columns.append(z_columns)
                saving_values.append(-inner[node] / MIB)
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
