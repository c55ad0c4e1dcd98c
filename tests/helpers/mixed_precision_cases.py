"""Per-rank bodies of the mixed-precision runtime tests (module level, so spawn can pickle them).

Both sides train the same MLP with the same bf16/fp32 policy on the same global batches:
our parallel module (planned FSDP-like with the parameter memory constraint) and torch's
own ``fully_shard``. FSDP2 averages gradients over ranks while our module sums them (the
gradient of the sum of the ranks' losses, which is what the single-process reference computes
with the loss normalized by the global element count); FSDP2's local loss is therefore scaled
by the world size. (Its divide factor cannot be set to 1 on gloo: that needs PREMUL_SUM.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel
from autoparallel._testing.harness import full_grads, full_params
from autoparallel.models import MLP

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
DIM, HIDDEN, BATCH = 64, 256, 512
STEPS = 3
LR = 1e-3


def build(device: str) -> MLP:
    with torch.device(device):
        return MLP(DIM, HIDDEN)


def global_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH, DIM, generator=generator) for _ in range(STEPS)]


def loss_of(output: torch.Tensor, global_numel: int) -> torch.Tensor:
    return output.float().pow(2).sum() / global_numel


def _train(model: torch.nn.Module, mesh: Any, loss_scale: float = 1.0) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    result: dict[str, Any] = {"losses": []}
    rank, world = mesh.get_coordinate()[0], mesh.shape[0]
    for step, batch in enumerate(global_batches()):
        output = model(batch.chunk(world)[rank])
        result.setdefault("output_dtype", str(output.dtype))
        loss = loss_of(output, batch.numel())
        (loss * loss_scale).backward()
        if step == 0:
            result["grads"] = full_grads(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        result["losses"].append(total.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result["params"] = full_params(model)
    return result


def train_autoparallel(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    with AutoParallel(
        build("meta"), lambda: global_batches()[0], mesh, POLICY, hardware="cpu"
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    result = _train(parallel, mesh)
    result["param_dtypes"] = sorted({str(p.dtype) for p in parallel.parameters()})
    return result


def train_fully_shard(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    model = build("cpu")
    model.init_weights(seed=0)
    fully_shard(model, mesh=mesh, mp_policy=POLICY)
    return _train(model, mesh, loss_scale=float(world_size))
