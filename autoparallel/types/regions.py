"""Plain types of ``local_map`` regions: a model's own local code inside the traced graph.

A region is a function the model wrote for *local* tensors (one rank's shards) with explicit
collectives, wrapped by :func:`autoparallel.local_map`. The joint graph holds it as one
forward op and one backward op whose placements are fixed by the region (the planner
chooses everything around it). :class:`LocalMapRegion` is what every stage needs to know
about one region; :class:`RegionProfile` is what its body did on local fake tensors (the
ops and collectives the cost model prices).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor.placement_types import Partial, Replicate

from autoparallel.types.kinds import CollectiveKind
from autoparallel.types.placements import Placements
from autoparallel.types.tensors import TensorInfo
from autoparallel.types.trees import TreeStructure


@dataclass(frozen=True)
class OpRecord:
    """One ATen op the body ran, with every tensor replaced by its local TensorInfo."""

    op: Any
    args: tuple
    kwargs: dict
    output: Any


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective the body issued: ``kind`` is all_to_all / all_gather / reduce_scatter /
    all_reduce, ``nbytes`` the bytes of the larger of its input and output on one rank."""

    kind: CollectiveKind
    mesh_dim: int
    nbytes: int


@dataclass(frozen=True)
class RegionProfile:
    """The body's work on one rank: its forward, and the backward of the backward op (which
    re-runs the forward under autograd, then its vector-Jacobian product)."""

    forward_ops: tuple[OpRecord, ...]
    forward_collectives: tuple[CollectiveRecord, ...]
    backward_ops: tuple[OpRecord, ...]
    backward_collectives: tuple[CollectiveRecord, ...]


@dataclass(frozen=True)
class RegionLayout:
    """One way to run a region: every placement resolved, its local input shapes, and the
    body's profile at those shapes. A region without free mesh dims has one layout; each
    free mesh dim doubles them (see :class:`LocalMapRegion`).

    Attributes:
        in_placements / in_grad_placements / out_placements: as in :class:`LocalMapRegion`,
            with no free entry left.
        local_inputs: per tensor argument, its local shape and dtype on one rank.
        free: per free mesh dim, (the mesh dim, what its free entries became: "R" or "S(0)").
        profile: what the body ran on these local shapes (set after tracing).
    """

    in_placements: tuple[Placements, ...]
    in_grad_placements: tuple[Placements, ...]
    out_placements: tuple[Placements, ...]
    local_inputs: tuple[TensorInfo, ...]
    free: tuple[tuple[int, str], ...] = ()
    profile: RegionProfile | None = field(default=None, repr=False, compare=False)


@dataclass
class LocalMapRegion:
    """One ``local_map`` region of a traced model.

    Free mesh dims: a placements tuple may hold ``None`` for a mesh dim instead of a
    placement (``(None, Shard(0))``): the body does not care how that tensor lies on that
    mesh dim, and the planner chooses. For each such mesh dim, every ``None`` of the region
    (arguments, outputs, gradients) becomes ``Replicate()`` together, or ``Shard(0)``
    together; a ``None`` in ``in_grad_placements`` becomes the adjoint of its argument's.
    So a free entry says "dim 0 of this tensor is a batch dim of the body": each output row
    depends on the same rows of the free arguments only (and on whole tensors of the
    others), and the body issues no collective over that mesh dim. ``layouts`` lists every
    resolution (one when nothing is free), each a strategy of the region's ops.

    Attributes:
        key: the name the graph's region ops carry (unique within one trace).
        func: the user's body, called on local tensors.
        source: ``file:line`` of the model's call, for messages.
        arg_spec: pytree structure of the body's positional arguments.
        constants: the non-tensor leaves of those arguments (None where a tensor goes).
        tensor_positions: leaf index of each tensor argument, in the ops' input order.
        in_placements / in_grad_placements: per tensor argument, its placements on the mesh
            and those of its gradient, as declared (``None`` on a free mesh dim).
        out_placements: per output tensor, its placements as declared (its gradient arrives
            in :func:`~autoparallel.types.regions.adjoint_placements` of them).
        differentiable: per tensor argument, whether it is floating point (gets a gradient).
        layouts: every resolution of the free mesh dims (the first when none is free).
        free_mesh_dims: the mesh dims with a ``None`` entry somewhere.
        out_spec: pytree structure of the body's result; set when the trace first runs it.
    """

    key: str
    func: Callable[..., Any]
    source: str
    arg_spec: TreeStructure
    constants: tuple
    tensor_positions: tuple[int, ...]
    in_placements: tuple[Placements, ...]
    in_grad_placements: tuple[Placements, ...]
    out_placements: tuple[Placements, ...]
    differentiable: tuple[bool, ...]
    layouts: tuple[RegionLayout, ...]
    free_mesh_dims: tuple[int, ...] = ()
    out_spec: TreeStructure | None = None

    def arguments(self, tensors: list[Any]) -> tuple:
        """The body's positional arguments with ``tensors`` in the tensor positions."""
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return tuple(self.arg_spec.unflatten(leaves))


def adjoint_placements(placements: Placements) -> Placements:
    """Where a region's gradient lives, given where its value lives.

    A region's backward runs the body's vector-Jacobian product on every rank, and each
    rank's result is its own contribution: a sharded value's gradient is sharded the same
    way; a replicated value's gradient is the sum of every rank's contribution (Partial); a
    partial value (a pending sum) gets the whole gradient on every rank (Replicate)."""

    def adjoint(placement: Any) -> Any:
        if isinstance(placement, Replicate):
            return Partial()
        if isinstance(placement, Partial):
            return Replicate()
        return placement

    return tuple(adjoint(p) for p in placements)
