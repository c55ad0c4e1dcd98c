"""One self-contained HTML page for a plan, rendered from the plan's JSON dict.

Contract: :func:`render_html` takes the dict of ``ShardingOptimizer.get_json()`` (schema
version 1; any section may be missing, e.g. when the dict was built from a ``Plan`` alone) and
returns one HTML document with inline CSS and JS only: no network access, no external fonts or
scripts, so the file can be mailed or opened from an air-gapped cluster. Everything is rendered
on the Python side (the page reads fine with JavaScript off); the small script only sorts tables
and opens/closes the module tree.

The input dict is embedded verbatim as ``<script type="application/json" id="plan-data">``, so
a reader (or a test) can recover it with ``json.loads``. JSON has no NaN/Infinity, so
non-finite floats are embedded as ``null``; every ``<``, ``>`` and ``&`` inside the JSON is
written as a ``\\u`` escape so no string in the data can close the script element.
All costs are in microseconds (``us``), as in the rest of autoparallel.

This module puts the page together and says what its header and its sections on the plan's
decisions show (solver, parameters by module, inputs and outputs, fallbacks, constraints);
the cost sections are in :mod:`autoparallel.report.html_costs`, the memory and regions
sections in ``html_memory`` and ``html_regions``, and the page shell, CSS, JS and the HTML
building blocks in :mod:`autoparallel.report.template`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoparallel.report import template as t
from autoparallel.report.html_costs import (
    collectives_section,
    hotspots_section,
    layers_section,
    nodes_section,
    totals_section,
)
from autoparallel.report.html_memory import memory_section
from autoparallel.report.html_pipeline import pipeline_section
from autoparallel.report.html_regions import regions_section
from autoparallel.report.summary import hardware_lines
from autoparallel.report.template import embed_json, format_bytes, json_safe, placement_html

__all__ = ["embed_json", "format_bytes", "json_safe", "placement_html", "render_html", "write_html"]

# ---------------------------------------------------------------------------- public API


def render_html(data: Mapping[str, Any]) -> str:
    """The whole report page for ``data`` (a plan JSON dict) as one HTML string."""
    if not isinstance(data, Mapping):
        raise TypeError(f"render_html expects the plan's JSON dict, got {type(data).__name__}")
    dims = t.dim_names(data)
    body = "\n".join(
        [
            _header(data),
            _nav(data),
            pipeline_section(data),
            totals_section(data),
            memory_section(data),
            _solver_section(data),
            _parameters_section(data, dims),
            _io_section(data, dims),
            layers_section(data),
            regions_section(data, dims),
            hotspots_section(data, dims),
            collectives_section(data, dims),
            nodes_section(data, dims),
            _fallbacks_section(data),
            _constraints_section(data),
        ]
    )
    return t.page(f"autoparallel plan: {_model_label(data)}", body, data)


def write_html(data: Mapping[str, Any], path: str | Path) -> Path:
    """Render ``data`` and write it to ``path`` (UTF-8); returns the path written."""
    path = Path(path)
    path.write_text(render_html(data), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- header, solver


def _model_label(data: Mapping[str, Any]) -> str:
    run = data.get("run") or {}
    model = run.get("model") if isinstance(run, Mapping) else None
    return str(model) if model else "model"


def _header(data: Mapping[str, Any]) -> str:
    mesh = data.get("mesh") or {}
    shape = list(mesh.get("shape") or [])
    dims = t.dim_names(data)
    devices = math.prod(int(s) for s in shape) if shape else 0
    mesh_text = ", ".join(f"{n}={s}" for n, s in zip(dims, shape)) or "-"
    stages = len((data.get("pipeline") or {}).get("stages") or [])
    mesh_fact = f"({mesh_text}), {devices} devices"
    if stages:  # a stage's plan: its mesh is the mesh without pp
        mesh_fact = f"(pp={stages}, {mesh_text}), {stages * devices} devices; this plan: a stage's"
    hardware = data.get("hardware") or {}
    facts = [
        ("mesh", mesh_fact),
        (
            "hardware",
            f"{hardware.get('name', '-')}, {hardware.get('gpus_per_node', '-')} devices per node",
        ),
    ]
    facts += [("priced on", line) for line in hardware_lines(data)]
    run = data.get("run") or {}
    if isinstance(run, Mapping):
        if run.get("layers") is not None:
            facts.append(("layers planned", run["layers"]))
        if run.get("layers_traced_once"):
            facts.append(
                (
                    "traced",
                    f"3 and 4 layers of `{run['layers_traced_once']}`; the rest repeated from them",
                )
            )
        if run.get("batch") is not None:
            facts.append(("global inputs", f"batch {run['batch']} x seq {run.get('seq', '-')}"))
        if run.get("memory_budget") is not None:
            facts.append(("memory budget", run["memory_budget"]))
        if run.get("parameter_memory") is not None:
            facts.append(("parameter memory", run["parameter_memory"]))
        if run.get("planning_s") is not None:
            stages = run.get("stage_times_s") or {}
            detail = ", ".join(f"{k} {t.num(v) or 0:.1f} s" for k, v in stages.items())
            facts.append(
                (
                    "planning time",
                    f"{t.num(run['planning_s']) or 0:.1f} s" + (f" ({detail})" if detail else ""),
                )
            )
    facts.append(("schema version", data.get("version", "-")))
    items = "".join(f"<dt>{t.esc(k)}</dt><dd>{t.esc(v)}</dd>" for k, v in facts)
    return (
        f"<header><h1>autoparallel plan: {t.esc(_model_label(data))}</h1>"
        f'<dl class="facts">{items}</dl>'
        '<p class="note">Placements are in mesh-dim order (S(d) = sharded on tensor dim d, R = replicated, '
        "P = partial); costs are per step, in microseconds (us).</p></header>"
    )


def _nav(data: Mapping[str, Any]) -> str:
    links = [("pipeline", "pipeline")] if data.get("pipeline") else []
    links += [
        ("totals", "totals"),
        ("memory", "memory"),
        ("solver", "solver"),
        ("parameters", "parameters"),
        ("io", "inputs/outputs"),
        ("layers", "cost per module"),
        ("regions", "regions"),
        ("hotspots", "hot spots"),
        ("collectives", "collectives"),
        ("nodes", "nodes"),
        ("fallbacks", "fallbacks"),
        ("constraints", "constraints"),
    ]
    return "<nav>" + " ".join(f'<a href="#{k}">{t.esc(v)}</a>' for k, v in links) + "</nav>"


def _solver_section(data: Mapping[str, Any]) -> str:
    solver = data.get("solver") or {}
    if not solver:
        return t.section("solver", "Solver", t.empty("no solver statistics in this plan"))
    gap = t.num(solver.get("gap"))
    time_s = t.num(solver.get("time_s"))
    rows = [
        ("status", solver.get("status", "-")),
        ("objective", t.us(solver.get("objective_us"))),
        ("best bound", t.us(solver.get("bound_us"))),
        ("relative gap", f"{100 * gap:.4f}%" if gap is not None else "-"),
        ("solve time", f"{time_s:.2f} s" if time_s is not None else "-"),
        ("variables", _count(solver.get("num_variables"))),
        ("constraints", _count(solver.get("num_constraints"))),
    ]
    body = "".join(f"<tr><th>{t.esc(k)}</th><td>{t.esc(v)}</td></tr>" for k, v in rows)
    return t.section("solver", "Solver", f'<table class="kv">{body}</table>')


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _count(value: Any) -> str:
    return (
        f"{value:,}"
        if isinstance(value, int) and not isinstance(value, bool)
        else t.esc(value if value is not None else "-")
    )


# ---------------------------------------------------------------------------- parameters: module tree


@dataclass
class _Module:
    """One dotted prefix of the parameter names, with its own parameters and sub-modules."""

    path: str
    children: dict[str, _Module] = field(default_factory=dict)
    params: list[Mapping[str, Any]] = field(default_factory=list)

    def all_params(self) -> list[Mapping[str, Any]]:
        out = list(self.params)
        for child in self.children.values():
            out.extend(child.all_params())
        return out

    def signature(self) -> tuple:
        """Parameter names relative to this module with their placements: equal for identical layers."""
        cut = len(self.path) + 1 if self.path else 0
        return tuple(
            (str(p.get("name", ""))[cut:], str(p.get("placements"))) for p in self.all_params()
        )


def _module_tree(params: Sequence[Mapping[str, Any]]) -> _Module:
    root = _Module("")
    for param in params:
        parts = str(param.get("name", "")).split(".")
        node = root
        for i, part in enumerate(parts[:-1]):
            node = node.children.setdefault(part, _Module(".".join(parts[: i + 1])))
        node.params.append(param)
    return root


def _collapse_chain(label: str, node: _Module) -> tuple[str, _Module]:
    """Merge a module that holds only one sub-module into it (``model.transformer``)."""
    while not node.params and len(node.children) == 1:
        ((name, child),) = node.children.items()
        label, node = f"{label}.{name}", child
    return label, node


def _param_rows(params: Sequence[Mapping[str, Any]], dims: Sequence[str]) -> list[str]:
    rows = []
    for p in params:
        rows.append(
            "<tr>"
            + t.cell(f"<code>{t.esc(p.get('name'))}</code>")
            + t.cell(t.esc(t.shape_text(p.get("shape"))))
            + t.cell(t.esc(p.get("dtype", "-")))
            + t.cell(t.placement_html(p.get("placements"), dims))
            + t.cell(
                t.esc(t.format_bytes(p.get("bytes_per_device"))), p.get("bytes_per_device"), "num"
            )
            + "</tr>"
        )
    return rows


def _param_table(params: Sequence[Mapping[str, Any]], dims: Sequence[str]) -> str:
    headers = ["parameter", "global shape", "dtype", "placements", "bytes per device#"]
    return t.table(headers, _param_rows(params, dims), cls="params sortable")


def _module_summary(label: str, node: _Module, same_as: str | None) -> str:
    params = node.all_params()
    total = sum(t.num(p.get("bytes_per_device")) or 0.0 for p in params)
    placements = sorted({str(p.get("placements")) for p in params})
    shown = ", ".join(placements[:4]) + (", ..." if len(placements) > 4 else "")
    tag = f' <span class="same">same placements as {t.esc(same_as)}</span>' if same_as else ""
    return (
        f'<summary><code class="mod">{t.esc(label)}</code> <span class="dim">{_plural(len(params), "parameter")}, '
        f"{t.esc(t.format_bytes(total))} per device; {t.esc(shown)}</span>{tag}</summary>"
    )


def _render_module(
    label: str, node: _Module, depth: int, dims: Sequence[str], same_as: str | None
) -> str:
    label, node = _collapse_chain(label, node)
    label = node.path or label
    inner = [_param_table(node.params, dims)] if node.params else []
    inner.append(_render_children(node, depth + 1, dims))
    open_attr = " open" if depth == 0 else ""
    return f"<details{open_attr}>{_module_summary(label, node, same_as)}{''.join(inner)}</details>"


def _render_children(node: _Module, depth: int, dims: Sequence[str]) -> str:
    """Sub-modules in order; a numbered entry (``layers.5``) identical to an earlier one says so."""
    seen: dict[tuple, str] = {}
    out = []
    for name, child in node.children.items():
        if not name.isdigit():
            out.append(_render_module(name, child, depth, dims, None))
            continue
        signature = child.signature()
        out.append(_render_module(name, child, depth, dims, seen.get(signature)))
        seen.setdefault(signature, child.path)
    return "".join(out)


def _parameters_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    params = [p for p in data.get("parameters") or [] if isinstance(p, Mapping)]
    if not params:
        return t.section("parameters", "Parameters", t.empty("no parameters in this plan"))
    root = _module_tree(params)
    total = sum(t.num(p.get("bytes_per_device")) or 0.0 for p in params)
    top = [_param_table(root.params, dims)] if root.params else []
    buttons = (
        '<p class="tools"><button type="button" data-tree="open">expand all</button> '
        '<button type="button" data-tree="close">collapse all</button></p>'
    )
    note = t.esc(
        f"{len(params)} parameters, {t.format_bytes(total)} per device in all; grouped by module (dotted prefix)."
    )
    content = f'{buttons}<div id="parameter-tree" class="tree">{"".join(top)}{_render_children(root, 0, dims)}</div>'
    return t.section("parameters", "Parameters by module", content, note)


# ---------------------------------------------------------------------------- inputs / outputs


def _io_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    rows = []
    for what in ("inputs", "outputs"):
        for item in data.get(what) or []:
            if not isinstance(item, Mapping):
                continue
            rows.append(
                "<tr>"
                + t.cell(t.esc(f"{what[:-1]} {item.get('index', '-')}"))
                + t.cell(t.esc(t.shape_text(item.get("shape"))))
                + t.cell(t.placement_html(item.get("placements"), dims))
                + "</tr>"
            )
    if not rows:
        return t.section("io", "Inputs and outputs", t.empty("no inputs or outputs recorded"))
    return t.section(
        "io", "Inputs and outputs", t.table(["tensor", "global shape", "placements"], rows)
    )


# ---------------------------------------------------------------------------- fallbacks and constraints


def _fallbacks_section(data: Mapping[str, Any]) -> str:
    fallbacks = data.get("fallbacks") or []
    if not fallbacks:
        return t.section(
            "fallbacks", "Fallbacks", t.empty("none: every op had a sharding strategy")
        )
    items = "".join(
        f"<li><code>{t.esc(f if not isinstance(f, Mapping) else json.dumps(f))}</code></li>"
        for f in fallbacks
    )
    return t.section(
        "fallbacks",
        "Fallbacks",
        f"<ul>{items}</ul>",
        "Ops without a sharding strategy, run replicated.",
    )


def _constraints_section(data: Mapping[str, Any]) -> str:
    constraints = data.get("constraints") or {}
    if not constraints:
        return t.section("constraints", "Constraints", t.empty("no user constraints"))
    if isinstance(constraints, Mapping):
        rows = [
            f"<tr><td><code>{t.esc(k)}</code></td><td>{t.esc(v)}</td></tr>"
            for k, v in constraints.items()
        ]
    else:
        rows = [f'<tr><td colspan="2">{t.esc(c)}</td></tr>' for c in constraints]
    return t.section("constraints", "Constraints", t.table(["name", "description"], rows))
