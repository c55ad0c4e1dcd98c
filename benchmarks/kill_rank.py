"""How long the surviving ranks take to raise ``RankLostError`` after a rank is lost.

    python -m benchmarks.kill_rank --timeout 10 --launches 5 [--nproc 2] [--mode kill hang]

Each launch starts ``--nproc`` gloo ranks (``run_distributed``), plans the MLP with its
parameters sharded (every phase of a step communicates), applies it with
``collective_timeout=--timeout`` and trains; at step 2 the last rank is lost between its
forward and its backward, while the others are in their backward's collectives:

* ``kill``: it ends with ``os._exit`` (its sockets close: gloo tells the peers at once);
* ``hang``: it sleeps with its sockets open (a stuck rank, or a host that vanished without
  closing its connections: only the collective timeout ends the others' wait).

The victim stamps the wall clock just before it is lost; each survivor stamps it when its
step raises. ``detect_s`` is the difference (same machine, same clock), per survivor; a
launch's figure is its slowest survivor. The goal is every survivor within 2x the timeout
(``worst_over_timeout`` <= 2): a hang costs about one timeout, a kill far less. Also
reported per mode: how many survivors raised ``RankLostError`` and how many named the lost
rank. Launches alternate the modes, so a slow spell of a shared machine falls on both.

One record per mode (``benchmarks.results``: question ``<mode>-<nproc>r-timeout<T>``, the
figure the worst survivor over the timeout, the raw figures and the machine's load average
beside it) is printed and appended to ``benchmarks/results/kill_rank.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel, RankLostError
from autoparallel.models import MLP
from autoparallel.runtime.launch import run_distributed
from benchmarks.results import record

ROWS = 256
LOST_AT_STEP = 2


def _batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(step))


def lose_a_rank(rank: int, world_size: int, mode: str, directory: str, timeout_s: float) -> None:
    """One rank's launch: train until the last rank is lost at ``LOST_AT_STEP``; a survivor
    writes ``{"at", "type", "lost_rank", "message"}`` to ``directory/rank<r>.json``, the
    victim its stamp to ``directory/victim.json``."""
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = MLP(64, 256)
    with AutoParallel(model, lambda: torch.empty(ROWS, 64), mesh, hardware="cpu") as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        parallel = autop.apply_placement(autop.optimize_placement(), collective_timeout=timeout_s)
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-2)
    victim = world_size - 1
    out = Path(directory)
    for step in range(LOST_AT_STEP + 2):
        try:
            output = parallel(_batch(step).chunk(world_size)[rank])
            if step == LOST_AT_STEP and rank == victim:
                (out / "victim.json").write_text(json.dumps({"at": time.time()}))
                _be_lost(mode, out, world_size)
            (output.pow(2).sum() / (output.numel() * world_size)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except RuntimeError as error:
            found = {
                "at": time.time(),
                "type": type(error).__name__,
                "lost_rank": getattr(error, "lost_rank", None),
                "message": str(error).splitlines()[0] if str(error) else "",
            }
            (out / f"rank{rank}.json").write_text(json.dumps(found))
            if not isinstance(error, RankLostError):
                raise
            return
    (out / f"rank{rank}.json").write_text(json.dumps({"at": None, "type": None}))


def _be_lost(mode: str, out: Path, world_size: int) -> None:
    if mode == "kill":
        os._exit(17)
    survivors = [out / f"rank{r}.json" for r in range(world_size - 1)]
    while not all(path.exists() for path in survivors):  # hung until the others reported
        time.sleep(0.05)
    os._exit(18)


def one_launch(mode: str, nproc: int, timeout_s: float, guard_s: float) -> dict[str, Any]:
    """Run one launch; the survivors' delays and what they raised."""
    with tempfile.TemporaryDirectory(prefix="kill-rank-") as directory:
        try:
            run_distributed(lose_a_rank, nproc, mode, directory, timeout_s, timeout_s=guard_s)
            launcher = "no rank failed"
        except RuntimeError as error:
            launcher = str(error).splitlines()[0]
        out = Path(directory)
        victim = json.loads((out / "victim.json").read_text())["at"]
        survivors = []
        for rank in range(nproc - 1):
            path = out / f"rank{rank}.json"
            found = json.loads(path.read_text()) if path.exists() else {"at": None}
            survivors.append(
                {
                    "rank": rank,
                    "detect_s": None if found["at"] is None else round(found["at"] - victim, 3),
                    "type": found.get("type"),
                    "lost_rank": found.get("lost_rank"),
                    "message": found.get("message"),
                }
            )
    return {"mode": mode, "launcher": launcher, "survivors": survivors}


