"""The HTML report's memory section: the predicted peak per device and its parts.

One stacked bar of the components alive at the peak (scaled to the budget when there is
one, so the bar's end is the budget), and one bar per layer of the activations it saves.
Reads the plan JSON's ``memory`` entry (``files/plan_json.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoparallel.report import template as t

COMPONENTS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("activations", "activations"),
    ("transient", "transient"),
)


def memory_section(data: Mapping[str, Any]) -> str:
    memory = data.get("memory")
    if not memory:
        return t.section("memory", "Memory", t.absent(data, "memory", "no memory estimate"))
    peak = t.num(memory.get("peak")) or 0.0
    budget = t.num(memory.get("budget"))
    at_peak = _alive_at_peak(memory)
    scale = max(peak, budget or 0.0) or 1.0
    legend = "".join(
        f'<span class="key {key}"></span>{label} {t.format_bytes(value)} '
        for (key, label), value in zip(COMPONENTS, (v for _, v in at_peak))
        if value > 0
    )
    bar = t.stacked_bar(at_peak, scale, "peak", t.format_bytes)
    if budget is not None:
        bar = bar.replace('class="bar"', 'class="bar budget"', 1)
    within = (
        ""
        if budget is None
        else f" against a budget of {t.format_bytes(budget)} "
        f"({'fits' if peak <= budget * (1 + 1e-9) else 'over'})"
    )
    summary = (
        f"<p>Predicted peak: <b>{t.format_bytes(peak)}</b> per device at the "
        f"{t.esc(memory.get('peak_at', '-'))}{t.esc(within)}; optimizer state for "
        f"{t.esc(memory.get('optimizer', '-'))}.</p>"
    )
    recomputed = list(memory.get("recomputed") or [])
    if recomputed:
        again_ms = (t.num(memory.get("recompute_us")) or 0.0) / 1000
        summary += (
            f"<p>Recomputed in the backward instead of saved ({len(recomputed)} layers, "
            f"{again_ms:.3f} ms of forward compute again): "
            f"{t.esc(', '.join(recomputed))}.</p>"
        )
    return t.section(
        "memory",
        "Memory",
        summary + bar + f'<p class="legend">{legend}</p>' + _layers_chart(memory),
        "Bytes per device of one training step (problem/memory.py). At the start of the "
        "backward: parameters, optimizer state, saved activations and the gathered parameters "
        "alive; at the optimizer step: parameters, gradients, optimizer state and the step's "
        "temporaries; with recomputed layers, also the backward of the first one it "
        "reaches, with that layer's activations back (transient).",
    )


def _alive_at_peak(memory: Mapping[str, Any]) -> list[tuple[str, float]]:
    """(component, bytes) of what is alive at the peak moment, in COMPONENTS order."""
    at_step = memory.get("peak_at") == "optimizer step"
    alive = {
        "parameters": True,
        "gradients": at_step,
        "optimizer_state": True,
        "activations": not at_step,
        "transient": True,
    }
    return [(key, (t.num(memory.get(key)) or 0.0) if alive[key] else 0.0) for key, _ in COMPONENTS]


def _layers_chart(memory: Mapping[str, Any]) -> str:
    recomputed = set(memory.get("recomputed") or [])
    layers = [
        (
            str(row.get("layer", "-"))
            + (" (recomputed)" if row.get("layer") in recomputed else ""),
            t.num(row.get("bytes")) or 0.0,
        )
        for row in memory.get("activations_by_layer") or []
    ]
    if not layers:
        return ""
    largest = max(value for _, value in layers) or 1.0
    rows = (
        "<tr>"
        + t.cell(t.esc(layer))
        + t.cell(t.esc(t.format_bytes(value)), value, "num")
        + t.cell(t.stacked_bar([("activations", value)], largest, layer, t.format_bytes))
        + "</tr>"
        for layer, value in layers
    )
    return "<h3>Saved activations per layer</h3>" + t.table(
        ["layer", "bytes", ""], rows, table_id="memory-layers"
    )
