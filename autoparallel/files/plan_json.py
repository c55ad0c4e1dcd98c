"""A plan as plain, JSON-serializable data (schema version 1): the format, and reading it back.

The plan JSON is how an HTML report, a CLI or a notebook read a plan without importing torch.
This module holds what any Plan writes by itself (:func:`plan_json`: the sections the live
tools read too), the hardware section (:func:`hardware_json`) and reading a file back
(:func:`read_plan_json`); the whole document, whose other sections need the traced graph of
the Problem the plan was solved from, is written by
:func:`~autoparallel.files.plan_json_graph.get_json`. Placements are written in the seed's
notation (``S(0)R``), every time in microseconds (keys end in ``_us``), solver time in
seconds (``time_s``). A value that is not finite (an impossible redistribution, an unknown
gap) is written as ``null``.

Sections: ``mesh``, ``hardware``, ``totals``, ``solver``, ``parameters`` (with the bytes
each device holds), ``inputs``/``outputs``, ``nodes`` (placements and costs per node),
``collectives`` (every redistribution, classified per mesh dim by
:func:`~autoparallel.files.plan_json_graph.collective_kind`),
``layers`` (cost per module), ``buckets`` (collectives the runtime coalesces: the latency each
pays once, and how many tensors share it), ``overlaps`` (communication the runtime runs
behind compute: what, behind what, and the part hidden; ``totals.hidden_comm_us`` is their
sum and ``totals.exposed_comm_us`` the comm the step waits for), ``fallbacks`` and
``constraints``, and ``regions`` (each ``local_map`` region of the model: where it is
called, its fixed placements, how many times the graph runs it, and the priced compute and
collectives of its forward and backward op on one rank). Two more are added by
``autoparallel plan``: ``run`` (model, batch, timings) and ``problem`` (the file name of the
whole problem saved as ``.npz``, relative to the JSON's folder, for ``autoparallel explain
--placement``; absent when none was saved). Readers must ignore keys they do not know, so
adding a section keeps the version.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoparallel.cost.matmul_table import MatmulTable
from autoparallel.cost.topology import Topology
from autoparallel.types.pipeline import StageMemory
from autoparallel.types.placements import placement_str
from autoparallel.types.plan import Plan

SCHEMA_VERSION = 1

__all__ = [
    "READ_VERSIONS",
    "SCHEMA_VERSION",
    "PlanJsonError",
    "hardware_json",
    "json_float",
    "node_rows",
    "plan_json",
    "problem_path",
    "problem_reference",
    "read_plan_json",
]


# ---------------------------------------------------------------------------- sections


def json_float(value: float) -> float | None:
    """A finite float, or None (JSON has no inf/nan)."""
    value = float(value)
    return value if math.isfinite(value) else None


def node_rows(plan: Plan, modules: dict[str, str]) -> list[dict[str, Any]]:
    """The ``nodes`` section: each node's placements and costs, and the module ``modules``
    attributes it to (``""`` where it names none)."""
    return [
        {
            "name": node.name,
            "target": node.target,
            "phase": node.phase,
            "module": modules.get(node.name, ""),
            "shape": list(node.shape) if node.shape is not None else None,
            "placements": placement_str(node.strategy.output),
            "input_placements": [placement_str(p) for p in node.strategy.inputs],
            "compute_us": json_float(node.compute_us),
            "comm_us": json_float(node.comm_us),
            "transition_us": json_float(node.transition_us),
        }
        for node in plan.nodes.values()
    ]


def _buckets(plan: Plan) -> list[dict[str, Any]]:
    return [
        {
            "kind": b.kind,
            "description": b.description,
            "latency_us": json_float(b.latency_us),
            "tensors": b.tensors,
            "candidates": b.candidates,
            "phase": b.phase,
        }
        for b in plan.buckets
    ]


def _overlaps(plan: Plan) -> list[dict[str, Any]]:
    return [
        {
            "phase": o.phase,
            "comm": o.comm,
            "during": o.during,
            "comm_us": json_float(o.comm_us),
            "compute_us": json_float(o.compute_us),
            "hidden_us": json_float(o.hidden_us),
        }
        for o in plan.overlaps
    ]


def _memory(plan: Plan) -> dict[str, Any] | None:
    """``plan.memory`` in bytes per device (see types/memory.py)."""
    memory = plan.memory
    if memory is None:
        return None
    return {
        "optimizer": memory.optimizer,
        "parameters": json_float(memory.parameters),
        "gradients": json_float(memory.gradients),
        "optimizer_state": json_float(memory.optimizer_state),
        "activations": json_float(memory.activations),
        "transient": json_float(memory.transient),
        "peak": json_float(memory.peak),
        "peak_at": memory.peak_at,
        "budget": json_float(memory.budget) if memory.budget is not None else None,
        "recomputed": list(memory.recomputed),
        "recompute_us": json_float(memory.recompute_us),
        "activations_by_layer": [
            {"layer": layer, "bytes": json_float(value)}
            for layer, value in memory.activations_by_layer
        ],
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    """The sections a Plan alone gives: ``mesh``, ``totals``, ``solver``, ``nodes`` (without
    module attribution), ``parameters`` (placements only), ``buckets`` and ``fallbacks``.

    Enough for the summary's totals and the diff of two plans (:mod:`autoparallel.report.summary` and :mod:`autoparallel.report.diff`),
    which is how the live tools (``diff_solutions``, the verbose log) use the same code as
    ``autoparallel diff`` on files.
    """
    totals, solver = plan.totals, plan.solver
    return {
        "version": SCHEMA_VERSION,
        "mesh": {
            "shape": list(plan.mesh_shape),
            "dim_names": list(plan.mesh_dim_names) if plan.mesh_dim_names is not None else None,
        },
        "totals": {
            "total_us": json_float(totals.total_us),
            "comm_us": json_float(totals.comm_us),
            "compute_us": json_float(totals.compute_us),
            "transition_us": json_float(totals.transition_us),
            "optimizer_us": json_float(totals.optimizer_us),
            "runtime_us": json_float(totals.runtime_us),
            "runtime_forward_us": json_float(totals.runtime_forward_us),
            "hidden_comm_us": json_float(totals.hidden_comm_us),
            "exposed_comm_us": json_float(totals.exposed_comm_us),
            "priced_on": plan.priced_on,
        },
        "solver": {
            "status": solver.status,
            "objective_us": json_float(solver.objective),
            "bound_us": json_float(solver.bound),
            "gap": json_float(solver.gap),
            "time_s": json_float(solver.time_s),
            "num_variables": int(solver.num_variables),
            "num_constraints": int(solver.num_constraints),
            "method": solver.method,
        },
        "parameters": [
            {"name": name, "placements": placement_str(p)}
            for name, p in plan.param_placements.items()
        ],
        "nodes": node_rows(plan, {}),
        "buckets": _buckets(plan),
        "overlaps": _overlaps(plan),
        "memory": _memory(plan),
        "fallbacks": list(plan.fallbacks),
        "pipeline": _pipeline(plan),
        "parameter_uses": _parameter_uses(plan),
    }


def _parameter_uses(plan: Plan) -> dict[str, Any]:
    """Per parameter, the op of the forward that reads it and the placements around it
    (:class:`~autoparallel.types.plan.ParameterUse`): what ``autoparallel export`` reads."""
    return {
        name: {
            "op": use.op,
            "node": use.node,
            "activation": placement_str(use.activation) if use.activation else None,
            "arrives": placement_str(use.arrives) if use.arrives else None,
            "at_use": placement_str(use.at_use) if use.at_use else None,
            "leaves": placement_str(use.leaves) if use.leaves else None,
            "feeds_output": use.feeds_output,
            "boundary": list(use.boundary),
            "placeholder": use.placeholder,
        }
        for name, use in plan.parameter_uses.items()
    }


def _pipeline(plan: Plan) -> dict[str, Any] | None:
    """With a "pp" mesh dim: the schedule, microbatches, every stage's layers, which stage
    this plan's placements are of (its mesh is the mesh without pp), the predicted step,
    every stage's memory under the schedule, and the settings the planner priced. Stage ``s``
    runs on pp rank ``s % (stages / stages_per_rank)``."""
    pipeline = plan.pipeline
    if pipeline is None:
        return None
    return {
        "schedule": pipeline.schedule,
        "microbatches": pipeline.microbatches,
        "stages": [list(layers) for layers in pipeline.stages],
        "stage_index": pipeline.stage_index,
        "stages_per_rank": pipeline.stages_per_rank,
        "cost": None
        if pipeline.cost is None
        else {
            "stage_microbatch_us": [json_float(t) for t in pipeline.cost.stage_microbatch_us],
            "bubble_us": json_float(pipeline.cost.bubble_us),
            "step_us": json_float(pipeline.cost.step_us),
            # [stage, microbatch, "forward" | "backward", start_us, end_us] per pass
            "timeline": [
                [b.stage, b.microbatch, b.kind, json_float(b.start_us), json_float(b.end_us)]
                for b in pipeline.cost.timeline
            ],
        },
        "memory": _stage_memory(pipeline.memory),
        "stage_memory": [_stage_memory(m) for m in pipeline.stage_memory],
        "options": [
            {
                "schedule": o.schedule,
                "microbatches": o.microbatches,
                "step_us": None if o.step_us is None else json_float(o.step_us),
                "peak": None if o.peak_bytes is None else json_float(o.peak_bytes),
                "stage_layers": list(o.stage_layers),
                "stages_per_rank": o.stages_per_rank,
            }
            for o in pipeline.options
        ],
    }


def _stage_memory(memory: StageMemory | None) -> dict[str, Any] | None:
    if memory is None:
        return None
    return {
        "in_flight": memory.in_flight,
        "activations": json_float(memory.activations),
        "peak": json_float(memory.peak),
    }


def hardware_json(topology: Topology) -> dict[str, Any]:
    """The figures the plan was priced with: where they come from, the device, each link."""
    hw = topology.hardware
    return {
        "name": hw.name,
        "source": hw.source,
        "gpus_per_node": topology.gpus_per_node,
        "flops_fp32": json_float(hw.flops_fp32),
        "flops_bf16": json_float(hw.flops_bf16),
        "memory_bandwidth": json_float(hw.memory_bandwidth),
        "kernel_launch_us": json_float(hw.kernel_launch_us),
        "memory_bytes": json_float(hw.memory_bytes),
        "runtime_step_us": json_float(hw.runtime_step_us),
        "runtime_us_per_parameter": json_float(hw.runtime_us_per_parameter),
        "runtime_forward_share": json_float(hw.runtime_forward_share),
        "links": {
            "intra": {
                "latency_us": json_float(hw.intra_node_latency_us),
                "bandwidth": json_float(hw.intra_node_bandwidth),
            },
            "inter": {
                "latency_us": json_float(hw.inter_node_latency_us),
                "bandwidth": json_float(hw.inter_node_bandwidth),
            },
        },
        "collectives": [
            {
                "link": fit.link,
                "collective": fit.collective,
                "latency_us": json_float(fit.latency_us),
                "bandwidth": json_float(fit.bandwidth),
                "max_error": json_float(fit.max_error),
            }
            for fit in hw.collectives
        ],
        "matmul_table": _matmul_table_json(hw.matmul_table),
    }


def _matmul_table_json(table: MatmulTable | None) -> dict[str, Any] | None:
    """What a profile's matmul table is (its timings stay in the profile file)."""
    if table is None:
        return None
    return {
        "dtype": table.dtype,
        "dims": list(table.dims),
        "shapes": len(table.warm_us),
        "cold_bytes": json_float(table.cold_bytes),
    }


