"""Tracing repeated layers once: a deep model's joint graph built from two short traces.

Tracing is torch's own per-op work, about 0.2 s per LLaMA layer on a laptop core, so an
80-layer model would spend most of its planning time there. When a model's layers are
identical modules we trace the model twice with only its first 3 and first 4 layers, and
build the N-layer graph from the 3-layer one:

1. :func:`find_repeated_layers` finds the longest ``ModuleList``/``ModuleDict`` whose children
   are the same class with the same parameter and buffer shapes, equal plain attributes and
   no hooks (so nothing visible tells one layer from another).
2. The 3-layer graph is cut into fixed nodes (embedding, head, loss, ...) and, per layer, a
   forward block and a backward block. Block lengths are the difference between the 3- and
   4-layer graphs; where a block starts is searched among the shifts under which the graph
   repeats with that period.
3. :func:`stamp_layers` lays out layer 0's blocks, N-2 copies of layer 1's and layer 2's
   (backward blocks in reverse). Every copy reads its neighbours at the same relative layer
   as the template did, and its own layer's parameters; new parameters get placeholders and
   gradient outputs named after their layer.
4. A cut is accepted only if stamping the 3-layer graph to 4 layers reproduces the real
   4-layer trace node for node (ops, arguments, shapes, strides, descriptors). Otherwise
   the caller traces every layer, and logs why.

Step 4 is what makes this safe for models we never saw: a forward that treats layers by
their index in a way two neighbours do not show (``if i == 57``) is the one thing it cannot
catch; ``AutoParallel(..., trace_layers_once=False)`` traces every layer.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import logging
import re
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from autoparallel import _torch_internals as internals

logger = logging.getLogger(__name__)

# Below this depth a full trace costs about what the two short traces do.
MIN_LAYERS = 6
# Traced depths: the template (layer 0, one middle layer, the last layer) and its check.
TEMPLATE_LAYERS = 3
CHECK_LAYERS = 4
# Cut positions tried before giving up (each try stamps and compares a 4-layer graph).
MAX_CUT_TRIES = 64

_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_HOOK_DICT = re.compile(r"^_(global_)?(forward|backward|state_dict|load_state_dict).*hooks.*$")


class CannotRepeatLayers(Exception):
    """The short traces do not determine the full graph; the message says why."""


@dataclass(frozen=True)
class RepeatedLayers:
    """A container of identical layers: its path in the model and its children's names.

    ``index_attributes`` are integer attributes that number the layers (Hugging Face's
    ``self_attn.layer_idx``, kept for the KV cache). They are the only thing allowed to
    differ; the short traces run with them replaced by :class:`UnreadLayerIndex`, so a
    forward that reads them fails there and the model is traced layer by layer.
    """

    path: str
    keys: tuple[str, ...]
    index_attributes: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.keys)

    def param_prefix(self, layer: int, name_prefix: str = "") -> str:
        """Start of the names of ``layer``'s parameters (``"layers.3."``)."""
        return f"{name_prefix}{self.path}.{self.keys[layer]}."


# ---------------------------------------------------------------------------- finding layers


def find_repeated_layers(model: nn.Module, min_layers: int = MIN_LAYERS) -> RepeatedLayers | None:
    """The outermost container of at least ``min_layers`` interchangeable layers, if any.

    Containers inside another stack of same-class layers (the experts of each MoE layer)
    are not considered: repeating the outer stack is what saves the trace. Among several
    outer stacks the longest wins. A stack whose layers are not interchangeable is logged
    with the first difference found, since it means every layer is traced.
    """
    shared = _shared_parameter_ids(model)
    stacks: list[str] = []
    best: RepeatedLayers | None = None
    for path, container in model.named_modules():
        if not path or not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or len(container) < min_layers:
            continue
        children = list(container._modules.items())
        if any(child is None for _, child in children) or len({type(child) for _, child in children}) > 1:
            continue
        if any(path.startswith(outer + ".") for outer in stacks):
            continue
        stacks.append(path)
        reason, index_attributes = _why_not_repeated(container, children, shared)
        if reason is not None:
            logger.info("the %d layers of `%s` are traced one by one: %s", len(children), path, reason)
            continue
        if best is None or len(children) > best.count:
            best = RepeatedLayers(path, tuple(key for key, _ in children), tuple(sorted(index_attributes)))
    return best


