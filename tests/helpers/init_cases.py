"""Per-rank bodies of the initialization tests: a torchtitan-style model initialized on the
parallel module, then trained, against the same code run on one device."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel._testing.harness import full_params
from autoparallel.models.titan_like import TitanArgs, TitanLlama
from autoparallel.types.placements import placement_str
from helpers.runtime_cases import LR, STEPS, _learn_from, _local_rows

SEED = 0


def titan_args(tied: bool) -> TitanArgs:
    return TitanArgs(tie_embeddings=tied)


def titan_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [
        torch.randint(0, TitanArgs.vocab_size, (8, 32), generator=generator) for _ in range(STEPS)
    ]


def titan_reference(tied: bool) -> TitanLlama:
    """The model on one device, initialized by its own init_weights from the global seed."""
    model = TitanLlama(titan_args(tied))
    torch.manual_seed(SEED)
    model.init_weights()
    return model


def plan_titan(model: torch.nn.Module, mesh: Any, example: torch.Tensor) -> tuple[Any, Any]:
    """Plan with the batch split over mesh dim 0 and the parameters sharded (FSDP-style),
    so that every init pattern lands on sharded DTensors."""
    rows = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
    with AutoParallel(model, lambda: torch.empty_like(example), mesh, hardware="cpu") as autop:
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        return plan, autop.apply_placement(plan)


def init_and_train_titan(rank: int, world_size: int, tied: bool) -> dict[str, Any]:
    """Meta model -> plan on a gloo mesh ((2, 2) dp x tp on 4 ranks) -> to_empty -> an
    optimizer -> the model's own init_weights() from the global seed -> STEPS AdamW steps."""
    shape, names = ((2, 2), ("dp", "tp")) if world_size == 4 else ((world_size,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    batches = titan_batches()
    with torch.device("meta"):
        model = TitanLlama(titan_args(tied))
    plan, parallel = plan_titan(model, mesh, batches[0])
    parallel.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR)  # built before the init
    before = {name: id(p) for name, p in parallel.named_parameters()}
    torch.manual_seed(SEED)
    parallel.init_weights()
    after = dict(parallel.named_parameters())
    result: dict[str, Any] = {
        "param_placements": {k: placement_str(v) for k, v in plan.param_placements.items()},
        "same_objects": all(id(p) == before[name] for name, p in after.items()),
        "initial": full_params(parallel),
        "tied": parallel.output.weight is parallel.tok_embeddings.weight,
        "losses": [],
    }
    for step, batch in enumerate(batches):
        _learn_from(parallel(_local_rows(batch, mesh)), parallel, optimizer, mesh, step, result)
    result["params"] = full_params(parallel)
    return result
