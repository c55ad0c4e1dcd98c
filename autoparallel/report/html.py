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
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["embed_json", "format_bytes", "json_safe", "placement_html", "render_html", "write_html"]

MAX_TABLE_ROWS = 2000
"""Longest collectives/nodes table rendered; the embedded JSON always holds everything."""

HOTSPOT_COUNT = 10
"""How many of the most expensive collectives the hot-spot section lists."""

TOP_NODE_COUNT = 25
"""How many of the most expensive nodes the node section lists."""

_PLACEMENT_TOKEN = re.compile(r"S\(-?\d+\)|R|P\([A-Za-z_]+\)")
_COST_PARTS = (("compute_us", "compute"), ("comm_us", "comm"), ("transition_us", "transition"))


# ---------------------------------------------------------------------------- public API


def render_html(data: Mapping[str, Any]) -> str:
    """The whole report page for ``data`` (a plan JSON dict) as one HTML string."""
    if not isinstance(data, Mapping):
        raise TypeError(f"render_html expects the plan's JSON dict, got {type(data).__name__}")
    dims = _dim_names(data)
    body = "\n".join(
        [
            _header(data),
            _nav(),
            _totals_section(data),
            _solver_section(data),
            _parameters_section(data, dims),
            _io_section(data, dims),
            _layers_section(data),
            _hotspots_section(data, dims),
            _collectives_section(data, dims),
            _nodes_section(data, dims),
            _fallbacks_section(data),
            _constraints_section(data),
        ]
    )
    title = _esc(f"autoparallel plan: {_model_label(data)}")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n{body}\n</main>\n"
        f"<script type=\"application/json\" id=\"plan-data\">{embed_json(data)}</script>\n"
        f"<script>{_JS}</script>\n</body>\n</html>\n"
    )


def write_html(data: Mapping[str, Any], path: str | Path) -> Path:
    """Render ``data`` and write it to ``path`` (UTF-8); returns the path written."""
    path = Path(path)
    path.write_text(render_html(data), encoding="utf-8")
    return path


