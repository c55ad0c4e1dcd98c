"""A hardware profile on disk: the versioned JSON ``autoparallel calibrate`` writes.

The profile holds one :class:`~autoparallel.cost.hardware.Hardware` (device figures and the
fitted collectives) plus what it was measured on and the raw timings, so a fit can be checked
or redone later. ``load_profile(path)`` gives the ``Hardware`` the planner prices with;
``AutoParallel(..., hardware="profile.json")`` and ``autoparallel plan --hardware
profile.json`` call it.

Format (``format: "autoparallel-hardware-profile"``, ``version: 1``)::

    {"format": ..., "version": 1,
     "hardware": {"name", "flops_fp32", "flops_bf16", "memory_bandwidth", ...,
                  "collectives": [{"link", "collective", "latency_us", "bandwidth",
                                   "max_error"}, ...],
                  "matmul_table": {"dtype", "dims", "warm_us", "cold_us", "cold_bytes"}},
     "measured_on": {"backend", "world_size", "mesh_shape", "devices_per_node", "torch",
                     "host", "date"},
     "samples": [{"what", ..., "time_us"}, ...]}

Units are SI (FLOP/s, bytes/s, bytes) and microseconds, as in ``Hardware``. Unknown keys are
ignored, so adding one keeps the version; a newer version is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from autoparallel.cost.hardware import FITTED_KINDS, LINKS, CollectiveFit, Hardware
from autoparallel.cost.matmul_table import MatmulTable

FORMAT = "autoparallel-hardware-profile"
VERSION = 1

__all__ = [
    "FORMAT",
    "VERSION",
    "ProfileError",
    "hardware_from_dict",
    "hardware_to_dict",
    "load_profile",
    "write_profile",
]


class ProfileError(ValueError):
    """A file that is not a hardware profile this version reads (the message says why)."""


def hardware_to_dict(hardware: Hardware) -> dict[str, Any]:
    """Plain JSON data of a ``Hardware`` (its collective fits as a list of dicts)."""
    data = dataclasses.asdict(hardware)
    data["collectives"] = [dataclasses.asdict(fit) for fit in hardware.collectives]
    return data


def hardware_from_dict(data: dict[str, Any], where: str = "hardware") -> Hardware:
    """The ``Hardware`` of :func:`hardware_to_dict`'s data; ProfileError names a bad field."""
    names = {f.name for f in dataclasses.fields(Hardware)}
    known = {key: value for key, value in data.items() if key in names}
    fits = data.get("collectives") or []
    if not isinstance(fits, list):
        raise ProfileError(f"{where}.collectives must be a list, got {fits!r}")
    known["collectives"] = tuple(
        _collective_fit(entry, f"{where}.collectives[{index}]") for index, entry in enumerate(fits)
    )
    if known.get("matmul_table") is not None:
        known["matmul_table"] = _matmul_table(known["matmul_table"], f"{where}.matmul_table")
    for field in dataclasses.fields(Hardware):
        if field.name not in known:
            continue
        if field.name in _FRACTIONS:
            known[field.name] = _fraction(known[field.name], f"{where}.{field.name}")
        elif field.type in ("float", float):
            check = _non_negative if field.default == 0.0 else _positive
            known[field.name] = check(known[field.name], f"{where}.{field.name}")
        elif field.type in ("bool", bool) and not isinstance(known[field.name], bool):
            raise ProfileError(
                f"{where}.{field.name}: expected true or false, got {known[field.name]!r}"
            )
        elif field.type in ("str", str) and not isinstance(known[field.name], str):
            raise ProfileError(
                f"{where}.{field.name}: expected a string, got {known[field.name]!r}"
            )
    try:
        return Hardware(**known)
    except TypeError as error:
        raise ProfileError(f"{where}: {error}") from error


