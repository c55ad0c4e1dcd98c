"""The N-layer joint graph built from 3- and 4-layer traces, checked node for node.

Given traces of the model with its first 3 and first 4 layers (``repeated_layers.py``):

1. The 3-layer graph is cut into fixed nodes (embedding, head, loss, ...) and *regions*, each
   holding one block per layer: the forward blocks, the backward blocks (last layer first)
   and runs of per-parameter ops such as mixed-precision casts. ``difflib`` on the two
   graphs' node signatures finds where one more layer inserts nodes, one insertion per
   region; the blocks are searched near it, where the signatures repeat with that period and
   each block reads only its own layer's parameters.
2. :func:`stamp_layers` lays out layer 0's blocks, N-2 copies of layer 1's and layer 2's.
   Every copy reads its neighbours at the same relative layer as the template did, and its
   own layer's parameters; new parameters get placeholders and gradient outputs named after
   their layer. FX names the nodes in creation order, so names match a full trace too.
3. A cut is accepted only if stamping the 3-layer graph to 4 layers reproduces the real
   4-layer trace node for node (:func:`first_difference`: ops, wiring, shapes, strides,
   descriptors). Otherwise :class:`CannotRepeatLayers` says why and every layer is traced.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
import torch.fx as fx

from autoparallel import _torch_internals as internals
from autoparallel.types.graph import RepeatedLayers

logger = logging.getLogger(__name__)

# Traced depths: the template (layer 0, one middle layer, the last layer) and its check.
TEMPLATE_LAYERS = 3
CHECK_LAYERS = 4
# Cuts tried before giving up (each try stamps and compares a 4-layer graph).
MAX_CUT_TRIES = 64


class CannotRepeatLayers(Exception):
    """The short traces do not determine the full graph; the message says why."""


# ---------------------------------------------------------------------------- the cut


@dataclass(frozen=True)
class _Region:
    """A run of the 3-layer graph's call nodes that holds one block per layer.

    Block i covers ``[start + i*length, start + (i+1)*length)`` and belongs to layer i, or to
    layer 2-i when ``descending`` (backward regions run from the last layer to the first).
    """

    start: int
    length: int
    descending: bool

    def layer_of_block(self, block: int) -> int:
        return TEMPLATE_LAYERS - 1 - block if self.descending else block


@dataclass(frozen=True)
class _Label:
    """A node's place in the layers: kind ("p" for placeholders, else its region), layer
    index and its key within the layer (offset in the block, or parameter name)."""

    kind: str
    layer: int
    key: Any


def stamp_verified(
    template: fx.GraphModule, check: fx.GraphModule, layers: RepeatedLayers, name_prefix: str = ""
) -> fx.GraphModule:
    """The graph of all ``layers.count`` layers, built from ``template`` and checked on ``check``.

    ``template`` and ``check`` are traces of the model with its first ``TEMPLATE_LAYERS`` and
    ``CHECK_LAYERS`` layers. Raises :class:`CannotRepeatLayers` when no layout of
    ``template``'s layers reproduces ``check``.
    """
    if any(n.op == "get_attr" for n in template.graph.nodes):
        raise CannotRepeatLayers("the traced graph reads module attributes (get_attr nodes)")
    prefixes = [layers.param_prefix(i, name_prefix) for i in range(layers.count)]
    last_reason = "no layout of the layers fits the 3-layer graph"
    for tries, cut in enumerate(_candidate_cuts(template, check, prefixes)):
        if tries >= MAX_CUT_TRIES:
            break
        try:
            stamped = stamp_layers(template, cut, prefixes, CHECK_LAYERS)
        except CannotRepeatLayers as exc:
            last_reason = str(exc)
            continue
        difference = first_difference(stamped.graph, check.graph)
        if difference is None:
            logger.debug("layer cut %s reproduces the %d-layer trace", cut, CHECK_LAYERS)
            return stamp_layers(template, cut, prefixes, layers.count)
        last_reason = (
            f"repeating a layer does not reproduce the {CHECK_LAYERS}-layer trace: {difference}"
        )
    raise CannotRepeatLayers(last_reason)


def _call_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]


def _candidate_cuts(
    template: fx.GraphModule, check: fx.GraphModule, prefixes: list[str]
) -> Iterator[tuple[_Region, ...]]:
    """Layouts of the 3-layer graph's layer blocks that could explain the 4-layer graph.

    The 4-layer graph is the 3-layer one with one block inserted per region (the forward
    pass, the backward pass, and any run of per-parameter ops such as precision casts);
    ``difflib`` finds the insertions. Each region's blocks lie within three block lengths
    of its insertion, wherever the graph repeats with that period and each block reads
    only its own layer's parameters.
    """
    graph3, graph4 = template.graph, check.graph
    calls3 = _call_nodes(graph3)
    placeholder_layer = _placeholder_layers(graph3, prefixes[:TEMPLATE_LAYERS])
    signatures3 = [_signature(n, placeholder_layer) for n in calls3]
    placeholder_layer4 = _placeholder_layers(graph4, prefixes[:CHECK_LAYERS])
    signatures4 = [_signature(n, placeholder_layer4) for n in _call_nodes(graph4)]
    insertions = []
    for tag, i1, _, j1, j2 in difflib.SequenceMatcher(
        None, signatures3, signatures4, autojunk=False
    ).get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            raise CannotRepeatLayers("the 4-layer graph is not the 3-layer graph with nodes added")
        insertions.append((i1, j2 - j1))
    if not insertions:
        raise CannotRepeatLayers("one more layer adds no nodes to the graph")
    layer_reads = [
        {placeholder_layer[x].layer for x in n.all_input_nodes if x in placeholder_layer}
        for n in calls3
    ]

    def fits(region: _Region) -> bool:
        start, length = region.start, region.length
        if any(signatures3[n] != signatures3[n + length] for n in range(start, start + 2 * length)):
            return False
        for block in range(TEMPLATE_LAYERS):
            positions = range(start + block * length, start + (block + 1) * length)
            if any(layer_reads[n] - {region.layer_of_block(block)} for n in positions):
                return False
        return True

    options = []
    for position, length in insertions:
        lowest, highest = max(0, position - 3 * length), min(position, len(calls3) - 3 * length)
        found = [
            region
            for start in range(lowest, highest + 1)
            for descending in (False, True)
            if fits(region := _Region(start, length, descending))
        ]
        if not found:
            raise CannotRepeatLayers(
                f"no run of the 3-layer graph near node {position} repeats every {length} nodes"
            )
        options.append(found)
    for regions in itertools.product(*options):
        if not _overlapping(regions):
            yield regions


def _overlapping(regions: tuple[_Region, ...]) -> bool:
    spans = sorted((r.start, r.start + 3 * r.length) for r in regions)
    return any(end > next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))


def _signature(node: fx.Node, placeholder_layer: dict[fx.Node, _Label]) -> tuple:
    inputs = []
    for x in node.all_input_nodes:
        if x in placeholder_layer:
            inputs.append(("layer", placeholder_layer[x].key))
        elif x.op == "placeholder":
            inputs.append(repr(x.meta.get("desc")))
        else:
            inputs.append("node")
    return (node.target, _value_signature(node.meta.get("val")), tuple(inputs))


def _value_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, tuple(value.stride()))
    if isinstance(value, (tuple, list)):
        return tuple(_value_signature(v) for v in value)
    return repr(value)


def _placeholder_layers(graph: fx.Graph, prefixes: list[str]) -> dict[fx.Node, _Label]:
    """Parameter/buffer placeholders of the layers -> ("p", layer, name inside the layer)."""
    found: dict[fx.Node, _Label] = {}
    for node in graph.find_nodes(op="placeholder"):
        kind, name = internals.describe_input(node.meta.get("desc"))
        if kind not in ("param", "buffer"):
            continue
        for layer, prefix in enumerate(prefixes):
            if name.startswith(prefix):
                found[node] = _Label("p", layer, (kind, name[len(prefix) :]))
                break
    return found


# ---------------------------------------------------------------------------- stamping


def stamp_layers(
    template: fx.GraphModule, cut: tuple[_Region, ...], prefixes: list[str], n_layers: int
) -> fx.GraphModule:
    """Lay out ``n_layers`` layers from the 3-layer ``template`` cut at ``cut``.

    ``prefixes[i]`` is the parameter-name prefix of layer i (at least ``n_layers`` of them).
    Raises :class:`CannotRepeatLayers` where the template's dataflow does not follow the cut.
    """
    graph = template.graph
    labels = _placeholder_layers(graph, prefixes[:TEMPLATE_LAYERS])
    calls = _call_nodes(graph)
    descending = {"p": False}
    for index, region in enumerate(cut):
        kind = f"region{index}"
        descending[kind] = region.descending
        for block in range(TEMPLATE_LAYERS):
            for offset in range(region.length):
                node = calls[region.start + block * region.length + offset]
                labels[node] = _Label(kind, region.layer_of_block(block), offset)
    return _Stamper(template, labels, descending, prefixes, n_layers).run()


class _Stamper:
    """One layout of the template: walks its nodes in order and emits each group once per
    layer it stands for (layer 0 -> 0, layer 1 -> 1..N-2, layer 2 -> N-1)."""

    def __init__(
        self,
        template: fx.GraphModule,
        labels: dict[fx.Node, _Label],
        descending: dict[str, bool],
        prefixes: list[str],
        n_layers: int,
    ):
        self.template_module = template
        self.template = template.graph
        self.labels = labels
        self.descending = descending
        self.prefixes = prefixes
        self.n_layers = n_layers
        self.graph = fx.Graph()
        self.fixed: dict[fx.Node, fx.Node] = {}
        self.layered: dict[tuple[str, int, Any], fx.Node] = {}
        self.placeholder_counts: dict[str, int] = {}

    def run(self) -> fx.GraphModule:
        nodes = [n for n in self.template.nodes if n.op != "output"]
        for group_label, group in groupby(nodes, key=self._group_of):
            members = list(group)
            if group_label is None:
                for node in members:
                    self.fixed[node] = self._emit(node, template_layer=None, layer=None)
                continue
            kind, template_layer = group_label
            for layer in self._layers_for(kind, template_layer):
                for node in members:
                    label = self.labels[node]
                    self.layered[(label.kind, layer, label.key)] = self._emit(
                        node, template_layer, layer
                    )
        self._emit_output(self.template.output_node())
        return internals.unrun_graph_module(self.template_module, self.graph)

    def _group_of(self, node: fx.Node) -> tuple[str, int] | None:
        label = self.labels.get(node)
        return None if label is None else (label.kind, label.layer)

    def _layers_for(self, kind: str, template_layer: int) -> list[int]:
        last = self.n_layers - 1
        if template_layer == 0:
            return [0]
        if template_layer == TEMPLATE_LAYERS - 1:
            return [last]
        middle = list(range(1, last))
        return middle[::-1] if self.descending[kind] else middle

    def _target_layer(self, source: _Label, template_layer: int | None, layer: int | None) -> int:
        """The layer whose copy of ``source`` a node of ``template_layer``, emitted as
        ``layer``, reads."""
        if template_layer is None:  # a fixed node sees the first and the last layer only
            if source.layer == 0:
                return 0
            if source.layer == TEMPLATE_LAYERS - 1:
                return self.n_layers - 1
            raise CannotRepeatLayers("a node outside the layers reads the middle layer")
        target = layer + source.layer - template_layer
        if not 0 <= target < self.n_layers:
            raise CannotRepeatLayers(
                f"a layer reads layer {target}, outside 0..{self.n_layers - 1}"
            )
        return target

    def _lookup(self, source: fx.Node, template_layer: int | None, layer: int | None) -> fx.Node:
        label = self.labels.get(source)
        if label is None:
            return self.fixed[source]
        key = (label.kind, self._target_layer(label, template_layer, layer), label.key)
        found = self.layered.get(key)
        if found is None:
            raise CannotRepeatLayers(
                "a layer reads a node that comes after it in the repeated graph"
            )
        return found

    def _emit(self, node: fx.Node, template_layer: int | None, layer: int | None) -> fx.Node:
        args = fx.map_arg(node.args, lambda x: self._lookup(x, template_layer, layer))
        kwargs = fx.map_arg(node.kwargs, lambda x: self._lookup(x, template_layer, layer))
        name = self._placeholder_name(node) if node.op == "placeholder" else _base_name(node.name)
        target = (
            name if node.op == "placeholder" else node.target
        )  # a placeholder's target is its argument name
        new = self.graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
        new.meta = dict(node.meta)
        if node.op == "placeholder" and layer is not None:
            new.meta["desc"] = self._retarget(node.meta.get("desc"), template_layer, layer)
        return new

    def _placeholder_name(self, node: fx.Node) -> str:
        stem = _base_name(node.name)
        self.placeholder_counts[stem] = self.placeholder_counts.get(stem, 0) + 1
        return f"{stem}_{self.placeholder_counts[stem]}"

    def _retarget(self, desc: Any, template_layer: int, layer: int) -> Any:
        return internals.retarget_descriptor(
            desc, self.prefixes[template_layer], self.prefixes[layer]
        )

    def _emit_output(self, output: fx.Node) -> None:
        values, descs = output.args[0], output.meta.get("desc")
        if descs is None or len(descs) != len(values):
            raise CannotRepeatLayers("the graph's outputs carry no descriptors")
        entries = list(zip(values, descs))
        new_values: list[Any] = []
        new_descs: list[Any] = []
        for layer_of_group, group in groupby(
            entries, key=lambda entry: self._gradient_layer(entry[1])
        ):
            members = list(group)
            if layer_of_group is None:
                for value, desc in members:
                    new_values.append(fx.map_arg(value, lambda x: self._lookup(x, None, None)))
                    new_descs.append(desc)
                continue
            for layer in self._layers_for("p", layer_of_group):
                for value, desc in members:
                    new_values.append(
                        fx.map_arg(
                            value,
                            lambda x, template=layer_of_group, at=layer: self._lookup(
                                x, template, at
                            ),
                        )
                    )
                    new_descs.append(self._retarget(desc, layer_of_group, layer))
        result = self.graph.output(type(values)(new_values))
        result.meta = dict(output.meta)
        result.meta["desc"] = new_descs

    def _gradient_layer(self, desc: Any) -> int | None:
        kind, key = internals.describe_output(desc)
        if kind != "grad" or key[0] not in ("param", "buffer"):
            return None
        name = key[1]
        for layer in range(TEMPLATE_LAYERS):
            if name.startswith(self.prefixes[layer]):
                return layer
        return None


def _base_name(name: str) -> str:
    """``mm_12`` -> ``mm``: FX numbers repeated names itself, in creation order."""
    return re.sub(r"_\d+$", "", name)


# ---------------------------------------------------------------------------- comparing


def first_difference(stamped: fx.Graph, traced: fx.Graph) -> str | None:
    """The first place two graphs differ in ops, wiring, values or descriptors (None if equal).

    Node names are not compared: they carry no meaning for later stages.
    """
    nodes_a, nodes_b = list(stamped.nodes), list(traced.nodes)
    if len(nodes_a) != len(nodes_b):
        return f"{len(nodes_a)} nodes against {len(nodes_b)}"
    index_a = {n: i for i, n in enumerate(nodes_a)}
    index_b = {n: i for i, n in enumerate(nodes_b)}
    for position, (a, b) in enumerate(zip(nodes_a, nodes_b)):
        if a.op != b.op or (a.op != "placeholder" and a.target != b.target):
            return f"node {position}: {a.op} {a.target} against {b.op} {b.target}"
        if _wiring(a, index_a) != _wiring(b, index_b):
            return f"node {position} ({b.name}): different arguments"
        if _value_signature(a.meta.get("val")) != _value_signature(b.meta.get("val")):
            return f"node {position} ({b.name}): different shape, dtype or strides"
        if repr(a.meta.get("desc")) != repr(b.meta.get("desc")):
            return (
                f"node {position} ({b.name}): {a.meta.get('desc')!r} against {b.meta.get('desc')!r}"
            )
    return None


def _wiring(node: fx.Node, index: dict[fx.Node, int]) -> Any:
    def plain(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return ("node", index[value])
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(plain(v) for v in value))
        if isinstance(value, dict):
            return tuple((k, plain(v)) for k, v in value.items())
        if isinstance(value, torch.Tensor):
            return ("tensor", _value_signature(value))
        return repr(value)

    return plain(node.args), plain(node.kwargs)
