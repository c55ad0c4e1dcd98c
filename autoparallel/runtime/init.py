"""Initializing a parallel module with code written for the unsharded model.

Initialization code (torchtitan's ``init_weights``, Hugging Face's ``_init_weights``) is
written for full tensors: it assigns new ``nn.Parameter``s, copies full tensors in, draws
random values and recomputes buffers. On the parallel module every parameter and buffer is a
DTensor with the plan's placements. Inside :func:`full_value_init` (which the parallel
module's own ``init_weights`` and ``reset_parameters`` run under) each pattern gives the
values the unsharded model would have, each rank keeping its shard:

* **assigning** a plain tensor or ``nn.Parameter`` to an attribute that holds a planned
  parameter or buffer (``self.linear.weight = nn.Parameter(w)``, ``self.freqs_cis = ...``)
  copies the value into the existing DTensor, which stays the same object: an optimizer
  built before the init keeps seeing it, and a buffer registered under two names stays
  shared. Assigning a DTensor with the plan's spec (tying two parameters) keeps it as is.
  A value of another dtype is copied, cast, where torch casts it to the planned dtype as a
  same-kind-or-wider cast (``self.buf = torch.arange(n)`` into a float32 buffer: plain torch
  would make the buffer int64, but the plan computes in the dtype it was planned with); one
  torch would not cast so (a float into an integer buffer) raises.
* **mixing** plain tensors with DTensors in an op reads the plain tensor as the replicated
  full value (DTensor's implicit replication): ``param.data[:] = full``,
  ``param.copy_(full)``, a submodule's own ``load_state_dict`` of full tensors.
* **random** in-place ops on a sharded DTensor (``nn.init.normal_``, ``trunc_normal_``,
  ``uniform_``, ``kaiming_uniform_``) draw the full tensor from torch's global generator and
  keep this rank's shard, so the same seed gives the same values as one device. This costs
  one full-size temporary tensor at a time.
* ``param.data = x`` cannot change a DTensor's values (it replaces only the wrapper's
  metadata, and a DTensor ``x`` leaves even that alike); inside the context it raises
  :class:`InitError` at once, naming the tensor. Outside it, the parallel module's forward
  raises for a plain ``x`` (the wrapper then holds a storage of its own); ``x`` a DTensor
  there goes unseen.

The hooks that catch assignments are torch's global registration hooks; they are installed
for the duration of the context only and ignore modules outside the parallel module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode

from autoparallel import _torch_internals as internals

# methods of the user's class that the parallel class runs under full_value_init
INIT_METHODS = ("init_weights", "reset_parameters")


class InitError(RuntimeError):
    """An initialization pattern that cannot give the unsharded model's values."""


@contextlib.contextmanager
def full_value_init(module: nn.Module, runs_on: nn.Module | None = None) -> Iterator[None]:
    """Run initialization code written for the unsharded model on a parallel module.

    See the module docstring for what each pattern does. Reentrant: nested uses (an
    ``init_weights`` calling a submodule's ``reset_parameters``) share the outer context.

    ``runs_on``: the module tree the code runs on, when not ``module`` itself (a pipeline
    stage's init runs the whole model's code on the whole model holding the stage's planned
    tensors, runtime/stage_init.py): assignments anywhere in that tree are caught.
    """
    runtime = getattr(module, "_autoparallel", None)
    if runtime is None:
        raise TypeError(
            "full_value_init expects a parallel module (what AutoParallel.apply_placement() or "
            f"auto_parallel() returns), got {type(module).__name__}"
        )
    if runtime.initializing:
        yield
        return
    assignment = _AssignmentRule(runs_on if runs_on is not None else module)
    runtime.initializing = True
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(register_module_parameter_registration_hook(assignment).remove)
            stack.callback(register_module_buffer_registration_hook(assignment).remove)
            stack.enter_context(implicit_replication())
            stack.enter_context(_FullRandomDraws())
            stack.enter_context(_DataAssignments(module))
            yield
    finally:
        runtime.initializing = False
    check_no_data_assignment(module)


def run_under_full_value_init(method: Callable) -> Callable:
    """``method`` of the user's class, run under :func:`full_value_init` of its module."""

    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with full_value_init(self):
            return method(self, *args, **kwargs)

    return wrapped


