"""The fixed parts of the HTML report: the page shell, its inline CSS and JS, and the HTML
building blocks (escaped text, placement chips, tables, sections, cost bars) that the sections
rendered by :mod:`autoparallel.report.html` are made of.

Nothing here knows what a plan's sections say; everything here is independent of the plan
data's layout except :func:`dim_names` (the ``mesh`` section) and :func:`absent` (why a
section is empty). No function reaches the network: the page must open offline.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "COST_PARTS",
    "CSS",
    "JS",
    "absent",
    "cell",
    "cost_parts",
    "dim_names",
    "embed_json",
    "empty",
    "esc",
    "format_bytes",
    "json_safe",
    "mesh_dims_html",
    "num",
    "page",
    "pct",
    "placement_html",
    "section",
    "shape_text",
    "stacked_bar",
    "table",
    "us",
]

_PLACEMENT_TOKEN = re.compile(r"S\(-?\d+\)|R|P\([A-Za-z_]+\)")
COST_PARTS = (("compute_us", "compute"), ("comm_us", "comm"), ("transition_us", "transition"))
"""(JSON key, CSS class / label) of the three cost components, in the order bars stack them."""


# ---------------------------------------------------------------------------- the page


def page(title: str, body: str, data: Any) -> str:
    """The whole HTML document: ``body`` (already HTML) inside the shell, ``data`` embedded as
    JSON (see :func:`embed_json`), ``title`` escaped here."""
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n{body}\n</main>\n"
        f'<script type="application/json" id="plan-data">{embed_json(data)}</script>\n'
        f"<script>{JS}</script>\n</body>\n</html>\n"
    )


def embed_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element and parses back equal.

    Non-finite floats become null (JSON has no NaN); objects JSON does not know become strings.
    """
    text = json.dumps(json_safe(data), ensure_ascii=False, allow_nan=False, default=str)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


# ---------------------------------------------------------------------------- formatting


def esc(value: Any) -> str:
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


def num(value: Any) -> float | None:
    """A finite float, or None for anything else (missing, null, NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def us(value: Any) -> str:
    number = num(value)
    if number is None:
        return "inf us" if isinstance(value, float) and math.isinf(value) else "-"
    return f"{number:,.2f} us"


def format_bytes(value: Any) -> str:
    """Bytes in binary units (``1.50 GiB``); ``-`` for a missing value."""
    number = num(value)
    if number is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(number) < 1024 or unit == "GiB":
            return f"{number:,.0f} {unit}" if unit == "B" else f"{number:,.2f} {unit}"
        number /= 1024
    return f"{number:,.2f} TiB"  # unreachable, keeps type checkers calm


def pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def shape_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "-" if value is None else str(value)


def dim_names(data: Mapping[str, Any]) -> list[str]:
    mesh = data.get("mesh") or {}
    shape = list(mesh.get("shape") or [])
    names = mesh.get("dim_names")
    if isinstance(names, (list, tuple)) and len(names) == len(shape):
        return [str(n) for n in names]
    return [f"dim{i}" for i in range(len(shape))]


def mesh_dims_html(value: Any, dims: Sequence[str]) -> str:
    """Mesh dims as names: ints index ``dims``, anything else is shown as given."""
    if not isinstance(value, (list, tuple)):
        return esc(value) if value is not None else "-"
    out = [dims[v] if isinstance(v, int) and 0 <= v < len(dims) else str(v) for v in value]
    return esc(", ".join(out)) or "-"


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
        return f"<code>{esc(text)}</code>"
    chips = []
    for i, token in enumerate(tokens):
        dim = dims[i] if i < len(dims) else f"dim{i}"
        chips.append(
            f'<span class="pl pl-{token[0]}" title="{esc(dim)}: {esc(token)}">{esc(token)}</span>'
        )
    return f'<span class="pls">{"".join(chips)}</span>'


def cell(text: str, sort_value: Any = None, cls: str = "") -> str:
    """A table cell; ``sort_value`` (a number) is what the sort script compares."""
    attrs = f' class="{cls}"' if cls else ""
    number = num(sort_value)
    if sort_value is not None:
        attrs += f' data-v="{number if number is not None else -1}"'
    return f"<td{attrs}>{text}</td>"


def table(headers: Sequence[str], rows: Iterable[str], *, table_id: str = "", cls: str = "") -> str:
    """A table with a header row; ``numeric`` columns are marked by a trailing ``#``."""
    ths = []
    for header in headers:
        numeric = header.endswith("#")
        label = header[:-1] if numeric else header
        cls_num = ' class="num"' if numeric else ""
        ths.append(f"<th{cls_num}>{esc(label)}</th>")
    id_attr = f' id="{esc(table_id)}"' if table_id else ""
    cls_attr = f' class="{esc(cls)}"' if cls else ""
    return f"<table{id_attr}{cls_attr}><thead><tr>{''.join(ths)}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def section(section_id: str, title: str, content: str, note: str = "") -> str:
    note_html = f'<p class="note">{note}</p>' if note else ""
    return f'<section id="{section_id}"><h2>{esc(title)}</h2>{note_html}{content}</section>'


def empty(text: str) -> str:
    return f'<p class="empty">{esc(text)}</p>'


def absent(data: Mapping[str, Any], key: str, none_text: str) -> str:
    """Why a section is empty: the data has no such key (a partial dict), or nothing to list."""
    if key not in data:
        return empty(f"not recorded in this data: it has no {key} entry (built from a Plan alone?)")
    return empty(none_text)


def stacked_bar(
    parts: Sequence[tuple[str, float]],
    scale: float,
    label: str,
    unit: Callable[[Any], str] | None = None,
) -> str:
    """A horizontal bar of ``parts`` (class name, value) whose full width is ``scale``;
    ``unit`` formats a value in the tooltips (microseconds by default)."""
    unit = unit or us
    segments = []
    for name, value in parts:
        width = pct(max(value, 0.0), scale)
        if width <= 0:
            continue
        title = f"{label}: {name.replace('_', ' ')} {unit(value)}"
        segments.append(
            f'<span class="seg {name}" style="width:{width:.3f}%" title="{esc(title)}"></span>'
        )
    return f'<div class="bar">{"".join(segments)}</div>'


def cost_parts(row: Mapping[str, Any]) -> list[tuple[str, float]]:
    return [(name, num(row.get(key)) or 0.0) for key, name in COST_PARTS]


# ---------------------------------------------------------------------------- inline CSS and JS

CSS = """
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
.seg.parameters,.key.parameters{background:#3b7dd8}.seg.gradients,.key.gradients{background:#7fb0ec}
.seg.optimizer_state,.key.optimizer_state{background:#2f8f5b}.seg.activations,.key.activations{background:#e8833a}
.seg.transient,.key.transient{background:#9aa5b1}.bar.budget{outline:2px dashed #b5432f;outline-offset:-2px}
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

JS = """
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
