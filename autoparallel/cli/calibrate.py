"""``autoparallel calibrate``: measure this cluster and write a hardware profile.

Two ways to run it:

* ``autoparallel calibrate --nproc 4 --out profile.json`` spawns 4 gloo ranks on this machine
  (``--pin-cores`` binds each to one core: calibrate so when the runs it prices are bound so);
* ``torchrun --nproc_per_node 8 --nnodes 2 ... -m autoparallel.cli calibrate --out
  profile.json --mesh 2x8`` uses the launched group (nccl where CUDA is there, else gloo);
  ranks per node come from torchrun (``LOCAL_WORLD_SIZE``), so the 2 of ``2x8`` is measured as
  the inter-node link. Rank 0 writes the file.

The profile then prices plans: ``autoparallel plan --hardware profile.json`` or
``AutoParallel(..., hardware="profile.json")``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from autoparallel.cli.common import UsageError, parse_bytes, parse_mesh


def add_commands(commands: Any) -> None:
    """Add the ``calibrate`` sub-command to the ``autoparallel`` parser."""
    calibrate = commands.add_parser(
        "calibrate",
        help="measure this cluster's collectives and devices into a hardware profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    calibrate.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    calibrate.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="spawn this many local gloo ranks (default: the torchrun group, if launched so)",
    )
    calibrate.add_argument(
        "--mesh", default=None, help="mesh whose dims are measured, e.g. 2x4 (default: 1-D)"
    )
    calibrate.add_argument(
        "--max-bytes", default="64MiB", help="largest collective buffer (default 64MiB)"
    )
    calibrate.add_argument(
        "--min-bytes", default="1KiB", help="smallest collective buffer (default 1KiB)"
    )
    calibrate.add_argument(
        "--repeats", type=int, default=5, help="timed calls per figure, at least (default 5)"
    )
    calibrate.add_argument(
        "--rounds", type=int, default=3, help="passes over every size; the median counts"
    )
    calibrate.add_argument(
        "--matmul-grid",
        default=None,
        help="dimensions whose every (M, K, N) the matmul table times, e.g. 16,64,256,1024 "
        "(default: 16-1024 on CPU, 64-16384 on GPU); none: no table",
    )
    calibrate.add_argument("--name", default=None, help="the profile's hardware name")
    calibrate.add_argument(
        "--pin-cores",
        action="store_true",
        help="with --nproc: bind each spawned rank to one core (time the runs it prices the same way)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``calibrate``; returns the exit status (bad values raise UsageError)."""
    from autoparallel.calibrate.run import calibrate_local
    from autoparallel.calibrate.settings import CalibrationSettings

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.pin_cores and args.nproc is None:
        raise UsageError(
            "--pin-cores binds the ranks --nproc spawns; under torchrun bind them there"
        )
    if args.nproc is None and not launched:
        raise UsageError("give --nproc N to spawn N local ranks, or launch with torchrun")
    if args.nproc is not None and args.nproc < 2:
        raise UsageError(f"--nproc must be at least 2 (collectives need peers), got {args.nproc}")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out {args.out}: directory {args.out.parent} does not exist")
    world = args.nproc if args.nproc is not None else int(os.environ["WORLD_SIZE"])
    mesh = parse_mesh(args.mesh) if args.mesh else (world,)
    if math.prod(mesh) != world:
        raise UsageError(f"--mesh {args.mesh} has {math.prod(mesh)} ranks but there are {world}")
    min_bytes, max_bytes = (
        parse_bytes(args.min_bytes, "--min-bytes"),
        parse_bytes(args.max_bytes, "--max-bytes"),
    )
    if min_bytes > max_bytes:
        raise UsageError(
            f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}"
        )
    if args.repeats < 1 or args.rounds < 1:
        raise UsageError("--repeats and --rounds must be positive integers")
    settings = CalibrationSettings(
        mesh_shape=mesh,
        min_bytes=int(min_bytes),
        max_bytes=int(max_bytes),
        repeats=args.repeats,
        rounds=args.rounds,
        matmul_grid=_matmul_grid(args.matmul_grid),
        name=args.name,
    )
    if args.nproc is not None:
        result = calibrate_local(args.nproc, settings, pin_cores=args.pin_cores)
    else:
        result = _calibrate_launched(settings)
        if result is None:  # not rank 0
            return 0
    result.write(args.out)
    print(f"wrote {args.out} ({result.hardware.name})")
    return 0


def _matmul_grid(text: str | None) -> tuple[int, ...] | None:
    """``--matmul-grid``: None (the device's default), () for "none", else rising dims."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(
            f"--matmul-grid {text!r}: give rising positive integers, e.g. 16,64,256,1024, or none"
        ) from None
    if len(dims) < 2 or any(d < 1 for d in dims) or list(dims) != sorted(set(dims)):
        raise UsageError(
            f"--matmul-grid {text!r}: give at least two rising positive integers, e.g. 16,64,256,1024"
        )
    return dims


def _calibrate_launched(settings: Any) -> Any:
    import torch
    import torch.distributed as dist

    from autoparallel.calibrate.run import calibrate_group
    from autoparallel.runtime.gloo import serial_gloo_backend
    from autoparallel.runtime.shutdown import shutdown_distributed

    # gloo with one worker thread per group, as the parallel module needs it (runtime/gloo.py)
    backend = "nccl" if torch.cuda.is_available() else serial_gloo_backend()
    dist.init_process_group(backend)
    try:
        result = calibrate_group(settings)
        return result if dist.get_rank() == 0 else None
    finally:
        shutdown_distributed()  # joins gloo's threads before the interpreter exits
