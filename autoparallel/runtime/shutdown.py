"""Leave the process groups so that no collective thread outlives the interpreter.

Why this exists. torch's gloo backend runs every collective on worker threads owned by the
process group. A worker finishes a collective, wakes the rank waiting for it, and only then
drops its own hold on the collective's work and tensors. Where the rank has already let go
of such a tensor in Python, that last drop deallocates the tensor's Python object on the
worker thread, which has to take the interpreter's lock to do it. If the interpreter has
begun to exit by then, the thread is ended in the middle of the deallocation, while it
unwinds C++ frames that may not throw: the process aborts after training finished
("terminate called without an active exception", then a segmentation fault as faulthandler
walks the half-freed state). On a loaded host the worker can lag the rank by many
milliseconds, enough for a short script to reach its exit.

``torch.distributed.destroy_process_group()`` does not stop those threads: a gloo group's
threads are joined only when the group object is freed, and every ``DeviceMesh`` holds its
groups' objects, while torch's own caches keep every mesh that ever redistributed a DTensor
alive until the interpreter exits (see ``_torch_internals.release_mesh_groups``). The
threads therefore live on, idle or not, into the exit.

Contract. :func:`shutdown_distributed` is a rank's last distributed call (in place of
``destroy_process_group()``): it destroys every process group, drops the dead groups that
live meshes still hold, and collects the garbage, so each gloo group is freed and its
threads joined while the interpreter is fully alive (torch releases the interpreter's lock
while a group is freed, so a worker still finishing can take it). It returns the collective
threads still running, [] on a clean shutdown, and warns where there are any.
"""

from __future__ import annotations

import gc
import logging
import os

import torch.distributed as dist

from autoparallel import _torch_internals as internals

logger = logging.getLogger(__name__)

__all__ = ["shutdown_distributed", "collective_threads"]

_COLLECTIVE_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
"""Linux thread names of gloo's worker and transport threads (torch names them)."""


def collective_threads() -> list[str]:
    """Names of this process's gloo collective threads still running (Linux; elsewhere [])."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the thread ended while we listed
            continue
        if name in _COLLECTIVE_THREADS:
            names.append(name)
    return sorted(names)


def shutdown_distributed() -> list[str]:
    """Destroy every process group of this rank and join their threads (see the module
    doc); returns the collective threads still running, [] on a clean shutdown. Safe to
    call where no process group was started, or twice."""
    if dist.is_initialized():
        dist.destroy_process_group()
    internals.release_mesh_groups()
    gc.collect()  # groups that only reference cycles still held
    alive = collective_threads()
    if alive:
        logger.warning(
            "%d gloo collective thread(s) still running after every process group was "
            "destroyed: something other than a DeviceMesh holds a group object. Drop it "
            "before shutdown_distributed(), or the thread can abort the interpreter's exit.",
            len(alive),
        )
    return alive
