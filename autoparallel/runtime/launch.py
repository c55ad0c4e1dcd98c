"""Start N gloo ranks on this machine and collect what each returns (CPU, one process per rank).

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` fresh processes joined by a gloo process group and returns what each
rank returned, in rank order. A :class:`RankPool` does the same on ranks started once and
reused. ``autoparallel calibrate`` measures the machine with it; tests and benchmarks use it
to check and time the parallel module. :func:`fake_mesh` is the other way to get ranks:
none at all, a mesh of any size on torch's fake process group, for planning on one machine.

Contract: ``fn`` is importable by name (module level, so it pickles), its return value is
picklable (tensors travel by value), and a failing rank's traceback is raised in the caller
as ``RuntimeError`` after the other ranks had a grace period to report. A rank that dies
without reporting (a signal, ``os._exit``) is named in the error with its exit code.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoparallel._torch_internals import init_fake_process_group
from autoparallel.runtime.gloo import serial_gloo_backend
from autoparallel.runtime.shutdown import shutdown_distributed

__all__ = ["RankPool", "fake_mesh", "find_free_port", "pin_to_core", "run_distributed"]

_GRACE_S = 5.0
"""After one rank fails, how long to wait for the others to report before killing them."""


def fake_mesh(
    shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None = None, rank: int = 0
) -> DeviceMesh:
    """A CPU DeviceMesh of ``shape`` on torch's fake process group, as seen by ``rank``.

    Nothing communicates: collectives return at once without moving data. This is how one
    process plans for a cluster (``fake_mesh((8, 8), ("dp", "tp"))`` plans 64 GPUs); the
    plan it gives is the plan every real rank computes. Any default process group already
    started in this process is destroyed first; call ``torch.distributed.destroy_process_group()``
    when done.

    Raises TypeError or ValueError naming the argument for a ``shape`` that is not a
    non-empty tuple of positive ints, ``mesh_dim_names`` that are not one distinct non-empty
    string per dim, or a ``rank`` that is not an int within the mesh.
    """
    if not isinstance(shape, (tuple, list)) or not all(_is_int(s) for s in shape):
        raise TypeError(f"fake_mesh shape must be a tuple of ints, e.g. (2, 4), got {shape!r}")
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"fake_mesh shape {tuple(shape)}: give at least one dim, each >= 1")
    if mesh_dim_names is not None and (
        not isinstance(mesh_dim_names, (tuple, list))
        or len(mesh_dim_names) != len(shape)
        or not all(isinstance(n, str) and n for n in mesh_dim_names)
        or len(set(mesh_dim_names)) != len(mesh_dim_names)
    ):
        raise ValueError(
            f"mesh_dim_names must be {len(shape)} distinct non-empty strings, one per dim of "
            f"{tuple(shape)}, got {mesh_dim_names!r}"
        )
    world_size = math.prod(shape)
    if not _is_int(rank):
        raise TypeError(f"rank must be an int, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a mesh of {world_size} ranks {tuple(shape)}")
    init_fake_process_group(world_size, rank)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _rank_context() -> Any:
    """Where ranks come from: forked from multiprocessing's fork server, which imported torch
    and autoparallel once, so a rank starts in milliseconds instead of the seconds a fresh
    interpreter spends importing torch; ``spawn`` where there is no fork server (Windows).

    Each rank is still a process of its own that ran nothing before ``fn``: the server is
    single-threaded and only imported (no CUDA, no process group). It is started by the first
    launch of this process and outlives it, so settings torch reads at import (e.g.
    ``OMP_NUM_THREADS``, set to 1 for every launch) are those of that first launch; every
    other environment variable a rank sees is the launching process's at launch time
    (:func:`_child_env`).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return torch_mp.get_context("spawn")
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "autoparallel"])
    return torch_mp.get_context("forkserver")


