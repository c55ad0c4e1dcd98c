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


def llama_reference() -> Llama:
    model = Llama(llama_config("tiny"))
    model.init_weights(seed=0)
    return model


def train_exported_mlp(
    rank: int, world_size: int, source: str, batches: list[torch.Tensor], lr: float
) -> dict[str, Any]:
    """Apply the exported ``parallelize`` to the single-device model on a ``dp`` mesh of all
    ranks, then train one AdamW step per batch on this rank's rows."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _parallelized(source, mlp_reference(), mesh)
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
    return {"losses": losses, **_trained(model)}


def train_exported_llama(
    rank: int,
    world_size: int,
    source: str,
    batches: list[torch.Tensor],
    lr: float,
    watched: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Apply the exported ``parallelize`` to the single-device LLaMA on a ``tp`` mesh of all
    ranks, then train one AdamW step per batch, every rank on the whole batch. ``watched``
    modules report the local shapes of the input they are handed (before any style's hook)
    and of the output they hand on (after it) in the first forward."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = _parallelized(source, llama_reference(), mesh)
    shapes: dict[str, list] = {}
    handles = []
    for name in watched:
        module = model.get_submodule(name)
        handles.append(
            module.register_forward_pre_hook(
                lambda _, args, name=name: _record(shapes, name, args[0]), prepend=True
            )
        )
        handles.append(
            module.register_forward_hook(lambda _, __, out, name=name: _record(shapes, name, out))
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        loss = default_loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        for handle in handles:  # the first forward's shapes only
            handle.remove()
        handles = []
    return {"losses": losses, "shapes": shapes, **_trained(model)}


def _parallelized(source: str, model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    namespace: dict[str, Any] = {}
    exec(compile(source, "parallelize_model.py", "exec"), namespace)
    return namespace["parallelize"](model, mesh)


def _trained(model: torch.nn.Module) -> dict[str, Any]:
    """Every parameter's full value and its placements (DTensors only)."""
    params, placements = {}, {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            placements[name] = placement_str(param.placements)
            param = param.full_tensor()
        params[name] = param.detach().clone()
    return {"params": params, "placements": placements}


def _record(shapes: dict[str, list], name: str, tensor: torch.Tensor) -> None:
    """Append the local shape of ``tensor`` to ``shapes[name]`` (a hook: returns None, so
    the module's input and output are left as they are)."""
    shapes.setdefault(name, []).append(_local(tensor))


def _local(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape this rank holds (a DTensor's local shard)."""
    return tuple((tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape)
