"""The HTML report's pipeline section (a mesh with a "pp" dim): the schedule in time, every
stage's microbatch time and memory, and the settings the planner priced.

The timeline is an inline SVG drawn from the plan JSON's ``pipeline.cost.timeline`` (one
row per pp rank, one block per forward or backward of a microbatch on one of its stages,
cost/pipeline.py), so the bubble shows as the gaps; nothing is computed here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autoparallel.report import template as t
from autoparallel.types.pipeline import stage_spans

ROW_PX, WIDTH_PX, LABEL_PX = 18, 860, 64
PASS_COLOURS = {"forward": "#3b7dd8", "backward": "#e8833a"}


def pipeline_section(data: Mapping[str, Any]) -> str:
    pipeline = data.get("pipeline")
    if not pipeline:
        return ""
    cost = pipeline.get("cost") or {}
    spans = stage_spans(pipeline["stages"])
    per_rank = pipeline.get("stages_per_rank", 1)
    ranks = len(spans) // per_rank
    shared = f" ({per_rank} per pp rank: stage s on rank s mod {ranks})" if per_rank > 1 else ""
    head = (
        f"<p>{len(spans)} stages{shared}, {t.esc(pipeline['schedule'])}, "
        f"{pipeline['microbatches']} microbatches; the rest of this report is stage "
        f"{pipeline['stage_index']}'s plan on the other mesh dims, for one microbatch.</p>"
    )
    if cost:
        head += (
            f"<p>Predicted step <b>{t.us(cost['step_us'])}</b>, of which the busiest rank "
            f"waits {t.us(cost['bubble_us'])} (the bubble).</p>"
        )
    body = head + _timeline(cost.get("timeline") or [], ranks, per_rank > 1)
    body += _stages_table(pipeline, spans, ranks) + _options_table(pipeline.get("options") or [])
    return t.section(
        "pipeline",
        "Pipeline",
        body,
        "Each pp rank runs its stages' microbatch forwards (blue) and backwards (orange) in "
        "the schedule's order, each once its input is there: the gaps are the bubble. Where "
        "a rank runs several stages, a block says stage:microbatch and later stages are "
        "lighter.",
    )


def _timeline(blocks: Sequence[Sequence[Any]], ranks: int, name_stages: bool) -> str:
    """One row per pp rank; a block says its microbatch (``stage:microbatch`` where a rank
    runs several stages, its later stages drawn lighter)."""
    if not blocks:
        return t.empty("no timeline: the other stages' times are not known to this plan")
    end = max(float(b[4]) for b in blocks) or 1.0
    scale = (WIDTH_PX - LABEL_PX) / end
    rects = [
        f'<text x="0" y="{i * ROW_PX + 13}" font-size="11">rank {i}</text>' for i in range(ranks)
    ]
    for stage, microbatch, kind, start, stop in blocks:
        x, width = LABEL_PX + float(start) * scale, max((float(stop) - float(start)) * scale, 1.0)
        y = int(stage) % ranks * ROW_PX + 2
        later = int(stage) >= ranks  # a rank's second (or later) stage
        label = f"{stage}:{microbatch}" if name_stages else str(microbatch)
        title = f"stage {stage}, microbatch {microbatch}, {kind}: {t.us(start)} to {t.us(stop)}"
        rects.append(
            f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{ROW_PX - 4}" '
            f'fill="{PASS_COLOURS.get(kind, "#9aa5b1")}" fill-opacity="{0.6 if later else 1}" '
            'stroke="#fff" stroke-width="0.5">'
            f"<title>{t.esc(title)}</title></rect>"
        )
        if width > 7 * len(label):
            rects.append(
                f'<text x="{x + width / 2:.1f}" y="{y + 11}" font-size="9" fill="#fff" '
                f'text-anchor="middle">{t.esc(label)}</text>'
            )
    height = ranks * ROW_PX + 4
    return (
        f'<svg class="timeline" width="{WIDTH_PX}" height="{height}" '
        f'viewBox="0 0 {WIDTH_PX} {height}" role="img" aria-label="pipeline timeline">'
        + "".join(rects)
        + "</svg>"
    )


def _stages_table(pipeline: Mapping[str, Any], spans: Sequence[str], ranks: int) -> str:
    cost = pipeline.get("cost") or {}
    times = cost.get("stage_microbatch_us") or [None] * len(spans)
    memory = pipeline.get("stage_memory") or [None] * len(spans)
    rows = []
    for index, (span, time_us, held) in enumerate(zip(spans, times, memory)):
        stage, _, layers = span.partition(": ")
        peak = t.format_bytes(held["peak"]) if held else "-"
        in_flight = str(held["in_flight"]) if held else "-"
        rows.append(
            f'<tr><td>{t.esc(stage)}</td><td class="num">{index % ranks}</td>'
            f"<td>{t.esc(layers)}</td>"
            f'<td class="num">{t.us(time_us)}</td><td class="num">{t.esc(in_flight)}</td>'
            f'<td class="num">{t.esc(peak)}</td></tr>'
        )
    headers = [
        "stage",
        "pp rank#",
        "layers",
        "a microbatch#",
        "microbatches in flight#",
        "peak memory#",
    ]
    return t.table(headers, rows)


def _options_table(options: Sequence[Mapping[str, Any]]) -> str:
    if len(options) < 2:
        return ""
    rows = [
        f'<tr><td>{t.esc(_schedule(o))}</td><td class="num">{o["microbatches"]}</td>'
        f"<td>{t.esc('/'.join(str(n) for n in o.get('stage_layers') or []))}</td>"
        f'<td class="num">{t.us(o["step_us"]) if o["step_us"] is not None else "no plan"}</td>'
        f'<td class="num">{t.format_bytes(o["peak"]) if o["peak"] is not None else "-"}</td></tr>'
        for o in options
    ]
    return "<p>The settings priced (the fastest within the memory budget is kept):</p>" + t.table(
        ["schedule", "microbatches#", "layers per stage", "predicted step#", "largest stage peak#"],
        rows,
    )


def _schedule(option: Mapping[str, Any]) -> str:
    per_rank = option.get("stages_per_rank", 1)
    return option["schedule"] + (f" ({per_rank} stages per rank)" if per_rank > 1 else "")