# ---------------------------------------------------------------------------- reading
#
# The JSON answers every question about the chosen plan by itself. Questions about plans
# *not* chosen (what would ``S(0)R`` cost here?) need the whole problem, which ``autoparallel
# plan --out`` saves next to the JSON as a ``.npz`` and names in the ``problem`` entry, a path
# relative to the JSON's folder. :func:`read_plan_json` returns the dict or raises
# :class:`PlanJsonError` with a one-line message that says what to do.

READ_VERSIONS = (1,)
"""Schema versions this code reads (:data:`SCHEMA_VERSION` must be one of them)."""

_REQUIRED = {"mesh": dict, "totals": dict, "parameters": list}
_OBJECTS = ("hardware", "solver", "memory", "run", "constraints")
"""Optional sections that are objects (or null)."""
_RECORDS = ("parameters", "nodes", "inputs", "outputs", "collectives", "layers", "buckets")
_RECORDS += ("overlaps", "regions")
"""Sections that are lists of objects; ``parameters`` and ``nodes`` name each entry."""
_NUMBER = re.compile(r"(_us|_bytes|bytes_per_device|bandwidth|^time_s)$|^flops_")
_MEMORY_NUMBERS = ("parameters", "gradients", "optimizer_state", "activations", "transient")
_MEMORY_NUMBERS += ("peak", "budget")
"""Keys whose values the readers compute with: numbers (or null) wherever they appear."""


