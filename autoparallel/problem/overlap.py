"""Communication that the runtime overlaps with compute, priced as the part left exposed.

The runtime starts each collective as soon as its inputs are ready and waits for it only
where its result is read (``runtime/local_graph.py``); gloo and NCCL run it on their own
threads or streams while the host goes on computing. Two kinds of collective have compute to
hide behind:

* **parameter gathers** (FSDP's prefetch): a layer's gathers are issued one gather ahead,
  where the previous layer's were, so they run while the previous layer computes; in the
  forward and, for the re-gathers of a plan that reshards after the forward, in the
  backward (last layer first).
  The parameters outside numbered layers (embedding, final norm, head) are gathered together
  at their first reader, with nothing before them: exposed.
* **gradient reductions** (DDP's overlap): gradients fill buckets in the order they become
  final (the first 1 MiB, then 25 MiB each, as DDP's); a bucket's reduction starts when
  its last gradient is final and runs while the backward computes the next bucket's
  gradients. The last bucket (with the embedding's gradient, usually) has nothing after
  it: exposed. A small model's gradients past the first MiB are one bucket: little hides.

Each such pairing is a *window*: its overlappable comm O (every move of the windowed edges,
linear in the edge columns) and the compute C it hides behind (linear in the node columns).
A step hides ``fraction * min(C, O)`` of it: max(C, O) for ``fraction = 1`` (a GPU's
separate streams), less where the collective threads compete with compute for the host
(CPU gloo; ``autoparallel calibrate`` measures ``Hardware.overlap_fraction``). Every other
collective (tensor-parallel activations, redistributions between ops) stays fully
charged, on the critical path.

The objective prices the min linearly: each window's comm columns are discounted by
``share * O``, with ``share = fraction * min(1, C / O)`` at the last plan (``fraction`` before
the first). That is exact for the plan it was fitted to, and keeps the problem's structure:
no column, no row, so the LP relaxation stays integral and folding applies. (The exact
form, a column ``h <= C, h <= O`` per window, makes a 3-D LLaMA's relaxation fractional:
a branch and bound past its time limit instead of one LP.) ``ShardingOptimizer.resolve``
refits the shares to the plan it found and solves again while they change, keeping the
plan whose totals, which always charge the exact min, are lowest.

Windows of one phase are disjoint in compute, and each pairs one comm group with the compute
right after it, so a backlog never carries over from one window to the next: conservative
for a DDP-like plan (its reductions could also hide behind later layers), close for an
FSDP-like one (each gather must be done before its layer runs). Since every share is at
least 0, the objective with overlap never exceeds the one without.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from autoparallel.graph.view_ops import parameter_views
from autoparallel.types.bucketing import BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES, capped_buckets
from autoparallel.types.graph import layer_of
from autoparallel.types.problem import OverlapWindow, Problem, Row


def add_overlap(problem: Problem, fraction: float) -> None:
    """Find the windows of ``problem`` and discount their comm at ``fraction`` (in place:
    ``problem.objective``, ``overlap_windows`` and ``overlap_shares`` change). ``fraction``
    0 finds none."""
    problem.overlap_fraction = fraction
    if fraction <= 0.0:
        return
    windows = []
    windows_found = (
        _gather_windows(problem, forward=True)
        + _gather_windows(problem, forward=False)
        + _reduction_windows(problem)
    )
    for window in windows_found:
        comm = _comm_row(problem, window.comm_edges)
        if not comm.values.any() or not _compute_row(problem, window.compute_nodes).values.any():
            continue  # nothing to hide, or nothing to hide behind
        windows.append(
            OverlapWindow(
                window.phase,
                window.comm,
                window.during,
                window.compute_nodes,
                window.comm_edges,
                comm,
            )
        )
    problem.overlap_windows = windows
    problem.overlap_shares = [0.0] * len(windows)
    set_shares(problem, [fraction] * len(windows))


def set_shares(problem: Problem, shares: list[float]) -> None:
    """Discount each window's comm columns by ``shares[w]`` of their comm, replacing the
    shares in force (in place)."""
    objective = problem.objective.copy()
    for window, old, new in zip(problem.overlap_windows, problem.overlap_shares, shares):
        if new != old:  # folded windows share columns: every member's part adds up
            np.subtract.at(objective, window.comm_row.columns, (new - old) * window.comm_row.values)
    problem.objective = objective
    problem.overlap_shares = list(shares)


def fit_shares(problem: Problem, choice: dict[fx.Node, int]) -> bool:
    """Set each window's share to what the plan ``choice`` hides of its comm,
    ``fraction * min(1, C / O)``; returns whether any share changed (by more than 1e-6)."""
    shares = []
    for window, old in zip(problem.overlap_windows, problem.overlap_shares):
        compute, comm = window_times(problem, window, choice)
        shares.append(old if comm <= 0.0 else problem.overlap_fraction * min(1.0, compute / comm))
    changed = any(abs(a - b) > 1e-6 for a, b in zip(shares, problem.overlap_shares))
    if changed:
        set_shares(problem, shares)
    return changed


def window_times(
    problem: Problem, window: OverlapWindow, choice: dict[fx.Node, int]
) -> tuple[float, float]:
    """(C, O) of ``window`` for the strategies of ``choice``: its nodes' compute and the
    comm of its edges' chosen moves (a bucket's latency left out)."""
    compute_us = problem.tables.compute_us
    compute = sum(compute_us[node][choice[node]] for node in window.compute_nodes)
    comm = sum(problem.chosen_comm_us(index, choice) for index in window.comm_edges)
    return compute, comm


@dataclass(frozen=True)
class _Window:
    phase: str
    comm: str
    during: str
    compute_nodes: tuple[fx.Node, ...]
    comm_edges: tuple[int, ...]


def _group(name: str) -> str:
    """What the runtime issues together: a numbered layer, or a parameter of its own."""
    return layer_of(name) or name


def _gather_windows(problem: Problem, forward: bool) -> list[_Window]:
    """Each layer's parameter gathers in one phase, behind the compute from the previous
    layer's first parameter read to this layer's (the runtime's one-gather-ahead prefetch;
    in the backward the layers come last first).

    Gathers go by ``layer_of`` (the runtime's groups, all non-layer parameters in one);
    the first group's gathers have no compute before them."""
    joint, tables = problem.joint, problem.tables
    phase = "forward" if forward else "backward"
    readers = parameter_views(joint)
    # (gather group, its nodes) in order; None: the nodes before the first parameter read
    regions: list[tuple[str | None, list[fx.Node]]] = [(None, [])]
    seen: set[str] = set()
    for node in _calls(problem, forward=forward):
        # the first op that computes with a group's parameter starts its region (casts and
        # views of a parameter are readers too, but the runtime gathers where ops compute)
        groups = (
            []
            if node in readers
            else [layer_of(readers[arg]) for arg in node.all_input_nodes if arg in readers]
        )
        new = [group for group in groups if group not in seen]
        if new:
            seen.update(new)
            regions.append((new[0], []))
        regions[-1][1].append(node)
    edges_of: dict[str, list[int]] = defaultdict(list)
    for index, edge in enumerate(tables.edges):
        if (
            edge.kind == "arg"
            and (edge.consumer in joint.forward_nodes) == forward
            and edge.producer in readers
        ):
            edges_of[layer_of(readers[edge.producer])].append(index)
    windows = []
    for (previous, compute), (group, _) in zip(regions, regions[1:]):
        if previous is not None and edges_of.get(group):
            windows.append(
                _Window(
                    phase,
                    f"parameter gathers of {_label(group)}",
                    f"{phase} of {_label(previous)}",
                    tuple(compute),
                    tuple(edges_of[group]),
                )
            )
    return windows


def _reduction_windows(problem: Problem) -> list[_Window]:
    """Each gradient bucket's reductions, behind the backward compute from its last
    gradient to the next bucket's last (or the end of the backward).

    The buckets are the runtime's (types/bucketing.py): gradients in the order they become
    final, cut at the runtime's caps by their full size (the partial sums a reduction
    starts from are full-size on a 1-D mesh), as if all were reduced the same way."""
    joint, tables = problem.joint, problem.tables
    calls = _calls(problem, forward=False)
    position = {node: k for k, node in enumerate(calls)}
    ready = sorted(
        (position[grad], name) for name, grad in joint.param_grads.items() if grad in position
    )
    names = [name for _, name in ready]
    sizes = [_nbytes(joint.param_grads[name]) for name in names]
    buckets = capped_buckets(
        list(range(len(names))), sizes, BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES
    )
    edges_of: dict[fx.Node, list[int]] = defaultdict(list)
    for index, edge in enumerate(tables.edges):
        if edge.kind == "param_grad":
            edges_of[edge.producer].append(index)
    ends = [ready[bucket[-1]][0] for bucket in buckets]
    windows = []
    for k, bucket in enumerate(buckets):
        stop = ends[k + 1] + 1 if k + 1 < len(buckets) else len(calls)
        compute = calls[ends[k] + 1 : stop]
        comm = [i for m in bucket for i in edges_of[joint.param_grads[names[m]]]]
        if not compute or not comm:
            continue
        during = (
            f"backward up to {names[buckets[k + 1][-1]]}'s gradient"
            if k + 1 < len(buckets)
            else "the rest of the backward"
        )
        windows.append(
            _Window(
                "backward",
                f"gradient reductions of {_span(names, bucket)}",
                during,
                tuple(compute),
                tuple(comm),
            )
        )
    return windows


def _span(names: list[str], bucket: list[int]) -> str:
    first, last = names[bucket[0]], names[bucket[-1]]
    if first == last:
        return first
    return f"{first} .. {last} ({len(bucket)} tensors)"


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    if value is None or not hasattr(value, "shape"):
        return 0
    return math.prod(value.shape) * value.element_size()


def _label(group: str | None) -> str:
    return group.removesuffix(".") if group else "the non-layer parameters"


def _calls(problem: Problem, forward: bool) -> list[fx.Node]:
    """The phase's call nodes that have strategies, in graph order."""
    joint = problem.joint
    return [
        node
        for node in problem.space.nodes
        if node.op == "call_function" and (node in joint.forward_nodes) == forward
    ]


def _compute_row(problem: Problem, nodes: tuple[fx.Node, ...]) -> Row:
    """sum over ``nodes`` of compute_us[node][s] * x[node, s], repeated columns summed."""
    compute_us = problem.tables.compute_us
    columns = [problem.node_columns[node] for node in nodes]
    values = [np.asarray(compute_us[node], dtype=np.float64) for node in nodes]
    return _merged(columns, values)


def _comm_row(problem: Problem, edges: tuple[int, ...]) -> Row:
    """sum over ``edges`` of every move's comm times its column: a bucket member at its
    bucketed price without the bucket's latency, which stays exposed (the shares of it
    change with the plan, problem/buckets.py, and the rows must not)."""
    columns, values = [], []
    for index in edges:
        moves = problem.edge_moves(index)
        comm = np.asarray([m.comm_us for m in moves], dtype=np.float64)
        if problem.edge_encoding(index) == "pairs":
            comm -= [problem.bucket_share(index, k) for k in range(len(moves))]
        columns.append(np.asarray([m.column for m in moves], dtype=np.int64))
        values.append(comm)
    return _merged(columns, values)


def _merged(columns: list[np.ndarray], values: list[np.ndarray]) -> Row:
    if not columns:
        return Row(np.zeros(0, dtype=np.int64), np.zeros(0), 0.0, 0.0)
    row = Row(np.concatenate(columns), np.concatenate(values), 0.0, 0.0).merged()
    keep = row.values != 0.0
    return Row(row.columns[keep], row.values[keep], 0.0, 0.0)
