"""``autoparallel export plan.json --format torch -o parallelize_model.py``: a plan as torch code.

Reads a plan JSON written by ``autoparallel plan --out`` (no model, process group or GPU
needed) and writes the ``parallelize(model, mesh)`` function of :mod:`autoparallel.export`.
The plan's choices torch's styles cannot write are printed, one per line, and listed in the
file's docstring; ``--strict`` makes them an error (exit status 1, nothing written). A plan
with none comes from :func:`autoparallel.export.plan_in_torch_styles`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from autoparallel.export import to_torch_code
from autoparallel.export.recipe import view_of_json
from autoparallel.files.plan_json import read_plan_json


def add_commands(commands: Any) -> None:
    """Add the ``export`` sub-command to the ``autoparallel`` parser."""
    export = commands.add_parser(
        "export",
        help="write a plan as torch code (fully_shard, parallelize_module, checkpoint_wrapper)",
        description="Write the plan in PLAN (a JSON from `autoparallel plan --out`) as a "
        "parallelize(model, mesh) function that uses torch's own APIs only.",
    )
    export.add_argument("plan", type=Path, help="plan JSON (autoparallel plan --out)")
    export.add_argument("--format", choices=("torch",), default="torch", help="(torch only)")
    export.add_argument(
        "-o", "--out", type=Path, default=None, help="file to write (default: stdout)"
    )
    export.add_argument(
        "--strict",
        action="store_true",
        help="fail (exit 1, nothing written) where the plan has a choice torch's styles cannot write",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``export``; returns the exit status (unreadable plans raise the library's errors)."""
    data = read_plan_json(args.plan)
    code = to_torch_code(view_of_json(data, str(args.plan)))
    for unexpressed in code.unexpressed:
        print(
            f"not expressed: {unexpressed.name}: {unexpressed.chosen}; {unexpressed.why}",
            file=sys.stderr,
        )
    if code.unexpressed and args.strict:
        print(
            f"autoparallel export: {len(code.unexpressed)} choices of the plan have no torch "
            "expression; plan again within them (autoparallel.export.plan_in_torch_styles)",
            file=sys.stderr,
        )
        return 1
    if args.out is None:
        sys.stdout.write(code.source)
        return 0
    args.out.write_text(code.source)
    print(
        f"wrote {args.out}: parallelize(model, mesh) for mesh {code.recipe.mesh_shape} "
        f"{code.recipe.mesh_dim_names}; {len(code.recipe.styles)} tensor-parallel styles, "
        f"data parallel by {code.recipe.data_parallel}, "
        f"{len(code.unexpressed)} choices not expressed"
    )
    return 0