def _why_not_repeated(
    container: nn.Module, children: list[tuple[str, nn.Module]], shared: set[int]
) -> tuple[str | None, set[str]]:
    """(why the children are not interchangeable or None, their integer index attributes)."""
    if _has_hooks(container):
        return "the container has hooks", set()
    first_key, first = children[0]
    index_attributes: set[str] = set()
    for key, child in children[1:]:
        difference = _difference(first, child, index_attributes)
        if difference is not None:
            return f"layer {key} differs from layer {first_key}: {difference}", set()
    for key, child in children:
        if any(id(param) in shared for param in child.parameters()):
            return f"layer {key} shares a parameter with another module", set()
    return None, index_attributes


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    """Parameters reachable under more than one name (tied): a copy could not own them."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _has_hooks(module: nn.Module) -> bool:
    return any(_HOOK_DICT.match(key) and value for key, value in vars(module).items())


def _difference(a: nn.Module, b: nn.Module, index_attributes: set[str]) -> str | None:
    """The first thing that tells layer ``b`` from layer ``a`` (None if nothing does).

    Integer attributes that differ are not a difference: they are added to
    ``index_attributes`` (dotted paths inside the layer).
    """
    modules_a, modules_b = list(a.named_modules()), list(b.named_modules())
    if [name for name, _ in modules_a] != [name for name, _ in modules_b]:
        return "different submodules"
    for (name, x), (_, y) in zip(modules_a, modules_b):
        where = name or "the layer"
        if type(x) is not type(y):
            return f"{where} is a {type(x).__name__} in one and a {type(y).__name__} in the other"
        if _has_hooks(x) or _has_hooks(y):
            return f"{where} has hooks"
        if _tensor_layout(x._parameters) != _tensor_layout(y._parameters):
            return f"{where} has other parameter shapes, dtypes or requires_grad"
        if _tensor_layout(x._buffers) != _tensor_layout(y._buffers) or (
            x._non_persistent_buffers_set != y._non_persistent_buffers_set
        ):
            return f"{where} has other buffers"
        state_x, state_y = _plain_state(x), _plain_state(y)
        for key in sorted(state_x.keys() | state_y.keys()):
            path = f"{name}.{key}" if name else key
            if key not in state_x or key not in state_y:
                return f"`{path}` is set in one layer only"
            value_x, value_y = state_x[key], state_y[key]
            if _same_value(value_x, value_y):
                continue
            if type(value_x) is int and type(value_y) is int:
                index_attributes.add(path)
                continue
            return f"`{path}` differs"
    return None


def _plain_state(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS and not _HOOK_DICT.match(k)}


def _tensor_layout(tensors: dict[str, Any]) -> list[tuple]:
    return [
        (name, None) if t is None else (name, tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in tensors.items()
    ]


def _same_value(a: Any, b: Any) -> bool:
    """Equal plain settings; anything richer must be the very same object."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return a == b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, functools.partial):  # e.g. an activation made per layer: partial(gelu, ...)
        return a.func is b.func and _same_value(a.args, b.args) and _same_value(a.keywords, b.keywords)
    return False


class LayerIndexRead(RuntimeError):
    """The model's forward read a layer-numbering attribute while being traced."""


class UnreadLayerIndex:
    """Stands in for a layer's index attribute in the short traces: any use of its value
    (comparison, arithmetic, hashing, indexing, formatting) raises :class:`LayerIndexRead`."""

    def __init__(self, attribute: str) -> None:
        object.__setattr__(self, "attribute", attribute)

    def _read(self, *args: Any, **kwargs: Any) -> Any:
        raise LayerIndexRead(f"the forward reads the layer index `{self.attribute}`")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __bool__ = _read
    __int__ = __index__ = __float__ = __str__ = __format__ = __neg__ = __abs__ = _read
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _read
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __pow__ = __rpow__ = _read

    def __repr__(self) -> str:
        return f"<layer index {self.attribute}, not to be read while tracing>"

    def __copy__(self) -> "UnreadLayerIndex":
        return self

    def __deepcopy__(self, memo: dict) -> "UnreadLayerIndex":
        return self


def with_first_layers(model: nn.Module, layers: RepeatedLayers, count: int) -> nn.Module:
    """A shallow copy of ``model`` whose container holds only its first ``count`` layers,
    their index attributes replaced by :class:`UnreadLayerIndex`.

    Only the modules on the way to what changes are copied; the user's model is untouched.
    """
    container = model.get_submodule(layers.path)
    kept = [(key, _without_index(container._modules[key], layers.index_attributes)) for key in layers.keys[:count]]
    short = nn.ModuleDict(kept) if isinstance(container, nn.ModuleDict) else nn.ModuleList(m for _, m in kept)
    return _replace_submodule(model, layers.path.split("."), short)


def _without_index(layer: nn.Module, index_attributes: tuple[str, ...]) -> nn.Module:
    for attribute in index_attributes:
        *module_path, name = attribute.split(".")
        owner = _shallow_copy(layer.get_submodule(".".join(module_path)))
        object.__setattr__(owner, name, UnreadLayerIndex(attribute))
        layer = _replace_submodule(layer, module_path, owner)
    return layer