def summarize(launches: list[dict[str, Any]], mode: str, nproc: int, timeout_s: float) -> dict:
    """One mode's figures: the slowest survivor of each launch, their median and worst, the
    worst over the timeout, and how many survivors raised RankLostError and named the rank."""
    mine = [launch for launch in launches if launch["mode"] == mode]
    survivors = [s for launch in mine for s in launch["survivors"]]
    slowest = [
        max((s["detect_s"] for s in launch["survivors"] if s["detect_s"] is not None), default=None)
        for launch in mine
    ]
    measured = [value for value in slowest if value is not None]
    worst = max(measured) if measured else None
    return {
        "launches": len(mine),
        "slowest_survivor_s": slowest,
        "median_s": round(statistics.median(measured), 3) if measured else None,
        "worst_s": worst,
        "worst_over_timeout": round(worst / timeout_s, 3) if worst is not None else None,
        "within_2x": worst is not None and worst <= 2 * timeout_s,
        "survivors": len(survivors),
        "raised_rank_lost": sum(s["type"] == "RankLostError" for s in survivors),
        "named_lost_rank": sum(s["lost_rank"] == nproc - 1 for s in survivors),
        "example_message": next((s["message"] for s in survivors if s["message"]), None),
    }


WHAT = {
    "kill": "a rank killed (os._exit) mid-step",
    "hang": "a rank hung (asleep, sockets open) mid-step",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="collective timeout, s")
    parser.add_argument("--launches", type=int, default=5, help="launches per mode")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mode", nargs="+", choices=("kill", "hang"), default=["kill", "hang"])
    parser.add_argument("--guard", type=float, default=600.0, help="a launch's hang guard, s")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    launches = []
    for index in range(args.launches):
        for mode in args.mode:
            launch = one_launch(mode, args.nproc, args.timeout, args.guard)
            print(f"launch {index} {mode}: {json.dumps(launch)}", file=sys.stderr, flush=True)
            launches.append(launch)
    load_at_end = [round(x, 2) for x in os.getloadavg()]
    load = {"load_average_at_start": load_at_start, "load_average_at_end": load_at_end}
    entries = []
    for mode in args.mode:
        figures = summarize(launches, mode, args.nproc, args.timeout)
        entries.append(
            {
                "question": f"{mode}-{args.nproc}r-timeout{args.timeout:g}",
                "what": (
                    f"slowest survivor's delay to RankLostError over the collective timeout, "
                    f"{WHAT[mode]}, MLP with sharded parameters, {args.nproc} gloo ranks, "
                    f"timeout {args.timeout:g} s, {args.launches} launches (goal: 2 at most)"
                ),
                "figure": figures["worst_over_timeout"],
                "unit": "x the timeout",
                "note": (
                    f"worst {figures['worst_s']} s, median {figures['median_s']} s; "
                    f"{figures['raised_rank_lost']} of {figures['survivors']} survivors raised "
                    f"RankLostError, {figures['named_lost_rank']} named rank {args.nproc - 1}"
                ),
                "timeout_s": args.timeout,
                "nproc": args.nproc,
                **figures,
                **load,
            }
        )
        print(json.dumps(entries[-1]), flush=True)
    if not args.no_record:
        record("kill_rank", entries, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
