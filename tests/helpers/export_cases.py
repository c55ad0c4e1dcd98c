"""What the ranks of tests/test_export.py run: exported torch code, applied and trained."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoparallel._testing.harness import default_loss
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.types.placements import placement_str


def mlp_reference() -> MLP:
    model = MLP(64, 256)
    model.init_weights(seed=0)
    return model


def train_exported_mlp(
    rank: int, world_size: int, source: str, batches: list[torch.Tensor], lr: float
) -> dict[str, Any]:
    """Apply the exported ``parallelize`` to the single-device model on a ``dp`` mesh of all
    ranks, then train one AdamW step per batch on this rank's rows."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    namespace: dict[str, Any] = {}
    exec(compile(source, "parallelize_model.py", "exec"), namespace)
    model = namespace["parallelize"](mlp_reference(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        local = batch.chunk(world_size)[rank]
        loss = default_loss(model(local), local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    params, placements = {}, {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            placements[name] = placement_str(param.placements)
            param = param.full_tensor()
        params[name] = param.detach().clone()
    return {"losses": losses, "params": params, "placements": placements}


def llama_reference() -> Llama:
    model = Llama(llama_config("tiny"))
    model.init_weights(seed=0)
    return model


def train_exported_llama(
    rank: int, world_size: int, source: str, batches: list[torch.Tensor], lr: float
) -> dict[str, Any]:
    """Apply the exported ``parallelize`` to the single-device LLaMA on a ``tp`` mesh of all
    ranks, then train one AdamW step per batch, every rank on the whole batch."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    namespace: dict[str, Any] = {}
    exec(compile(source, "parallelize_model.py", "exec"), namespace)
    model = namespace["parallelize"](llama_reference(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        loss = default_loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    params, placements = {}, {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            placements[name] = placement_str(param.placements)
            param = param.full_tensor()
        params[name] = param.detach().clone()
    return {"losses": losses, "params": params, "placements": placements}