def check_no_data_assignment(module: nn.Module) -> None:
    """Raise :class:`InitError` naming the first parameter or buffer given ``.data = x``."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in tensors:
        if isinstance(tensor, DTensor) and internals.has_wrapper_storage(tensor):
            raise data_assignment_error(name)


def data_assignment_error(name: str) -> InitError:
    """The error for ``.data = x`` on the planned tensor ``name`` (the forward checks too)."""
    return InitError(
        f"{name} was assigned with `.data = ...`, which cannot change a DTensor's values "
        "(its shards stay as they were). Copy the full value in instead: "
        f"`with torch.no_grad(): {name.rsplit('.', 1)[-1]}.copy_(value)` inside init_weights, "
        "or under autoparallel.full_value_init(model) elsewhere"
    )


class _AssignmentRule:
    """A registration hook: a full value assigned to a planned DTensor is copied into it."""

    def __init__(self, root: nn.Module):
        self.prefixes = {
            id(module): prefix for prefix, module in root.named_modules(remove_duplicate=False)
        }

    def __call__(self, module: nn.Module, name: str, value: Any) -> DTensor | None:
        if id(module) not in self.prefixes or value is None:
            return None
        current = module._parameters.get(name, module._buffers.get(name))
        if not isinstance(current, DTensor) or value is current:
            return None
        qualified = f"{self.prefixes[id(module)]}.{name}".lstrip(".")
        if isinstance(value, DTensor):
            _check_same_spec(qualified, current, value)
            return None  # a tie to another planned tensor: keep the object
        _check_assignable(qualified, current, value)
        copy_full_value(current, value)
        if isinstance(value, nn.Parameter):
            current.requires_grad_(value.requires_grad)
        return current


def _check_same_spec(name: str, current: DTensor, value: DTensor) -> None:
    same = (
        value.device_mesh == current.device_mesh
        and tuple(value.placements) == tuple(current.placements)
        and value.shape == current.shape
    )
    if not same:
        raise InitError(
            f"{name}: assigned a DTensor of shape {tuple(value.shape)} with placements "
            f"{value.placements}, but the plan holds it as {tuple(current.shape)} with "
            f"{current.placements}. To tie parameters, tie them in the model before planning"
        )


def _check_assignable(name: str, current: DTensor, value: torch.Tensor) -> None:
    if value.shape != current.shape:
        raise InitError(
            f"{name}: assigned a tensor of shape {tuple(value.shape)}, but the model was planned "
            f"with {tuple(current.shape)}; assign a tensor of the planned shape"
        )
    if value.dtype != current.dtype and not torch.can_cast(value.dtype, current.dtype):
        raise InitError(
            f"{name}: assigned a {value.dtype} tensor, but the model was planned with "
            f"{current.dtype}; convert it first (`.to({current.dtype})`)"
        )
    if internals.local_tensor_of(current).is_meta and not value.is_meta:
        raise InitError(
            f"{name} is still on the meta device: call parallel_model.to_empty(device=...) "
            "before initializing it"
        )


def copy_full_value(target: DTensor, full: torch.Tensor) -> None:
    """Copy the unsharded value ``full`` into ``target`` in place: each rank keeps its shard
    (no communication: every rank holds ``full``)."""
    local = internals.local_tensor_of(target)
    if local.is_meta:
        return
    shard = distribute_tensor(
        full.detach().to(device=local.device, dtype=local.dtype),
        target.device_mesh,
        target.placements,
        src_data_rank=None,
    )
    with torch.no_grad():
        local.copy_(internals.local_tensor_of(shard))


class _DataAssignments(TorchFunctionMode):
    """``planned.data = x`` on a parameter or buffer of the module raises :class:`InitError`
    naming it: the assignment would leave the DTensor's shards as they were, silently where
    ``x`` is a DTensor."""

    def __init__(self, module: nn.Module):
        super().__init__()
        planned = [*module.named_parameters(), *module.named_buffers()]
        self.names = {id(tensor): name for name, tensor in planned}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func == _SET_DATA and args and id(args[0]) in self.names:
            raise data_assignment_error(self.names[id(args[0])])
        return func(*args, **(kwargs or {}))


_SET_DATA = torch.Tensor.data.__set__


class _FullRandomDraws(internals.TorchDispatchMode):
    """Random in-place ops on sharded DTensors draw the full tensor, then keep the shard.

    Replicated DTensors need nothing: every rank draws the full tensor already, from the
    same generator state as one device would.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        target = args[0] if args else None
        if not (isinstance(target, DTensor) and internals.is_inplace_random(func)):
            return func(*args, **kwargs)
        if all(placement.is_replicate() for placement in target.placements):
            return func(*args, **kwargs)
        local = internals.local_tensor_of(target)
        full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
        func(full, *args[1:], **kwargs)
        copy_full_value(target, full)
        return target