def _collective_fit(entry: Any, where: str) -> CollectiveFit:
    if not isinstance(entry, dict):
        raise ProfileError(f"{where} must be an object, got {type(entry).__name__}")
    link, collective = entry.get("link"), entry.get("collective")
    if link not in LINKS:
        raise ProfileError(f"{where}.link is {link!r}; expected one of {', '.join(LINKS)}")
    if collective not in FITTED_KINDS:
        raise ProfileError(
            f"{where}.collective is {collective!r}; expected one of {', '.join(FITTED_KINDS)}"
        )
    return CollectiveFit(
        link,
        collective,
        latency_us=_non_negative(entry.get("latency_us"), f"{where}.latency_us"),
        bandwidth=_positive(entry.get("bandwidth"), f"{where}.bandwidth"),
        max_error=_non_negative(entry.get("max_error", 0.0), f"{where}.max_error"),
    )


def _matmul_table(entry: Any, where: str) -> MatmulTable:
    if not isinstance(entry, dict):
        raise ProfileError(f"{where} must be an object, got {type(entry).__name__}")
    fields = ("dtype", "dims", "warm_us", "cold_us", "cold_bytes")
    missing = [name for name in fields if name not in entry]
    if missing:
        raise ProfileError(f"{where} lacks {', '.join(missing)}")
    try:
        return MatmulTable(
            dtype=str(entry["dtype"]),
            dims=tuple(int(d) for d in entry["dims"]),
            warm_us=tuple(_number(t, f"{where}.warm_us") for t in entry["warm_us"]),
            cold_us=tuple(_number(t, f"{where}.cold_us") for t in entry["cold_us"]),
            cold_bytes=_positive(entry["cold_bytes"], f"{where}.cold_bytes"),
        )
    except (TypeError, ValueError) as error:
        if isinstance(error, ProfileError):
            raise
        raise ProfileError(f"{where}: {error}") from error


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _positive(value: Any, where: str) -> float:
    number = _number(value, where)
    if number <= 0:
        raise ProfileError(f"{where} must be positive, got {number}")
    return number


_FRACTIONS = frozenset({"overlap_fraction", "runtime_forward_share"})  # figures within [0, 1]


def _fraction(value: Any, where: str) -> float:
    number = _number(value, where)
    if not 0.0 <= number <= 1.0:
        raise ProfileError(f"{where} must be within [0, 1], got {number}")
    return number


def _non_negative(value: Any, where: str) -> float:
    number = _number(value, where)
    if number < 0:
        raise ProfileError(f"{where} must not be negative, got {number}")
    return number


def write_profile(
    hardware: Hardware,
    path: str | Path,
    measured_on: dict[str, Any] | None = None,
    samples: list[dict[str, Any]] | None = None,
) -> None:
    """Write ``hardware`` (and what it was measured on, and the raw timings) to ``path``."""
    data = {
        "format": FORMAT,
        "version": VERSION,
        "hardware": hardware_to_dict(dataclasses.replace(hardware, source="preset")),
        "measured_on": dict(measured_on or {}),
        "samples": list(samples or []),
    }
    del data["hardware"]["source"]  # where it is read from is said by the reader
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def load_profile(path: str | Path) -> Hardware:
    """The ``Hardware`` in the profile at ``path`` (``source`` says which file)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(
            f"{path}: no such hardware profile; write one with `autoparallel calibrate --out {path}`"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProfileError(f"{path} is not a hardware profile ({error})") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{path} is not a hardware profile written by `autoparallel calibrate`")
    version = data.get("version")
    if version != VERSION:
        raise ProfileError(
            f"{path} has profile version {version!r}; this autoparallel reads version {VERSION}"
            + ("; upgrade autoparallel" if isinstance(version, int) and version > VERSION else "")
        )
    if not isinstance(data.get("hardware"), dict):
        raise ProfileError(f"{path} has no 'hardware' entry")
    hardware = hardware_from_dict(data["hardware"], f"{path}: hardware")
    return dataclasses.replace(hardware, source=str(path))
