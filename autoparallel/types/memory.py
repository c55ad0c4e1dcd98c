"""Memory per device as data: the optimizer's state rule, the linear model, the plan's estimate.

``problem/memory.py`` builds a :class:`MemoryModel` from a Problem (which bytes each strategy
and each move costs); the memory constraint turns it into rows and ``solver/plan.py``
evaluates it for the chosen strategies into a :class:`MemoryEstimate` (``plan.memory``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx as fx

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter element, as torch's own optimizers allocate it.

    ``state_elements`` tensors of the parameter's shape, dtype and placement (AdamW: the two
    moments; SGD with momentum: the buffer), unless ``bytes_per_element`` (given by the user
    for another optimizer) says how many bytes each parameter element costs.
    ``step_temporaries`` is how many parameter-sized tensors the (foreach) step allocates and
    frees again: AdamW's square root of the second moment.
    """

    name: str
    state_elements: int = 0
    step_temporaries: int = 0
    bytes_per_element: float | None = None

    def state_bytes(self, numel: int, itemsize: int) -> float:
        if self.bytes_per_element is not None:
            return float(numel * self.bytes_per_element)
        return float(numel * itemsize * self.state_elements)


def optimizer_state(optimizer: str | float) -> OptimizerState:
    """The state rule of ``optimizer``: a name in :data:`OPTIMIZERS` or bytes per parameter
    element. Raises ValueError for anything else."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ValueError(f"optimizer state bytes per parameter must be >= 0, got {optimizer}")
        return OptimizerState(f"{optimizer:g} B per parameter", bytes_per_element=float(optimizer))
    rules = {
        "adamw": OptimizerState("adamw", state_elements=2, step_temporaries=1),
        "adam": OptimizerState("adam", state_elements=2, step_temporaries=1),
        "sgd": OptimizerState("sgd"),
        "sgd-momentum": OptimizerState("sgd-momentum", state_elements=1),
    }
    if optimizer not in rules:
        raise ValueError(
            f"unknown optimizer {optimizer!r}: give one of {', '.join(OPTIMIZERS)}, "
            "or the optimizer state's bytes per parameter element as a number"
        )
    return rules[optimizer]


@dataclass(frozen=True)
class NodeBytes:
    """Bytes per device that depend on one node's strategy: ``per_strategy[s]`` under its
    strategy ``s``."""

    node: fx.Node
    per_strategy: np.ndarray


@dataclass(frozen=True)
class MoveBytes:
    """Bytes per device a move on edge ``edge`` holds while it lives: the redistributed
    value's local size where the chosen pair changes placements (a parameter gather).
    ``net_of_source``: the producer's own output is counted apart (a parameter's
    mixed-precision cast that the backward reads through a view, among the activations),
    so a move counts the copy's bytes less the source's: the saved storage comes out as
    the cast's where no move copies it, else the copy (a gather's)."""

    edge: int
    net_of_source: bool = False
    copies: int = 1  # a saved gather of each microbatch in flight (Problem.activation_copies)


@dataclass(frozen=True)
class GatherGroup:
    """Parameters the runtime gathers together (one numbered layer, or the rest), with the
    moves that gather them in the forward."""

    label: str
    moves: tuple[MoveBytes, ...]


@dataclass(frozen=True)
class RecomputeClass:
    """Numbered layers that cost and save the same when recomputed (repeated layers folded
    alike, or one layer alone): the solver picks how many of them the backward recomputes,
    and the runtime recomputes the first that many in forward order.

    ``inner``: the activations one of these layers stops saving, per strategy of the nodes
    whose columns the layers share; ``forward_us``: the compute its forward costs again in
    the backward (NodeBytes's per-strategy values in microseconds here).
    """

    label: str  # "layers.0" or "layers.1 .. layers.30"
    layers: tuple[str, ...]
    inner: tuple[NodeBytes, ...]
    forward_us: tuple[NodeBytes, ...]

    def chosen(self, count: int) -> tuple[str, ...]:
        """The layers recomputed when the plan recomputes ``count`` of them."""
        return self.layers[:count]


@dataclass(frozen=True)
class MemoryModel:
    """The per-device bytes of a training step, linear in the strategies (problem/memory.py).

    The peak is the larger of two moments:

    * **start of the backward**: parameters + optimizer state + every saved activation
      (with the redistributed parameter reads saved, ``saved_gathers``) + the parameter
      gathers alive then (two groups: one computing, one prefetched);
    * **optimizer step**: parameters + gradients + optimizer state + the step's temporaries.

    With recomputed layers the start of the backward holds their saved activations less
    their ``inner`` ones, and a third moment appears: the backward of the first recomputed
    layer it reaches, with that layer's inner activations back (see problem/recompute.py).
    """

    optimizer: OptimizerState
    parameters: tuple[NodeBytes, ...]
    gradients: tuple[NodeBytes, ...]
    optimizer_state: tuple[NodeBytes, ...]
    step_temporaries: tuple[NodeBytes, ...]
    activations: tuple[NodeBytes, ...]
    activation_layers: tuple[str, ...]  # activations[i] is saved by that layer
    saved_gathers: tuple[MoveBytes, ...]  # redistributed parameter reads the backward reads
    gather_groups: tuple[GatherGroup, ...]
    # the layers activation checkpointing may recompute, by class (empty: not built)
    recompute: tuple[RecomputeClass, ...] = ()


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per device of one training step under a plan (``plan.memory``).

    ``transient`` is what lives only around the peak (gathered parameters, the optimizer
    step's temporaries); ``peak`` = the components alive at ``peak_at`` (see
    :class:`MemoryModel`). ``budget`` is the memory constraint's, None without one.
    ``recomputed`` names the layers activation checkpointing recomputes and
    ``recompute_us`` what their forward costs again in the backward.
    ``activations_by_layer`` splits ``activations`` by the layer that saves them.
    """

    optimizer: str
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    transient: float
    peak: float
    peak_at: str
    budget: float | None = None
    recomputed: tuple[str, ...] = ()
    activations_by_layer: tuple[tuple[str, float], ...] = ()
    recompute_us: float = 0.0

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget
