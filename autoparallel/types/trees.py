"""The shape of a nested value, as the types between stages name it."""

from __future__ import annotations

from typing import Protocol


class TreeStructure(Protocol):
    """How a nested value (tuple, dict, ModelOutput, ...) is rebuilt from its flat leaves:
    torch's pytree ``TreeSpec``, named here by what types use of it (types import nothing of
    the package, and the pytree module is private to torch)."""

    @property
    def num_leaves(self) -> int: ...
