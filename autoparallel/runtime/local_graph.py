"""Trace the planned program once into plain local FX graphs.

Interpreting the joint graph op by op through DTensor costs Python dispatch on every op of
every step. The first call of each phase (forward, backward, inference) is therefore traced
with ``make_fx`` on fake copies of this rank's tensors (same shapes, strides and dtypes, no
data): DTensor's dispatch and redistributions unfold into plain ATen ops on local shapes and
torch's functional collectives (``_c10d_functional.all_gather_into_tensor`` and friends).
Every call, the first included, then runs that graph on the real tensors (eagerly, as its
source with the ops bound once: runtime/bound_graph.py).

Wrapping local tensors as DTensors (the phase's inputs, the saved values) leaves one view of
each input to its own shape in the trace; :func:`drop_identity_views` removes them, since on
a CPU every op of the local graph costs its Python dispatch.

DTensor's all-reduce is torch's functional one, which copies its input before reducing it;
where that input is a temporary no other op reads (a gradient bucket's flat buffer, a
matmul's partial sums), :func:`reduce_in_place` reduces the temporary itself instead.

Tracing runs nothing: no collective is issued and no buffer is handed to the process
group while the tracer runs. The contract the ranks rely on is that every call of a phase,
the first one included, issues exactly the collectives of its local graph, in the graph's
order: the process group pairs the ranks' collectives by their sequence number alone, so a
rank that issued one more than its peer would pair every later collective with a different
one, and the transport would write one collective's bytes into another's buffer. (Tracing
on real tensors issued each phase's collectives a second time, from inside the tracer:
safe only while every rank's tracer did exactly the same.)

Under ``torch.compile`` the phases are not traced here: AOTAutograd traces them itself
(see runtime/module.py and runtime/compile.py) and Inductor compiles the result.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from autoparallel import _torch_internals as internals
from autoparallel.regions.context import RegionScope, region_scope
from autoparallel.runtime.bound_graph import bound_program
from autoparallel.runtime.shards import wrap_shard


@dataclass
class SavedSlot:
    """Where one saved local tensor goes back in the backward environment."""

    node: fx.Node
    index: int | None  # position inside a multi-output value, or None
    placements: tuple
    arity: int  # length of the multi-output value (0 for a single tensor)
    shape: tuple[int, ...]  # the global shape (an uneven shard cannot be inferred locally)


def flatten_saved(
    env: dict[fx.Node, Any], nodes: list[fx.Node]
) -> tuple[list[torch.Tensor], list[SavedSlot]]:
    """Local tensors of the saved values, and how to rebuild them as DTensors."""
    tensors, slots = [], []
    for node in nodes:
        value = env[node]
        if isinstance(value, DTensor):
            tensors.append(value.to_local())
            slots.append(SavedSlot(node, None, tuple(value.placements), 0, tuple(value.shape)))
            continue
        for index, item in enumerate(value):
            if isinstance(item, DTensor):
                tensors.append(item.to_local())
                slots.append(
                    SavedSlot(node, index, tuple(item.placements), len(value), tuple(item.shape))
                )
    return tensors, slots


def rebuild_saved(
    tensors: list[torch.Tensor], slots: list[SavedSlot], mesh: Any
) -> dict[fx.Node, Any]:
    env: dict[fx.Node, Any] = {}
    for tensor, slot in zip(tensors, slots):
        value = wrap_shard(tensor, mesh, slot.placements, slot.shape)
        if slot.index is None:
            env[slot.node] = value
            continue
        items = env.setdefault(slot.node, [None] * slot.arity)
        items[slot.index] = value
    return env


class TracedPhase:
    """A phase function, traced into a local graph on its first call.

    ``parameter_positions`` says, when the phase is traced, which of its inputs are
    parameters (or their casts and views): their gathers are issued one gather ahead (see
    :func:`issue_collectives_early`). ``regions`` is the scope the model's ``local_map``
    region ops find their bodies in (regions/context.py), set around every call; a region
    op stays one op of the local graph (its body's sizes may depend on the data)."""

    def __init__(
        self,
        name: str,
        function: Callable[..., list[torch.Tensor]],
        parameter_positions: Callable[[], Collection[int]] = tuple,
        regions: RegionScope | None = None,
    ):
        self.name = name
        self.function = function
        self.parameter_positions = parameter_positions
        self.regions = regions
        self.graph_module: fx.GraphModule | None = None  # functional ops only
        self.eager_module: fx.GraphModule | None = None  # the same, reduced in place
        self.eager_program: Callable[..., Any] | None = None  # eager_module, ops bound once
        # seconds the eager graph ran while ``timed`` (runtime/timing.py's graph_clock): what
        # the module's step spent inside its graphs, the rest being its own work
        self.timed = False
        self.graph_s = 0.0

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        with region_scope(self.regions) if self.regions is not None else contextlib.nullcontext():
            if get_proxy_mode() is not None:
                # Already being traced (torch.compile's AOTAutograd): let that tracer see the
                # phase itself rather than a graph we traced for other tensors.
                return list(self.function(*tensors))
            if self.graph_module is None:
                self._trace(*tensors)
            if _all_plain(tensors):
                if not self.timed:
                    return list(self.eager_program(*tensors))
                start = time.perf_counter()
                results = list(self.eager_program(*tensors))
                self.graph_s += time.perf_counter() - start
                return results
            # a tracer's tensors (torch.compile functionalizing a frame it captured): the
            # graph with only functional ops, which it can functionalize
            return list(self.graph_module(*tensors))

    # Our own tracing must never be captured by torch.compile (a frame Dynamo skipped can
    # still reach here eagerly while compile is active).
    @torch.compiler.disable
    def _trace(self, *tensors: torch.Tensor) -> None:
        with torch.no_grad():
            graph_module = internals.trace_on_fake(self.function, *tensors)
        drop_dead_ops(graph_module)
        drop_identity_views(graph_module)
        issue_collectives_early(graph_module, self.parameter_positions())
        self.graph_module = graph_module
        self.eager_module = _copy(graph_module)
        reduce_in_place(self.eager_module)
        self.eager_program = bound_program(self.eager_module)


def _all_plain(tensors: tuple) -> bool:
    """Every tensor is a plain eager tensor (no subclass: not fake, not functional)."""
    return all(
        type(t) in (torch.Tensor, torch.nn.Parameter)
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


def _copy(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``graph_module`` whose graph a pass may change (nodes' meta shared)."""
    return fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph))


def drop_dead_ops(graph_module: fx.GraphModule) -> int:
    """Remove the ops whose results nothing reads and that change nothing; returns how many.

    Under torch 2.11, DTensor works out each op's output shape by running it on
    empty tensors of the global shapes, and the trace records those runs beside the local
    ones: dead, and unsafe to run (an embedding looked up with uninitialized ids reads out
    of range). Kept: ops that write an argument, collectives and their waits, and random
    ops (dropping one would shift the random stream of every later draw)."""
    dropped = 0
    for node in reversed(list(graph_module.graph.nodes)):
        if node.op != "call_function" or node.users or not _is_pure(node.target):
            continue
        graph_module.graph.erase_node(node)
        dropped += 1
    if dropped:
        graph_module.recompile()
    return dropped


def _is_pure(target: object) -> bool:
    if not isinstance(target, internals.OpOverload):
        return False
    if target.namespace != "aten" or target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


_ALIAS_OPS = (torch.ops.aten.view.default, torch.ops.aten.alias.default)


def drop_identity_views(graph_module: fx.GraphModule) -> int:
    """Remove views that return their input's own shape and strides (aliases of it), feeding
    their users the input itself; returns how many were removed.

    Such a view is the same memory read the same way, so an op reading it, or writing into
    it in place, sees exactly what it would on the input. A view that is a graph output is
    kept: the caller gets a new tensor object, as before.
    """
    removed = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in _ALIAS_OPS:
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node) or not _same_layout(source, node):
            continue
        if any(user.op == "output" for user in node.users):
            continue
        node.replace_all_uses_with(source)
        graph_module.graph.erase_node(node)
        removed += 1
    if removed:
        graph_module.recompile()
    return removed


def _same_layout(source: fx.Node, view: fx.Node) -> bool:
    before, after = source.meta.get("val"), view.meta.get("val")
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return False
    return before.shape == after.shape and before.stride() == after.stride()


def reduce_in_place(graph_module: fx.GraphModule) -> int:
    """Turn each all-reduce of a temporary into the in-place all-reduce of that temporary;
    returns how many changed.

    torch's functional all-reduce copies its input and reduces the copy, so the input stays
    as it was for any other reader. When the input is a fresh result (an op's output, or a
    view of one) that only the all-reduce reads, nothing else can see it change, and the
    copy is pure cost: for a DDP plan's gradient buckets, a pass over every gradient and a
    second bucket in memory. The reduced values and every other op are unchanged. The
    in-place op cannot be functionalized: run the result on eager tensors only.
    """
    changed = 0
    for node in graph_module.graph.find_nodes(
        op="call_function", target=internals.FUNCTIONAL_ALL_REDUCE
    ):
        if _is_private_temporary(node.args[0], node):
            node.target = internals.FUNCTIONAL_ALL_REDUCE_IN_PLACE
            changed += 1
    if changed:
        graph_module.recompile()
    return changed


def _is_private_temporary(value: object, reader: fx.Node) -> bool:
    """``value`` is read by ``reader`` alone and is an op's fresh output, or a chain of views
    (each read by the next alone) of one."""
    while isinstance(value, fx.Node) and value.op == "call_function":
        if set(value.users) != {reader}:
            return False
        if not _returns_a_view(value):
            return True
        reader, value = value, value.args[0]
    return False


def _returns_a_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or len(schema.returns) != 1:
        return True  # not an ATen op with one result: treat as aliasing, never reduce it
    return schema.returns[0].alias_info is not None


_WAIT = "_c10d_functional.wait_tensor"


def _is_collective(node: fx.Node) -> bool:
    """A functional collective's start (it returns at once; ``wait_tensor`` blocks)."""
    name = str(node.target)
    return node.op == "call_function" and name.startswith("_c10d_functional.") and _WAIT not in name


def issue_collectives_early(
    graph_module: fx.GraphModule, parameter_positions: Collection[int] = ()
) -> int:
    """Start each collective as soon as its inputs are ready and wait for it as late as its
    first reader allows, so that it runs (on gloo's or NCCL's own threads) while the ops in
    between compute; returns how many collectives moved.

    A collective moves with the packing ops only it reads (a bucket's flattening views and
    ``cat``, a parameter's cast) to just after the last op it depends on. A gather of
    parameters (graph inputs at ``parameter_positions``) would move to the top, holding
    every layer unsharded at once: it moves one such gather ahead instead, to where the
    previous one was, so the next layer's gather runs during this layer's compute (FSDP's
    prefetch, in the forward and, in reverse layer order, in the backward; two layers
    unsharded at a time), and the gathers keep their order. A collective of other graph
    inputs stays. Each ``wait_tensor`` moves to just before its first reader. Values are
    unchanged: only the order of independent ops changes, the same way on every rank (the
    graphs are the same), so the ranks still issue their collectives in one order.
    """
    graph = graph_module.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    parameters = {placeholders[i] for i in parameter_positions if i < len(placeholders)}
    moved, previous_gather, last_gather = 0, None, None
    for node in [n for n in graph.nodes if _is_collective(n)]:
        chain = _packing_chain(node)
        external = {arg for member in chain for arg in member.all_input_nodes if arg not in chain}
        if external and external <= parameters:
            anchor, previous_gather = previous_gather, chain[0].prev
            if anchor is not None:
                moved += _move_after(graph, chain, anchor, last_gather)
            last_gather = node
        elif not all(arg.op == "placeholder" for arg in external):
            moved += _move_after(graph, chain, _last(graph, external), None)
    position = {node: i for i, node in enumerate(graph.nodes)}
    for wait in reversed([n for n in graph.nodes if _WAIT in str(n.target)]):
        if wait.users:
            first = min(wait.users, key=position.__getitem__)
            if first.prev is not wait:
                first.prepend(wait)
    graph.lint()
    graph_module.recompile()
    return moved


def _last(graph: fx.Graph, nodes: set[fx.Node]) -> fx.Node:
    position = {node: i for i, node in enumerate(graph.nodes)}
    return max(nodes, key=position.__getitem__)


def _move_after(
    graph: fx.Graph, chain: list[fx.Node], anchor: fx.Node, floor: fx.Node | None
) -> int:
    """Move ``chain`` (in order) to just after ``anchor``, or after ``floor`` (the previous
    gather, for a gather) if that is later; 1 if it moved."""
    if floor is not None and _last(graph, {anchor, floor}) is floor:
        anchor = floor
    preceding = chain[0].prev
    for node in chain:
        anchor.append(node)
        anchor = node
    return int(chain[0].prev is not preceding)


_PACKING_OPS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.cat.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
}
"""Ops that lay a collective's input out (the bucket's flat buffer), not compute."""


def _packing_chain(collective: fx.Node) -> list[fx.Node]:
    """``collective`` and the packing ops whose every reader is in that set, in graph order."""
    members = {collective}
    frontier = list(collective.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node in members or node.op != "call_function" or node.target not in _PACKING_OPS:
            continue
        if not all(user in members for user in node.users):
            continue
        members.add(node)
        frontier.extend(node.all_input_nodes)
    return [node for node in collective.graph.nodes if node in members]
