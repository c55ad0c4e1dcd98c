"""The traced joint graph and the roles of its boundary: the trace stage's output.

:class:`JointGraph` is the FX graph plus the *roles* of its boundary: which placeholders are
parameters, buffers, user inputs or tangents, and which outputs are user outputs, parameter
gradients or input gradients. Every later stage reads roles from here instead of
re-deriving them from node names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autoparallel.types.regions import LocalMapRegion
from autoparallel.types.trees import TreeStructure


@dataclass(frozen=True)
class RepeatedLayers:
    """A container of identical layers: its path in the model and its children's names.

    ``index_attributes`` are integer attributes that number the layers (Hugging Face's
    ``self_attn.layer_idx``, kept for the KV cache). They are the only thing allowed to
    differ; the short traces run with them replaced by :class:`UnreadLayerIndex`, so a
    forward that reads them fails there and the model is traced layer by layer.
    """

    path: str
    keys: tuple[str, ...]
    index_attributes: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.keys)

    def param_prefix(self, layer: int, name_prefix: str = "") -> str:
        """Start of the names of ``layer``'s parameters (``"layers.3."``)."""
        return f"{name_prefix}{self.path}.{self.keys[layer]}."


@dataclass
class JointGraph:
    """The traced joint graph and the roles of its inputs and outputs.

    Attributes:
        graph_module: joint forward+backward graph; every node's ``meta["val"]`` is a fake
            tensor with the *global* shape.
        params / buffers: fully-qualified name -> placeholder node.
        user_inputs: placeholders of the flattened user inputs, in pytree-leaf order.
        tangents: placeholder of the incoming gradient for each user output index.
        user_outputs: node producing each flattened user output.
        param_grads: parameter name -> node producing its gradient (missing if the parameter
            gets no gradient).
        input_grads: user-input index -> node producing its gradient.
        forward_nodes: nodes of the forward pass (the rest of the call_function nodes are
            backward); used by logs and later by folding, which must not mix the two.
        in_spec / out_spec: pytree structure of the user's inputs ((args, kwargs)) and outputs.
        tied_params: groups of parameter names that are one tensor (tied embeddings); the
            graph has a placeholder per name, and the plan must give them one placement.
        layers_traced_once: the container of identical layers whose graph was built from
            3 and 4 traced layers (trace/repeated_layers.py), or None if every layer was traced.
        regions: the model's ``local_map`` regions by key (autoparallel/regions); the
            graph's region ops name them, and each such node has ``meta["local_map_region"]``.
    """

    graph_module: fx.GraphModule
    fake_mode: Any
    params: dict[str, fx.Node]
    buffers: dict[str, fx.Node]
    user_inputs: list[fx.Node]
    tangents: dict[int, fx.Node]
    user_outputs: list[fx.Node | None]
    param_grads: dict[str, fx.Node]
    input_grads: dict[int, fx.Node]
    forward_nodes: set[fx.Node]
    in_spec: TreeStructure
    out_spec: TreeStructure
    device: torch.device
    tied_params: list[list[str]] = field(default_factory=list)
    layers_traced_once: RepeatedLayers | None = None
    regions: dict[str, LocalMapRegion] = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def placeholder_role(self, node: fx.Node) -> str:
        """A short human word for a placeholder: 'param', 'buffer', 'input' or 'tangent'."""
        return self._roles().get(node, "other")

    def _roles(self) -> dict[fx.Node, str]:
        roles: dict[fx.Node, str] = {}
        roles.update({n: "param" for n in self.params.values()})
        roles.update({n: "buffer" for n in self.buffers.values()})
        roles.update({n: "input" for n in self.user_inputs})
        roles.update({n: "tangent" for n in self.tangents.values()})
        return roles

    def param_name_of(self) -> dict[fx.Node, str]:
        return {node: name for name, node in self.params.items()}

    def parameter_sources(self) -> dict[fx.Node, str]:
        """Nodes that stand for a parameter where the ops read it: its placeholder, and a
        dtype cast of it in the forward (the mixed-precision policy's ``_to_copy``), each
        with the parameter's name. The runtime gathers these a layer at a time."""
        sources = self.param_name_of()
        for node, name in list(sources.items()):
            for user in node.users:
                if (
                    user in self.forward_nodes
                    and getattr(user.target, "__name__", "") == "_to_copy.default"
                    and user.all_input_nodes == [node]
                ):
                    sources[user] = name
        return sources


def layer_of(name: str) -> str:
    """The numbered layer a parameter belongs to (``layers.3.attention.wq.weight`` ->
    ``layers.3.``), or ``""`` for one outside numbered layers. The runtime gathers a layer's
    parameters together by this name, and the solver prices them so."""
    parts = name.split(".")
    for index in range(len(parts) - 2, -1, -1):
        if parts[index].isdigit():
            return ".".join(parts[: index + 1]) + "."
    return ""
