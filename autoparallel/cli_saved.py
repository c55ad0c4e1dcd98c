"""``autoparallel explain`` and ``autoparallel diff``: questions asked of saved problems.

Both read problems saved by ``autoparallel plan --save FILE.npz`` or
``ShardingOptimizer.save``: no model code, no process group, no GPU needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


class SavedUsageError(ValueError):
    """A bad argument of explain/diff: reported as one line, exit status 2."""


def add_commands(commands: Any) -> None:
    explain = commands.add_parser(
        "explain",
        help="question a saved plan: why this placement, what would another cost",
        description="Question a problem saved by `autoparallel plan --save FILE.npz`.",
    )
    explain.add_argument("problem", type=Path, help="saved problem (.npz)")
    explain.add_argument("--placement", help="target output placement in seed notation, e.g. S(0)R")
    explain.add_argument("--node", action="append", default=None, help="only this node (repeatable)")
    explain.add_argument("--costs", metavar="NODE", help="print the redistribution cost matrix of NODE's input --arg")
    explain.add_argument("--arg", type=int, default=0, help="input slot for --costs (default 0)")
    diff = commands.add_parser("diff", help="compare the solutions of two saved problems")
    diff.add_argument("a", type=Path, help="saved problem (.npz)")
    diff.add_argument("b", type=Path, help="saved problem (.npz)")


def run(args: argparse.Namespace) -> int:
    if args.command == "explain":
        return _explain(args)
    return _diff(args)


def _load(path: Path) -> Any:
    from autoparallel.persistence import PlacementFileError
    from autoparallel.solver.optimizer import ShardingOptimizer

    if not path.is_file():
        raise SavedUsageError(f"{path} does not exist")
    try:
        return ShardingOptimizer.load(str(path))
    except PlacementFileError as error:
        raise SavedUsageError(str(error)) from error


def _explain(args: argparse.Namespace) -> int:
    from autoparallel.explain import format_parameters, format_placement_explanations, format_totals
    from autoparallel.persistence import PlacementFileError, parse_placements

    optimizer = _load(args.problem)
    plan = optimizer.get_solution()
    if args.placement is None and args.costs is None:
        print("\n".join(format_parameters(plan) + format_totals(plan)))
        return 0
    if args.placement is not None:
        try:
            target = parse_placements(args.placement)
        except PlacementFileError as error:
            raise SavedUsageError(f"--placement: {error}") from error
        if len(target) != len(plan.mesh_shape):
            raise SavedUsageError(f"--placement {args.placement} has {len(target)} entries for a {len(plan.mesh_shape)}-D mesh")
        try:
            explanations = optimizer.explain_placement(target, nodes=args.node)
        except KeyError as error:
            raise SavedUsageError(f"--node: {error}") from error
        print("\n".join(format_placement_explanations(explanations)))
    if args.costs is not None:
        try:
            print(optimizer.print_costs_for_node(args.costs, arg=args.arg))
        except KeyError as error:
            raise SavedUsageError(f"--costs {args.costs}: {error}") from error
    return 0


def _diff(args: argparse.Namespace) -> int:
    first, second = _load(args.a), _load(args.b)
    print(first.diff_solutions(first.get_solution(), second.get_solution()))
    return 0
