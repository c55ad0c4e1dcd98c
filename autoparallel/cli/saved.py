"""``autoparallel explain`` and ``autoparallel diff``: questions asked of plans on disk.

Both take either a plan JSON (``autoparallel plan --out plan.json``) or a saved problem
(``autoparallel plan --save FILE.npz``, ``ShardingOptimizer.save``); no model code, process
group or GPU is needed. What the chosen plan is (placements, totals, what moved between two
plans) is read from the JSON alone (a saved problem is turned into the same JSON first, so
both kinds of file print the same text). What *other* placements would cost
(``explain --placement`` / ``--costs``) needs the whole problem: for a JSON, the ``.npz`` that
``plan --out`` saved next to it and named in its ``problem`` entry.

Contract: bad arguments and unreadable files raise :class:`SavedUsageError`, which the CLI
prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

_ZIP_MAGIC = b"PK\x03\x04"


class SavedUsageError(ValueError):
    """A bad argument of explain/diff: reported as one line, exit status 2."""


def add_commands(commands: Any) -> None:
    """Add the ``explain`` and ``diff`` sub-commands to the ``autoparallel`` parser."""
    what = "plan JSON (plan --out) or saved problem (.npz, plan --save)"
    explain = commands.add_parser(
        "explain",
        help="question a plan: its placements and totals, or what another placement would cost",
        description="Question a plan written by `autoparallel plan --out plan.json` (or a problem saved with --save). "
        "--placement and --costs need the whole problem, which `plan --out` saves next to the JSON.",
    )
    explain.add_argument("plan", type=Path, help=what)
    explain.add_argument(
        "--placement",
        help="per node: the chosen placement vs this one, in seed notation, e.g. S(0)R",
    )
    explain.add_argument(
        "--node",
        action="append",
        default=None,
        help="with --placement: only this node (repeatable)",
    )
    explain.add_argument(
        "--costs", metavar="NODE", help="print the redistribution cost matrix of NODE's input --arg"
    )
    explain.add_argument("--arg", type=int, default=None, help="input slot for --costs (default 0)")
    diff = commands.add_parser(
        "diff",
        help="compare two plans: cost delta, moved parameters and nodes",
        description="Compare two plans (plan JSONs or saved problems) of the same model.",
    )
    diff.add_argument("a", type=Path, help=what)
    diff.add_argument("b", type=Path, help=what)


def run(args: argparse.Namespace) -> int:
    """Run ``explain`` or ``diff``; returns the exit status (errors raise SavedUsageError)."""
    if args.command == "explain":
        return _explain(args)
    return _diff(args)


# ---------------------------------------------------------------------------- files


class _PlanFile:
    """One file named on the command line, read lazily: a plan JSON or a saved problem."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise SavedUsageError(f"{path} does not exist")
        self.path = path
        self.is_problem = _is_saved_problem(path)
        self._data: dict[str, Any] | None = None
        self._optimizer: Any = None

    def data(self) -> dict[str, Any]:
        """The plan as its JSON dict (schema of ``files/plan_json.py``)."""
        if self._data is None:
            self._data = self._problem_json() if self.is_problem else _read_json(self.path)
        return self._data

    def optimizer(self) -> Any:
        """The ShardingOptimizer of the whole problem, with this plan as its solution."""
        if self._optimizer is None:
            if self.is_problem:
                self._optimizer = _load_problem(self.path)
            else:
                self._optimizer = _load_problem(self._named_problem())
                _check_same_plan(self.data(), self._optimizer, self.path)
        return self._optimizer

    def _problem_json(self) -> dict[str, Any]:
        optimizer = self.optimizer()
        _solution(optimizer, self.path)
        return optimizer.get_json()

    def _named_problem(self) -> Path:
        from autoparallel.files.plan_json import problem_path

        problem = problem_path(self.data(), self.path)
        again = f"plan again with `autoparallel plan ... --out {self.path}`, which saves the problem next to it"
        if problem is None:
            raise SavedUsageError(
                f"{self.path} names no saved problem, which --placement/--costs need (it was written with --no-save "
                f"or by an older autoparallel); {again}"
            )
        if not problem.is_file():
            raise SavedUsageError(
                f"{self.path} names its problem {problem}, which does not exist; {again}"
            )
        return problem


