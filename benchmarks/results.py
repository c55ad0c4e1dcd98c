"""Where the benchmarks keep their figures: one JSON line per figure in
``benchmarks/results/<benchmark>.jsonl``, appended, never rewritten.

A record names the benchmark, a short stable ``question`` (the same question asked again
gets the same key, so its history lines up), one line saying what was measured, the
``figure`` itself (a number with its ``unit``, or a short string), and where it came from:
``date`` (ISO), ``commit`` (``git rev-parse --short HEAD``, or "unknown"), ``machine``
(hostname, cpu count, torch version) and ``command`` (the argv as run). Any other fields
are the raw figures behind it. ``python -m benchmarks.render`` turns these files into
``docs/measurements.md`` and the README's status figures.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(
    os.environ.get("BENCHMARK_RESULTS_DIR", Path(__file__).resolve().parent / "results")
)
"""Where records go; ``BENCHMARK_RESULTS_DIR`` points a trial run elsewhere."""
REQUIRED = ("benchmark", "question", "what", "figure", "date", "commit", "machine", "command")
"""The fields every record has; ``unit`` is optional (a string figure carries its own)."""


def commit() -> str:
    """This checkout's short commit hash, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine() -> dict[str, Any]:
    """The host the figures were measured on."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return {
        "hostname": platform.node() or "unknown",
        "cpu_count": os.cpu_count(),
        "torch": torch_version,
    }


def command(argv: list[str] | None = None) -> str:
    """The command as run: ``python -m benchmarks.<name>`` and its arguments."""
    args = sys.argv[1:] if argv is None else argv
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([program, *args])


def preset_suffix(hardware: str) -> str:
    """The question key's tail for a hardware preset (``-cpu``); none for a calibrated
    profile (``*.json``), the usual case, so runs on fresh profiles share their history."""
    return "" if hardware.endswith(".json") else f"-{hardware}"


def make_record(
    benchmark: str,
    question: str,
    what: str,
    figure: float | int | str,
    unit: str = "",
    argv: list[str] | None = None,
    **raw: Any,
) -> dict[str, Any]:
    """One record, stamped with the date, commit, machine and command of this run."""
    return {
        "benchmark": benchmark,
        "question": question,
        "what": what,
        "figure": figure,
        "unit": unit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "command": command(argv),
        **raw,
    }


def record(
    benchmark: str,
    figures: dict[str, Any] | list[dict[str, Any]],
    argv: list[str] | None = None,
) -> Path:
    """Append one record per figure (a dict with ``question``, ``what``, ``figure``, an
    optional ``unit`` and raw fields; or a list of them) to ``results/<benchmark>.jsonl``."""
    if isinstance(figures, dict):
        figures = [figures]
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{benchmark}.jsonl"
    with path.open("a") as out:
        for entry in figures:
            line = make_record(benchmark, argv=argv, **entry)
            out.write(json.dumps(line, sort_keys=False) + "\n")
    print(f"[{benchmark}] {len(figures)} record(s) appended to {path}", file=sys.stderr)
    return path
