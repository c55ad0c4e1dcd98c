"""Plain-text summary of a plan JSON dict: what ``autoparallel plan`` and ``autoparallel
explain`` print (header, hardware, parameters collapsed over identical layers, totals,
memory, regions, solver).

Everything here reads the JSON dict only (schema in :mod:`autoparallel.files.plan_json`), so it
works the same on a plan just made, a ``plan.json`` from disk, or the JSON of a saved problem;
it uses no torch objects. Costs are printed in microseconds (``us``).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from autoparallel.report.template import format_bytes
from autoparallel.types.pipeline import stage_spans

__all__ = [
    "collapse_layers",
    "free_layouts_text",
    "hardware_lines",
    "memory_lines",
    "parameter_lines",
    "region_lines",
    "solver_lines",
    "summary_lines",
    "totals_lines",
]


_LAYER_RE = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?[^.]+)\.(?P<index>\d+)\.(?P<rest>.+)$")


def _ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out: list[str] = []
    values = sorted(indices)
    start = prev = values[0]
    for value in values[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ",".join(out)


def collapse_layers(placements: Mapping[str, str]) -> list[tuple[str, str]]:
    """Name -> placement lines with ``prefix.N.rest`` groups folded over N.

    Parameters that differ only in their first numeric component and share a placement become
    one line, e.g. ``layers.0-31.attention.wq.weight  S(0)S(1)``; layers that differ get one
    line per distinct placement (``layers.0,2-31...`` and ``layers.1...``). Order follows the
    first occurrence of each group.
    """
    groups: OrderedDict[tuple[str, str] | str, OrderedDict[str, list[int]]] = OrderedDict()
    for name, placement in placements.items():
        match = _LAYER_RE.match(name)
        if match is None:
            groups.setdefault(name, OrderedDict()).setdefault(placement, [])
            continue
        key = (match["prefix"], match["rest"])
        groups.setdefault(key, OrderedDict()).setdefault(placement, []).append(int(match["index"]))
    lines: list[tuple[str, str]] = []
    for key, by_placement in groups.items():
        for placement, indices in by_placement.items():
            if isinstance(key, str):
                lines.append((key, placement))
            else:
                lines.append((f"{key[0]}.{_ranges(indices)}.{key[1]}", placement))
    return lines


def _fmt_us(value: Any) -> str:
    return f"{value:,.2f} us" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def summary_lines(data: Mapping[str, Any]) -> list[str]:
    """The human-readable summary of a plan JSON dict (what ``autoparallel plan`` prints)."""
    lines = _header_lines(data)
    lines += pipeline_lines(data)
    lines += parameter_lines(data)
    lines += totals_lines(data)
    lines += memory_lines(data)
    lines += region_lines(data)
    lines += _hotspot_lines(data)
    lines += solver_lines(data)
    if data.get("fallbacks"):
        lines.append(f"replicated for lack of a strategy: {', '.join(map(str, data['fallbacks']))}")
    return lines


def pipeline_lines(data: Mapping[str, Any]) -> list[str]:
    """With a "pp" mesh dim: the schedule, the microbatches, every stage's layers, and which
    stage the rest of the summary is of."""
    p = data.get("pipeline")
    if not p:
        return []
    stages = "; ".join(stage_spans(p["stages"]))
    per_rank = p.get("stages_per_rank", 1)
    shared = f" ({per_rank} per pp rank)" if per_rank > 1 else ""
    lines = [
        f"pipeline: {len(p['stages'])} stages{shared}, {p['schedule']}, {p['microbatches']} "
        f"microbatches ({stages}); the placements below are stage {p['stage_index']}'s on the "
        "other mesh dims"
    ]
    cost = p.get("cost")
    if cost:
        per_stage = ", ".join(_fmt_us(t) for t in cost["stage_microbatch_us"])
        lines.append(
            f"pipeline step: {_fmt_us(cost['step_us'])} predicted, bubble "
            f"{_fmt_us(cost['bubble_us'])}; a microbatch per stage: {per_stage}"
        )
    held = [m for m in p.get("stage_memory") or [] if m]
    if len(held) == len(p["stages"]):
        lines.append(
            "pipeline memory: "
            + ", ".join(
                f"stage {i} peak {format_bytes(m['peak'])} ({m['in_flight']} microbatches "
                "in flight)"
                for i, m in enumerate(held)
            )
        )
    options = p.get("options") or []
    if len(options) > 1:
        lines.append("pipeline settings priced: " + "; ".join(_option(o) for o in options))
    return lines


def _option(option: Mapping[str, Any]) -> str:
    head = f"{option['schedule']} x{option['microbatches']}"
    if option.get("stages_per_rank", 1) > 1:
        head += f" ({option['stages_per_rank']} stages per rank)"
    if option.get("stage_layers"):
        head += " layers " + "/".join(str(n) for n in option["stage_layers"])
    if option["step_us"] is None:
        return f"{head} no plan"
    peak = "" if option["peak"] is None else f" peak {format_bytes(option['peak'])}"
    return f"{head} {_fmt_us(option['step_us'])}{peak}"


def _header_lines(data: Mapping[str, Any]) -> list[str]:
    mesh = data.get("mesh") or {}
    shape = list(mesh.get("shape") or [])
    names = mesh.get("dim_names") or [f"dim{i}" for i in range(len(shape))]
    hardware = data.get("hardware") or {}
    run = data.get("run") or {}
    what = (
        f"{run.get('model', 'model')} ({run.get('layers')} layers)"
        if run.get("layers")
        else str(run.get("model", "model"))
    )
    inputs = f", batch {run['batch']} x seq {run['seq']}" if "batch" in run else ""
    mesh_text = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
    stages = len((data.get("pipeline") or {}).get("stages") or [])
    if stages:  # a stage's plan: its mesh is the mesh without pp
        mesh_text = f"pp={stages}, {mesh_text}"
    lines = [
        f"{what}{inputs}, mesh ({mesh_text}), {hardware.get('name', '-')} with {hardware.get('gpus_per_node', '-')} devices per node"
    ]
    if "memory_budget" in run:  # a plan made by `autoparallel plan` (not a saved problem's JSON)
        lines.append(f"memory budget: {run['memory_budget']}")
    if "parameter_memory" in run:
        lines.append(f"parameter memory: {run['parameter_memory']}")
    return lines + hardware_lines(data)


def hardware_lines(data: Mapping[str, Any]) -> list[str]:
    """What the plan's prices were computed from: the preset or profile and its figures."""
    hw = data.get("hardware") or {}
    if "flops_fp32" not in hw:  # a JSON from before the figures were recorded
        return []
    source = hw.get("source") or "preset"
    origin = "preset" if source == "preset" else f"profile {source}"
    lines = [
        f"priced on {hw.get('name', '-')} ({origin}): matmul fp32 {_rate(hw.get('flops_fp32'), 'FLOP/s')}, "
        f"bf16 {_rate(hw.get('flops_bf16'), 'FLOP/s')}, memory {_rate(hw.get('memory_bandwidth'), 'B/s')}, "
        f"{_fmt_us(hw.get('kernel_launch_us'))} per op"
    ]
    table = hw.get("matmul_table")
    if isinstance(table, Mapping) and table.get("dims"):
        dims = table["dims"]
        lines.append(
            f"matmuls priced by a measured table: {table.get('dtype')}, {table.get('shapes')} "
            f"shapes ({dims[0]}-{dims[-1]} per dim), warm or cold by the bytes touched "
            f"(cold from {_rate(table.get('cold_bytes'), 'B')})"
        )
    if float(hw.get("runtime_step_us") or 0.0) or float(hw.get("runtime_us_per_parameter") or 0.0):
        lines.append(
            f"the runtime's own work per step: {_fmt_us(hw.get('runtime_step_us'))} + "
            f"{_fmt_us(hw.get('runtime_us_per_parameter'))} per trained parameter"
        )
    fits = [f for f in hw.get("collectives") or [] if isinstance(f, Mapping)]
    if fits:
        lines.append(
            "collectives (latency per ring step + bandwidth, largest fit error): "
            + "; ".join(
                f"{f.get('collective')} {f.get('link')} {_fmt_us(f.get('latency_us'))} + "
                f"{_rate(f.get('bandwidth'), 'B/s')} ({_percent(f.get('max_error'))})"
                for f in fits
            )
        )
    else:
        links = hw.get("links") or {}
        lines.append(
            "links (latency per ring step + bandwidth): "
            + "; ".join(
                f"{name} {_fmt_us((link or {}).get('latency_us'))} + {_rate((link or {}).get('bandwidth'), 'B/s')}"
                for name, link in links.items()
            )
        )
    return lines


