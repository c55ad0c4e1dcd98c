"""Parameter all-gathers done a layer at a time: one collective per layer, mesh dim and dtype.

A plan that shards parameters (FSDP-like) all-gathers each one where an op first reads it
replicated, one collective per parameter and per phase. FSDP instead gathers a whole layer's
parameters in one collective. Here, within one run of a phase, every parameter read whose
planned move is all-gathers (Shard -> Replicate on one or more mesh dims, evenly divided, of
tensor dims no other mesh dim shards, no route in between) joins the group of its numbered
layer (``layers.3.``), mesh dims and dtype; the first read of any member gathers the whole
group in one flat buffer (one collective per mesh dim, innermost first, which leaves the
rows in the rank-major layout of ``rank_layout.py``), and each gathered value is dropped
after the phase's last read of it. Memory: one layer's parameters are unsharded at a time,
as with FSDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoparallel import _torch_internals as internals
from autoparallel.runtime import rank_layout
from autoparallel.types.bucketing import ranks_per_tensor_dim
from autoparallel.types.graph import layer_of


@dataclass(frozen=True)
class Gather:
    """What parameter all-gathers done in one bucket share (mesh dims in ascending order)."""

    layer: str
    mesh_dims: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class GatherPlan:
    """For one phase: which (parameter, wanted placements) are gathered with their layer,
    and how many times the phase reads each (so a gathered value is dropped after its last
    read, as FSDP frees a layer's unsharded parameters)."""

    group_of: dict[tuple, Gather]
    reads: dict[tuple, int]
    members: dict[Gather, list[tuple]]

    @classmethod
    def of_reads(cls, reads: list[tuple[tuple, Gather]]) -> GatherPlan:
        """The plan for a phase's gatherable reads, in order: (key, group) per read. Groups
        of a single parameter are left out (nothing to coalesce)."""
        members: dict[Gather, list[tuple]] = {}
        counts: dict[tuple, int] = {}
        for key, group in reads:
            if key not in counts:
                members.setdefault(group, []).append(key)
            counts[key] = counts.get(key, 0) + 1
        members = {group: keys for group, keys in members.items() if len(keys) > 1}
        group_of = {key: group for group, keys in members.items() for key in keys}
        return cls(group_of, {key: counts[key] for key in group_of}, members)


def plan_gather(
    param_name: str,
    source: tuple,
    wanted: tuple,
    shape: tuple,
    dtype: torch.dtype,
    mesh_shape: tuple,
) -> Gather | None:
    """The group of a parameter read in ``wanted`` placements, when the move from its own
    ``source`` placements is all-gathers (Shard -> Replicate on one or more mesh dims) of
    evenly divided tensor dims that no mesh dim the move keeps also shards; None otherwise."""
    changed = [dim for dim, (src, dst) in enumerate(zip(source, wanted)) if src != dst]
    if not changed:
        return None
    for mesh_dim in changed:
        src, dst = source[mesh_dim], wanted[mesh_dim]
        if type(src) is not Shard or not isinstance(dst, Replicate) or src.dim >= len(shape):
            return None
    ranks = ranks_per_tensor_dim((mesh_shape[d], source[d].dim) for d in changed)
    for other, placement in enumerate(source):
        # a tensor dim also sharded by a mesh dim the move keeps: one rank's rows are not
        # contiguous in the wanted layout, so the flat gather would misplace them; left to
        # DTensor's own redistribute
        if other not in changed and type(placement) is Shard and placement.dim in ranks:
            return None
    if any(shape[dim] % count for dim, count in ranks.items()):
        return None
    return Gather(layer_of(param_name), tuple(changed), dtype)


class ParameterGathers:
    """The parameter all-gathers of one run of a phase, one collective per group, issued at
    the first read of any member."""

    def __init__(self, plan: GatherPlan, mesh: DeviceMesh):
        self.plan = plan
        self.mesh = mesh
        self.reads_left = dict(plan.reads)
        self.ready: dict[tuple, DTensor] = {}

    def take(self, node: object, wanted: tuple, env: dict) -> DTensor | None:
        """``node``'s value in ``wanted`` placements if its group handles it, else None."""
        key = (node, wanted)
        group = self.plan.group_of.get(key)
        if group is None:
            return None
        if key not in self.ready:
            self._gather(group, env)
        value = self.ready[key]
        self.reads_left[key] -= 1
        if self.reads_left[key] == 0:
            del self.ready[key]
        return value

    def _gather(self, group: Gather, env: dict) -> None:
        members = self.plan.members[group]
        values = [env[node] for node, _ in members]
        tensors = [value.to_local() for value in values]
        rows = torch.cat([t.reshape(-1) for t in tensors])
        for mesh_dim in reversed(group.mesh_dims):  # innermost first: rank-major rows
            rows = internals.all_gather_rows(rows, self.mesh, mesh_dim)
        ranks = math.prod(self.mesh.size(d) for d in group.mesh_dims)
        parts = rows.view(ranks, -1).split([t.numel() for t in tensors], dim=1)
        for (node, wanted), value, tensor, part in zip(members, values, tensors, parts):
            shards = [(self.mesh.size(d), value.placements[d].dim) for d in group.mesh_dims]
            self.ready[(node, wanted)] = DTensor.from_local(
                rank_layout.from_rank_rows(part, tuple(tensor.shape), shards),
                self.mesh,
                wanted,
                run_check=False,
            )
