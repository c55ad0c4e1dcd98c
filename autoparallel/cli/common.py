"""What every ``autoparallel`` sub-command shares: its usage error and value parsers."""

from __future__ import annotations

import re

_MESH_RE = re.compile(r"^\d+(x\d+)*$")
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class UsageError(Exception):
    """A bad command-line value, reported as one line with exit status 2."""


def parse_mesh(text: str) -> tuple[int, ...]:
    shape_text = text.strip().lower()
    if not _MESH_RE.match(shape_text):
        raise UsageError(
            f"--mesh {text!r} is not a shape like 8 or 8x8 (positive integers joined by 'x')"
        )
    shape = tuple(int(s) for s in shape_text.split("x"))
    if any(s < 1 for s in shape):
        raise UsageError(f"--mesh {text!r}: every mesh dimension must be at least 1")
    return shape


def parse_bytes(text: str, flag: str, also: str = "") -> float:
    """A positive byte count such as ``2e9``, ``16GiB`` or ``64MiB``; UsageError otherwise
    (``also`` names the other words the flag takes, for the message)."""
    match = _BUDGET_RE.match(text.strip().lower())
    if not match or match.group(2) not in _BYTE_UNITS:
        raise UsageError(f"{flag} {text!r} is not {also}a byte count such as 2e9 or 16GiB")
    value = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    if value <= 0:
        raise UsageError(f"{flag} must be positive, got {text!r}")
    return value