def _rate(value: Any, unit: str) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    if value >= 1e18:  # a fit with no bandwidth term (latency-bound at every size measured)
        return f"unbounded {unit}"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _percent(value: Any) -> str:
    return f"{100 * value:.0f}%" if isinstance(value, (int, float)) else "-"


def parameter_lines(data: Mapping[str, Any]) -> list[str]:
    params = {
        str(p["name"]): str(p.get("placements"))
        for p in data.get("parameters") or []
        if "name" in p
    }
    if not params:
        return []
    rows = collapse_layers(params)
    width = max(len(name) for name, _ in rows)
    total = sum(p.get("bytes_per_device") or 0 for p in data.get("parameters") or [])
    header = (
        f"parameter placements (mesh-dim order), {format_bytes(total)} of parameters per device:"
    )
    return [header] + [f"  {name:<{width}}  {placement}" for name, placement in rows]


def totals_lines(data: Mapping[str, Any]) -> list[str]:
    t = data.get("totals") or {}
    if not t:
        return []
    comm, compute, transition = (
        float(t.get(k) or 0.0) for k in ("comm_us", "compute_us", "transition_us")
    )
    whole = comm + compute + transition
    share = (lambda v: f"{100 * v / whole:.1f}%") if whole > 0 else (lambda v: "-")
    hidden = float(t.get("hidden_comm_us") or 0.0)
    hiding = f" - hidden {_fmt_us(hidden)}" if hidden > 0 else ""
    per = "per microbatch of this stage" if data.get("pipeline") else "per step"
    lines = [
        f"total cost: {_fmt_us(t.get('total_us'))} {per} = comm {_fmt_us(comm)} + compute {_fmt_us(compute)} "
        f"+ transition {_fmt_us(transition)}{hiding}",
        f"share: comm {share(comm)}, compute {share(compute)}, transition {share(transition)}",
    ]
    if hidden > 0:
        lines.append(
            f"overlap: {_fmt_us(hidden)} of the comm runs behind compute; "
            f"{_fmt_us(comm - hidden)} is exposed"
        )
    return lines + _optimizer_line(t)


