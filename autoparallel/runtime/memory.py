"""Measure a training step's memory per device, component by component, against the plan.

``plan.memory`` is a promise (problem/memory.py); :func:`measure_memory` checks it on the
user's own model: it runs one training step of the parallel module and counts, on this
rank, the bytes of the tensors themselves::

    measured = autoparallel.measure_memory(parallel, optimizer, batch, loss_fn, plan)
    print(measured)  # parameters 4.01 MiB (predicted 4.01 MiB), ...

* ``parameters``: the distinct storages of the parameters' local tensors;
* ``gradients``: the storages of the local ``param.grad`` after the backward;
* ``optimizer_state``: the storages of the optimizer's state tensors after its step (not its
  scalar ``step`` counters);
* ``activations``: every distinct storage the forward saves for the backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` around the module's forward, the
  parameters' own storages left out (the loss outside the module is not counted).

No allocator statistics are read: the peak itself is not measured here (on CUDA,
``torch.cuda.max_memory_allocated`` is the figure to put beside ``plan.memory.peak``).

:func:`measure_activation_peak` runs any step (a pipeline schedule's, where several
microbatches' activations are held at once) and returns the most bytes of saved tensors
alive at one time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoparallel.types.plan import Plan

__all__ = ["MeasuredMemory", "measure_activation_peak", "measure_memory"]

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations")


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes this rank holds of each component, beside the plan's prediction (None without
    a plan)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    predicted: dict[str, float] | None = None

    def __str__(self) -> str:
        parts = []
        for name in COMPONENTS:
            text = f"{name.replace('_', ' ')} {_mib(getattr(self, name))}"
            if self.predicted is not None:
                text += f" (predicted {_mib(self.predicted[name])})"
            parts.append(text)
        return ", ".join(parts)


def measure_memory(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    plan: Plan | None = None,
) -> MeasuredMemory:
    """One training step of ``module`` (forward on ``inputs``, ``loss_fn(output).backward()``,
    ``optimizer.step()``) and the bytes of each component on this rank (see the module doc).

    ``inputs`` is a tensor, or a tuple of positional inputs. The step is a real one: the
    parameters change. Every rank must call it (the step has collectives)."""
    params = list(module.parameters())
    param_storages = {_storage(p).data_ptr() for p in params}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    args = inputs if isinstance(inputs, tuple) else (inputs,)
    optimizer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = module(*args)
    activations = _storage_bytes(saved, skip=param_storages)
    saved.clear()
    loss_fn(output).backward()
    gradients = _storage_bytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    states = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    predicted = None
    if plan is not None and plan.memory is not None:
        predicted = {name: float(getattr(plan.memory, name)) for name in COMPONENTS}
    return MeasuredMemory(
        parameters=_storage_bytes(params),
        gradients=gradients,
        optimizer_state=_storage_bytes(states),
        activations=activations,
        predicted=predicted,
    )


def measure_activation_peak(step: Callable[[], Any], module: nn.Module) -> int:
    """Run ``step()`` and return the most bytes of distinct storages saved for the backward
    (``saved_tensors_hooks``) alive at once on this rank, ``module``'s parameters left out.

    A saved tensor counts from its forward until autograd releases it (after its backward):
    under a pipeline schedule that is every microbatch whose forward ran and whose backward
    has not. Sampled at each save, so a peak between saves is not seen."""
    params = {_storage(p).data_ptr() for p in module.parameters()}
    live: dict[int, tuple[weakref.ref, int]] = {}
    peak = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal peak
        storage = _storage(tensor)
        if storage.data_ptr() not in params:
            live[storage.data_ptr()] = (weakref.ref(tensor), storage.nbytes())
        for key in [key for key, (ref, _) in live.items() if ref() is None]:
            del live[key]
        peak = max(peak, sum(nbytes for _, nbytes in live.values()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return peak


def _storage(tensor: torch.Tensor) -> Any:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage()


def _storage_bytes(tensors: Iterable[torch.Tensor], skip: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages of ``tensors``, leaving out the storages in ``skip``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _storage(tensor)
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"