class PlanJsonError(ValueError):
    """A file that is not a plan JSON this version can read (one-line message)."""


def read_plan_json(path: str | Path) -> dict[str, Any]:
    """The plan dict in ``path``, checked for the schema version and the sections tools read
    (their types, the names of parameters and nodes, the numbers the summary and the diff
    compute with): :class:`PlanJsonError` naming the file and the entry otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlanJsonError(
            f"{path} is not a plan JSON written by `autoparallel plan --out` ({_short(error)})"
        ) from error
    if not isinstance(data, dict) or "version" not in data:
        raise PlanJsonError(
            f"{path} is not a plan JSON written by `autoparallel plan --out` (no schema version)"
        )
    _check_version(path, data["version"])
    for key, kind in _REQUIRED.items():
        if not isinstance(data.get(key), kind):
            raise PlanJsonError(
                f"{path} is not a complete plan JSON: its {key!r} entry is missing or not a {kind.__name__}"
            )
    problem = _section_problem(data)
    if problem is not None:
        raise PlanJsonError(f"{path} is not a plan JSON this version reads: {problem}")
    return data


def _section_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with the sections the tools read (their types, the names of the
    parameters and nodes, the numbers they compute with), or None."""
    for key in _OBJECTS:
        if not isinstance(data.get(key), (dict, type(None))):
            return f"its {key!r} entry is not an object"
    for key in _RECORDS:
        entries = data.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            return f"its {key!r} entry is not a list of objects"
        if key in ("parameters", "nodes") and not all(
            isinstance(e.get("name"), str) for e in entries
        ):
            return f"an entry of {key!r} has no name"
    shape = data["mesh"].get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) for s in shape):
        return f"its mesh shape {shape!r} is not a list of sizes"
    memory = data.get("memory") or {}
    numbers = [(f"memory.{k}", memory.get(k)) for k in _MEMORY_NUMBERS] + _numbers(data, "")
    for where, value in numbers:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{where} is {value!r}, not a number"
    return None


