"""A local FX graph as a plain Python function whose ops are bound once.

The eager runtime runs each phase's local graph (runtime/local_graph.py) every step, and on
a host-bound step (a CPU, a small model) its cost is the Python around each op: FX's
generated code looks every op up through ``torch.ops.<namespace>.<op>.<overload>`` and
calls it through ``OpOverload.__call__``, a Python frame around the dispatcher entry. Here
the generated source calls each op's dispatcher entry by a global name bound when the
function is made (same arguments, same kernels: ``OpOverload.__call__`` only forwards to
it). That saves a lookup and a Python frame on every op call, a sizeable share of a small
op's cost when the step is host-bound.

The source is FX's own (``Graph.python_code``), with only the op references replaced, and
it is compiled and run as FX runs it; a graph whose source does not come out as expected
keeps running as its GraphModule. The program reads the graph module it was made from (its
constants), which must not change afterwards.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autoparallel import _torch_internals as internals

logger = logging.getLogger(__name__)

_OP_REFERENCE = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


@dataclass(frozen=True)
class BoundGraph:
    """``forward(graph_module, *inputs)``: FX's source of the graph with its ops bound."""

    forward: Callable[..., Any]
    graph_module: fx.GraphModule

    def __call__(self, *tensors: Any) -> Any:
        return self.forward(self.graph_module, *tensors)


def bound_program(graph_module: fx.GraphModule) -> Callable[..., Any]:
    """``graph_module``'s forward as a function of its inputs, each op bound once (a
    :class:`BoundGraph`); the GraphModule itself where its source holds an op reference
    that does not resolve to an op overload."""
    code = graph_module.graph.python_code(root_module="self")
    scope = dict(code.globals)
    kernels: dict[str, str] = {}
    try:
        source = _OP_REFERENCE.sub(lambda m: _bind(m, scope, kernels) + "(", code.src)
        exec(compile(source, f"<autoparallel local graph {id(graph_module)}>", "exec"), scope)
    except (AttributeError, SyntaxError) as error:
        logger.debug("local graph kept as a GraphModule: %s", error)
        return graph_module
    return BoundGraph(scope["forward"], graph_module)


def _bind(match: re.Match, scope: dict[str, Any], kernels: dict[str, str]) -> str:
    """The global name the source calls for one ``torch.ops`` reference, bound in ``scope``."""
    path = match.group(0)[:-1]
    name = kernels.get(path)
    if name is None:
        namespace, op_name, overload = match.groups()
        op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
        if not isinstance(op, internals.OpOverload):
            raise AttributeError(f"{path} is not an op overload")
        name = f"_kernel_{len(kernels)}_{namespace}_{op_name}_{overload}"
        scope[name] = internals.op_kernel(op)
        kernels[path] = name
    return name