def memory_lines(data: Mapping[str, Any]) -> list[str]:
    """The predicted peak memory per device and what it is made of (``plan.memory``)."""
    m = data.get("memory") or {}
    if not m:
        return []
    budget = m.get("budget")
    within = "" if budget is None else f" (budget {format_bytes(budget)})"
    parts = ", ".join(
        f"{label} {format_bytes(m.get(key) or 0)}"
        for key, label in (
            ("parameters", "parameters"),
            ("gradients", "gradients"),
            ("optimizer_state", f"{m.get('optimizer', 'optimizer')} state"),
            ("activations", "activations"),
            ("transient", "transient"),
        )
    )
    lines = [
        f"memory: peak {format_bytes(m.get('peak') or 0)} per device at the "
        f"{m.get('peak_at', '-')}{within}",
        f"  {parts}",
    ]
    recomputed = list(m.get("recomputed") or [])
    if recomputed:
        lines.append(
            f"  recomputed in the backward ({len(recomputed)} layers, "
            f"+{_fmt_us(float(m.get('recompute_us') or 0.0))} of forward compute): "
            + ", ".join(recomputed)
        )
    return lines


def region_lines(data: Mapping[str, Any]) -> list[str]:
    """One line per ``local_map`` region: where it is called, how often it runs, the
    placements it fixes and what one run of its forward and backward is priced."""
    lines = []
    dims = (data.get("mesh") or {}).get("dim_names") or ()
    for region in data.get("regions") or []:
        inputs = ", ".join(str(i.get("placements")) for i in region.get("inputs") or [])
        outputs = ", ".join(str(o.get("placements")) for o in region.get("outputs") or [])
        priced = []
        for phase in ("forward", "backward"):
            part = region.get(phase) or {}
            compute = float(part.get("compute_us") or 0.0)
            comm = float(part.get("comm_us") or 0.0)
            priced.append(f"{phase} {_fmt_us(compute + comm)} (comm {_fmt_us(comm)})")
        free = free_layouts_text(region, dims)
        lines.append(
            f"region {region.get('function')} at {region.get('source')}, "
            f"x{region.get('instances')}: in {inputs} -> out {outputs}; {', '.join(priced)}"
            + (f"; {free}" if free else "")
        )
    return lines


