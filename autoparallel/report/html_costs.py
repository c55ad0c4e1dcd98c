"""The HTML report's cost sections: where the predicted step time goes.

The totals (the cost parts of one step, the comm hidden behind compute, what the total is a
prediction of), the cost per module as bars, the most expensive collectives (hot spots), every
collective in a sortable table, and the most expensive nodes. Kept apart from the page and
its sections on the plan's decisions (:mod:`autoparallel.report.html`): these read the plan
JSON's costs only (``totals``, ``overlaps``, ``layers``, ``collectives``, ``nodes``; schema in
``files/plan_json.py``), all in microseconds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from autoparallel.report import template as t

MAX_TABLE_ROWS = 2000
"""Longest collectives/nodes table rendered; the embedded JSON always holds everything."""

HOTSPOT_COUNT = 10
"""How many of the most expensive collectives the hot-spot section lists."""

TOP_NODE_COUNT = 25
"""How many of the most expensive nodes the node section lists."""


# ---------------------------------------------------------------------------- totals


def totals_section(data: Mapping[str, Any]) -> str:
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


# ---------------------------------------------------------------------------- cost per layer


def _natural_key(row: Mapping[str, Any]) -> list[tuple[int, Any]]:
    """``layers.2`` before ``layers.10``; the top level (``""``) first."""
    parts = str(row.get("module") or "").split(".")
    return [(0, int(p)) if p.isdigit() else (1, p) for p in parts]


def layers_section(data: Mapping[str, Any]) -> str:
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


def hotspots_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
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


def collectives_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
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


def nodes_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
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