def _is_saved_problem(path: Path) -> bool:
    """A saved problem is a .npz, i.e. a zip archive; anything else is read as JSON."""
    if path.suffix.lower() == ".npz":
        return True
    with path.open("rb") as handle:
        return handle.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC


def _read_json(path: Path) -> dict[str, Any]:
    from autoparallel.files.plan_json import PlanJsonError, read_plan_json

    try:
        return read_plan_json(path)
    except PlanJsonError as error:
        raise SavedUsageError(str(error)) from error


def _load_problem(path: Path) -> Any:
    from autoparallel.files.placements import PlacementFileError
    from autoparallel.optimizer import ShardingOptimizer

    try:
        return ShardingOptimizer.load(str(path))
    except PlacementFileError as error:
        raise SavedUsageError(str(error)) from error


def _solution(optimizer: Any, path: Path) -> Any:
    try:
        return optimizer.get_solution()
    except RuntimeError as error:
        raise SavedUsageError(
            f"{path} holds a problem without a solution; solve and save it again"
        ) from error


def _check_same_plan(data: dict[str, Any], optimizer: Any, path: Path) -> None:
    """Refuse a problem file that no longer holds the JSON's plan (e.g. overwritten by a later
    ``plan --save`` to the same path): answers about it would be about another plan."""
    from autoparallel.types.placements import placement_str

    plan = _solution(optimizer, path)
    saved = {name: placement_str(p) for name, p in plan.param_placements.items()}
    for row in data["parameters"]:
        name = row.get("name") if isinstance(row, dict) else None
        if name is not None and saved.get(name) != row.get("placements"):
            raise SavedUsageError(
                f"the problem saved for {path} holds another plan (parameter {name}: {row.get('placements')} in the "
                f"JSON, {saved.get(name, 'absent')} in the problem); plan again with `autoparallel plan ... --out {path}`"
            )


# ---------------------------------------------------------------------------- explain


def _explain(args: argparse.Namespace) -> int:
    if args.node and args.placement is None:
        raise SavedUsageError("--node selects the nodes of --placement; give --placement too")
    if args.arg is not None and args.costs is None:
        raise SavedUsageError("--arg selects the input of --costs NODE; give --costs too")
    source = _PlanFile(args.plan)
    if args.placement is None and args.costs is None:
        from autoparallel.report.summary import summary_lines

        print("\n".join(summary_lines(source.data())))
        return 0
    optimizer = source.optimizer()
    if args.placement is not None:
        print(_placement_report(optimizer, args.placement, args.node))
    if args.costs is not None:
        try:
            print(optimizer.print_costs_for_node(args.costs, arg=args.arg or 0))
        except KeyError as error:
            raise SavedUsageError(f"--costs {args.costs}: {error}") from error
    return 0


def _placement_report(optimizer: Any, text: str, nodes: list[str] | None) -> str:
    """Per node: the chosen placement vs ``text`` (seed notation), as printed lines."""
    from autoparallel.explain import format_placement_explanations
    from autoparallel.types.placements import PlacementSyntaxError, parse_placements

    mesh_shape = optimizer.get_solution().mesh_shape
    try:
        target = parse_placements(text)
    except PlacementSyntaxError as error:
        raise SavedUsageError(f"--placement: {error}") from error
    if len(target) != len(mesh_shape):
        raise SavedUsageError(
            f"--placement {text} has {len(target)} entries for a {len(mesh_shape)}-D mesh"
        )
    try:
        explanations = optimizer.explain_placement(target, nodes=nodes)
    except KeyError as error:
        raise SavedUsageError(f"--node: {error}") from error
    return "\n".join(format_placement_explanations(explanations))


# ---------------------------------------------------------------------------- diff


def _diff(args: argparse.Namespace) -> int:
    from autoparallel.report.diff import diff_plan_json

    first, second = _PlanFile(args.a).data(), _PlanFile(args.b).data()
    print(f"a: {args.a}, b: {args.b}")
    print(diff_plan_json(first, second))
    return 0