def free_layouts_text(region: Mapping[str, Any], dims: Sequence[str] = ()) -> str:
    """How the plan resolved a region's free mesh dims, with how many calls run in each
    layout: ``free mesh dims dp: dp=S(0) x2, dp=R x0`` (``dims``: the mesh dims' names);
    empty when none is free."""
    layouts = region.get("layouts") or []
    if not region.get("free_mesh_dims") or not layouts:
        return ""
    parts = []
    for layout in layouts:
        free = layout.get("free") or {}
        choice = " ".join(
            f"{dims[int(d)] if int(d) < len(dims) else d}={p}" for d, p in free.items()
        )
        parts.append(f"{choice} x{layout.get('instances', 0)}")
    names = ", ".join(
        dims[int(d)] if int(d) < len(dims) else str(d) for d in region["free_mesh_dims"]
    )
    return f"free mesh dims {names}: " + ", ".join(parts)


def _optimizer_line(totals: Mapping[str, Any]) -> list[str]:
    optimizer = float(totals.get("optimizer_us") or 0.0)
    priced_on = totals.get("priced_on")
    where = f" (priced on {priced_on})" if priced_on else ""
    runtime = float(totals.get("runtime_us") or 0.0)
    lines = []
    if optimizer > 0:
        lines.append(f"of compute, the optimizer step: {_fmt_us(optimizer)}{where}")
    elif priced_on:
        lines.append(f"optimizer step: not priced{where}")
    if runtime > 0:
        lines.append(f"of compute, the runtime's own work outside its graphs: {_fmt_us(runtime)}")
    return lines


def _hotspot_lines(data: Mapping[str, Any], count: int = 5) -> list[str]:
    collectives = [
        c for c in data.get("collectives") or [] if isinstance(c.get("comm_us"), (int, float))
    ]
    top = sorted(collectives, key=lambda c: -c["comm_us"])[:count]
    if not top:
        return []
    names = list((data.get("mesh") or {}).get("dim_names") or [])

    def dims(c: Mapping[str, Any]) -> str:
        return ",".join(
            names[d] if isinstance(d, int) and d < len(names) else str(d)
            for d in c.get("mesh_dims") or []
        )

    rows = [
        (
            _fmt_us(c["comm_us"]),
            f"{c.get('kind', '-')} ({dims(c)})",
            f"{c.get('src', '-')} -> {c.get('dst', '-')}",
            str(c.get("phase", "-")),
            f"{c.get('module') or '-'}  ({c.get('consumer', '-')} <- {c.get('producer', '-')})",
        )
        for c in top
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        f"top {len(top)} of {len(collectives)} collectives (comm, kind (mesh dims), src -> dst, phase, module):"
    ]
    for row in rows:
        lines.append(
            f"  {row[0]:>{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:<{widths[3]}}  {row[4]}"
        )
    return lines


def solver_lines(data: Mapping[str, Any]) -> list[str]:
    s = data.get("solver") or {}
    lines = []
    if s:
        gap = s.get("gap")
        gap_text = f"{100 * gap:.3f}%" if isinstance(gap, (int, float)) else "-"
        lines.append(
            f"solver: status {s.get('status')}, objective {_fmt_us(s.get('objective_us'))}, "
            f"bound {_fmt_us(s.get('bound_us'))}, gap {gap_text}, time {float(s.get('time_s') or 0):.2f} s, "
            f"{s.get('num_variables')} variables, {s.get('num_constraints')} constraints"
            + (", solved as an LP (its relaxation was integral)" if s.get("method") == "lp" else "")
        )
    run = data.get("run") or {}
    if run.get("stage_times_s"):
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in run["stage_times_s"].items())
        lines.append(f"planning took {run.get('planning_s', 0):.1f} s ({stages})")
    return lines
