"""Reading a plan JSON file (``autoparallel plan --out plan.json``) back, with its saved problem.

The JSON (schema in :mod:`autoparallel.report_data`) answers every question about the chosen
plan by itself. Questions about plans *not* chosen (what would ``S(0)R`` cost here?) need the
whole problem, which ``autoparallel plan --out`` saves next to the JSON as a ``.npz`` and names
in the JSON's ``problem`` entry, a path relative to the JSON's folder.

Contract: :func:`read_plan_json` returns the dict or raises :class:`PlanJsonError` with a
message that fits on one line and says what to do. It uses the JSON only (no torch objects).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["READ_VERSIONS", "PlanJsonError", "problem_path", "problem_reference", "read_plan_json"]

READ_VERSIONS = (1,)
"""Schema versions this code reads (``report_data.SCHEMA_VERSION`` must be one of them)."""

_REQUIRED = {"mesh": dict, "totals": dict, "parameters": list}


class PlanJsonError(ValueError):
    """A file that is not a plan JSON this version can read (one-line message)."""


def read_plan_json(path: str | Path) -> dict[str, Any]:
    """The plan dict in ``path``, checked for the schema version and the sections tools read."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlanJsonError(f"{path} is not a plan JSON written by `autoparallel plan --out` ({_short(error)})") from error
    if not isinstance(data, dict) or "version" not in data:
        raise PlanJsonError(f"{path} is not a plan JSON written by `autoparallel plan --out` (no schema version)")
    _check_version(path, data["version"])
    for key, kind in _REQUIRED.items():
        if not isinstance(data.get(key), kind):
            raise PlanJsonError(f"{path} is not a complete plan JSON: its {key!r} entry is missing or not a {kind.__name__}")
    return data


def _check_version(path: Path, version: Any) -> None:
    if version in READ_VERSIONS:
        return
    newest = max(READ_VERSIONS)
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        raise PlanJsonError(
            f"{path} has plan schema version {version}, newer than this autoparallel reads ({newest}); upgrade autoparallel"
        )
    raise PlanJsonError(
        f"{path} has plan schema version {version!r}, which this autoparallel does not read "
        f"(it reads {', '.join(map(str, READ_VERSIONS))}); plan again with `autoparallel plan ... --out`"
    )


def _short(error: Exception) -> str:
    return " ".join(str(error).split())[:200]


def problem_reference(problem: Path, json_path: Path) -> str:
    """How a plan JSON at ``json_path`` names its saved ``problem``: relative to the JSON's
    folder when that is possible (so the pair can be moved together), else absolute."""
    try:
        return Path(os.path.relpath(problem.resolve(), json_path.resolve().parent)).as_posix()
    except ValueError:  # another drive on Windows
        return str(problem.resolve())


def problem_path(data: Mapping[str, Any], json_path: Path) -> Path | None:
    """The saved problem a plan JSON names, resolved against the JSON's folder (None if none)."""
    reference = data.get("problem")
    if not isinstance(reference, str) or not reference:
        return None
    return json_path.parent / reference
