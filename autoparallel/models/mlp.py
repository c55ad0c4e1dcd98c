"""A two-layer MLP: the smallest model worth sharding.

It is the canonical Megatron-style example (column-parallel ``w1``,
row-parallel ``w2``), so tests and examples use it to check that the planner
finds the obvious plan.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["MLP", "copy_full_", "seeded_generator"]


def seeded_generator(seed: int | None) -> torch.Generator | None:
    """Return a CPU generator seeded with ``seed``, or ``None`` for the global RNG.

    Initialization always draws on CPU and then copies to the parameter's
    device, so a given seed yields the same values on every device and after
    ``to_empty`` from the meta device.
    """
    if seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def copy_full_(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the unsharded value ``full`` into ``dst`` in place.

    ``dst`` may be a plain tensor on any device (meta included, where the copy
    is a no-op) or a DTensor, in which case each rank keeps only its own
    shard of ``full``. This is what makes ``init_weights`` give the same
    global values whatever the sharding.
    """
    with torch.no_grad():
        if _is_dtensor(dst):
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(
                full.to(device=dst.device, dtype=dst.dtype),
                dst.device_mesh,
                dst.placements,
                src_data_rank=None,
            )
        dst.copy_(full)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is a DTensor (without importing distributed eagerly)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _fill_uniform_(tensor: torch.Tensor, bound: float, generator: torch.Generator | None) -> None:
    """Fill ``tensor`` in place with U(-bound, bound) drawn on CPU."""
    values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
    values.uniform_(-bound, bound, generator=generator)
    copy_full_(tensor, values)


class MLP(nn.Module):
    """``Linear(dim, hidden) -> GELU -> Linear(hidden, dim)``.

    Parameters are ``w1.weight``, ``w1.bias``, ``w2.weight`` and ``w2.bias``
    (the biases only when ``bias`` is true). The input's last dimension must be
    ``dim``; any leading dimensions are kept. ``hidden_placements`` pins the hidden
    activation's layout with ``with_sharding_constraint`` (one placement per mesh dim).
    """

    def __init__(
        self, dim: int, hidden: int, bias: bool = True, hidden_placements: tuple | None = None
    ) -> None:
        super().__init__()
        self.dim = dim
        self.hidden = hidden
        self.hidden_placements = hidden_placements
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[..., dim]`` to ``[..., dim]``."""
        hidden = nn.functional.gelu(self.w1(x))
        if self.hidden_placements is not None:
            from autoparallel.trace.sharding_constraint import with_sharding_constraint

            hidden = with_sharding_constraint(hidden, self.hidden_placements)
        return self.w2(hidden)

    def init_weights(self, seed: int | None = None) -> None:
        """Initialize every parameter in place, deterministically given ``seed``.

        Uses the ``nn.Linear`` default bound ``1/sqrt(fan_in)`` for weights and
        biases. Works on any device, including right after ``to_empty``.
        """
        generator = seeded_generator(seed)
        for linear in (self.w1, self.w2):
            bound = 1.0 / math.sqrt(linear.in_features)
            _fill_uniform_(linear.weight, bound, generator)
            if linear.bias is not None:
                _fill_uniform_(linear.bias, bound, generator)
