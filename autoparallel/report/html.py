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

This module says what each section of the page shows; the page shell, CSS, JS and the HTML
building blocks live in :mod:`autoparallel.report.template`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoparallel.report import template as t
from autoparallel.report.html_memory import memory_section
from autoparallel.report.html_regions import regions_section
from autoparallel.report.template import embed_json, format_bytes, json_safe, placement_html
from autoparallel.report.text import hardware_lines

__all__ = ["embed_json", "format_bytes", "json_safe", "placement_html", "render_html", "write_html"]

MAX_TABLE_ROWS = 2000
"""Longest collectives/nodes table rendered; the embedded JSON always holds everything."""

HOTSPOT_COUNT = 10
"""How many of the most expensive collectives the hot-spot section lists."""

TOP_NODE_COUNT = 25
"""How many of the most expensive nodes the node section lists."""


# ---------------------------------------------------------------------------- public API


def render_html(data: Mapping[str, Any]) -> str:
    """The whole report page for ``data`` (a plan JSON dict) as one HTML string."""
    if not isinstance(data, Mapping):
        raise TypeError(f"render_html expects the plan's JSON dict, got {type(data).__name__}")
    dims = t.dim_names(data)
    body = "\n".join(
        [
            _header(data),
            _nav(),
            _totals_section(data),
            memory_section(data),
            _solver_section(data),
            _parameters_section(data, dims),
            _io_section(data, dims),
            _layers_section(data),
            regions_section(data, dims),
            _hotspots_section(data, dims),
            _collectives_section(data, dims),
            _nodes_section(data, dims),
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


# ---------------------------------------------------------------------------- header, totals, solver


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
    hardware = data.get("hardware") or {}
    facts = [
        ("mesh", f"({mesh_text}), {devices} devices"),
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


def _nav() -> str:
    links = [
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


def _totals_section(data: Mapping[str, Any]) -> str:
    totals = data.get("totals") or {}
    if not totals:
        return t.section("totals", "Totals", t.empty("no totals in this plan"))
    parts = t.cost_parts(totals)
    whole = sum(v for _, v in parts)
    cards = [
        f'<div class="card total"><div class="k">total</div><div class="v">{t.us(totals.get("total_us"))}</div></div>'
    ]
    for name, value in parts:
        cards.append(
            f'<div class="card {name}"><div class="k">{name}</div><div class="v">{t.us(value)}</div>'
            f'<div class="k">{t.pct(value, whole):.1f}% of total</div></div>'
        )
    legend = "".join(f'<span class="key {n}"></span>{n} {t.pct(v, whole):.1f}% ' for n, v in parts)
    bar = t.stacked_bar(parts, whole, "total")
    return t.section(
        "totals",
        "Totals",
        f'<div class="cards">{"".join(cards)}</div>{bar}<p class="legend">{legend}</p>'
        + _overlap_note(data)
        + _prediction_note(totals),
    )


def _overlap_note(data: Mapping[str, Any]) -> str:
    """How much of the comm runs behind compute, and a table of where."""
    totals = data.get("totals") or {}
    hidden = t.num(totals.get("hidden_comm_us")) or 0.0
    overlaps = data.get("overlaps") or []
    if hidden <= 0 or not overlaps:
        return ""
    rows = "".join(
        "<tr>"
        + t.cell(t.esc(o.get("phase", "")))
        + t.cell(t.esc(o.get("comm", "")))
        + t.cell(t.esc(o.get("during", "")))
        + t.cell(t.esc(t.us(o.get("comm_us"))), o.get("comm_us"), "num")
        + t.cell(t.esc(t.us(o.get("compute_us"))), o.get("compute_us"), "num")
        + t.cell(t.esc(t.us(o.get("hidden_us"))), o.get("hidden_us"), "num")
        + "</tr>"
        for o in overlaps
    )
    return (
        f'<p class="legend">Of the comm, {t.us(hidden)} runs behind compute (the total '
        f"leaves it out); {t.us(totals.get('exposed_comm_us'))} is exposed.</p>"
        "<table><thead><tr><th>phase</th><th>comm</th><th>behind</th><th>comm</th>"
        f"<th>compute</th><th>hidden</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _prediction_note(totals: Mapping[str, Any]) -> str:
    """What the total is a prediction of, and what it was priced on."""
    optimizer = t.num(totals.get("optimizer_us")) or 0.0
    priced_on = totals.get("priced_on")
    step = (
        f"of which the optimizer step {t.us(optimizer)}"
        if optimizer > 0
        else "the optimizer step not priced"
    )
    runtime = t.num(totals.get("runtime_us")) or 0.0
    if runtime > 0:
        step += f"; the runtime's own work outside its traced graphs {t.us(runtime)}"
    where = f", priced on <code>{t.esc(priced_on)}</code>" if priced_on else ""
    return (
        f'<p class="legend">The total is the predicted time of one training step (forward and '
        f"backward; {step}){where}. Check it on your cluster with "
        "<code>autoparallel.measure_step</code>.</p>"
    )


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


# ---------------------------------------------------------------------------- cost per layer


def _natural_key(row: Mapping[str, Any]) -> list[tuple[int, Any]]:
    """``layers.2`` before ``layers.10``; the top level (``""``) first."""
    parts = str(row.get("module") or "").split(".")
    return [(0, int(p)) if p.isdigit() else (1, p) for p in parts]


def _layers_section(data: Mapping[str, Any]) -> str:
    layers = sorted(
        (row for row in data.get("layers") or [] if isinstance(row, Mapping)), key=_natural_key
    )
    if not layers:
        return t.section(
            "layers", "Cost per module", t.absent(data, "layers", "no per-module costs")
        )
    totals = [sum(v for _, v in t.cost_parts(row)) for row in layers]
    scale = max(totals) if totals else 0.0
    rows = []
    for row, total in zip(layers, totals):
        label = str(row.get("module") or "(top level)")
        detail = ", ".join(f"{n} {t.us(v)}" for n, v in t.cost_parts(row))
        rows.append(
            f'<div class="lrow"><div class="lname"><code>{t.esc(label)}</code></div>'
            f"{t.stacked_bar(t.cost_parts(row), scale, label)}"
            f'<div class="lval" title="{t.esc(detail)}">{t.esc(t.us(total))}</div></div>'
        )
    legend = "".join(f'<span class="key {n}"></span>{n} ' for _, n in t.COST_PARTS)
    content = f'<div class="chart">{"".join(rows)}</div><p class="legend">{legend}</p>'
    note = "Compute of each module's nodes plus the redistributions into them; bars are scaled to the most expensive module (hover for the split)."
    return t.section("layers", "Cost per module", content, note)


# ---------------------------------------------------------------------------- collectives


def _collectives(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Collectives sorted by cost, most expensive first (non-numbers last)."""
    rows = [c for c in data.get("collectives") or [] if isinstance(c, Mapping)]
    return sorted(rows, key=lambda c: -(t.num(c.get("comm_us")) or -1.0))


def _kind_html(kind: Any) -> str:
    parts = str(kind or "-").split("+")
    return "+".join(
        f'<span class="kind k-{t.esc(re.sub(r"[^a-z_]", "", p))}">{t.esc(p)}</span>' for p in parts
    )


def _collective_row(
    c: Mapping[str, Any], dims: Sequence[str], share_of: float | None = None
) -> str:
    cells = [
        t.cell(_kind_html(c.get("kind")), cls="nw"),
        t.cell(t.mesh_dims_html(c.get("mesh_dims"), dims), cls="nw"),
        t.cell(
            f'{t.placement_html(c.get("src"), dims)} <span class="arrow">&rarr;</span> {t.placement_html(c.get("dst"), dims)}',
            cls="nw",
        ),
        t.cell(t.esc(t.us(c.get("comm_us"))), c.get("comm_us"), "num"),
    ]
    if share_of is not None:
        share = t.pct(t.num(c.get("comm_us")) or 0.0, share_of)
        cells.append(
            t.cell(
                f'<div class="bar mini"><span class="seg comm" style="width:{share:.3f}%"></span></div> {share:.1f}%',
                share,
                "num",
            )
        )
    cells += [
        t.cell(t.esc(c.get("phase", "-"))),
        t.cell(f"<code>{t.esc(c.get('module') or '-')}</code>"),
        t.cell(
            f"<code>{t.esc(c.get('consumer', '-'))}</code> &larr; <code>{t.esc(c.get('producer', '-'))}</code>"
        ),
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def _hotspots_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    rows = _collectives(data)[:HOTSPOT_COUNT]
    if not rows:
        return t.section(
            "hotspots",
            "Communication hot spots",
            t.absent(data, "collectives", "none: no redistribution in this plan"),
        )
    comm_total = t.num((data.get("totals") or {}).get("comm_us")) or sum(
        t.num(c.get("comm_us")) or 0.0 for c in _collectives(data)
    )
    headers = [
        "kind",
        "mesh dims",
        "src -> dst",
        "comm#",
        "share of comm#",
        "phase",
        "module",
        "consumer <- producer",
    ]
    table = t.table(
        headers, [_collective_row(c, dims, comm_total) for c in rows], table_id="hotspot-table"
    )
    return t.section("hotspots", f"Communication hot spots (top {len(rows)})", table)


def _collectives_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    rows = _collectives(data)
    if not rows:
        return t.section(
            "collectives",
            "Collectives",
            t.absent(data, "collectives", "none: no redistribution in this plan"),
        )
    shown = rows[:MAX_TABLE_ROWS]
    headers = [
        "kind",
        "mesh dims",
        "src -> dst",
        "comm#",
        "phase",
        "module",
        "consumer <- producer",
    ]
    table = t.table(
        headers,
        [_collective_row(c, dims) for c in shown],
        table_id="collective-table",
        cls="sortable",
    )
    kinds: dict[str, float] = {}
    for c in rows:
        kinds[str(c.get("kind"))] = kinds.get(str(c.get("kind")), 0.0) + (
            t.num(c.get("comm_us")) or 0.0
        )
    by_kind = "; ".join(
        f"{t.esc(k)} {t.esc(t.us(v))}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
    )
    note = f"{len(rows)} collectives, sorted by cost; click a column header to sort. By kind: {by_kind}."
    if len(rows) > len(shown):
        note += f" Only the {len(shown)} most expensive are listed; the embedded JSON has all."
    return t.section("collectives", "Collectives", table, note)


# ---------------------------------------------------------------------------- nodes


def _node_cost(node: Mapping[str, Any]) -> float:
    return sum(v for _, v in t.cost_parts(node))


def _nodes_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    nodes = [n for n in data.get("nodes") or [] if isinstance(n, Mapping)]
    if not nodes:
        return t.section("nodes", "Most expensive nodes", t.absent(data, "nodes", "no nodes"))
    top = sorted(nodes, key=_node_cost, reverse=True)[:TOP_NODE_COUNT]
    rows = []
    for n in top:
        inputs = t.placement_html(n.get("input_placements") or [], dims)
        rows.append(
            "<tr>"
            + t.cell(f"<code>{t.esc(n.get('name'))}</code>")
            + t.cell(f"<code>{t.esc(n.get('target'))}</code>")
            + t.cell(t.esc(n.get("phase", "-")))
            + t.cell(f"<code>{t.esc(n.get('module') or '-')}</code>")
            + t.cell(t.esc(t.shape_text(n.get("shape"))))
            + t.cell(
                f'{inputs} <span class="arrow">&rarr;</span> {t.placement_html(n.get("placements"), dims)}'
            )
            + "".join(t.cell(t.esc(t.us(n.get(k))), n.get(k), "num") for k, _ in t.COST_PARTS)
            + "</tr>"
        )
    headers = [
        "node",
        "op",
        "phase",
        "module",
        "global shape",
        "inputs -> output",
        "compute#",
        "comm#",
        "transition#",
    ]
    table = t.table(headers, rows, table_id="node-table", cls="sortable")
    inner = f"<details><summary>{len(top)} of {len(nodes)} nodes, by compute + comm + transition</summary>{table}</details>"
    return t.section("nodes", "Most expensive nodes", inner)


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
