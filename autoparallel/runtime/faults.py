"""A rank lost in the middle of a step: bounded waits and one error that names it.

Contract. Every collective the parallel module runs waits at most its process group's
timeout: ``apply_placement(..., collective_timeout=...)`` sets it on each of the mesh's
groups with ``ProcessGroup.set_timeout`` (torch's default is 30 minutes on gloo and 10 on
nccl; a mesh dim that spans the whole world is the default group, whose timeout then changes
for every collective on it). When a peer rank dies, a surviving rank's collective fails
either at once (gloo: the peer's sockets closed, "Connection closed by peer ..." or
"Connection reset by peer") or after that timeout (a peer that hangs, or a host that vanished
without closing its connections: "Timed out waiting ...ms for recv operation"). The parallel
module's forward and backward turn those gloo errors into :class:`RankLostError`, whose
one-line message names the lost rank where it can be known and says what to do: every rank
stops, and all of them restart from the last checkpoint (a broken process group cannot be
repaired in place; nothing here retries). The gloo error stays attached as ``__cause__``.

Which rank: gloo names the peer's socket address. ``apply_placement`` records, on each rank,
the TCP ports of every socket its process holds (Linux ``/proc``) and shares them over the
mesh's groups, so a survivor maps the address back to a rank. The rank named is the one whose
connection this rank lost: the dead rank itself when they talked directly (always on a 1-D
mesh, or on a 2-rank one), else possibly a rank that stopped after losing it. A time-out
names no address; it names a rank only when the mesh has a single peer. Elsewhere the
message says a peer did not answer, and the launcher's log tells which rank exited first.

Collectives outside the parallel module (a loss all-reduce, gradient clipping, DCP's save),
and a backward compiled by ``torch.compile``, raise gloo's own errors: wrap the training
step in :func:`translate_rank_loss` to get :class:`RankLostError` from them too.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autoparallel import _torch_internals as internals

__all__ = [
    "PeerPorts",
    "RankLostError",
    "set_collective_timeout",
    "share_peer_addresses",
    "translate_rank_loss",
]

RESTART = "restart every rank from the last checkpoint"

# gloo's phrases for a peer that went away, and for one that stopped answering
_CLOSED = re.compile(
    r"(Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused)"
)
_ADDRESS = re.compile(r"\[([^\]]*)\]:(\d+)")
_TIMED_OUT = re.compile(r"Timed out waiting (\d+)\s*ms for (recv|send) operation")


class RankLostError(RuntimeError):
    """A peer rank died or stopped answering during a collective; this rank cannot go on.

    Attributes: ``rank`` (this process's global rank), ``lost_rank`` (the peer's global
    rank, or None where gloo's error does not tell it), ``timed_out`` (True when the peer
    did not answer within the group's timeout, False when its connection closed).
    """

    def __init__(self, message: str, rank: int, lost_rank: int | None, timed_out: bool):
        super().__init__(message)
        self.rank = rank
        self.lost_rank = lost_rank
        self.timed_out = timed_out

    def __reduce__(self) -> tuple:  # pickles whole (the base class would pass the message only)
        return (type(self), (str(self), self.rank, self.lost_rank, self.timed_out))


def set_collective_timeout(mesh: DeviceMesh, timeout: float | timedelta) -> timedelta:
    """Bound every later collective on the mesh's process groups by ``timeout`` (seconds or
    a timedelta), with torch's public ``ProcessGroup.set_timeout``; returns it as a timedelta."""
    value = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if value <= timedelta(0):
        raise ValueError(f"collective_timeout must be positive, got {timeout!r}")
    for dim in range(mesh.ndim):
        mesh.get_group(dim).set_timeout(value)
    return value


@dataclass(frozen=True)
class PeerPorts:
    """Which TCP ports each rank's process held when the parallel module was built (this
    rank's view): how a gloo error naming a peer's socket address names its rank. Held by
    the parallel module; empty where nothing could be read (another backend, not Linux)."""

    ports: Mapping[int, frozenset[int]] = field(default_factory=dict)

    def rank_at_port(self, port: int, me: int) -> int | None:
        """The one peer rank holding ``port``, or None. gloo prints a peer's port in network
        byte order in some messages, so the byte-swapped value is looked up too."""
        swapped = ((port & 0xFF) << 8) | (port >> 8)
        owners = {
            rank
            for rank, ports in self.ports.items()
            if rank != me and (port in ports or swapped in ports)
        }
        return owners.pop() if len(owners) == 1 else None

    def only_peer(self, me: int) -> int | None:
        """The single other rank, when there is exactly one (from the table, else from the
        default group's size)."""
        peers = [rank for rank in self.ports if rank != me]
        if not peers and dist.is_initialized() and dist.get_world_size() == 2 and me in (0, 1):
            return 1 - me
        return peers[0] if len(peers) == 1 else None


