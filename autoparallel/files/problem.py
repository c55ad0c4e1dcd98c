"""Saving and loading a whole optimization problem, to inspect and re-solve it anywhere.

A saved problem holds everything the solver and the plan tools read — the graph's nodes
(names, ops, shapes, roles), their strategies and compute prices, the priced edges, the
structural rows, the user's named constraints, the folding and the last solution — and
nothing live: placements are strings in the seed's notation, arrays are numpy, metadata is
JSON, all in one ``.npz`` file (no pickle). Loading rebuilds a stand-in FX graph of the same
node names and shapes (on the meta device) so that every tool that reads a Problem works
unchanged, without the model's code, a process group or a GPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any
from zipfile import BadZipFile
from zlib import error as ZlibError

import numpy as np
import torch
import torch.fx as fx

from autoparallel.cost.profile import hardware_from_dict, hardware_to_dict
from autoparallel.cost.redistribution import PairPricer
from autoparallel.cost.topology import Topology
from autoparallel.files.placements import PlacementFileError
from autoparallel.files.problem_graph import stand_in_joint, stand_in_node
from autoparallel.types.costs import CostTables, EdgeCost, EdgeRoutes
from autoparallel.types.graph import JointGraph
from autoparallel.types.placements import (
    PlacementSyntaxError,
    is_multi,
    parse_placements,
    placement_str,
)
from autoparallel.types.plan import Solution, SolverStats
from autoparallel.types.problem import (
    AuxiliaryColumns,
    Bucket,
    BucketMember,
    Folding,
    OverlapWindow,
    Problem,
    Row,
    UserConstraint,
)
from autoparallel.types.strategies import NodeStrategies, Strategy, StrategySpace
from autoparallel.types.tensors import TensorInfo

FORMAT = "autoparallel-problem"
VERSION = 1


# ---------------------------------------------------------------------------- save


def save_problem(
    problem: Problem,
    mesh_dim_names: tuple[str, ...] | None,
    path: str | Path,
    solution: Solution | None = None,
) -> None:
    registry = _Registry()
    joint, space, tables = problem.joint, problem.space, problem.tables
    nodes = [
        _node_record(node, ns, joint, tables, problem, registry) for node, ns in space.nodes.items()
    ]
    edges = [
        _edge_record(edge, columns, problem.edge_encoding(index), registry)
        for index, (edge, columns) in enumerate(zip(tables.edges, problem.edge_columns))
    ]
    topology = tables.topology
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "mesh_shape": list(space.mesh_shape),
        "mesh_dim_names": list(mesh_dim_names) if mesh_dim_names else None,
        "hardware": hardware_to_dict(topology.hardware),
        "gpus_per_node": topology.gpus_per_node,
        "strategy_lists": registry.strategy_lists,
        "compute_lists": registry.compute_lists,
        "pair_tables": registry.pair_tables,
        "nodes": nodes,
        "edges": edges,
        "roles": _roles(joint),
        "fallbacks": list(space.fallbacks),
        "folding": {n.name: r.name for n, r in problem.folding.representative.items()}
        if problem.folding
        else None,
        "user_constraints": [_constraint_record(c) for c in problem.user_constraints.values()],
        "choice": {node.name: index for node, index in solution.choice.items()}
        if solution
        else None,
        "solver": dataclasses.asdict(solution.stats) if solution else None,
        "auxiliary": dict(solution.auxiliary) if solution else {},
        "buckets": [
            {
                "kind": b.kind,
                "description": b.description,
                "latency_us": b.latency_us,
                "candidates": b.candidates,
                "members": [[m.edge, m.pair, m.saving_us, m.share_us] for m in b.members],
            }
            for b in problem.buckets
        ],
        "overlap": {
            "fraction": problem.overlap_fraction,
            "windows": [
                {
                    "phase": w.phase,
                    "comm": w.comm,
                    "during": w.during,
                    "compute_nodes": [node.name for node in w.compute_nodes],
                    "comm_edges": list(w.comm_edges),
                }
                for w in problem.overlap_windows
            ],
            "shares": list(problem.overlap_shares),
        },
        "memory": {
            "optimizer": problem.memory_optimizer,
            "budget": problem.memory_budget,
            "activation_checkpointing": problem.activation_checkpointing,
            "activation_copies": problem.activation_copies,
        },
    }
    rows = _pack_rows(problem.rows)
    rows.update(
        {
            f"overlap_{k}": v
            for k, v in _pack_rows([w.comm_row for w in problem.overlap_windows]).items()
        }
    )
    with open(path, "wb") as handle:
        np.savez_compressed(
            handle,
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            objective=problem.objective,
            integrality=problem.integrality,
            **{f"rows_{k}": v for k, v in rows.items()},
        )


class _Registry:
    """Shared lists (strategies, prices, pair tables) are stored once and referenced by id."""

    def __init__(self) -> None:
        self.strategy_lists: list = []
        self.compute_lists: list = []
        self.pair_tables: list = []
        self._ids: dict[tuple[str, int], int] = {}

    def ref(self, kind: str, value: list, encode) -> int:
        key = (kind, id(value))
        if key not in self._ids:
            store = getattr(self, kind)
            self._ids[key] = len(store)
            store.append(encode(value))
        return self._ids[key]


def _encode_placements(placements: Any) -> Any:
    if placements is None:
        return None
    if is_multi(placements):
        return [_encode_placements(p) for p in placements]
    return placement_str(placements)


def _encode_strategies(strategies: list[Strategy]) -> list:
    return [
        [_encode_placements(s.output), [_encode_placements(p) for p in s.inputs]]
        for s in strategies
    ]


def _shape_record(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, (tuple, list)):
        return [_shape_record(v) for v in value]
    return None


def _node_record(
    node: fx.Node,
    ns: NodeStrategies,
    joint: JointGraph,
    tables: CostTables,
    problem: Problem,
    registry: _Registry,
) -> dict:
    columns = problem.node_columns[node]
    return {
        "name": node.name,
        "op": node.op,
        "target": str(node.target),
        "value": _shape_record(node.meta.get("val")),
        "forward": node in joint.forward_nodes,
        "inputs": [n.name for n in ns.input_nodes],
        "source": ns.source,
        "strategies": registry.ref("strategy_lists", ns.strategies, _encode_strategies),
        "compute": registry.ref("compute_lists", tables.compute_us[node], list),
        "columns": [int(columns[0]), len(columns)],
    }


def _edge_record(edge: EdgeCost, columns: np.ndarray, encoding: str, registry: _Registry) -> dict:
    return {
        "producer": edge.producer.name,
        "consumer": edge.consumer.name,
        "slot": edge.slot,
        "kind": edge.kind,
        "src_options": [_encode_placements(p) for p in edge.src_options],
        "src_of_strategy": list(edge.src_of_strategy),
        "dst_options": [_encode_placements(p) for p in edge.dst_options],
        "dst_of_strategy": list(edge.dst_of_strategy),
        "pairs": registry.ref("pair_tables", edge.pairs, lambda pairs: [list(p) for p in pairs]),
        "columns": [int(columns[0]), len(columns)] if len(columns) else [0, 0],
        "encoding": encoding,
        "routes": edge.routes is not None,
    }


def _roles(joint: JointGraph) -> dict:
    def name(node: fx.Node | None) -> str | None:
        return node.name if node is not None else None

    return {
        "params": {k: v.name for k, v in joint.params.items()},
        "buffers": {k: v.name for k, v in joint.buffers.items()},
        "user_inputs": [n.name for n in joint.user_inputs],
        "tangents": {str(k): v.name for k, v in joint.tangents.items()},
        "user_outputs": [name(n) for n in joint.user_outputs],
        "param_grads": {k: v.name for k, v in joint.param_grads.items()},
        "input_grads": {str(k): v.name for k, v in joint.input_grads.items()},
        "tied_params": joint.tied_params,
    }


def _constraint_record(constraint: UserConstraint) -> dict:
    record = {
        "name": constraint.name,
        "description": constraint.description,
        "rows": [
            [r.columns.tolist(), r.values.tolist(), r.lower, r.upper, r.budget]
            for r in constraint.rows
        ],
    }
    columns = constraint.columns
    if columns is not None:
        record["columns"] = {
            "names": list(columns.names),
            "objective": columns.objective.tolist(),
            "lower": columns.lower.tolist(),
            "upper": columns.upper.tolist(),
            "integral": columns.integral.tolist(),
        }
    return record


def _auxiliary_columns(record: dict | None) -> AuxiliaryColumns | None:
    if record is None:
        return None
    return AuxiliaryColumns(
        tuple(record["names"]),
        np.asarray(record["objective"], dtype=np.float64),
        np.asarray(record["lower"], dtype=np.float64),
        np.asarray(record["upper"], dtype=np.float64),
        np.asarray(record["integral"], dtype=bool),
    )


def _pack_rows(rows: list[Row]) -> dict[str, np.ndarray]:
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(r.columns) for r in rows])
    return {
        "starts": starts,
        "columns": np.concatenate([r.columns for r in rows]) if rows else np.zeros(0, np.int64),
        "values": np.concatenate([r.values for r in rows]) if rows else np.zeros(0),
        "lower": np.array([r.lower for r in rows]),
        "upper": np.array([r.upper for r in rows]),
    }


# ---------------------------------------------------------------------------- load


def load_problem(path: str | Path) -> tuple[Problem, tuple[str, ...] | None, Solution | None]:
    """(problem, mesh dim names, the saved solution or None) from :func:`save_problem`.

    Raises :class:`PlacementFileError` naming ``path`` for a file that is missing, not a
    saved problem, of another format version, or damaged (an entry missing or of the wrong
    type, arrays whose sizes disagree, a solution choosing strategies that do not exist):
    whatever is wrong with the file, never an error from deep in the decoding or the solver.
    """
    try:
        with open(path, "rb") as handle:
            is_zip = handle.read(4) == b"PK\x03\x04"  # an .npz is a zip archive
        archive = np.load(path, allow_pickle=False) if is_zip else None
        meta = json.loads(archive["meta"].tobytes().decode()) if archive is not None else None
    except Exception as error:  # OSError, a damaged zip, meta that is not JSON
        raise PlacementFileError(f"{path} is not a saved autoparallel problem: {error}") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PlacementFileError(f"{path} is not a saved autoparallel problem (.npz)")
    if meta.get("version") != VERSION:
        raise PlacementFileError(
            f"{path} has problem format version {meta.get('version')}; this autoparallel reads {VERSION}"
        )
    try:
        problem, names, solution = _decode_problem(archive, meta)
        _check_sizes(problem, solution)
    except _DAMAGED as e:
        what = f"no entry {e.args[0]!r}" if type(e) is KeyError else " ".join(str(e).split())
        message = f"{path} is a damaged saved problem ({what}); save it again"
        raise PlacementFileError(message) from e
    return problem, names, solution


_DAMAGED = (LookupError, TypeError, ValueError, AttributeError, OSError, BadZipFile, ZlibError)
"""What decoding a damaged file raises: an entry missing or of a wrong type, a bad CRC."""


def _check_sizes(problem: Problem, solution: Solution | None) -> None:
    """ValueError where the arrays and records of a loaded problem disagree."""
    columns, ranges = problem.num_variables, [*problem.node_columns.values(), *problem.edge_columns]
    used = max((int(c[-1]) + 1 for c in ranges if len(c)), default=0)
    if len(problem.integrality) != columns or used > columns:
        sizes = f"{columns} objective, {len(problem.integrality)} integrality entries"
        raise ValueError(f"{sizes} for {used} columns")
    if any(len(r.columns) and int(r.columns.max()) >= columns for r in problem.rows):
        raise ValueError(f"a row names a column past the {columns} columns")
    for node, index in (solution.choice if solution else {}).items():
        if not 0 <= index < len(problem.space[node].strategies):
            raise ValueError(f"the solution chooses strategy {index} of node {node.name}")


def _decode_problem(
    archive: Any, meta: dict
) -> tuple[Problem, tuple[str, ...] | None, Solution | None]:
    graph = fx.Graph()
    by_name: dict[str, fx.Node] = {}
    strategy_lists = [_decode_strategies(s) for s in meta["strategy_lists"]]
    space = StrategySpace(
        nodes={}, mesh_shape=tuple(meta["mesh_shape"]), fallbacks=list(meta["fallbacks"])
    )
    compute: dict[fx.Node, list[float]] = {}
    node_columns: dict[fx.Node, np.ndarray] = {}
    forward: set[fx.Node] = set()
    for record in meta["nodes"]:
        inputs = [by_name[n] for n in record["inputs"]]
        node = stand_in_node(graph, record, inputs)
        by_name[record["name"]] = node
        if record["forward"]:
            forward.add(node)
        space.nodes[node] = NodeStrategies(
            node,
            inputs,
            strategy_lists[record["strategies"]],
            record["source"],
            is_multi_value(record),
        )
        compute[node] = meta["compute_lists"][record["compute"]]
        start, count = record["columns"]
        node_columns[node] = np.arange(start, start + count, dtype=np.int64)

    hardware = hardware_from_dict(meta["hardware"])
    topology = Topology(tuple(meta["mesh_shape"]), hardware, meta["gpus_per_node"])
    pricers: dict[TensorInfo, PairPricer] = {}
    pair_tables = [[tuple(p) for p in table] for table in meta["pair_tables"]]
    edges, edge_columns, edge_encodings = [], [], []
    for record in meta["edges"]:
        edges.append(
            EdgeCost(
                producer=by_name[record["producer"]],
                consumer=by_name[record["consumer"]],
                slot=record["slot"],
                kind=record["kind"],
                src_options=[_decode_placements(p) for p in record["src_options"]],
                src_of_strategy=record["src_of_strategy"],
                dst_options=[_decode_placements(p) for p in record["dst_options"]],
                dst_of_strategy=record["dst_of_strategy"],
                pairs=pair_tables[record["pairs"]],
            )
        )
        if record.get("routes"):
            edges[-1].routes = _edge_routes(edges[-1], topology, pricers)
        start, count = record["columns"]
        edge_columns.append(np.arange(start, start + count, dtype=np.int64))
        edge_encodings.append(record.get("encoding", "pairs"))
    tables = CostTables(compute_us=compute, edges=edges, topology=topology)
    joint = stand_in_joint(meta["roles"], by_name, graph, forward)
    folding = (
        Folding({by_name[n]: by_name[r] for n, r in meta["folding"].items()})
        if meta["folding"]
        else None
    )
    problem = Problem(
        joint=joint,
        space=space,
        tables=tables,
        node_columns=node_columns,
        edge_columns=edge_columns,
        objective=np.asarray(archive["objective"], dtype=np.float64),
        integrality=np.asarray(archive["integrality"], dtype=bool),
        rows=_unpack_rows(archive),
        folding=folding,
        edge_encodings=edge_encodings,
    )
    problem.set_buckets(
        [
            Bucket(
                record["kind"],
                record["description"],
                record["latency_us"],
                record["candidates"],
                tuple(
                    BucketMember(int(e), int(k), saving, share)
                    for e, k, saving, share in record["members"]
                ),
            )
            for record in meta.get("buckets", [])
        ]
    )
    overlap = meta.get("overlap") or {}
    problem.overlap_fraction = float(overlap.get("fraction", 0.0))
    comm_rows = _unpack_rows(archive, "rows_overlap_") if overlap.get("windows") else []
    problem.overlap_windows = [
        OverlapWindow(
            record["phase"],
            record["comm"],
            record["during"],
            tuple(by_name[name] for name in record["compute_nodes"]),
            tuple(int(index) for index in record["comm_edges"]),
            comm_row,
        )
        for record, comm_row in zip(overlap.get("windows", []), comm_rows)
    ]
    problem.overlap_shares = [float(share) for share in overlap.get("shares", [])]
    memory = meta.get("memory") or {}
    problem.memory_optimizer = memory.get("optimizer", "adamw")
    problem.memory_budget = memory.get("budget")
    problem.activation_checkpointing = memory.get("activation_checkpointing", "off")
    problem.activation_copies = int(memory.get("activation_copies", 1))
    for record in meta["user_constraints"]:
        rows = [
            Row(np.array(c, dtype=np.int64), np.array(v, dtype=np.float64), lo, hi, *budget)
            for c, v, lo, hi, *budget in record["rows"]  # older files: no budget flag
        ]
        columns = _auxiliary_columns(record.get("columns"))
        problem.add_constraint(UserConstraint(record["name"], record["description"], rows, columns))
    solution = None
    if meta["choice"]:
        choice = {by_name[n]: i for n, i in meta["choice"].items()}
        solution = Solution(
            choice=choice,
            stats=SolverStats(**meta["solver"]),
            auxiliary=dict(meta.get("auxiliary") or {}),
        )
    names = tuple(meta["mesh_dim_names"]) if meta["mesh_dim_names"] else None
    return problem, names, solution


def is_multi_value(record: dict) -> bool:
    return isinstance(record["value"], list)


def _decode_placements(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(_decode_placements(v) for v in value)
    try:
        return parse_placements(value)
    except PlacementSyntaxError as error:
        raise PlacementFileError(f"not a saved autoparallel problem: {error}") from error


def _decode_strategies(encoded: list) -> list[Strategy]:
    return [
        Strategy(_decode_placements(out), tuple(_decode_placements(p) for p in ins))
        for out, ins in encoded
    ]


def _edge_routes(edge: EdgeCost, topology: Topology, pricers: dict) -> EdgeRoutes | None:
    """Route tables are not stored: they are a function of the tensor and the topology."""
    value = edge.producer.meta["val"]
    info = TensorInfo(tuple(value.shape), value.dtype)
    pricer = pricers.get(info)
    if pricer is None:
        pricer = pricers[info] = PairPricer(info, topology)
    src_states = [pricer.state_of(p) for p in edge.src_options]
    dst_states = [pricer.state_of(p) for p in edge.dst_options]
    if None in src_states or None in dst_states:
        raise PlacementFileError(
            f"edge {edge.name} was priced on routes, but its placements are not route states"
        )
    return EdgeRoutes(pricer, src_states, dst_states)  # type: ignore[arg-type]


def _unpack_rows(archive: Any, prefix: str = "rows_") -> list[Row]:
    starts, columns, values = (
        archive[f"{prefix}starts"],
        archive[f"{prefix}columns"],
        archive[f"{prefix}values"],
    )
    lower, upper = archive[f"{prefix}lower"], archive[f"{prefix}upper"]
    return [
        Row(
            columns[starts[i] : starts[i + 1]].astype(np.int64),
            values[starts[i] : starts[i + 1]].astype(np.float64),
            float(lower[i]),
            float(upper[i]),
        )
        for i in range(len(lower))
    ]