def _shallow_copy(module: nn.Module) -> nn.Module:
    copied = object.__new__(type(module))
    copied.__dict__.update(module.__dict__)
    copied._modules = dict(module._modules)
    return copied


def _replace_submodule(module: nn.Module, path: list[str], new: nn.Module) -> nn.Module:
    if not path:
        return new
    head, *rest = path
    copied = _shallow_copy(module)
    copied._modules[head] = _replace_submodule(module._modules[head], rest, new)
    return copied


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
        last_reason = f"repeating a layer does not reproduce the {CHECK_LAYERS}-layer trace: {difference}"
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
    for tag, i1, _, j1, j2 in difflib.SequenceMatcher(None, signatures3, signatures4, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            raise CannotRepeatLayers("the 4-layer graph is not the 3-layer graph with nodes added")
        insertions.append((i1, j2 - j1))
    if not insertions:
        raise CannotRepeatLayers("one more layer adds no nodes to the graph")
    layer_reads = [{placeholder_layer[x].layer for x in n.all_input_nodes if x in placeholder_layer} for n in calls3]

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
            raise CannotRepeatLayers(f"no run of the 3-layer graph near node {position} repeats every {length} nodes")
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
                found[node] = _Label("p", layer, (kind, name[len(prefix):]))
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
    return _Stamper(graph, labels, descending, prefixes, n_layers).run(template)


class _Stamper:
    """One layout of the template: walks its nodes in order and emits each group once per
    layer it stands for (layer 0 -> 0, layer 1 -> 1..N-2, layer 2 -> N-1)."""

    def __init__(
        self,
        graph: fx.Graph,
        labels: dict[fx.Node, _Label],
        descending: dict[str, bool],
        prefixes: list[str],
        n_layers: int,
    ):
        self.template = graph
        self.labels = labels
        self.descending = descending
        self.prefixes = prefixes
        self.n_layers = n_layers
        self.graph = fx.Graph()
        self.fixed: dict[fx.Node, fx.Node] = {}
        self.layered: dict[tuple[str, int, Any], fx.Node] = {}
        self.placeholder_counts: dict[str, int] = {}

    def run(self, template: fx.GraphModule) -> fx.GraphModule:
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
                    self.layered[(label.kind, layer, label.key)] = self._emit(node, template_layer, layer)
        self._emit_output(self.template.output_node())
        return fx.GraphModule(template, self.graph)

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
            raise CannotRepeatLayers(f"a layer reads layer {target}, outside 0..{self.n_layers - 1}")
        return target

    def _lookup(self, source: fx.Node, template_layer: int | None, layer: int | None) -> fx.Node:
        label = self.labels.get(source)
        if label is None:
            return self.fixed[source]
        key = (label.kind, self._target_layer(label, template_layer, layer), label.key)
        found = self.layered.get(key)
        if found is None:
            raise CannotRepeatLayers("a layer reads a node that comes after it in the repeated graph")
        return found

    def _emit(self, node: fx.Node, template_layer: int | None, layer: int | None) -> fx.Node:
        args = fx.map_arg(node.args, lambda x: self._lookup(x, template_layer, layer))
        kwargs = fx.map_arg(node.kwargs, lambda x: self._lookup(x, template_layer, layer))
        name = self._placeholder_name(node) if node.op == "placeholder" else _base_name(node.name)
        target = name if node.op == "placeholder" else node.target  # a placeholder's target is its argument name
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
        return internals.retarget_descriptor(desc, self.prefixes[template_layer], self.prefixes[layer])

    def _emit_output(self, output: fx.Node) -> None:
        values, descs = output.args[0], output.meta.get("desc")
        if descs is None or len(descs) != len(values):
            raise CannotRepeatLayers("the graph's outputs carry no descriptors")
        entries = list(zip(values, descs))
        new_values: list[Any] = []
        new_descs: list[Any] = []
        for layer_of_group, group in groupby(entries, key=lambda entry: self._gradient_layer(entry[1])):
            members = list(group)
            if layer_of_group is None:
                for value, desc in members:
                    new_values.append(fx.map_arg(value, lambda x: self._lookup(x, None, None)))
                    new_descs.append(desc)
                continue
            for layer in self._layers_for("p", layer_of_group):
                for value, desc in members:
                    new_values.append(fx.map_arg(value, lambda x: self._lookup(x, layer_of_group, layer)))
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
            return f"node {position} ({b.name}): {a.meta.get('desc')!r} against {b.meta.get('desc')!r}"
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
