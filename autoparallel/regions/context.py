"""Which mesh and which regions a ``local_map`` call or a region op sees right now.

Two scopes, each set for the duration of one piece of work and reset after it (context
variables, never module state that outlives the work):

* a :class:`RegionScope` while a model is traced for planning (``recording``: each
  ``local_map`` call defines a region and emits the region op) or while a parallel module
  runs its phases (the region ops find their body by key here);
* a :class:`BodyContext` while a region's body runs: the collectives of
  :mod:`autoparallel.regions.collectives` read their mesh from it.

Outside both (the plain model on one device) ``local_map`` calls its function directly and
every collective is the identity of a one-rank group.

One more way to a region, for compiled code: under ``torch.compile`` the region ops run from
the code Inductor generated (the forward) and from the autograd engine (the backward), outside
any scope a phase can set. So a parallel module's running scope is also registered by its
regions' keys (:func:`register_running_scope`), weakly: an entry lives exactly as long as
the parallel module that owns the scope, and keys carry their trace's id, so two models in
one process never meet.
"""

from __future__ import annotations

import contextlib
import uuid
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from autoparallel.types.regions import LocalMapRegion


@dataclass
class RegionScope:
    """The regions of one traced model and the mesh they run on.

    ``signatures`` maps what defines a region (body, constants, placements, local shapes)
    to its key, so that identical layers share one region."""

    mesh: DeviceMesh | None
    regions: dict[str, LocalMapRegion] = field(default_factory=dict)
    recording: bool = False
    signatures: dict[Any, str] = field(default_factory=dict)
    trace_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass(frozen=True)
class BodyContext:
    """The mesh a region's body runs on. ``balanced``: the body runs on fake tensors (planning),
    so a data-dependent exchange (an all-to-all with split sizes from the data) is assumed to
    send and receive equal row counts: output shapes must not depend on values there."""

    mesh: DeviceMesh | None
    balanced: bool


_SCOPE: ContextVar[RegionScope | None] = ContextVar("autoparallel_region_scope", default=None)
_BODY: ContextVar[BodyContext | None] = ContextVar("autoparallel_region_body", default=None)
_RUNNING: weakref.WeakValueDictionary[str, RegionScope] = weakref.WeakValueDictionary()
"""Key -> the running scope of the parallel module that owns it (see the module doc)."""


@contextlib.contextmanager
def region_scope(scope: RegionScope) -> Iterator[RegionScope]:
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def active_scope() -> RegionScope | None:
    return _SCOPE.get()


def register_running_scope(scope: RegionScope) -> None:
    """Let region ops that run outside any scope (compiled code) find ``scope``'s regions by
    key, for as long as something else holds ``scope``."""
    for key in scope.regions:
        _RUNNING[key] = scope


def scope_of(key: str) -> RegionScope | None:
    """The scope that knows region ``key``: the active one, else a running parallel
    module's (:func:`register_running_scope`); None where neither knows it."""
    scope = _SCOPE.get()
    if scope is not None and key in scope.regions:
        return scope
    return _RUNNING.get(key)


@contextlib.contextmanager
def body_context(mesh: DeviceMesh | None, balanced: bool) -> Iterator[BodyContext]:
    context = BodyContext(mesh, balanced)
    token = _BODY.set(context)
    try:
        yield context
    finally:
        _BODY.reset(token)


def active_body() -> BodyContext | None:
    return _BODY.get()


def current_mesh() -> DeviceMesh | None:
    """The mesh the model is being planned for or run on, or None (the plain model).

    A model whose regions depend on the mesh (how many experts each rank holds, which mesh
    dims its tokens are sharded over) reads it here in its forward."""
    body = _BODY.get()
    if body is not None:
        return body.mesh
    scope = _SCOPE.get()
    return scope.mesh if scope is not None else None
