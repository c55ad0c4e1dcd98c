"""The stand-in FX graph a loaded problem is rebuilt on (files/problem.py): nodes of the
saved names, ops, inputs and shapes on the meta device, enough for every reader of a
Problem and never run."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autoparallel.types.graph import JointGraph


def stand_in_node(graph: fx.Graph, record: dict, inputs: list[fx.Node]) -> fx.Node:
    """A node with the saved name, op name, inputs and a meta-device value: enough for every
    reader of a Problem (it cannot run)."""
    if record["op"] == "placeholder":
        node = graph.placeholder(record["name"])
    else:
        node = graph.create_node(
            "call_function", _target(record["target"]), tuple(inputs), name=record["name"]
        )
    node.meta["val"] = _meta_value(record["value"])
    return node


def _target(text: str) -> Any:
    """The op a saved target string names (``aten.mm.default``), or a named stand-in."""
    if text == str(operator.getitem):
        return operator.getitem
    parts = text.split(".")
    if len(parts) == 3:
        namespace, name, overload = parts
        try:
            return getattr(getattr(getattr(torch.ops, namespace), name), overload)
        except (AttributeError, RuntimeError):
            pass
    return _NamedTarget(text)


class _NamedTarget:
    """A callable placeholder for an op this process does not know; it only keeps a name."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} comes from a saved problem and cannot run")

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


def stand_in_joint(
    roles: dict, by_name: dict[str, fx.Node], graph: fx.Graph, forward: set[fx.Node]
) -> JointGraph:
    """The JointGraph of a loaded problem: its roles (``roles``, by node name) on the
    stand-in ``graph``; it cannot run."""

    def node(name: str | None) -> fx.Node | None:
        return by_name.get(name) if name is not None else None

    holder = _GraphHolder(graph)
    return JointGraph(
        graph_module=holder,  # type: ignore[arg-type]  # a loaded graph cannot run
        fake_mode=None,
        params={k: by_name[v] for k, v in roles["params"].items()},
        buffers={k: by_name[v] for k, v in roles["buffers"].items()},
        user_inputs=[by_name[n] for n in roles["user_inputs"]],
        tangents={int(k): by_name[v] for k, v in roles["tangents"].items()},
        user_outputs=[node(n) for n in roles["user_outputs"]],
        param_grads={k: by_name[v] for k, v in roles["param_grads"].items()},
        input_grads={int(k): by_name[v] for k, v in roles["input_grads"].items()},
        forward_nodes=forward,
        in_spec=None,  # type: ignore[arg-type]
        out_spec=None,  # type: ignore[arg-type]
        device=torch.device("meta"),
        tied_params=[list(group) for group in roles["tied_params"]],
    )


class _GraphHolder:
    """Stands in for the GraphModule of a loaded problem: it only carries the graph."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph


def _meta_value(record: Any) -> Any:
    if record is None:
        return None
    if isinstance(record, list):
        return tuple(_meta_value(r) for r in record)
    return torch.empty(record["shape"], dtype=getattr(torch, record["dtype"]), device="meta")
