"""Walking an FX node's arguments without torch's general pytree machinery.

ATen nodes' arguments are nests of tuples, lists and dicts around nodes and plain values.
``torch.utils._pytree`` handles every registered container and costs tens of microseconds a
call; the strategy and cost stages walk the arguments of every node several times, so on a
large graph pytree would be much of their time. These two functions cover exactly the
containers FX puts in ``node.args``/``node.kwargs`` (its immutable lists and dicts are
subclasses of list and dict) and visit leaves in pytree's order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx


def flat_args(value: Any) -> list[Any]:
    """The leaves of ``value`` (nested tuples, lists and dict values), left to right."""
    leaves: list[Any] = []
    _collect(value, leaves)
    return leaves


def _collect(value: Any, leaves: list[Any]) -> None:
    if isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, leaves)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, leaves)
    else:
        leaves.append(value)


def tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes among ``node``'s arguments, in flatten order and with repeats: one per input
    slot, as the strategies and the plan number them."""
    return [leaf for leaf in flat_args((node.args, node.kwargs)) if isinstance(leaf, fx.Node)]


def map_args(function: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with every leaf replaced by ``function(leaf)``; containers come back as
    plain tuples, lists and dicts."""
    if isinstance(value, tuple):
        return tuple(map_args(function, item) for item in value)
    if isinstance(value, list):
        return [map_args(function, item) for item in value]
    if isinstance(value, dict):
        return {key: map_args(function, item) for key, item in value.items()}
    return function(value)