def _child_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """A rank's whole environment: the launching process's now, and the rank's own."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (the fork server or a spawned
    child, started inside it, imports torch with them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def pin_to_core(rank: int) -> int | None:
    """Bind this process to one of the cores it may run on, ``rank`` modulo their count (as
    a GPU job binds one device per rank), and return that core; None where the OS has no
    affinity call. On a shared host a rank the scheduler moves between cores, or whose core
    another rank's threads share, times less steadily."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _worker(
    rank: int,
    world_size: int,
    environment: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
    pin_cores: bool = False,
) -> None:
    """Body of one rank: report ("ok", payload) or ("error", traceback) on ``results``."""
    _adopt(environment)
    if pin_cores:
        pin_to_core(rank)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(serial_gloo_backend(), rank=rank, world_size=world_size)
        # Pickle here (plain pickle: tensors travel by value) so that an unpicklable return
        # value is reported as this rank's error, and nothing depends on shared memory that
        # disappears when the child exits; the value itself dies here, before the shutdown.
        message = (rank, "ok", pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        message = (rank, "error", traceback.format_exc())
    # Report before leaving the group: leaving closes the connections, which makes peers
    # blocked in a collective fail too, and their report should not overtake this one.
    results.put(message)
    shutdown_distributed()  # joins gloo's threads while the interpreter is alive


def _stop(processes: Sequence[Any]) -> None:
    """Terminate, then kill, every child still alive; reap them all."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 2.0
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    pin_cores: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Each rank is a fresh process (forked from a server that imported torch: see
    :func:`_rank_context`) with ``MASTER_ADDR=127.0.0.1``, a free
    ``MASTER_PORT``, ``RANK``/``WORLD_SIZE`` set, ``OMP_NUM_THREADS=1`` and
    ``torch.set_num_threads(1)``; it joins the default process group with
    ``init_process_group(serial_gloo_backend())`` (gloo with one worker thread per group,
    runtime/gloo.py) before ``fn`` runs and leaves it afterwards.

    ``fn`` must be a module-level function and its arguments and return value picklable
    (tensors are returned by value). Returns the ranks' return values in rank order.
    ``pin_cores``: each rank bound to one core (:func:`pin_to_core`).

    Return DTensors as full tensors (``gather_full``, ``full_params``, ``full_grads``):
    the process group is gone by the time the value is pickled.

    Raises RuntimeError with the formatted traceback of the failing rank (the first
    failure to arrive; later ones are listed by their last line) if any rank raises, if
    a rank dies without reporting, or if the whole run takes longer than ``timeout_s``
    seconds; in every case all children are stopped (terminate, then kill) first.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {type(fn).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    context = _rank_context()
    results = context.Queue()
    port = find_free_port()
    processes = []
    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        # The fork server (or a spawned child) imports torch with this environment:
        # OMP_NUM_THREADS must be set before that.
        with _environ(
            {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ):
            for rank in range(world_size):
                proc = context.Process(
                    target=_worker,
                    args=(
                        rank,
                        world_size,
                        _child_env(rank, world_size, port),
                        fn,
                        args,
                        kwargs,
                        results,
                        pin_cores,
                    ),
                    name=f"autoparallel-rank{rank}",
                    daemon=True,
                )
                proc.start()
                processes.append(proc)
        _collect(processes, results, reports, world_size, deadline)
    finally:
        _stop(processes)
        results.close()
        results.join_thread()

    return _verdict(reports, world_size, fn, timeout_s)


def _collect(
    processes: Sequence[Any],
    results: Any,
    reports: dict[int, tuple[str, Any]],
    world_size: int,
    deadline: float,
    task: int | None = None,
) -> None:
    """Fill ``reports`` (rank -> (status, payload)) from ``results`` until every rank has
    reported, one has failed and the others had ``_GRACE_S`` to follow, a rank died without
    reporting, or ``deadline`` passed. With ``task``, messages carry a task number and only
    that task's count (a pool's earlier, abandoned tasks may still report)."""
    failure_at: float | None = None
    dead_since: dict[int, float] = {}
    while len(reports) < world_size:
        now = time.monotonic()
        if now >= deadline:
            break
        if failure_at is not None and now - failure_at >= _GRACE_S:
            break
        try:
            message = results.get(timeout=0.1)
        except queue_module.Empty:
            _note_silent_deaths(processes, reports, dead_since)
            if failure_at is None and any(status != "ok" for status, _ in reports.values()):
                failure_at = time.monotonic()
            continue
        if task is not None:
            message_task, *message = message
            if message_task != task:
                continue
        rank, status, payload = message
        reports[rank] = (status, payload)
        if status != "ok" and failure_at is None:
            failure_at = time.monotonic()


def _verdict(
    reports: dict[int, tuple[str, Any]], world_size: int, fn: Any, timeout_s: float
) -> list[Any]:
    """The ranks' values in rank order, or the RuntimeError ``run_distributed`` documents."""
    # The first failure to arrive is usually the cause; ranks that merely lost their
    # connection to a failed peer go last whatever their arrival.
    failed = [rank for rank, (status, _) in reports.items() if status != "ok"]
    failed.sort(key=lambda rank: _is_peer_loss(reports[rank][1]))  # stable: keeps arrival order
    if failed:
        rank = failed[0]
        others = "".join(
            f"\n(rank {other} also failed: {_last_line(reports[other][1])})" for other in failed[1:]
        )
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{reports[rank][1]}{others}")
    if len(reports) < world_size:
        missing = [rank for rank in range(world_size) if rank not in reports]
        raise RuntimeError(
            f"run_distributed({getattr(fn, '__name__', fn)!r}) timed out after {timeout_s:.0f} s: "
            f"ranks {missing} of {world_size} did not finish (children killed)"
        )
    return [pickle.loads(reports[rank][1]) for rank in range(world_size)]


