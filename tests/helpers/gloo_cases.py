"""Per-rank bodies of the gloo checks (tests/test_gloo.py): which worker counts the groups a
rank makes get, and what ``apply_placement`` says on a mesh of torch's default gloo groups."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel, UnsafeProcessGroupError
from autoparallel import _torch_internals as internals
from autoparallel.models import MLP


def worker_threads_of_groups(rank: int, world_size: int) -> dict[str, int | None]:
    """The worker threads of every kind of group a rank of the launch helpers makes: the
    default group, a ``new_group`` and a 2-D ``DeviceMesh``'s dims."""
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    groups = {
        "default": dist.group.WORLD,
        "new_group": dist.new_group(list(range(world_size))),
        "mesh dp": mesh.get_group("dp"),
        "mesh tp": mesh.get_group("tp"),
    }
    return {name: internals.gloo_worker_threads(group, "cpu") for name, group in groups.items()}


def apply_on_default_gloo(rank: int, world_size: int) -> str | None:
    """Plan the MLP on a mesh over a group of torch's own gloo backend (two worker threads)
    and apply it: the error's message, or None where it was applied."""
    group = dist.new_group(list(range(world_size)), backend="gloo")
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = MLP(16, 32)
    with AutoParallel(model, lambda: torch.empty(8, 16), mesh, hardware="cpu") as autop:
        autop.add_input_constraints([(Shard(0),)])
        plan = autop.optimize_placement()
        try:
            autop.apply_placement(plan)
        except UnsafeProcessGroupError as error:
            return str(error)
    return None
