"""Gloo process groups that run their collectives on one worker thread, and the check for them.

The cause. torch's ``ProcessGroupGloo`` runs a group's collectives on a pool of worker
threads, two per device unless told otherwise. A worker that finishes a collective wakes the
rank waiting for it and then, no longer holding the group's lock, records the group's status
for torch's flight recorder: ``ProcessGroupGloo::runLoop`` assigns the name of the finished
work to one ``std::string`` the group owns (``pgStatus_->lastCompletedWorkName``). Two workers
that finish collectives of the same group at the same moment assign that string at once. The
names of the all-gather and reduce-scatter works (``ALLGATHER_COALESCED``,
``_REDUCE_SCATTER_BASE``) are too long to be kept inside the string, so each assignment frees
the heap buffer of the name before it, and both threads free the same buffer. glibc notices
later, wherever its free list is next used: ``malloc(): unaligned tcache chunk detected``, or
a segmentation fault inside a gloo worker's ``malloc`` (both seen in issue 44's cores, whose
per-thread free list was cut short exactly as a second free leaves it). AddressSanitizer names
the race directly: "attempting double-free" of a 20-byte string in ``runLoop`` on one worker,
"freed by thread T9 here: ``runLoop``", allocated by the first worker.

Two collectives of one group finish together only when both were in flight, which the
runtime arranges on purpose (it starts gathers early to hide them behind compute, see
runtime/local_graph.py) and torch's FSDP2 does too (it prefetches the next all-gather). A rank
that waits for each collective before starting the next is exposed as well, more rarely: on a
loaded host a worker can be descheduled between waking the rank and recording the status,
while the other worker runs the next collective to its end.

The fix. A gloo group with a single worker thread runs its collectives one after another, so
nothing races, and a collective still runs beside the rank's compute. torch's
``init_process_group`` and ``new_group`` take no worker count for gloo (they ignore options
for it), so :func:`serial_gloo_backend` registers, through torch's public
``Backend.register_backend``, a backend that creates gloo groups with one worker:
``dist.init_process_group(autoparallel.serial_gloo_backend())``, and every group made after
it (a ``DeviceMesh``'s included) is such a group. The launch helpers (runtime/launch.py), the
calibrate command and the examples start their groups that way.

Contract. :func:`check_process_groups` raises :class:`UnsafeProcessGroupError` for a mesh
whose groups on its device are gloo groups with more than one worker thread;
``apply_placement`` calls it before it builds anything, since the module it returns keeps
several collectives in flight. Planning needs no real group and is not checked.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autoparallel import _torch_internals as internals

__all__ = [
    "SERIAL_GLOO",
    "UnsafeProcessGroupError",
    "check_process_groups",
    "serial_gloo_backend",
]

SERIAL_GLOO = "serial_gloo"
"""The name :func:`serial_gloo_backend` registers: gloo, one worker thread per group."""


class UnsafeProcessGroupError(RuntimeError):
    """A mesh's collectives would run on gloo groups that can corrupt the heap (see the
    module doc); the message names the mesh dims and how to start safe groups."""


def serial_gloo_backend() -> str:
    """Register the ``serial_gloo`` backend with torch (once per process; later calls only
    return the name) and return its name.

    Pass it where ``"gloo"`` went: ``dist.init_process_group(serial_gloo_backend())``, or in
    a device map, ``f"cpu:{serial_gloo_backend()},cuda:nccl"``. It serves CPU tensors only,
    and it does not become the default for CPU: a group asks for it by name."""
    if SERIAL_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(SERIAL_GLOO, internals.one_worker_gloo, devices=["cpu"])
    return SERIAL_GLOO


def check_process_groups(mesh: DeviceMesh) -> None:
    """Raise :class:`UnsafeProcessGroupError` where a dim of ``mesh`` runs its collectives on
    a gloo group with more than one worker thread; any other backend passes."""
    unsafe = []
    for dim in range(mesh.ndim):
        workers = internals.gloo_worker_threads(mesh.get_group(dim), mesh.device_type)
        if workers is not None and workers > 1:
            names = mesh.mesh_dim_names
            unsafe.append(f"{names[dim]!r}" if names else f"{dim}")
    if not unsafe:
        return
    raise UnsafeProcessGroupError(
        f"mesh dim(s) {', '.join(unsafe)} run their collectives on gloo groups with several "
        "worker threads, and torch's ProcessGroupGloo corrupts the heap when two collectives "
        "of one such group finish at the same moment (a race in ProcessGroupGloo::runLoop; "
        "the parallel module keeps several collectives in flight). Start the process groups "
        "with one worker thread each, before the mesh is built: "
        "dist.init_process_group(autoparallel.serial_gloo_backend()) in place of "
        "dist.init_process_group('gloo') (with CUDA too: "
        "f'cpu:{autoparallel.serial_gloo_backend()},cuda:nccl'). See docs/usage.md."
    )
