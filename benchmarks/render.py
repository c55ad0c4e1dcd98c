"""Write the measured figures into the docs from ``benchmarks/results/*.jsonl``.

    python -m benchmarks.render           # rewrite docs/measurements.md and README's figures
    python -m benchmarks.render --check   # exit 1 if either differs from what is on disk

``docs/measurements.md`` is generated whole: one table per results file, the questions
ordered by their latest record, each question's records newest first. A time or size that
is at least twice its question's previous figure on the same machine is flagged in its
note, listed at the top of the page and printed when rendering (:func:`regression`). In ``README.md``
every span ``<!-- figure: BENCHMARK/QUESTION -->...<!-- /figure -->`` is replaced by the
latest record of that question, naming its results file. A record that cannot be read
stops the render with its file and line (exit 2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.results import REQUIRED

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks") / "results"
MEASUREMENTS = Path("docs") / "measurements.md"
README = Path("README.md")

FIGURE = re.compile(r"<!-- figure: (?P<key>[\w.+-]+/[\w.+-]+) -->.*?<!-- /figure -->", re.S)

TITLES = {
    "plan_time": "Planning time",
    "step_time": "Step time against torch's DDP and FSDP2",
    "moe_step_time": "Step time of the mixture-of-experts model",
    "pipeline_step": "Pipeline stages against the plan without them",
    "plan_fidelity": "Predicted against measured step time",
    "memory_fidelity": "Predicted against measured memory",
    "op_breakdown": "Step time op by op",
    "kill_rank": "A rank lost mid-step: how long the others take to raise",
    "soak": "Fresh launches under glibc's heap checks",
    "calibrate": "Calibration figures",
    "compat": "The test suite on each torch release",
    "fuzz_api": "Bad input, fuzzed",
    "export_coverage": "The plan as torch code: what the export cannot write",
}
"""Section titles, in the order the page lists them; other results files follow by name."""

WRITTEN_BY = {
    name: f"written by `python -m benchmarks.{name}`"
    for name in (
        "plan_time",
        "step_time",
        "moe_step_time",
        "pipeline_step",
        "plan_fidelity",
        "memory_fidelity",
        "op_breakdown",
        "kill_rank",
        "soak",
        "fuzz_api",
        "export_coverage",
    )
} | {
    "calibrate": "kept by hand: `autoparallel calibrate` writes a profile, not records",
    "compat": "kept by hand from `make test` and `make compat TORCH=...`",
}
"""Where each results file's records come from."""


class RenderError(Exception):
    """A results file or the README cannot be rendered; the message names where."""


@dataclass(frozen=True)
class Record:
    """One results line, with where it came from."""

    data: dict[str, Any]
    path: Path
    line: int

    @property
    def question(self) -> str:
        return self.data["question"]

    @property
    def date(self) -> str:
        return self.data["date"]


# ------------------------------------------------------------------------------- reading


def parse_record(text: str, path: Path, line: int, benchmark: str) -> Record:
    """One line of ``path`` as a Record; a RenderError naming ``path:line`` otherwise."""
    where = f"{path}:{line}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RenderError(f"{where}: not a JSON object ({exc.msg})") from None
    if not isinstance(data, dict):
        raise RenderError(f"{where}: not a JSON object")
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise RenderError(f"{where}: missing {', '.join(missing)}")
    if data["benchmark"] != benchmark:
        raise RenderError(f"{where}: benchmark {data['benchmark']!r} in {benchmark}.jsonl")
    for key in ("question", "what", "commit", "command", "date"):
        if not isinstance(data[key], str) or not data[key]:
            raise RenderError(f"{where}: {key} must be a non-empty string")
    if not isinstance(data["figure"], (int, float, str)) or isinstance(data["figure"], bool):
        raise RenderError(f"{where}: figure must be a number or a string")
    try:
        datetime.date.fromisoformat(data["date"][:10])
    except ValueError:
        raise RenderError(f"{where}: date {data['date']!r} is not ISO (YYYY-MM-DD...)") from None
    return Record(data, path, line)


def read_results(root: Path) -> dict[str, list[Record]]:
    """Every results file under ``root``, by benchmark, its records in file order."""
    results: dict[str, list[Record]] = {}
    for path in sorted((root / RESULTS).glob("*.jsonl")):
        shown = path.relative_to(root)
        records = []
        for number, text in enumerate(path.read_text().splitlines(), start=1):
            if text.strip():
                records.append(parse_record(text, shown, number, path.stem))
        results[path.stem] = records
    return results


