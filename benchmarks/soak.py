"""Soak test: how often a fresh multi-rank training launch aborts, hangs or trains wrongly.

    python -m benchmarks.soak [--launches 50] [--nproc 2 4] [--models llama-tiny ...]
        [--mesh 1d|2d|pp] [--steps 5] [--hardware cpu|profile.json] [--compile] [--eager]
        [--timeout 300] [--logs DIR]

Each launch is what a new user runs: ``--nproc`` fresh processes (a torchrun-like
environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), each joining a new
gloo process group, planning the model with the public API (``AutoParallel`` ->
``optimize_placement`` -> ``apply_placement`` -> ``to_empty`` -> ``init_weights``) and
training ``--steps`` steps (5) of ``torch.optim.AdamW(foreach=True)`` on its rows of a fixed
global batch, eagerly or under ``torch.compile`` with ``autoparallel_backend()``, priced on
``--hardware`` (AutoParallel's default, the ``h100`` preset, unless given). The mesh is 1-D over all ranks (``dp``), or
with ``--mesh 2d`` a (ranks / 2, 2) ``dp`` x ``tp`` mesh with the batch split over ``dp`` only
and the parameter memory constraint, as ``autoparallel.search_mesh`` plans it: two process
groups per rank with collectives of both in flight (the MoE always runs on ``dp`` x ``ep``);
with ``--mesh pp`` a (2, ranks / 2) ``pp`` x ``dp`` pipeline (torch.distributed.pipelining's
asynchronous point-to-point sends beside the stages' collectives).
Every rank runs with glibc's heap checks (``MALLOC_CHECK_=3``, with ``libc_malloc_debug.so`` preloaded where
glibc has it, as glibc >= 2.34 needs; ``MALLOC_PERTURB_`` random in 1..255 per launch) and
``PYTHONFAULTHANDLER=1``, so a use of freed memory tends to abort or crash, with the Python
stack of the dying rank in its log.

A launch counts as one of:

* ``abort``: a rank died of a signal (SIGABRT from glibc's checks or from gloo, SIGSEGV,
  ...), while training or at exit (after it left the process group);
* ``hang``: a rank had not exited after ``--timeout`` seconds (all ranks then killed);
* ``error``: a rank exited non-zero without a signal (a Python exception);
* ``wrong``: every rank finished, but a step's global loss differs from the one-device
  reference (the same model, init and batch, unsharded, in this process) by more than
  ``1e-4 * (step + 1) * |loss|`` (see ``TOLERANCE``), or the ranks issued different numbers
  of collectives in a step (a process group pairs collectives by sequence number: they
  must match);
* ``ok``: otherwise.

Prints one table of counts per (model, nproc, mode) and appends one JSON line to
``benchmarks/results/soak.jsonl`` (date, commit, machine, command, counts). The logs of
every launch that was not ``ok`` are kept under ``--logs``.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.results import record

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("mlp", "llama-tiny", "llama-small", "moe-tiny")
"""``llama-small`` is the ~21 M parameter LLaMA of the benchmarks."""
STEPS = 5
"""Training steps per launch unless ``--steps`` says otherwise."""
TOLERANCE = 1e-4
"""How far step k's global loss may lie from one device's, relative, times ``k + 1``: the
ranks sum in another order than one device, and the rounding differences compound with each
optimizer step (40 steps of the 21 M LLaMA on a (2, 2) mesh drift by up to 5.5e-4 relative,
at 0.3 of this bound, the same in every launch); a corrupted value lies far further off."""
OUTCOMES = ("ok", "abort", "hang", "error", "wrong")
MALLOC_DEBUG = ctypes.util.find_library("c_malloc_debug")
"""glibc's checking allocator (where it is a library of its own), preloaded into every rank."""
DONE = "soak: rank done"
"""What a rank prints once it has trained and left the group: an abort after it is at exit."""
ISSUED = "soak: collectives per step "
"""What a rank prints before its list of collectives issued per step (ranks must agree)."""


def _workload(name: str) -> Any:
    from benchmarks.workloads import MOE_TINY_WORKLOAD, WORKLOADS

    return MOE_TINY_WORKLOAD if name == "moe-tiny" else WORKLOADS[name]


# ---------------------------------------------------------------------------------- a rank