def embed_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element and parses back equal.

    Non-finite floats become null (JSON has no NaN); objects JSON does not know become strings.
    """
    text = json.dumps(json_safe(data), ensure_ascii=False, allow_nan=False, default=str)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


# ---------------------------------------------------------------------------- formatting


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as None and tuples as lists: what standard JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _num(value: Any) -> float | None:
    """A finite float, or None for anything else (missing, null, NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _us(value: Any) -> str:
    number = _num(value)
    if number is None:
        return "inf us" if isinstance(value, float) and math.isinf(value) else "-"
    return f"{number:,.2f} us"


def format_bytes(value: Any) -> str:
    """Bytes in binary units (``1.50 GiB``); ``-`` for a missing value."""
    number = _num(value)
    if number is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(number) < 1024 or unit == "GiB":
            return f"{number:,.0f} {unit}" if unit == "B" else f"{number:,.2f} {unit}"
        number /= 1024
    return f"{number:,.2f} TiB"  # unreachable, keeps type checkers calm


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def _shape(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "-" if value is None else str(value)


def _dim_names(data: Mapping[str, Any]) -> list[str]:
    mesh = data.get("mesh") or {}
    shape = list(mesh.get("shape") or [])
    names = mesh.get("dim_names")
    if isinstance(names, (list, tuple)) and len(names) == len(shape):
        return [str(n) for n in names]
    return [f"dim{i}" for i in range(len(shape))]


def _mesh_dims(value: Any, dims: Sequence[str]) -> str:
    """Mesh dims as names: ints index ``dims``, anything else is shown as given."""
    if not isinstance(value, (list, tuple)):
        return _esc(value) if value is not None else "-"
    out = [dims[v] if isinstance(v, int) and 0 <= v < len(dims) else str(v) for v in value]
    return _esc(", ".join(out)) or "-"


def placement_html(value: Any, dims: Sequence[str]) -> str:
    """Seed notation (``S(0)R``) as one chip per mesh dim, titled with the dim's name.

    Anything that is not a plain placement string (multi-output tuples, lists) is shown as text.
    """
    if isinstance(value, (list, tuple)):
        return ", ".join(placement_html(v, dims) for v in value) or "-"
    if value is None:
        return "-"
    text = str(value)
    tokens = _PLACEMENT_TOKEN.findall(text)
    if not tokens or "".join(tokens) != text:
        return f"<code>{_esc(text)}</code>"
    chips = []
    for i, token in enumerate(tokens):
        dim = dims[i] if i < len(dims) else f"dim{i}"
        chips.append(f'<span class="pl pl-{token[0]}" title="{_esc(dim)}: {_esc(token)}">{_esc(token)}</span>')
    return f'<span class="pls">{"".join(chips)}</span>'


def _cell(text: str, sort_value: Any = None, cls: str = "") -> str:
    """A table cell; ``sort_value`` (a number) is what the sort script compares."""
    attrs = f' class="{cls}"' if cls else ""
    number = _num(sort_value)
    if sort_value is not None:
        attrs += f' data-v="{number if number is not None else -1}"'
    return f"<td{attrs}>{text}</td>"


def _table(headers: Sequence[str], rows: Iterable[str], *, table_id: str = "", cls: str = "") -> str:
    """A table with a header row; ``numeric`` columns are marked by a trailing ``#``."""
    ths = []
    for header in headers:
        numeric = header.endswith("#")
        label = header[:-1] if numeric else header
        cls_num = ' class="num"' if numeric else ""
        ths.append(f"<th{cls_num}>{_esc(label)}</th>")
    id_attr = f' id="{_esc(table_id)}"' if table_id else ""
    cls_attr = f' class="{_esc(cls)}"' if cls else ""
    return f"<table{id_attr}{cls_attr}><thead><tr>{''.join(ths)}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _section(section_id: str, title: str, content: str, note: str = "") -> str:
    note_html = f'<p class="note">{note}</p>' if note else ""
    return f'<section id="{section_id}"><h2>{_esc(title)}</h2>{note_html}{content}</section>'


def _empty(text: str) -> str:
    return f'<p class="empty">{_esc(text)}</p>'


def _absent(data: Mapping[str, Any], key: str, none_text: str) -> str:
    """Why a section is empty: the data has no such key (a partial dict), or nothing to list."""
    if key not in data:
        return _empty(f"not recorded in this data: it has no {key} entry (built from a Plan alone?)")
    return _empty(none_text)


def _stacked_bar(parts: Sequence[tuple[str, float]], scale: float, label: str) -> str:
    """A horizontal bar of ``parts`` (class name, us) whose full width is ``scale`` us."""
    segments = []
    for name, value in parts:
        width = _pct(max(value, 0.0), scale)
        if width <= 0:
            continue
        title = f"{label}: {name} {_us(value)}"
        segments.append(f'<span class="seg {name}" style="width:{width:.3f}%" title="{_esc(title)}"></span>')
    return f'<div class="bar">{"".join(segments)}</div>'


def _cost_parts(row: Mapping[str, Any]) -> list[tuple[str, float]]:
    return [(name, _num(row.get(key)) or 0.0) for key, name in _COST_PARTS]


# ---------------------------------------------------------------------------- header, totals, solver


def _model_label(data: Mapping[str, Any]) -> str:
    run = data.get("run") or {}
    model = run.get("model") if isinstance(run, Mapping) else None
    return str(model) if model else "model"


def _header(data: Mapping[str, Any]) -> str:
    mesh = data.get("mesh") or {}
    shape = list(mesh.get("shape") or [])
    dims = _dim_names(data)
    devices = math.prod(int(s) for s in shape) if shape else 0
    mesh_text = ", ".join(f"{n}={s}" for n, s in zip(dims, shape)) or "-"
    hardware = data.get("hardware") or {}
    facts = [
        ("mesh", f"({mesh_text}), {devices} devices"),
        ("hardware", f"{hardware.get('name', '-')}, {hardware.get('gpus_per_node', '-')} GPUs per node"),
    ]
    run = data.get("run") or {}
    if isinstance(run, Mapping):
        if run.get("layers") is not None:
            facts.append(("layers planned", run["layers"]))
        if run.get("batch") is not None:
            facts.append(("global inputs", f"batch {run['batch']} x seq {run.get('seq', '-')}"))
        if run.get("memory_budget") is not None:
            facts.append(("memory budget", run["memory_budget"]))
        if run.get("planning_s") is not None:
            stages = run.get("stage_times_s") or {}
            detail = ", ".join(f"{k} {_num(v) or 0:.1f} s" for k, v in stages.items())
            facts.append(("planning time", f"{_num(run['planning_s']) or 0:.1f} s" + (f" ({detail})" if detail else "")))
    facts.append(("schema version", data.get("version", "-")))
    items = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in facts)
    return (
        f'<header><h1>autoparallel plan: {_esc(_model_label(data))}</h1>'
        f'<dl class="facts">{items}</dl>'
        '<p class="note">Placements are in mesh-dim order (S(d) = sharded on tensor dim d, R = replicated, '
        "P = partial); costs are per step, in microseconds (us).</p></header>"
    )


def _nav() -> str:
    links = [
        ("totals", "totals"), ("solver", "solver"), ("parameters", "parameters"), ("io", "inputs/outputs"),
        ("layers", "cost per module"), ("hotspots", "hot spots"), ("collectives", "collectives"),
        ("nodes", "nodes"), ("fallbacks", "fallbacks"), ("constraints", "constraints"),
    ]
    return "<nav>" + " ".join(f'<a href="#{k}">{_esc(v)}</a>' for k, v in links) + "</nav>"


def _totals_section(data: Mapping[str, Any]) -> str:
    totals = data.get("totals") or {}
    if not totals:
        return _section("totals", "Totals", _empty("no totals in this plan"))
    parts = _cost_parts(totals)
    whole = sum(v for _, v in parts)
    cards = [f'<div class="card total"><div class="k">total</div><div class="v">{_us(totals.get("total_us"))}</div></div>']
    for name, value in parts:
        cards.append(
            f'<div class="card {name}"><div class="k">{name}</div><div class="v">{_us(value)}</div>'
            f'<div class="k">{_pct(value, whole):.1f}% of total</div></div>'
        )
    legend = "".join(f'<span class="key {n}"></span>{n} {_pct(v, whole):.1f}% ' for n, v in parts)
    bar = _stacked_bar(parts, whole, "total")
    return _section("totals", "Totals", f'<div class="cards">{"".join(cards)}</div>{bar}<p class="legend">{legend}</p>')


def _solver_section(data: Mapping[str, Any]) -> str:
    solver = data.get("solver") or {}
    if not solver:
        return _section("solver", "Solver", _empty("no solver statistics in this plan"))
    gap = _num(solver.get("gap"))
    time_s = _num(solver.get("time_s"))
    rows = [
        ("status", solver.get("status", "-")),
        ("objective", _us(solver.get("objective_us"))),
        ("best bound", _us(solver.get("bound_us"))),
        ("relative gap", f"{100 * gap:.4f}%" if gap is not None else "-"),
        ("solve time", f"{time_s:.2f} s" if time_s is not None else "-"),
        ("variables", _count(solver.get("num_variables"))),
        ("constraints", _count(solver.get("num_constraints"))),
    ]
    body = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    return _section("solver", "Solver", f'<table class="kv">{body}</table>')


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else _esc(value if value is not None else "-")


# ---------------------------------------------------------------------------- parameters: module tree


@dataclass
class _Module:
    """One dotted prefix of the parameter names, with its own parameters and sub-modules."""

    path: str
    children: dict[str, "_Module"] = field(default_factory=dict)
    params: list[Mapping[str, Any]] = field(default_factory=list)

    def all_params(self) -> list[Mapping[str, Any]]:
        out = list(self.params)
        for child in self.children.values():
            out.extend(child.all_params())
        return out

    def signature(self) -> tuple:
        """Parameter names relative to this module with their placements: equal for identical layers."""
        cut = len(self.path) + 1 if self.path else 0
        return tuple((str(p.get("name", ""))[cut:], str(p.get("placements"))) for p in self.all_params())


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
        (name, child), = node.children.items()
        label, node = f"{label}.{name}", child
    return label, node


def _param_rows(params: Sequence[Mapping[str, Any]], dims: Sequence[str]) -> list[str]:
    rows = []
    for p in params:
        rows.append(
            "<tr>"
            + _cell(f'<code>{_esc(p.get("name"))}</code>')
            + _cell(_esc(_shape(p.get("shape"))))
            + _cell(_esc(p.get("dtype", "-")))
            + _cell(placement_html(p.get("placements"), dims))
            + _cell(_esc(format_bytes(p.get("bytes_per_device"))), p.get("bytes_per_device"), "num")
            + "</tr>"
        )
    return rows


def _param_table(params: Sequence[Mapping[str, Any]], dims: Sequence[str]) -> str:
    headers = ["parameter", "global shape", "dtype", "placements", "bytes per device#"]
    return _table(headers, _param_rows(params, dims), cls="params sortable")


def _module_summary(label: str, node: _Module, same_as: str | None) -> str:
    params = node.all_params()
    total = sum(_num(p.get("bytes_per_device")) or 0.0 for p in params)
    placements = sorted({str(p.get("placements")) for p in params})
    shown = ", ".join(placements[:4]) + (", ..." if len(placements) > 4 else "")
    tag = f' <span class="same">same placements as {_esc(same_as)}</span>' if same_as else ""
    return (
        f'<summary><code class="mod">{_esc(label)}</code> <span class="dim">{_plural(len(params), "parameter")}, '
        f"{_esc(format_bytes(total))} per device; {_esc(shown)}</span>{tag}</summary>"
    )


def _render_module(label: str, node: _Module, depth: int, dims: Sequence[str], same_as: str | None) -> str:
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
        return _section("parameters", "Parameters", _empty("no parameters in this plan"))
    root = _module_tree(params)
    total = sum(_num(p.get("bytes_per_device")) or 0.0 for p in params)
    top = [_param_table(root.params, dims)] if root.params else []
    buttons = (
        '<p class="tools"><button type="button" data-tree="open">expand all</button> '
        '<button type="button" data-tree="close">collapse all</button></p>'
    )
    note = _esc(f"{len(params)} parameters, {format_bytes(total)} per device in all; grouped by module (dotted prefix).")
    content = f'{buttons}<div id="parameter-tree" class="tree">{"".join(top)}{_render_children(root, 0, dims)}</div>'
    return _section("parameters", "Parameters by module", content, note)


# ---------------------------------------------------------------------------- inputs / outputs


def _io_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    rows = []
    for what in ("inputs", "outputs"):
        for item in data.get(what) or []:
            if not isinstance(item, Mapping):
                continue
            rows.append(
                "<tr>"
                + _cell(_esc(f"{what[:-1]} {item.get('index', '-')}"))
                + _cell(_esc(_shape(item.get("shape"))))
                + _cell(placement_html(item.get("placements"), dims))
                + "</tr>"
            )
    if not rows:
        return _section("io", "Inputs and outputs", _empty("no inputs or outputs recorded"))
    return _section("io", "Inputs and outputs", _table(["tensor", "global shape", "placements"], rows))


# ---------------------------------------------------------------------------- cost per layer


def _natural_key(row: Mapping[str, Any]) -> list[tuple[int, Any]]:
    """``layers.2`` before ``layers.10``; the top level (``""``) first."""
    parts = str(row.get("module") or "").split(".")
    return [(0, int(p)) if p.isdigit() else (1, p) for p in parts]


def _layers_section(data: Mapping[str, Any]) -> str:
    layers = sorted((row for row in data.get("layers") or [] if isinstance(row, Mapping)), key=_natural_key)
    if not layers:
        return _section("layers", "Cost per module", _absent(data, "layers", "no per-module costs"))
    totals = [sum(v for _, v in _cost_parts(row)) for row in layers]
    scale = max(totals) if totals else 0.0
    rows = []
    for row, total in zip(layers, totals):
        label = str(row.get("module") or "(top level)")
        detail = ", ".join(f"{n} {_us(v)}" for n, v in _cost_parts(row))
        rows.append(
            f'<div class="lrow"><div class="lname"><code>{_esc(label)}</code></div>'
            f"{_stacked_bar(_cost_parts(row), scale, label)}"
            f'<div class="lval" title="{_esc(detail)}">{_esc(_us(total))}</div></div>'
        )
    legend = "".join(f'<span class="key {n}"></span>{n} ' for _, n in _COST_PARTS)
    content = f'<div class="chart">{"".join(rows)}</div><p class="legend">{legend}</p>'
    note = "Compute of each module's nodes plus the redistributions into them; bars are scaled to the most expensive module (hover for the split)."
    return _section("layers", "Cost per module", content, note)


# ---------------------------------------------------------------------------- collectives


def _collectives(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Collectives sorted by cost, most expensive first (non-numbers last)."""
    rows = [c for c in data.get("collectives") or [] if isinstance(c, Mapping)]
    return sorted(rows, key=lambda c: -(_num(c.get("comm_us")) or -1.0))


def _kind_html(kind: Any) -> str:
    parts = str(kind or "-").split("+")
    return "+".join(f'<span class="kind k-{_esc(re.sub(r"[^a-z_]", "", p))}">{_esc(p)}</span>' for p in parts)


def _collective_row(c: Mapping[str, Any], dims: Sequence[str], share_of: float | None = None) -> str:
    cells = [
        _cell(_kind_html(c.get("kind")), cls="nw"),
        _cell(_mesh_dims(c.get("mesh_dims"), dims), cls="nw"),
        _cell(f'{placement_html(c.get("src"), dims)} <span class="arrow">&rarr;</span> {placement_html(c.get("dst"), dims)}', cls="nw"),
        _cell(_esc(_us(c.get("comm_us"))), c.get("comm_us"), "num"),
    ]
    if share_of is not None:
        share = _pct(_num(c.get("comm_us")) or 0.0, share_of)
        cells.append(_cell(f'<div class="bar mini"><span class="seg comm" style="width:{share:.3f}%"></span></div> {share:.1f}%', share, "num"))
    cells += [
        _cell(_esc(c.get("phase", "-"))),
        _cell(f'<code>{_esc(c.get("module") or "-")}</code>'),
        _cell(f'<code>{_esc(c.get("consumer", "-"))}</code> &larr; <code>{_esc(c.get("producer", "-"))}</code>'),
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def _hotspots_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    rows = _collectives(data)[:HOTSPOT_COUNT]
    if not rows:
        return _section("hotspots", "Communication hot spots", _absent(data, "collectives", "none: no redistribution in this plan"))
    comm_total = _num((data.get("totals") or {}).get("comm_us")) or sum(_num(c.get("comm_us")) or 0.0 for c in _collectives(data))
    headers = ["kind", "mesh dims", "src -> dst", "comm#", "share of comm#", "phase", "module", "consumer <- producer"]
    table = _table(headers, [_collective_row(c, dims, comm_total) for c in rows], table_id="hotspot-table")
    return _section("hotspots", f"Communication hot spots (top {len(rows)})", table)


def _collectives_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    rows = _collectives(data)
    if not rows:
        return _section("collectives", "Collectives", _absent(data, "collectives", "none: no redistribution in this plan"))
    shown = rows[:MAX_TABLE_ROWS]
    headers = ["kind", "mesh dims", "src -> dst", "comm#", "phase", "module", "consumer <- producer"]
    table = _table(headers, [_collective_row(c, dims) for c in shown], table_id="collective-table", cls="sortable")
    kinds: dict[str, float] = {}
    for c in rows:
        kinds[str(c.get("kind"))] = kinds.get(str(c.get("kind")), 0.0) + (_num(c.get("comm_us")) or 0.0)
    by_kind = "; ".join(f"{_esc(k)} {_esc(_us(v))}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    note = f"{len(rows)} collectives, sorted by cost; click a column header to sort. By kind: {by_kind}."
    if len(rows) > len(shown):
        note += f" Only the {len(shown)} most expensive are listed; the embedded JSON has all."
    return _section("collectives", "Collectives", table, note)


# ---------------------------------------------------------------------------- nodes


def _node_cost(node: Mapping[str, Any]) -> float:
    return sum(v for _, v in _cost_parts(node))


def _nodes_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    nodes = [n for n in data.get("nodes") or [] if isinstance(n, Mapping)]
    if not nodes:
        return _section("nodes", "Most expensive nodes", _absent(data, "nodes", "no nodes"))
    top = sorted(nodes, key=_node_cost, reverse=True)[:TOP_NODE_COUNT]
    rows = []
    for n in top:
        inputs = placement_html(n.get("input_placements") or [], dims)
        rows.append(
            "<tr>"
            + _cell(f'<code>{_esc(n.get("name"))}</code>')
            + _cell(f'<code>{_esc(n.get("target"))}</code>')
            + _cell(_esc(n.get("phase", "-")))
            + _cell(f'<code>{_esc(n.get("module") or "-")}</code>')
            + _cell(_esc(_shape(n.get("shape"))))
            + _cell(f'{inputs} <span class="arrow">&rarr;</span> {placement_html(n.get("placements"), dims)}')
            + "".join(_cell(_esc(_us(n.get(k))), n.get(k), "num") for k, _ in _COST_PARTS)
            + "</tr>"
        )
    headers = ["node", "op", "phase", "module", "global shape", "inputs -> output", "compute#", "comm#", "transition#"]
    table = _table(headers, rows, table_id="node-table", cls="sortable")
    inner = f"<details><summary>{len(top)} of {len(nodes)} nodes, by compute + comm + transition</summary>{table}</details>"
    return _section("nodes", "Most expensive nodes", inner)


# ---------------------------------------------------------------------------- fallbacks and constraints


def _fallbacks_section(data: Mapping[str, Any]) -> str:
    fallbacks = data.get("fallbacks") or []
    if not fallbacks:
        return _section("fallbacks", "Fallbacks", _empty("none: every op had a sharding strategy"))
    items = "".join(f"<li><code>{_esc(f if not isinstance(f, Mapping) else json.dumps(f))}</code></li>" for f in fallbacks)
    return _section("fallbacks", "Fallbacks", f"<ul>{items}</ul>", "Ops without a sharding strategy, run replicated.")


def _constraints_section(data: Mapping[str, Any]) -> str:
    constraints = data.get("constraints") or {}
    if not constraints:
        return _section("constraints", "Constraints", _empty("no user constraints"))
    if isinstance(constraints, Mapping):
        rows = [f"<tr><td><code>{_esc(k)}</code></td><td>{_esc(v)}</td></tr>" for k, v in constraints.items()]
    else:
        rows = [f"<tr><td colspan=\"2\">{_esc(c)}</td></tr>" for c in constraints]
    return _section("constraints", "Constraints", _table(["name", "description"], rows))


# ---------------------------------------------------------------------------- inline CSS and JS

_CSS = """
:root{--fg:#1d232b;--muted:#5b6675;--line:#d8dee6;--bg:#f6f8fa;--compute:#3b7dd8;--comm:#e8833a;
--transition:#9aa5b1;--S:#2f8f5b;--R:#6b7785;--P:#b5432f}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:var(--fg);background:#fff}
main{max-width:1400px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 10px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid var(--line);padding-bottom:4px}
code{font:12.5px/1.3 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
nav{position:sticky;top:0;background:#fff;border-bottom:1px solid var(--line);padding:6px 0;z-index:2}
nav a{color:#2457a5;text-decoration:none;margin-right:12px;font-size:13px}nav a:hover{text-decoration:underline}
.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0}
.facts dt{color:var(--muted)}.facts dd{margin:0}
.note{color:var(--muted);font-size:12.5px;margin:4px 0 8px}.empty{color:var(--muted);font-style:italic}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin-bottom:10px}
.card{border:1px solid var(--line);border-radius:6px;padding:8px 14px;min-width:170px;background:var(--bg);border-top:4px solid var(--line)}
.card.compute{border-top-color:var(--compute)}.card.comm{border-top-color:var(--comm)}.card.transition{border-top-color:var(--transition)}
.card .k{color:var(--muted);font-size:12px}.card .v{font-size:18px;font-weight:600}
.bar{display:flex;height:18px;background:var(--bg);border:1px solid var(--line);border-radius:3px;overflow:hidden;flex:1}
.bar.mini{display:inline-flex;width:80px;height:10px;vertical-align:middle;flex:none}
.seg{display:block;height:100%}.seg.compute{background:var(--compute)}.seg.comm{background:var(--comm)}.seg.transition{background:var(--transition)}
.legend{font-size:12.5px;color:var(--muted)}
.key{display:inline-block;width:10px;height:10px;margin:0 4px 0 8px;border-radius:2px;vertical-align:baseline}
.key.compute{background:var(--compute)}.key.comm{background:var(--comm)}.key.transition{background:var(--transition)}
table{border-collapse:collapse;margin:4px 0 8px;font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:3px 10px 3px 4px;text-align:left;vertical-align:top}
thead th{background:var(--bg);position:sticky;top:30px;white-space:nowrap}
table.sortable thead th{cursor:pointer}table.sortable thead th:hover{background:#e9eef4}
th.sorted-asc::after{content:" \\25B2";font-size:10px}th.sorted-desc::after{content:" \\25BC";font-size:10px}
td.num,th.num{text-align:right;white-space:nowrap}td.nw{white-space:nowrap}
table.kv th{text-align:left;color:var(--muted);font-weight:normal;background:none;position:static}
.pls{white-space:nowrap}
.pl{display:inline-block;font:12px/1.2 ui-monospace,Menlo,Consolas,monospace;padding:1px 4px;margin-right:2px;border-radius:3px;color:#fff}
.pl-S{background:var(--S)}.pl-R{background:var(--R)}.pl-P{background:var(--P)}
.kind{display:inline-block;padding:0 5px;border-radius:3px;background:#eef2f7;font-size:12.5px}
.k-all_gather{background:#dbe9fb}.k-reduce_scatter{background:#fbe3d1}.k-all_reduce{background:#f7d4d4}.k-all_to_all{background:#e6dcf7}.k-local{background:#e8ece9}
.arrow{color:var(--muted)}
.tree details{margin:2px 0 2px 14px;border-left:1px dotted var(--line);padding-left:8px}
.tree>details{margin-left:0}
.tree summary{cursor:pointer;padding:2px 0}.tree summary .dim{color:var(--muted);font-size:12.5px}
.same{font-size:11.5px;background:#eef6ee;color:#2f6b43;border-radius:3px;padding:0 5px}
code.mod{font-weight:600}
.chart{display:flex;flex-direction:column;gap:3px}
.lrow{display:flex;align-items:center;gap:8px}.lname{width:260px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.lval{width:130px;text-align:right;font-size:12.5px;white-space:nowrap}
button{font:inherit;font-size:12.5px;padding:2px 8px;border:1px solid var(--line);border-radius:4px;background:var(--bg);cursor:pointer}
"""

_JS = """
(function(){
  function key(cell){
    var v = cell.getAttribute('data-v');
    return v === null ? {n:false, v:cell.textContent.trim().toLowerCase()} : {n:true, v:parseFloat(v)};
  }
  document.querySelectorAll('table.sortable thead th').forEach(function(th){
    th.addEventListener('click', function(){
      var table = th.closest('table'), body = table.tBodies[0], col = th.cellIndex;
      var desc = !th.classList.contains('sorted-desc');
      table.querySelectorAll('thead th').forEach(function(h){ h.classList.remove('sorted-asc','sorted-desc'); });
      th.classList.add(desc ? 'sorted-desc' : 'sorted-asc');
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function(a, b){
        var x = key(a.cells[col]), y = key(b.cells[col]);
        var c = (x.n && y.n) ? x.v - y.v : (x.v < y.v ? -1 : x.v > y.v ? 1 : 0);
        return desc ? -c : c;
      });
      rows.forEach(function(r){ body.appendChild(r); });
    });
  });
  document.querySelectorAll('button[data-tree]').forEach(function(b){
    b.addEventListener('click', function(){
      var open = b.getAttribute('data-tree') === 'open';
      document.querySelectorAll('#parameter-tree details').forEach(function(d){ d.open = open; });
    });
  });
})();
"""
