"""The HTML report's regions section: each ``local_map`` region of the model.

A region is code the model wrote for local tensors (an MoE's token dispatch, say) whose
placements the planner keeps. The section says where each one is called, the placements it
fixes for its inputs (and their gradients) and outputs, how many times the graph runs it,
and what its forward and backward op are priced on one rank: the body's ops and its own
collectives apart. Reads the plan JSON's ``regions`` entry (``files/plan_json.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autoparallel.report import template as t
from autoparallel.report.summary import free_layouts_text


def regions_section(data: Mapping[str, Any], dims: Sequence[str]) -> str:
    regions = data.get("regions")
    if not regions:
        return t.section(
            "regions",
            "Regions",
            t.absent(data, "regions", "none: the model has no local_map region"),
        )
    rows = [_row(region, dims) for region in regions]
    headers = [
        "region",
        "called at",
        "runs#",
        "inputs (gradients)",
        "outputs",
        "forward ms#",
        "backward ms#",
        "collectives per run",
    ]
    return t.section(
        "regions",
        "Regions",
        t.table(headers, rows),
        "local_map regions: the planner keeps their placements and prices their bodies on "
        "local shapes. A phase's time is the body's ops + its own collectives, per run on "
        "one rank. A mesh dim a region leaves free (None) is the planner's: the placements "
        "shown are those most runs take, and the layouts each run takes are listed.",
    )


def _row(region: Mapping[str, Any], dims: Sequence[str]) -> str:
    inputs = ", ".join(
        t.placement_html(i.get("placements"), dims)
        + (f" ({t.placement_html(i['gradient'], dims)})" if i.get("gradient") else "")
        for i in region.get("inputs") or []
    )
    outputs = ", ".join(
        t.placement_html(o.get("placements"), dims) for o in region.get("outputs") or []
    )
    forward, backward = region.get("forward") or {}, region.get("backward") or {}
    return (
        "<tr>"
        + "".join(
            [
                t.cell(f"<code>{t.esc(region.get('function', region.get('key', '-')))}</code>"),
                t.cell(f"<code>{t.esc(region.get('source', '-'))}</code>" + _free(region, dims)),
                t.cell(t.esc(region.get("instances", "-")), region.get("instances")),
                t.cell(inputs or "-"),
                t.cell(outputs or "-"),
                t.cell(_phase_text(forward), _total_us(forward)),
                t.cell(_phase_text(backward), _total_us(backward)),
                t.cell(t.esc(_collectives_text(forward, backward, dims))),
            ]
        )
        + "</tr>"
    )


def _free(region: Mapping[str, Any], dims: Sequence[str]) -> str:
    text = free_layouts_text(region, dims)
    return f"<br>{t.esc(text)}" if text else ""


def _total_us(phase: Mapping[str, Any]) -> float:
    return (t.num(phase.get("compute_us")) or 0.0) + (t.num(phase.get("comm_us")) or 0.0)


def _phase_text(phase: Mapping[str, Any]) -> str:
    compute = (t.num(phase.get("compute_us")) or 0.0) / 1e3
    comm = (t.num(phase.get("comm_us")) or 0.0) / 1e3
    return t.esc(f"{compute + comm:.3f} (ops {compute:.3f} + comm {comm:.3f})")


def _collectives_text(
    forward: Mapping[str, Any], backward: Mapping[str, Any], dims: Sequence[str]
) -> str:
    parts = []
    for label, phase in (("fwd", forward), ("bwd", backward)):
        for c in phase.get("collectives") or []:
            dim = c.get("mesh_dim")
            name = dims[dim] if isinstance(dim, int) and 0 <= dim < len(dims) else str(dim)
            parts.append(f"{label} {c.get('kind')} over {name} ({t.format_bytes(c.get('bytes'))})")
    return "; ".join(parts) or "none"
