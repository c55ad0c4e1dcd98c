"""Helpers for the project's tests and benchmarks: not part of the public API, and nothing in
the library imports them.

``reference_training`` runs a training loop on one process without any sharding, so a
parallel run (started with :func:`autoparallel.runtime.launch.run_distributed`) can be
checked against it. ``gather_full`` turns a DTensor back into the full tensor (a collective:
call it on every rank, in the same order).

Typical test::

    def train(rank, world_size):                 # module level, so it pickles
        mesh = init_device_mesh("cpu", (world_size,))
        ...
        return {"losses": losses, "params": full_params(model)}

    results = run_distributed(train, 2)
    reference = reference_training(make_model, batches, steps=2, lr=1e-2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["default_loss", "full_grads", "full_params", "gather_full", "reference_training"]


# ---------------------------------------------------------------------------------- reference


def default_loss(output: Any, inputs: Any = None) -> torch.Tensor:
    """``output.float().pow(2).mean()``: a loss that needs no targets."""
    return output.float().pow(2).mean()


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def reference_training(
    model_factory: Callable[[], nn.Module],
    batches: Sequence[Any],
    steps: int,
    lr: float,
    loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss,
) -> dict[str, Any]:
    """Train the unsharded model on one process: the ground truth for a parallel run.

    ``model_factory()`` must return a ready model (parameters materialized and initialized,
    e.g. ``MLP(...)`` followed by ``init_weights(seed=0)``). Step ``i`` uses
    ``batches[i % len(batches)]`` (a tensor, a tuple of positional inputs, or a dict of
    keyword inputs) and ``loss = loss_fn(model(batch), batch)``; then ``backward`` and one
    ``torch.optim.AdamW(lr=lr)`` step (other AdamW settings at their defaults).

    Returns ``{"losses": [float per step], "params": {name: tensor after the last step},
    "grads": {name: gradient of step 0}}`` (detached CPU clones; a parameter without a
    gradient maps to None).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not batches:
        raise ValueError("batches must hold at least one batch")
    model = model_factory()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    first_grads: dict[str, torch.Tensor | None] = {}
    for step in range(steps):
        batch = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(_call(model, batch), batch)
        loss.backward()
        if step == 0:
            first_grads = {
                name: None if p.grad is None else p.grad.detach().cpu().clone()
                for name, p in model.named_parameters()
            }
        optimizer.step()
        losses.append(loss.item())
    params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "grads": first_grads}


# ---------------------------------------------------------------------------------- gathering


def gather_full(tensor: Any) -> Any:
    """The full (unsharded) value of a DTensor, as a plain tensor; anything else unchanged.

    For a DTensor this is ``tensor.full_tensor()``, a collective over its mesh: every rank
    must call it, for the same tensors in the same order.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full detached CPU value}`` of every parameter (collective for DTensors)."""
    with torch.no_grad():
        return {
            name: gather_full(p.detach()).cpu().clone() for name, p in module.named_parameters()
        }


def full_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: full CPU gradient or None}`` of every parameter (collective for DTensors)."""
    with torch.no_grad():
        return {
            name: None if p.grad is None else gather_full(p.grad).cpu().clone()
            for name, p in module.named_parameters()
        }