def _numbers(value: Any, where: str) -> list[tuple[str, Any]]:
    """(where, value) of every entry, at any depth, whose key says it holds a number."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and _NUMBER.search(key):
                found.append((inner, item))
            found.extend(_numbers(item, inner))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(_numbers(item, f"{where}[{index}]"))
    return found


def _check_version(path: Path, version: Any) -> None:
    if version in READ_VERSIONS:
        return
    newest = max(READ_VERSIONS)
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        raise PlanJsonError(
            f"{path} has plan schema version {version}, newer than this autoparallel reads ({newest}); upgrade autoparallel"
        )
    raise PlanJsonError(
        f"{path} has plan schema version {version!r}, which this autoparallel does not read "
        f"(it reads {', '.join(map(str, READ_VERSIONS))}); plan again with `autoparallel plan ... --out`"
    )


def _short(error: Exception) -> str:
    return " ".join(str(error).split())[:200]


def problem_reference(problem: Path, json_path: Path) -> str:
    """How a plan JSON at ``json_path`` names its saved ``problem``: relative to the JSON's
    folder when that is possible (so the pair can be moved together), else absolute."""
    try:
        return Path(os.path.relpath(problem.resolve(), json_path.resolve().parent)).as_posix()
    except ValueError:  # another drive on Windows
        return str(problem.resolve())


def problem_path(data: Mapping[str, Any], json_path: Path) -> Path | None:
    """The saved problem a plan JSON names, resolved against the JSON's folder (None if none)."""
    reference = data.get("problem")
    if not isinstance(reference, str) or not reference:
        return None
    return json_path.parent / reference
