"""The runtime's private hooks: torch.compile entry points, the dispatch mode that sees
in-place random fills, re-entering autograd inside a custom op's kernel, grouped matmul and
an op's dispatcher entry."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor._api import DTensor
from torch.utils._python_dispatch import TorchDispatchMode  # a mode sees every aten op first

__all__ = ["TorchDispatchMode"]

# ---------------------------------------------------------------------------- torch.compile


def nonstrict_trace(fn: Callable) -> Callable:
    """Dynamo records a call to ``fn`` without tracing its Python; AOTAutograd traces it.

    The parallel module's forward interprets a planned graph with Python-side state (the
    executor, DTensor redistributions); Dynamo cannot follow that, AOTAutograd's make_fx
    can. torch 2.13 offers this only as ``torch._dynamo.nonstrict_trace``.
    """
    return torch._dynamo.nonstrict_trace(fn)


def lookup_compile_backend(name: str) -> Callable:
    """A registered torch.compile backend by name ("inductor", "aot_eager", ...)."""
    from torch._dynamo import lookup_backend

    return lookup_backend(name)


# ---------------------------------------------------------------------------- initialization
# Drawing the random values of a sharded parameter as the unsharded model would needs to see
# each in-place random op on a DTensor before DTensor runs it locally (runtime/init.py); a
# dispatch mode is torch's way to do that, and its base class lives in a private module.


def is_inplace_random(func: torch._ops.OpOverload) -> bool:
    """True for aten ops that fill their first argument with random values (``normal_``)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    # in place: the first argument is written (``Tensor(a!) self``); read off the schema, as
    # torch 2.11 has no ``Tag.inplace``
    arguments = func._schema.arguments
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and alias.is_write


def has_wrapper_storage(tensor: DTensor) -> bool:
    """True when ``tensor.data = x`` gave a DTensor's wrapper a storage of its own.

    A DTensor is a wrapper whose values live in its local tensor; its own storage is empty.
    Assigning ``.data`` with a plain tensor replaces only the wrapper's storage and
    metadata, so the values the runtime reads do not change: this is how it shows.
    """
    return tensor.data_ptr() != 0


# ---------------------------------------------------------------------------- local_map regions
# A local_map region is one custom op in the joint graph; its backward op re-runs the body
# under autograd to get the body's vector-Jacobian product. A custom op's kernel runs below
# the autograd dispatch keys (the dispatcher excludes them for the kernel's duration), and
# torch offers no public way to re-enter autograd there: the guard below restores them.
# The collectives a region body issues are torch's functional collectives, which live in a
# private module; grouped matmul (one matmul per expert over contiguous row groups) is only
# offered as ``torch._grouped_mm``.

_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in dir(torch._C.DispatchKey)
    if name.startswith("Autograd") or name == "ADInplaceOrView"
)


@contextlib.contextmanager
def autograd_inside_kernel() -> Any:
    """Autograd records again inside a custom op's kernel (grad mode on)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded):
        with torch.enable_grad():
            yield


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows[start_e:end_e] @ weights[e]`` for each group e, concatenated; ``offsets`` are
    the groups' cumulative ends (int32).

    On fake tensors of a dtype other than bfloat16 (torch's shape function accepts only
    that, its CPU kernel any float) one matmul of the same size stands in: same output
    shape, same FLOPs, and fake tensors carry no values to get wrong."""
    if isinstance(rows, FakeTensor) and rows.dtype != torch.bfloat16:
        return rows @ weights[0]
    return torch._grouped_mm(rows, weights, offs=offsets)


def op_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """The dispatcher entry ``op(...)`` calls. ``OpOverload.__call__`` is one Python frame
    around it; a local graph that runs every step on a CPU host pays that frame per op
    (runtime/bound_graph.py). Private: ``_op`` is the only handle on it."""
    return op._op
