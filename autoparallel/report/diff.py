"""The difference of two plans, read from their JSON dicts: what ``autoparallel diff`` prints
and ``ShardingOptimizer.diff_solutions`` returns.

Like the summary, it reads the JSON dict only (schema in :mod:`autoparallel.files.plan_json`)
and uses no torch objects; costs are in microseconds (``us``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["CostDelta", "ParameterChange", "PlanDiff", "diff_plan_json"]


_COMPONENTS = ("total_us", "comm_us", "compute_us", "transition_us")
_LISTED_NAMES = 10


class ParameterChange(NamedTuple):
    """A parameter whose placement changed, in the seed's notation (``S(0)R``)."""

    name: str
    before: str
    after: str


@dataclass(frozen=True)
class CostDelta:
    """``b - a`` per cost total, in us (negative: ``b`` is cheaper); None where either side
    has no finite value. Read as attributes (``delta.comm_us``) or by the JSON's keys
    (``delta["comm_us"]``)."""

    total_us: float | None
    comm_us: float | None
    compute_us: float | None
    transition_us: float | None

    def __getitem__(self, key: str) -> float | None:
        if key not in _COMPONENTS:
            raise KeyError(key)
        return getattr(self, key)


@dataclass(frozen=True)
class PlanDiff:
    """What changed from plan ``a`` to plan ``b`` (two constraints, two meshes, ...), read
    from their JSON dicts: the one diff behind ``diff_solutions`` and ``autoparallel diff``.

    ``delta`` is a :class:`CostDelta`; ``objective_delta_us`` the same for the solver
    objectives (which include any objective discount, e.g. prefetch). ``parameters`` has a
    :class:`ParameterChange` per parameter whose placement changed; ``moves`` counts the nodes
    (placeholders included) whose output placement changed, per (before, after), most
    frequent first. Placements are compared as written, in mesh-dim order, so on meshes of
    different dim names ``mesh_note`` says so. ``nodes_recorded`` is False when either side
    has no ``nodes`` entry: then ``moves`` and the ``only_in_*`` lists are empty, not zero.
    """

    delta: CostDelta
    objective_delta_us: float | None
    parameters: list[ParameterChange]
    moves: dict[tuple[str, str], int]
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    mesh_note: str | None = None
    nodes_recorded: bool = True

    @property
    def num_moved(self) -> int:
        return sum(self.moves.values())

    def lines(self) -> list[str]:
        """The diff as text lines (what ``autoparallel diff`` prints)."""
        lines = [self.mesh_note] if self.mesh_note else []
        d = self.delta
        lines.append(
            f"total {_signed(d.total_us)} = comm {_signed(d.comm_us)} + compute {_signed(d.compute_us)} "
            f"+ transition {_signed(d.transition_us)} (solver objective {_signed(self.objective_delta_us)})"
        )
        return lines + self._parameter_lines() + self._move_lines() + self._only_lines()

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _parameter_lines(self) -> list[str]:
        width = max((len(name) for name, _, _ in self.parameters), default=0)
        lines = [f"{len(self.parameters)} parameter(s) changed placement:"]
        return lines + [
            f"  {name:<{width}}  {before} -> {after}" for name, before, after in self.parameters
        ]

    def _move_lines(self) -> list[str]:
        if not self.nodes_recorded:
            return [
                "node placements: not recorded (a JSON without a 'nodes' entry, built from a Plan alone)"
            ]
        lines = [f"{self.num_moved} node(s) changed output placement:"]
        for (src, dst), count in self.moves.items():
            lines.append(f"  {src} -> {dst}: {count} node{'s' if count != 1 else ''}")
        return lines

    def _only_lines(self) -> list[str]:
        if not (self.only_in_a or self.only_in_b):
            return []
        return [f"only in a: {_names(self.only_in_a)}; only in b: {_names(self.only_in_b)}"]


def diff_plan_json(a: Mapping[str, Any], b: Mapping[str, Any]) -> PlanDiff:
    """Compare two plan JSON dicts of the same model; nothing but the dicts is read."""
    totals_a, totals_b = a.get("totals") or {}, b.get("totals") or {}
    objective_a, objective_b = ((d.get("solver") or {}).get("objective_us") for d in (a, b))
    nodes_a, nodes_b = _placements_by_name(a.get("nodes")), _placements_by_name(b.get("nodes"))
    recorded = nodes_a is not None and nodes_b is not None
    nodes_a, nodes_b = nodes_a or {}, nodes_b or {}
    return PlanDiff(
        delta=CostDelta(*(_minus(totals_b.get(key), totals_a.get(key)) for key in _COMPONENTS)),
        objective_delta_us=_minus(objective_b, objective_a),
        parameters=_changed(
            _placements_by_name(a.get("parameters")) or {},
            _placements_by_name(b.get("parameters")) or {},
        ),
        moves=_moves(nodes_a, nodes_b),
        only_in_a=[name for name in nodes_a if name not in nodes_b],
        only_in_b=[name for name in nodes_b if name not in nodes_a],
        mesh_note=_mesh_note(a, b),
        nodes_recorded=recorded,
    )


def _placements_by_name(rows: Any) -> dict[str, str] | None:
    """name -> placements of a ``parameters`` or ``nodes`` list; None if it is not a list."""
    if not isinstance(rows, list):
        return None
    return {
        str(r["name"]): str(r.get("placements"))
        for r in rows
        if isinstance(r, Mapping) and "name" in r
    }


def _changed(a: Mapping[str, str], b: Mapping[str, str]) -> list[ParameterChange]:
    return [
        ParameterChange(name, before, b[name])
        for name, before in a.items()
        if name in b and b[name] != before
    ]


def _moves(a: Mapping[str, str], b: Mapping[str, str]) -> dict[tuple[str, str], int]:
    moves = Counter(
        (before, b[name]) for name, before in a.items() if name in b and b[name] != before
    )
    return dict(moves.most_common())


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _minus(b: Any, a: Any) -> float | None:
    x, y = _finite(b), _finite(a)
    return None if x is None or y is None else x - y


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f} us"


def _names(names: Sequence[str]) -> str:
    if not names:
        return "-"
    shown = ", ".join(names[:_LISTED_NAMES])
    return shown if len(names) <= _LISTED_NAMES else f"{shown}, ... ({len(names)} in all)"


def _mesh_text(data: Mapping[str, Any]) -> str:
    mesh = data.get("mesh") or {}
    shape = list(mesh.get("shape") or [])
    names = mesh.get("dim_names") or [f"dim{i}" for i in range(len(shape))]
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, shape)) + ")"


def _mesh_note(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    first, second = _mesh_text(a), _mesh_text(b)
    if first == second:
        return None
    return f"meshes differ: a {first}, b {second}; placements are compared as written, in mesh-dim order"