def by_question(records: list[Record]) -> list[list[Record]]:
    """Records grouped by question, each group newest first (a later line wins a tie), the
    groups ordered by their newest record, then by question."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(record.question, []).append(record)
    ordered = [
        sorted(group, key=lambda r: (r.date, r.line), reverse=True) for group in groups.values()
    ]
    return sorted(ordered, key=lambda g: (g[0].date, g[0].line), reverse=True)


def latest(results: dict[str, list[Record]], key: str) -> Record:
    """The newest record of ``benchmark/question``."""
    benchmark, question = key.split("/", 1)
    records = [r for r in results.get(benchmark, []) if r.question == question]
    if not records:
        raise RenderError(f"{README}: no record of {key} in {RESULTS / benchmark}.jsonl")
    return max(records, key=lambda r: (r.date, r.line))


# ----------------------------------------------------------------------------- regressions

LOWER_IS_BETTER = frozenset({"s", "ms", "us", "GB", "GiB", "MB", "MiB"})
"""Units of figures where more is worse: a planning time, a step time, a peak memory."""

REGRESSION_RATIO = 2.0
"""How many times its previous figure a figure must be to be flagged."""


def regression(group: list[Record]) -> str | None:
    """Why the newest record of a question (``group``, newest first) is flagged, if it is:
    a number in a :data:`LOWER_IS_BETTER` unit, at least :data:`REGRESSION_RATIO` times the
    previous record's on the same machine. A noisy machine moves figures by tens of
    percent; twice the time is a change in the code or its inputs."""
    if len(group) < 2:
        return None
    new, old = group[0].data, group[1].data
    numbers = all(
        isinstance(d["figure"], (int, float)) and not isinstance(d["figure"], bool)
        for d in (new, old)
    )
    if not numbers or new.get("unit") not in LOWER_IS_BETTER or new.get("unit") != old.get("unit"):
        return None
    if _machine(new["machine"]) != _machine(old["machine"]) or old["figure"] <= 0:
        return None
    ratio = new["figure"] / old["figure"]
    if ratio < REGRESSION_RATIO:
        return None
    return f"{ratio:.1f}x its previous figure ({figure_text(old)}, {old['commit']})"


def regressions(results: dict[str, list[Record]]) -> list[tuple[str, str]]:
    """Every flagged question as (``benchmark/question``, why)."""
    found = []
    for name in _order(results):
        for group in by_question(results[name]):
            why = regression(group)
            if why is not None:
                found.append((f"{name}/{group[0].question}", why))
    return found


# ----------------------------------------------------------------------------- rendering


def figure_text(data: dict[str, Any]) -> str:
    """The figure with its unit: ``6.1 s``, ``0.49``, or the string as recorded."""
    figure, unit = data["figure"], data.get("unit") or ""
    text = f"{figure:g}" if isinstance(figure, float) else str(figure)
    return f"{text} {unit}" if unit else text


def _cell(text: Any) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("\n", " ").replace("|", "\\|")


def _date(date: str) -> str:
    return date[:16].replace("T", " ")


def _machine(machine: Any) -> str:
    if isinstance(machine, dict):
        cpus = machine.get("cpu_count")
        return (
            f"{machine.get('hostname', 'unknown')}, {cpus if cpus else '?'} cpus, "
            f"torch {machine.get('torch', 'unknown')}"
        )
    return str(machine)


def _order(results: dict[str, list[Record]]) -> list[str]:
    known = [name for name in TITLES if name in results]
    return known + sorted(name for name in results if name not in TITLES)


REPEATS = (0, 3, 5, 6, 7)
"""Columns left blank where a row repeats the row above in its question: the question,
what, commit, machine and command."""


def benchmark_section(name: str, records: list[Record]) -> list[str]:
    """One benchmark's heading and table."""
    lines = [
        f"## {TITLES.get(name, name)}",
        "",
        f"From [`{RESULTS}/{name}.jsonl`](../{RESULTS}/{name}.jsonl)"
        + (f", {WRITTEN_BY[name]}." if name in WRITTEN_BY else "."),
        "",
        "| question | date | figure | what | note | commit | machine | command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for group in by_question(records):
        previous: tuple[str, ...] = ()
        flagged = regression(group)
        for index, record in enumerate(group):
            data = record.data
            figure = figure_text(data)
            note = data.get("note", "")
            if index == 0 and flagged is not None:
                note = f"REGRESSION: {flagged}" + (f"; {note}" if note else "")
            cells = (
                f"`{record.question}`",
                _date(data["date"]),
                f"**{figure}**" if index == 0 else figure,
                data["what"],
                note,
                data["commit"],
                _machine(data["machine"]),
                f"`{data['command']}`",
            )
            shown = [
                "" if i in REPEATS and previous and cell == previous[i] else cell
                for i, cell in enumerate(cells)
            ]
            previous = cells
            lines.append("| " + " | ".join(_cell(c) for c in shown) + " |")
    return lines + [""]


def render_measurements(results: dict[str, list[Record]]) -> str:
    """The whole of docs/measurements.md."""
    lines = [
        "# Measurements",
        "",
        "<!-- Generated by `python -m benchmarks.render` from benchmarks/results/*.jsonl: "
        "edit those, not this page. -->",
        "",
        "Every figure the benchmarks have recorded, read from `benchmarks/results/*.jsonl` by "
        "`python -m benchmarks.render`. Each table holds one benchmark; a *question* is one "
        "measurement asked again and again (the same model, mesh and settings), its latest "
        "figure in bold, then its history, newest first (a blank cell repeats the one above). "
        "Records whose source is "
        '"recorded by hand before generated results" were copied from the tables this '
        "project kept by hand; their commit is unknown, and where those tables gave no date "
        "the date is that of the commit that first wrote the figure down. How each figure "
        "is measured is in the docstring of its benchmark (`python -m benchmarks.<name> "
        "--help`).",
        "",
    ]
    for name in _order(results):
        lines.append(f"- [{TITLES.get(name, name)}](#{_anchor(TITLES.get(name, name))})")
    lines.append("")
    flagged = regressions(results)
    if flagged:
        lines += [
            f"**Regressions**: figures at least {REGRESSION_RATIO:g}x their previous run on "
            "the same machine.",
            "",
        ]
        lines += [f"- `{key}`: {why}" for key, why in flagged] + [""]
    for name in _order(results):
        lines += benchmark_section(name, results[name])
    return "\n".join(lines).rstrip() + "\n"


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", title.lower())
    return text.replace(" ", "-")


def readme_figure(record: Record) -> str:
    """What a README figure span holds: the figure, what it measures, its file and date."""
    data = record.data
    name = record.path.name
    return (
        f"**{_cell(figure_text(data))}**: {_cell(data['what'])} "
        f"([{name}]({RESULTS}/{name}), {data['date'][:10]})"
    )


def render_readme(text: str, results: dict[str, list[Record]]) -> str:
    """``text`` with every figure span filled from its latest record."""

    def fill(match: re.Match[str]) -> str:
        key = match["key"]
        return f"<!-- figure: {key} -->{readme_figure(latest(results, key))}<!-- /figure -->"

    return FIGURE.sub(fill, text)


# ---------------------------------------------------------------------------------- main


def rendered(root: Path, results: dict[str, list[Record]]) -> dict[Path, str]:
    """Each generated file (relative to ``root``) and what it should hold."""
    return {
        MEASUREMENTS: render_measurements(results),
        README: render_readme((root / README).read_text(), results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is out of date"
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this)")
    args = parser.parse_args(argv)
    try:
        results = read_results(args.root)
        files = rendered(args.root, results)
    except RenderError as exc:
        print(f"render: {exc}", file=sys.stderr)
        return 2
    for key, why in regressions(results):
        print(f"render: REGRESSION {key}: {why}", file=sys.stderr)
    stale = [path for path, text in files.items() if _read(args.root / path) != text]
    if args.check:
        for path in stale:
            print(
                f"render: {path} is out of date: run python -m benchmarks.render", file=sys.stderr
            )
        return 1 if stale else 0
    for path in stale:
        (args.root / path).write_text(files[path])
        print(f"render: wrote {path}", file=sys.stderr)
    return 0


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


if __name__ == "__main__":
    sys.exit(main())