# ---------------------------------------------------------------------------------- pool


def _adopt(environment: Mapping[str, str]) -> None:
    """Make ``environment`` (:func:`_child_env`) this rank's whole environment."""
    os.environ.clear()
    os.environ.update(environment)


def _pool_worker(
    rank: int, world_size: int, environment: dict[str, str], tasks: Any, results: Any
) -> None:
    """Body of one pooled rank: join the group once, then run tasks until told to stop."""
    _adopt(environment)
    torch.set_num_threads(1)
    dist.init_process_group(serial_gloo_backend(), rank=rank, world_size=world_size)
    while (task := tasks.get()) is not None:
        number, fn, args, kwargs = task
        try:
            message = (number, rank, "ok", pickle.dumps(fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - everything is reported to the parent
            message = (number, rank, "error", traceback.format_exc())
        # what one task compiled must not change how the next one compiles
        torch.compiler.reset()
        results.put(message)
    shutdown_distributed()  # joins gloo's threads while the interpreter is alive


class RankPool:
    """``world_size`` gloo ranks started once and reused for many ``run`` calls.

    Starting a rank (a fresh interpreter importing torch, joining the group) costs seconds;
    a test module that runs many short multi-rank checks shares one pool instead. ``run``
    has the contract of :func:`run_distributed`, with one difference: the ranks keep the
    default process group and whatever ``fn`` leaves in their process (torch.compile's
    caches are reset after each call). After any failure or time-out the ranks are stopped
    and the next ``run`` starts fresh ones, so one failing check cannot poison the next.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self._context = _rank_context()
        self._processes: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._count = 0

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; values in rank order."""
        if not callable(fn):
            raise TypeError(f"fn must be a module-level function, got {type(fn).__name__}")
        if not self._processes:
            self._start()
        self._count += 1
        for tasks in self._tasks:
            tasks.put((self._count, fn, args, kwargs))
        reports: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        _collect(self._processes, self._results, reports, self.world_size, deadline, self._count)
        if len(reports) < self.world_size or any(s != "ok" for s, _ in reports.values()):
            self.close()
        return _verdict(reports, self.world_size, fn, timeout_s)

    def _start(self) -> None:
        port = find_free_port()
        self._results = self._context.Queue()
        self._tasks = [self._context.Queue() for _ in range(self.world_size)]
        with _environ(
            {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ):
            for rank in range(self.world_size):
                proc = self._context.Process(
                    target=_pool_worker,
                    args=(
                        rank,
                        self.world_size,
                        _child_env(rank, self.world_size, port),
                        self._tasks[rank],
                        self._results,
                    ),
                    name=f"autoparallel-pool-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self._processes.append(proc)

    def close(self) -> None:
        """Stop the ranks (politely, then by force); a later ``run`` starts new ones."""
        for tasks in self._tasks:
            tasks.put(None)
        deadline = time.monotonic() + 5.0
        for proc in self._processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        _stop(self._processes)
        for channel in [*self._tasks, self._results]:
            if channel is not None:
                channel.close()
                channel.join_thread()
        self._processes, self._tasks, self._results = [], [], None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "RankLostError",
)


def _is_peer_loss(text: str) -> bool:
    """True for a traceback that only says another rank went away (a consequence)."""
    return any(marker in text for marker in _PEER_LOSS)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _note_silent_deaths(
    processes: Sequence[Any], reports: dict[int, tuple[str, Any]], dead_since: dict[int, float]
) -> None:
    """Record ranks whose process exited without reporting (segfault, os._exit, OOM kill).

    A rank that reported just before exiting may still be in the queue's pipe, so a dead
    rank counts as lost only after its report has failed to arrive for a second.
    """
    now = time.monotonic()
    for rank, proc in enumerate(processes):
        if rank in reports or proc.exitcode is None:
            continue
        first_seen = dead_since.setdefault(rank, now)
        if now - first_seen >= 1.0:
            reports[rank] = (
                "error",
                f"process exited with code {proc.exitcode} without reporting a result\n",
            )
