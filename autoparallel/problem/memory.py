"""The memory model: per-device bytes of a training step, linear in the plan's choices.

Every component is a sum over nodes of bytes that depend on that node's strategy alone
(``NodeBytes``), except the parameter gathers, which depend on the move an edge makes
(``MoveBytes``). So each moment of the step is one linear row over the problem's columns,
and "the peak stays within the budget" is a handful of rows (one per moment and pair of
gather groups; folded layers give identical rows, kept once).

What is counted, per device (see ``types/memory.py`` for the two moments):

* parameters: each distinct parameter (tied names once) at its local size;
* gradients: each trained parameter's gradient, at the parameter's placement and the
  gradient's dtype (``zero_grad(set_to_none=True)`` before the forward frees them, so they
  exist only from the backward to the next step);
* optimizer state: ``OptimizerState`` per trained parameter, sharded as the parameter;
* activations: the forward values (and input tensors) the backward reads, at their
  producer's placement (what the runtime saves, ``runtime/executor.py``), except parameters
  and their casts and views (the backward gathers them again) and views of another saved
  value (same storage);
* saved gathers: a parameter read the backward needs (a transposed weight, say) that the
  forward redistributed is saved as that copy, an activation until the backward
  (``MoveBytes`` on the edges into it);
* microbatches in flight (``Problem.activation_copies``, a pipeline stage's): the activations
  and saved gathers count once per microbatch alive at the backward's start; a recomputed
  layer frees its inner activations in each, and the one it recomputes at a time is priced
  as if every microbatch's were back (an overestimate of one layer's activations);
* gathered parameters: a parameter read (or its cast) whose consumer wants another placement
  holds the redistributed copy while its group computes; the runtime keeps the group outside
  numbered layers for the whole forward, and one layer ahead of the computing one.

Not counted: the gradient buckets' flat buffers (at most twice ``BUCKET_CAP_BYTES``),
the unreduced (Partial) gradient of the op that computes it, intermediate values of the
forward and backward that are freed within the phase, and the allocator's fragmentation.
``benchmarks/memory_fidelity.py`` measures each component against the prediction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.fx as fx

from autoparallel.graph.layers import forward_layers
from autoparallel.graph.view_ops import parameter_views, storage_root
from autoparallel.problem.constraints import distinct_param_nodes
from autoparallel.problem.recompute import (
    recompute_classes,
    recompute_columns,
    recompute_moment_parts,
    recomputed_layers,
)
from autoparallel.types.graph import JointGraph, layer_of
from autoparallel.types.memory import (
    GatherGroup,
    MemoryEstimate,
    MemoryModel,
    MoveBytes,
    NodeBytes,
    optimizer_state,
)
from autoparallel.types.placements import is_multi
from autoparallel.types.problem import MIB, Problem, Row, UserConstraint
from autoparallel.types.tensors import local_shape

NON_LAYER = "the non-layer parameters"


def memory_model(problem: Problem) -> MemoryModel:
    """The problem's memory model, built on first use for ``problem.memory_optimizer`` and
    ``problem.activation_checkpointing``."""
    if problem.memory is None:
        problem.memory = build_memory_model(
            problem, problem.memory_optimizer, problem.activation_checkpointing != "off"
        )
    return problem.memory


def build_memory_model(
    problem: Problem, optimizer: str | float, recompute: bool = False
) -> MemoryModel:
    """The bytes each strategy and move of ``problem`` costs per device (module doc), with
    ``optimizer``'s state (a name of ``types.memory.OPTIMIZERS`` or bytes per parameter
    element; ValueError otherwise); with ``recompute``, the layers activation
    checkpointing may recompute (problem/recompute.py)."""
    state = optimizer_state(optimizer)
    mesh_shape = problem.space.mesh_shape
    parameters, gradients, states, temporaries = [], [], [], []
    names = problem.joint.param_name_of()
    for node in distinct_param_nodes(problem):
        local = _strategy_bytes(problem, node, mesh_shape)
        parameters.append(NodeBytes(node, local))
        grad = problem.joint.param_grads.get(names[node])
        if grad is None:
            continue  # frozen: no gradient, no optimizer state
        value = node.meta["val"]
        numel = local / value.element_size()
        grad_itemsize = _itemsize(grad, value.element_size())
        gradients.append(NodeBytes(node, numel * grad_itemsize))
        states.append(
            NodeBytes(node, np.array([state.state_bytes(n, value.element_size()) for n in numel]))
        )
        temporaries.append(NodeBytes(node, local * state.step_temporaries))
    activations, layers = _activations(problem, mesh_shape)
    saved_gathers = _saved_gathers(problem)
    copies = problem.activation_copies
    if copies != 1:  # each microbatch in flight saves its own (module doc)
        activations = [NodeBytes(p.node, p.per_strategy * copies) for p in activations]
        saved_gathers = [dataclasses.replace(m, copies=copies) for m in saved_gathers]
    classes = (
        recompute_classes(problem, activations, saved_activations(problem.joint))
        if recompute
        else ()
    )
    return MemoryModel(
        optimizer=state,
        parameters=tuple(parameters),
        gradients=tuple(gradients),
        optimizer_state=tuple(states),
        step_temporaries=tuple(temporaries),
        activations=tuple(activations),
        activation_layers=tuple(layers),
        saved_gathers=tuple(saved_gathers),
        gather_groups=tuple(_gather_groups(problem, {m.edge for m in saved_gathers})),
        recompute=classes,
    )


# ---------------------------------------------------------------------------- the constraint


def memory_constraint_of(
    problem: Problem, model: MemoryModel, name: str, budget: float, every_layer: bool = False
) -> UserConstraint:
    """Every moment of the step within ``budget`` bytes per device under ``model``, with the
    layers of ``model.recompute`` recomputed where the solver finds it pays (or all of them:
    ``every_layer``). Raises ValueError for a budget that is not positive."""
    if not budget > 0:
        raise ValueError(f"memory budget must be a positive number of bytes, got {budget}")
    columns, rows, saving = None, [], _NO_TERM
    if model.recompute:
        columns, rows, saving = recompute_columns(problem, model.recompute, every_layer)
    moves: dict[MoveBytes, tuple[np.ndarray, np.ndarray]] = {}  # its (columns, bytes)
    bases, moments = _moments(model)
    base_rows: dict[str, Row] = {}
    seen: set[tuple[str, bytes, bytes]] = set()
    for base, extra, recomputed in moments:
        # the moments of folded layers differ in their gathers only, and often not even
        # there: compare those small rows before building the whole one
        added = _row(problem, extra, budget, moves, saving if recomputed else _NO_TERM)
        key = (base, added.columns.tobytes(), added.values.tobytes())
        if key in seen:
            continue
        seen.add(key)
        if base not in base_rows:
            base_rows[base] = _row(problem, bases[base], budget, moves)
        rows.append(_sum_of(base_rows[base], added))
    smallest = smallest_peak(model)
    description = (
        f"peak memory per device <= the budget of {_gib(budget)} with {model.optimizer.name}"
        + (
            (", recomputing every layer" if every_layer else ", recomputing layers where it pays")
            if model.recompute
            else ""
        )
        + f" (the smallest peak any plan can reach is at least {_gib(smallest)})"
    )
    return UserConstraint(name, description, rows, columns)


_NO_TERM = (np.zeros(0, np.int64), np.zeros(0))


def smallest_peak(model: MemoryModel) -> float:
    """A lower bound on the peak of any plan: every node at its smallest strategy, no gather."""
    smallest = {id(part): float(part.per_strategy.min()) for part in _all_parts(model)}
    start = sum(smallest[id(p)] for p in model.parameters + model.optimizer_state)
    backward = start + sum(smallest[id(p)] for p in model.activations)
    if model.recompute:  # every layer recomputed, one layer's inner activations back
        inner = [sum(float(p.per_strategy.min()) for p in cls.inner) for cls in model.recompute]
        backward -= sum(len(cls.layers) * i for cls, i in zip(model.recompute, inner))
        backward += max(inner)
    step = start + sum(smallest[id(p)] for p in model.gradients + model.step_temporaries)
    return max(backward, step)


def _moments(
    model: MemoryModel,
) -> tuple[dict[str, list[NodeBytes | MoveBytes]], list[tuple[str, list, bool]]]:
    """The moments that can be the peak (see MemoryModel): the terms every moment of a kind
    shares (``"step"``, ``"backward"``), and each moment as (its kind, its own terms,
    whether the recomputed layers' inner activations come off it: the backward start)."""
    resident = list(model.parameters + model.optimizer_state)
    bases = {
        "step": resident + list(model.gradients + model.step_temporaries),
        "backward": resident + list(model.activations) + list(model.saved_gathers),
    }
    moments: list[tuple[str, list, bool]] = [("step", [], False)]
    for gathers in _alive_gathers(model):
        moments.append(("backward", list(gathers), True))
        for parts in recompute_moment_parts(model.recompute):
            moments.append(("backward", list(gathers) + parts, False))
    return bases, moments


def _alive_gathers(model: MemoryModel) -> list[tuple[MoveBytes, ...]]:
    """The gathers alive together: the non-layer group, with each layer and the next."""
    rest = tuple(m for g in model.gather_groups if g.label == NON_LAYER for m in g.moves)
    layers = [g.moves for g in model.gather_groups if g.label != NON_LAYER]
    if len(layers) < 2:
        return [rest + tuple(m for moves in layers for m in moves)]
    return [rest + a + b for a, b in zip(layers, layers[1:])]


def _row(
    problem: Problem,
    parts: Sequence[NodeBytes | MoveBytes],
    budget: float,
    moves: dict[MoveBytes, tuple[np.ndarray, np.ndarray]],
    term: tuple[np.ndarray, np.ndarray] = _NO_TERM,
) -> Row:
    """The row ``sum(parts) + term <= budget`` (MiB; ``term``: columns and MiB already);
    ``moves`` caches each move's columns and bytes (folded layers share edges' rows)."""
    columns, values = [term[0]], [term[1] * MIB]
    for part in parts:
        if isinstance(part, NodeBytes):
            columns.append(problem.node_columns[part.node])
            values.append(part.per_strategy)
            continue
        if part not in moves:
            moves[part] = _move_bytes(problem, part)
        columns.append(moves[part][0])
        values.append(moves[part][1])
    row = Row(np.concatenate(columns), np.concatenate(values) / MIB, -np.inf, budget / MIB)
    merged = row.merged()
    keep = merged.values != 0.0
    return Row(merged.columns[keep], merged.values[keep], -np.inf, budget / MIB, budget=True)


def _sum_of(base: Row, added: Row) -> Row:
    """The budget row of ``base``'s terms plus ``added``'s (both rows of :func:`_row`)."""
    if not len(added.columns):
        return base
    row = Row(
        np.concatenate([base.columns, added.columns]),
        np.concatenate([base.values, added.values]),
        -np.inf,
        base.upper,
    )
    merged = row.merged()
    keep = merged.values != 0.0
    return Row(merged.columns[keep], merged.values[keep], -np.inf, base.upper, budget=True)


def _move_bytes(problem: Problem, move: MoveBytes) -> tuple[np.ndarray, np.ndarray]:
    """(columns, bytes) of ``move``'s edge: the redistributed value's local bytes where a
    column changes placements (less the source's where the move is ``net_of_source``),
    else 0. Priced once per distinct placement (a flow-encoded edge has hundreds of arcs
    over a few dozen states)."""
    edge = move.edge
    producer = problem.tables.edges[edge].producer.meta["val"]
    mesh_shape = problem.space.mesh_shape
    columns = np.asarray(problem.edge_columns[edge], dtype=np.int64)
    src, dst, placements_of = _move_ends(problem, edge)
    ids, id_of = np.unique(np.concatenate([dst, src]), return_inverse=True)
    id_bytes = np.array([_value_bytes(producer, placements_of(int(i)), mesh_shape) for i in ids])
    ends_bytes = id_bytes[id_of.reshape(-1)]
    values = ends_bytes[: len(dst)]
    if move.net_of_source:  # the copy less the source, which the activations count
        values = values - ends_bytes[len(dst) :]
    return columns, np.where(src == dst, 0.0, values) * move.copies


def _move_ends(problem: Problem, edge: int) -> tuple[np.ndarray, np.ndarray, Callable]:
    """Each column of edge ``edge`` as (source id, target id) arrays, and the placements of
    an id. Equal ids are equal placements: route states on a flow-encoded edge; on a
    pair-encoded one, options numbered so that a source option equal to a target option
    shares its id."""
    cost = problem.tables.edges[edge]
    if problem.edge_encoding(edge) != "pairs":
        assert cost.routes is not None
        table, pricer = cost.routes.table, cost.routes.pricer
        return np.asarray(table.arc_src), np.asarray(table.arc_dst), pricer.placements_of_state
    options = list(cost.dst_options)
    ids = {placements: i for i, placements in enumerate(options)}
    src_ids = []
    for placements in cost.src_options:
        if placements not in ids:
            ids[placements] = len(options)
            options.append(placements)
        src_ids.append(ids[placements])
    src = np.array([src_ids[i] for i, _, _, _ in cost.pairs], dtype=np.int64)
    dst = np.array([j for _, j, _, _ in cost.pairs], dtype=np.int64)
    return src, dst, options.__getitem__


# ---------------------------------------------------------------------------- the estimate


def estimate_memory(
    problem: Problem,
    choice: dict[fx.Node, int],
    budget: float | None = None,
    recompute_counts: dict[str, int] | None = None,
) -> MemoryEstimate:
    """The bytes per device of each component under ``choice`` (``plan.memory``), with
    ``recompute_counts`` layers of each recompute class (by label) recomputed."""
    model = memory_model(problem)
    counts = recompute_counts or {}

    def total(parts: Sequence[NodeBytes]) -> float:
        return float(sum(part.per_strategy[choice[part.node]] for part in parts))

    parameters, gradients = total(model.parameters), total(model.gradients)
    states, temporaries = total(model.optimizer_state), total(model.step_temporaries)
    readers = parameter_views(problem.joint)
    recomputed = recomputed_layers(model.recompute, counts)
    by_layer: dict[str, float] = {}
    for part, layer in zip(model.activations, model.activation_layers):
        by_layer[layer] = by_layer.get(layer, 0.0) + float(part.per_strategy[choice[part.node]])
    kept = 0.0  # the saved gathers: a recomputed layer gathers again in its backward
    for move in model.saved_gathers:
        name = readers.get(problem.tables.edges[move.edge].producer, "")
        layer = layer_of(name).removesuffix(".") or NON_LAYER
        value = 0.0 if layer in recomputed else _gathered_bytes(problem, move, choice)
        by_layer[layer] = by_layer.get(layer, 0.0) + value
        kept += value
    inner = {cls.label: total(cls.inner) for cls in model.recompute}
    for cls in model.recompute:
        for layer in cls.chosen(counts.get(cls.label, 0)):
            by_layer[layer] = by_layer.get(layer, 0.0) - inner[cls.label]
    all_saved = total(model.activations)
    activations = all_saved + kept - sum(counts.get(c, 0) * i for c, i in inner.items())
    gathered = max(
        (
            sum(_gathered_bytes(problem, m, choice) for m in alive)
            for alive in _alive_gathers(model)
        ),
        default=0.0,
    )
    resident = parameters + states
    moments = {
        "start of the backward": resident + activations + gathered,
        "optimizer step": resident + gradients + temporaries,
    }
    used = [c for c in model.recompute if counts.get(c.label, 0) > 0]
    if used:  # the backward of a recomputed layer (problem/recompute.py)
        freed = sum(len(c.layers) * inner[c.label] for c in model.recompute)
        back = max(inner[c.label] for c in used)
        moments["backward of a recomputed layer"] = (
            resident + all_saved + kept - freed + back + gathered
        )
    peak_at = max(moments, key=moments.__getitem__)
    return MemoryEstimate(
        optimizer=model.optimizer.name,
        parameters=parameters,
        gradients=gradients,
        optimizer_state=states,
        activations=activations,
        # at a recomputed layer's backward, its activations are back on top of the saved
        transient=(
            temporaries
            if peak_at == "optimizer step"
            else moments[peak_at] - resident - activations
        ),
        peak=moments[peak_at],
        peak_at=peak_at,
        budget=budget,
        recomputed=recomputed,
        activations_by_layer=tuple(by_layer.items()),
        recompute_us=sum(counts.get(c.label, 0) * total(c.forward_us) for c in model.recompute),
    )


def _gathered_bytes(problem: Problem, move: MoveBytes, choice: dict[fx.Node, int]) -> float:
    edge = problem.tables.edges[move.edge]
    src, dst = problem.chosen_pair(move.edge, choice)
    if edge.src_options[src] == edge.dst_options[dst]:
        return 0.0
    value, mesh_shape = edge.producer.meta["val"], problem.space.mesh_shape
    copy = _value_bytes(value, edge.dst_options[dst], mesh_shape)
    if move.net_of_source:  # the source is among the activations (see MoveBytes)
        return (copy - _value_bytes(value, edge.src_options[src], mesh_shape)) * move.copies
    return copy * move.copies


# ---------------------------------------------------------------------------- the parts


def _activations(
    problem: Problem, mesh_shape: tuple[int, ...]
) -> tuple[list[NodeBytes], list[str]]:
    """The storages the saved values keep alive (see the module doc), one part each, and the
    layer each one belongs to: the last numbered layer whose parameters the forward read
    before it.

    A saved view keeps its base's whole storage: values are grouped by the node whose
    storage they view (through view ops and the items of a splitting view), which is
    counted once at its own size, whether or not it is saved itself."""
    readers = parameter_views(problem.joint)
    saved = saved_activations(problem.joint)
    layer_at = {node: label or NON_LAYER for node, label in forward_layers(problem.joint).items()}
    roots: dict[fx.Node, None] = {}  # ordered set
    for node in layer_at:
        if node in saved:
            root = storage_root(node)
            own = root not in readers or _is_cast(root)  # a cast is a storage of its own
            if own and root in problem.space.nodes:
                roots[root] = None
    parts = [NodeBytes(root, _strategy_bytes(problem, root, mesh_shape)) for root in roots]
    return parts, [layer_at.get(root, NON_LAYER) for root in roots]


def _saved_gathers(problem: Problem) -> list[MoveBytes]:
    """The moves into the saved parameter reads (a parameter, its cast, views of those):
    where one changes placement, the saved value is the redistributed copy (a transposed
    weight gathered in the forward, say), alive until the backward; where none does, it is
    the parameter's own storage, or its cast's (a storage of its own, counted among the
    activations; a move out of it then counts what it adds, see ``MoveBytes``; exact
    while one move chain leaves each cast). A move into a cast is not saved: the cast
    consumes its copy (a transient gather)."""
    joint = problem.joint
    readers = parameter_views(joint)
    saved = {p for p in _read_by_backward(joint) if p in readers and p.op == "call_function"}
    chain: set[fx.Node] = set()  # the saved reads and the reads they view
    for node in saved:
        while node in readers and node not in chain:
            chain.add(node)
            node = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    return [
        MoveBytes(index, net_of_source=_is_cast(edge.producer) and edge.producer not in saved)
        for index, edge in enumerate(problem.tables.edges)
        if edge.kind == "arg"
        and edge.consumer in chain
        and edge.producer in readers
        and not _is_cast(edge.consumer)
    ]


def _is_cast(node: fx.Node) -> bool:
    """A parameter read with a storage of its own (its mixed-precision cast), given a
    node of ``parameter_views``: an op that is no view."""
    return node.op == "call_function" and storage_root(node) is node


def saved_activations(joint: JointGraph) -> set[fx.Node]:
    """The forward ops' values and user inputs the backward reads (what the runtime saves,
    parameters aside)."""
    inputs = set(joint.user_inputs)
    return {
        producer
        for producer in _read_by_backward(joint)
        if (producer in joint.forward_nodes and producer.op == "call_function")
        or producer in inputs
    }


def _read_by_backward(joint: JointGraph) -> set[fx.Node]:
    """Every node an op of the backward reads (computed there or saved from before)."""
    return {
        producer
        for node in joint.graph.nodes
        if node.op == "call_function" and node not in joint.forward_nodes
        for producer in node.all_input_nodes
    }


def _gather_groups(problem: Problem, saved: set[int]) -> list[GatherGroup]:
    """The forward's parameter reads by the group the runtime gathers them in, in order of
    first read; the moves in ``saved`` (kept for the backward: activations) left out."""
    joint = problem.joint
    readers = parameter_views(joint)
    groups: dict[str, list[MoveBytes]] = {}
    for index, edge in enumerate(problem.tables.edges):
        if edge.kind != "arg" or edge.consumer not in joint.forward_nodes:
            continue
        if edge.producer not in readers or index in saved:
            continue
        label = layer_of(readers[edge.producer]).removesuffix(".") or NON_LAYER
        groups.setdefault(label, []).append(MoveBytes(index))
    return [GatherGroup(label, tuple(moves)) for label, moves in groups.items()]


def _strategy_bytes(problem: Problem, node: fx.Node, mesh_shape: tuple[int, ...]) -> np.ndarray:
    value = node.meta.get("val")
    return np.array(
        [_value_bytes(value, s.output, mesh_shape) for s in problem.space[node].strategies]
    )


def _value_bytes(value: object, placements: object, mesh_shape: tuple[int, ...]) -> float:
    """Local bytes of ``value`` (a tensor or a tuple of them) under ``placements``."""
    if isinstance(value, torch.Tensor):
        if is_multi(placements):
            placements = placements[0]
        if placements is None:
            return 0.0
        shape = local_shape(value.shape, placements, mesh_shape)
        return float(math.prod(shape) * value.element_size())
    if isinstance(value, (tuple, list)) and is_multi(placements):
        return sum(
            _value_bytes(item, p, mesh_shape) for item, p in zip(value, placements) if p is not None
        )
    return 0.0


def _itemsize(node: fx.Node, default: int) -> int:
    value = node.meta.get("val")
    return value.element_size() if isinstance(value, torch.Tensor) else default


def _all_parts(model: MemoryModel) -> tuple[NodeBytes, ...]:
    return (
        model.parameters
        + model.gradients
        + model.optimizer_state
        + model.step_temporaries
        + model.activations
    )


def _gib(value: float) -> str:
    return f"{value / 2**30:.3f} GiB" if value >= 2**28 else f"{value / MIB:.2f} MiB"