def rank_main(
    model: str, mesh_kind: str, steps: int, compiled: bool, out: str, hardware: str | None = None
) -> None:
    """One rank of one launch (the environment says which): plan, train, report losses,
    then leave as a user should (autoparallel.shutdown_distributed, runtime/shutdown.py)."""
    import torch
    import torch.distributed as dist

    from autoparallel import serial_gloo_backend, shutdown_distributed

    torch.set_num_threads(1)
    dist.init_process_group(serial_gloo_backend())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.dup2(2, 1)  # the solver's banner goes to the log, not to the parent's table
    losses, issued = _train(model, mesh_kind, steps, compiled, rank, world_size, hardware)
    print(f"{ISSUED}{json.dumps(issued)}", file=sys.stderr, flush=True)
    total = torch.stack(losses)
    dist.all_reduce(total)
    if rank == 0:
        Path(out).write_text(json.dumps((total / world_size).tolist()))
    left = shutdown_distributed()
    if left:  # an error: the exit would race those threads (runtime/shutdown.py)
        raise SystemExit(f"soak: collective threads left after shutdown_distributed: {left}")
    print(DONE, file=sys.stderr, flush=True)


def _train(
    model: str,
    mesh_kind: str,
    steps: int,
    compiled: bool,
    rank: int,
    world_size: int,
    hardware: str | None = None,
) -> tuple[list, list[int]]:
    """Plan ``model`` on a fresh mesh and train it ``steps`` steps; the losses (this rank's) and
    the collectives issued in each step. The mesh and the module die when this returns."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from autoparallel import autoparallel_backend
    from benchmarks.workloads import local_rows, loss_of, make_optimizer, plan_ours

    if mesh_kind == "pp":
        return _train_pipelined(model, steps, rank, world_size, hardware)
    rows, row_rank, row_ranks = None, rank, world_size  # the batch split over every rank
    if model == "moe-tiny":  # experts over "ep", as benchmarks/moe_step_time.py plans it
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "ep"))
    elif mesh_kind == "2d":  # the batch over dp, replicated over tp
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        rows, row_rank, row_ranks = (Shard(0), Replicate()), rank // 2, world_size // 2
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    workload = _workload(model)
    # on dp x tp with the parameter memory constraint, as search_mesh plans a candidate: the
    # parameters sharded over both dims, gathered on both groups
    module = plan_ours(
        workload, mesh, rows=rows, memory_constraint=rows is not None, hardware=hardware
    ).module
    optimizer = make_optimizer(module)
    run = (
        torch.compile(module, backend=autoparallel_backend(), fullgraph=True)
        if compiled
        else module
    )
    inputs, targets = workload.global_batch()
    inputs = local_rows(inputs, row_rank, row_ranks)
    targets = local_rows(targets, row_rank, row_ranks)
    sequence = _collectives_issued(mesh)
    losses, issued = [], []
    for _ in range(steps):
        before = sequence()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(run(inputs), targets)
        (loss / world_size).backward()  # ours: gradients of the sum of the ranks' losses
        optimizer.step()
        losses.append(loss.detach().double())
        issued.append(sequence() - before)
    return losses, issued


def _collectives_issued(mesh: Any) -> Callable[[], int]:
    """A counter of the collectives this rank issued on ``mesh``'s groups and the default
    one: a gloo backend's sequence number (private, no public counter) goes up by one per
    collective; every rank must issue the same ones."""
    import torch
    import torch.distributed as dist

    groups = {dist.distributed_c10d._get_default_group(), *mesh.get_all_groups()}
    backends = [group._get_backend(torch.device("cpu")) for group in groups]
    return lambda: sum(backend._get_sequence_number_for_group() for backend in backends)


def _train_pipelined(
    model: str, steps: int, rank: int, world_size: int, hardware: str | None
) -> tuple[list, list[int]]:
    """As ``_train``, on a (2, ranks / 2) pp x dp mesh (pp alone on 2 ranks): the model cut
    into 2 stages, each planned on dp, the schedule and microbatches the planner's, trained
    with ``ParallelPipeline.step``. A stage is cut from a materialized model (a meta one
    cannot be initialized per stage yet): built on CPU with the reference's init. Each
    rank's losses are its share of the global loss times the ranks (the first stage's 0),
    so that ``rank_main``'s mean over the ranks is the global loss."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from autoparallel import AutoParallel
    from benchmarks.workloads import local_rows, loss_of, make_optimizer

    dp = world_size // 2
    shape, names = ((2, dp), ("pp", "dp")) if dp > 1 else ((2,), ("pp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    rows = (Replicate(), Shard(0)) if dp > 1 else (Replicate(),)
    workload = _workload(model)
    torch.manual_seed(0)
    module = workload.build()
    module.init_weights(seed=0)
    inputs, targets = workload.global_batch()
    with AutoParallel(module, lambda: inputs, mesh, hardware=hardware) as autop:
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        plan = autop.optimize_placement()
        pipe = autop.apply_placement(plan, loss_fn=lambda out, tgt: loss_of(out, tgt) / dp)
    optimizer = make_optimizer(pipe)
    row = mesh.get_local_rank("dp") if dp > 1 else 0
    inputs, targets = local_rows(inputs, row, dp), local_rows(targets, row, dp)
    sequence = _collectives_issued(mesh)
    losses, issued = [], []
    for _ in range(steps):
        before = sequence()
        optimizer.zero_grad(set_to_none=True)
        microbatches: list = []
        pipe.step(inputs, target=targets, losses=microbatches)
        optimizer.step()
        mine = torch.stack(microbatches).detach().double().mean() if microbatches else None
        losses.append(torch.zeros((), dtype=torch.float64) if mine is None else mine * world_size)
        issued.append(sequence() - before)
    return losses, issued


# ---------------------------------------------------------------------------------- launches


def reference_losses(model: str, steps: int = STEPS) -> list[float]:
    """The global loss of each step, trained unsharded on one process."""
    import torch

    from benchmarks.workloads import loss_of, make_optimizer

    workload = _workload(model)
    torch.manual_seed(0)
    module = workload.build()
    module.init_weights(seed=0)
    optimizer = make_optimizer(module)
    inputs, targets = workload.global_batch()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(module(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@dataclass
class Launch:
    """What one launch came to."""

    outcome: str
    seconds: float
    perturb: int
    detail: str = ""  # the failing rank, its exit status, its log
    issued: list[int] | None = None  # collectives rank 0 issued in each step


def _free_port() -> int:
    from autoparallel.runtime.launch import find_free_port

    return find_free_port()


def launch(
    model: str,
    nproc: int,
    mesh_kind: str,
    compiled: bool,
    timeout_s: float,
    logs: Path,
    reference: list[float],
    hardware: str | None = None,
) -> Launch:
    """Start ``nproc`` fresh ranks of one launch, wait for them, classify the result."""
    perturb = random.randint(1, 255)
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=logs))
    out = work / "losses.json"
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        OMP_NUM_THREADS="1",
        MALLOC_CHECK_="3",
        MALLOC_PERTURB_=str(perturb),
        PYTHONFAULTHANDLER="1",
    )
    if MALLOC_DEBUG:  # glibc >= 2.34 honours MALLOC_CHECK_ only with this library preloaded
        env["LD_PRELOAD"] = " ".join(filter(None, (env.get("LD_PRELOAD"), MALLOC_DEBUG)))
    command = [sys.executable, "-m", "benchmarks.soak", "--rank-of", model, "--out", str(out)]
    command += ["--mesh", mesh_kind, "--steps", str(len(reference))]
    command += ["--hardware", hardware] if hardware else []
    command += ["--compile"] if compiled else []
    start = time.monotonic()
    procs = []
    for rank in range(nproc):
        log = open(work / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            (subprocess.Popen(command, cwd=ROOT, env=rank_env, stdout=log, stderr=log), log)
        )
    deadline = start + timeout_s
    hung = False
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            break
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    seconds = time.monotonic() - start
    codes = [proc.returncode for proc, _ in procs]
    signalled = [(r, c) for r, c in enumerate(codes) if c < 0 and not (hung and c == -9)]
    if signalled:
        rank, code = signalled[0]
        log = work / f"rank{rank}.log"
        when = "at exit" if DONE in log.read_text(errors="replace") else "while training"
        name = signal.Signals(-code).name
        return Launch("abort", seconds, perturb, f"rank {rank} {name} {when}: {log}")
    if hung:
        return Launch("hang", seconds, perturb, f"codes {codes}: {work}")
    if any(codes):
        rank = next(r for r, c in enumerate(codes) if c)
        return Launch("error", seconds, perturb, f"rank {rank} exit {codes[rank]}: {work}")
    losses = json.loads(out.read_text())
    issued = [_issued(work / f"rank{rank}.log") for rank in range(nproc)]
    if any(
        abs(a - b) > TOLERANCE * (step + 1) * max(abs(b), 1e-3)
        for step, (a, b) in enumerate(zip(losses, reference))
    ):
        return Launch("wrong", seconds, perturb, f"{losses} vs {reference}: {work}", issued[0])
    # the ranks of one pipeline stage must agree (the stages run other collectives)
    alike = nproc // 2 if mesh_kind == "pp" else nproc
    if any(counts != issued[r - r % alike] for r, counts in enumerate(issued)):
        return Launch("wrong", seconds, perturb, f"ranks issued {issued}: {work}", issued[0])
    for path in work.iterdir():
        path.unlink()
    work.rmdir()
    return Launch("ok", seconds, perturb, issued=issued[0])


def _issued(log: Path) -> list[int]:
    """The collectives per step a rank's log reports."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(ISSUED):
            return json.loads(line[len(ISSUED) :])
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launches", type=int, default=50, help="launches per configuration")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["llama-tiny"])
    parser.add_argument(
        "--mesh",
        choices=("1d", "2d", "pp"),
        default="1d",
        help="2d: (ranks / 2, 2) dp x tp; pp: (2, ranks / 2) pp x dp, eager, LLaMA models",
    )
    parser.add_argument(
        "--hardware", help="preset or profile.json to plan with (default: AutoParallel's, h100)"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per launch")
    parser.add_argument("--eager", action="store_true", help="eager launches (the default)")
    parser.add_argument("--compile", action="store_true", help="torch.compile launches")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "soak-logs")
    parser.add_argument("--seed", type=int, default=None, help="seeds MALLOC_PERTURB_ draws")
    parser.add_argument("--no-record", action="store_true", help="do not append to soak.jsonl")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one rank
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        rank_main(args.rank_of, args.mesh, args.steps, args.compile, args.out, args.hardware)
        return 0
    if args.mesh == "pp" and (args.compile or not all(m.startswith("llama") for m in args.models)):
        parser.error("--mesh pp runs the LLaMA models (a layer stack to cut), eagerly")
    modes = (["eager"] if args.eager or not args.compile else []) + (
        ["compile"] if args.compile else []
    )
    random.seed(args.seed)
    args.logs.mkdir(parents=True, exist_ok=True)
    counts = []
    for model in args.models:
        reference = reference_losses(model, args.steps)
        for nproc in args.nproc:
            for mode in modes:
                tally = dict.fromkeys(OUTCOMES, 0)
                failures, issued = [], set()
                for index in range(args.launches):
                    result = launch(
                        model,
                        nproc,
                        args.mesh,
                        mode == "compile",
                        args.timeout,
                        args.logs,
                        reference,
                        args.hardware,
                    )
                    tally[result.outcome] += 1
                    print(
                        f"{model} nproc={nproc} {mode} #{index}: {result.outcome} "
                        f"{result.seconds:.1f}s perturb={result.perturb} "
                        f"collectives/step={result.issued} {result.detail}",
                        flush=True,
                    )
                    if result.outcome != "ok":
                        failures.append(asdict(result))
                    if result.issued:
                        issued.add(tuple(result.issued))
                counts.append(
                    {"model": model, "nproc": nproc, "mode": mode, "launches": args.launches}
                    | {"mesh": _mesh_label(model, args.mesh), "steps": args.steps}
                    | {"hardware": args.hardware or "default"}
                    | tally
                    | {"collectives_per_step": sorted(issued), "failures": failures}
                )
    print(f"\n{'model':<12} {'nproc':>5} {'mode':<8} " + " ".join(f"{o:>6}" for o in OUTCOMES))
    for row in counts:
        print(
            f"{row['model']:<12} {row['nproc']:>5} {row['mode']:<8} "
            + " ".join(f"{row[o]:>6}" for o in OUTCOMES)
        )
    if not args.no_record:
        record("soak", [_soak_record(row) for row in counts], argv)
    return 0 if all(row["ok"] == row["launches"] for row in counts) else 1


def _mesh_label(model: str, mesh_kind: str) -> str:
    """The mesh a launch of ``model`` runs on, in words."""
    if model == "moe-tiny":
        return "dp x ep"
    return {"2d": "dp x tp", "pp": "pp x dp"}.get(mesh_kind, "dp")


def _priced_on(hardware: str) -> str:
    """How a record names the hardware model its plans were priced on (none for the default)."""
    if hardware == "default":
        return ""
    if hardware.endswith(".json"):
        return ", priced on a profile from autoparallel calibrate"
    return f", priced on {hardware}"


def _hardware_suffix(hardware: str) -> str:
    """The question key's tail for what the launches planned with: none for AutoParallel's
    default (a user's first run), ``-profile`` for a calibrated profile, ``-<preset>``."""
    if hardware == "default":
        return ""
    return "-profile" if hardware.endswith(".json") else f"-{hardware}"


def _soak_record(row: dict) -> dict:
    """One results record (benchmarks/results.py) of a (model, ranks, mode) row."""
    bad = {outcome: row[outcome] for outcome in OUTCOMES if outcome != "ok" and row[outcome]}
    figure = f"{row['ok']}/{row['launches']} ok"
    if bad:
        figure += " (" + ", ".join(f"{count} {outcome}" for outcome, count in bad.items()) + ")"
    raw = {key: value for key, value in row.items() if key not in ("model", "nproc", "mode")}
    suffix = {"dp x tp": "-2d", "pp x dp": "-pp"}.get(row["mesh"], "")
    suffix += f"-{row['steps']}steps" if row["steps"] != STEPS else ""
    suffix += _hardware_suffix(row["hardware"])
    return {
        "question": f"{row['model']}-{row['nproc']}r-{row['mode']}{suffix}",
        "what": f"fresh launches of {row['model']} on {row['nproc']} gloo ranks ({row['mode']}, "
        f"mesh {row['mesh']}{_priced_on(row['hardware'])}), {row['steps']} AdamW steps each "
        "under glibc's heap checks: "
        "launches ending clean",
        "figure": figure,
        **raw,
    }


if __name__ == "__main__":
    sys.exit(main())