def share_peer_addresses(mesh: DeviceMesh) -> PeerPorts:
    """Which TCP ports each peer rank of ``mesh`` holds, so that a gloo error naming a peer's
    address can name its rank. Collective over each of the mesh's groups: every rank of the
    mesh calls it (``apply_placement`` does). Only real gloo groups: any other backend (nccl,
    the fake group of planning) names no address this can read, and gets an empty table."""
    if not dist.is_initialized() or any(
        internals.gloo_worker_threads(mesh.get_group(dim), mesh.device_type) is None
        for dim in range(mesh.ndim)
    ):
        return PeerPorts()
    mine = _own_tcp_ports()
    table: dict[int, frozenset[int]] = {}
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        gathered: list[frozenset[int] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        for rank, ports in zip(dist.get_process_group_ranks(group), gathered):
            if ports is not None:
                table[rank] = ports
    return PeerPorts(table)


def _own_tcp_ports() -> frozenset[int]:
    """The local ports of every TCP socket this process holds (listening and connected),
    from Linux's ``/proc``; empty elsewhere."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
        ports = set()
        for table in ("tcp", "tcp6"):
            with open(f"/proc/self/net/{table}") as lines:
                next(lines)  # the header
                for line in lines:
                    fields = line.split()
                    if len(fields) > 9 and fields[9] in inodes:
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return frozenset(ports)
    except OSError:
        return frozenset()


def as_rank_lost(error: BaseException, peers: PeerPorts | None = None) -> RankLostError | None:
    """The :class:`RankLostError` a gloo error means, or None for any other error; ``peers``
    (the parallel module's table) lets it name the lost rank from gloo's address."""
    peers = peers if peers is not None else PeerPorts()
    if isinstance(error, RankLostError) or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    closed, timed_out = _CLOSED.search(text), _TIMED_OUT.search(text)
    if closed is None and timed_out is None:
        return None
    me = dist.get_rank() if dist.is_initialized() else -1
    if closed is not None:
        address = _ADDRESS.search(text)
        lost = peers.rank_at_port(int(address.group(2)), me) if address else None
        if lost is None and (address is None or not any(peers.ports.values())):
            lost = peers.only_peer(me)  # no address, or none could be read: the only peer, if one
        phrase = closed.group(1).lower()
        head = (
            f"rank {lost} was lost: its connection to rank {me} broke (gloo: {phrase})"
            if lost is not None
            else f"a peer rank was lost: its connection to rank {me} broke (gloo: {phrase}"
            + (f" [{address.group(1)}]:{address.group(2)}" if address else "")
            + "; the launcher's log names the rank that exited first)"
        )
        return RankLostError(f"{head}; {RESTART}", me, lost, timed_out=False)
    assert timed_out is not None
    lost = peers.only_peer(me)
    waited = f"within {int(timed_out.group(1)) / 1000:g} s, the collective timeout"
    head = (
        f"rank {lost} did not answer rank {me} {waited} (dead or hung)"
        if lost is not None
        else f"a peer rank did not answer rank {me} {waited} (dead or hung: the rank that "
        "does not report this error is the one)"
    )
    return RankLostError(f"{head}; {RESTART}", me, lost, timed_out=True)


@contextlib.contextmanager
def translate_rank_loss(parallel: nn.Module | PeerPorts | None = None) -> Iterator[None]:
    """Inside the block, a gloo error saying a peer rank went away or timed out is raised as
    :class:`RankLostError` (the original as its ``__cause__``); other errors pass unchanged.

    The parallel module does this for its own forward and backward; wrap the rest of a
    training step (the loss's all-reduce, gradient clipping, a compiled backward,
    checkpointing) to get the same error from any collective in it. Pass the parallel module
    (``translate_rank_loss(parallel)``) so the error can name the lost rank from gloo's
    address; without it, a rank is named only on a 2-rank world.
    """
    peers = parallel if isinstance(parallel, PeerPorts) else peer_ports_of(parallel)
    try:
        yield
    except RuntimeError as error:
        lost = as_rank_lost(error, peers)
        if lost is None:
            raise
        raise lost from error


def peer_ports_of(parallel: nn.Module | None) -> PeerPorts:
    """The peer table a parallel module holds (empty for None or any other module)."""
    runtime = getattr(parallel, "_autoparallel", None)
    return getattr(runtime, "peers", None) or PeerPorts()
