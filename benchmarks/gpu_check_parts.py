"""The parts of ``benchmarks/gpu_check.py``, each run on fresh ranks (``run_distributed``).

Every part takes the device type ("cuda" or "cpu") and returns plain figures; on CUDA every
rank uses GPU 0 (the check is made for a machine with one GPU). See the script's docstring
for what each part measures and why.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autoparallel.models.llama import Llama, LlamaConfig, llama_config

LR = 1e-3


@dataclass(frozen=True)
class CheckModel:
    """The LLaMA a part trains and its global batch."""

    name: str
    config: LlamaConfig
    batch: int
    seq: int

    def global_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(
            0, self.config.vocab_size, (self.batch, self.seq + 1), generator=generator
        )
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


LLAMA_1B = CheckModel(
    "llama-1b",
    llama_config(
        "llama3-8b",
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        multiple_of=256,
        ffn_dim_multiplier=None,
        max_seq_len=2048,
    ),
    batch=2,
    seq=2048,
)
"""About 1.25 B parameters (LLaMA-3.2-1B's widths with its 128 K vocabulary untied): the
one-GPU model of part (b)."""

LLAMA_TINY = CheckModel("llama-tiny", llama_config("tiny"), batch=8, seq=32)
"""The two-rank model of part (c), and part (b)'s on a CPU, where the check proves the path
runs rather than how fast."""


def device_of(device_type: str) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ (a) calibrate


def calibrate_rank(rank: int, world_size: int, device_type: str, settings: Any, out: str) -> dict:
    """Calibrate the device on this group (one rank) and write the profile to ``out``."""
    from autoparallel.calibrate.run import calibrate_group

    device_of(device_type)
    calibration = calibrate_group(settings)
    if rank == 0:
        calibration.write(out)
    hardware = calibration.hardware
    return {
        "profile": out,
        "flops_bf16": hardware.flops_bf16,
        "flops_fp32": hardware.flops_fp32,
        "memory_bandwidth": hardware.memory_bandwidth,
        "kernel_launch_us": hardware.kernel_launch_us,
        "matmul_table_dims": list(hardware.matmul_table.dims) if hardware.matmul_table else [],
        "round_spread": calibration.measured_on.get("round_spread", {}),
        "device": calibration.measured_on.get("device"),
    }


# ------------------------------------------------------------------- (b, d, e) one device


def plan_on_one_device(
    model: CheckModel, device: torch.device, hardware: str | None, mp_policy: Any
) -> tuple[nn.Module, Any, Any]:
    """Our parallel module of ``model`` on a mesh of this one device, its plan and its
    problem's joint graph (for the per-layer figures)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from autoparallel import AutoParallel

    mesh = init_device_mesh(device.type, (1,))
    with torch.device("meta"):
        meta_model = Llama(model.config)
    inputs, _ = model.global_batch()
    with AutoParallel(meta_model, lambda: inputs, mesh, mp_policy, hardware=hardware) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
        joint = autop.sharding_optimizer.problem.joint
    parallel.to_empty(device=device)
    parallel.init_weights(seed=0)
    return parallel, plan, joint


def plain_model(model: CheckModel, device: torch.device) -> nn.Module:
    with torch.device(device):
        plain = Llama(model.config)
    plain.init_weights(seed=0)
    return plain


def training_step(
    module: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast: bool,
) -> Callable[[], float]:
    """zero_grad, forward and loss (under bf16 autocast for the plain model: what the
    policy does for ours), backward, AdamW step."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, foreach=True)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(module(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def one_device_rank(
    rank: int,
    world_size: int,
    device_type: str,
    model: CheckModel,
    hardware: str | None,
    steps: int,
    rounds: int,
) -> dict:
    """Part (b): ours on a mesh of one device against the plain model, eager and compiled,
    timed round-robin; (d) the plan's step and per-layer compute beside measured ones; (e)
    the plan's peak memory beside ``torch.cuda.max_memory_allocated``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoparallel import autoparallel_backend
    from autoparallel.runtime.timing import measure_step

    device = device_of(device_type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inputs, targets = (t.to(device) for t in model.global_batch())
    ours, plan, joint = plan_on_one_device(model, device, hardware, policy)
    memory = _peak_memory(device, training_step(ours, inputs, targets, autocast=False))
    plain = plain_model(model, device)
    steps_of = {
        "ours": training_step(ours, inputs, targets, autocast=False),
        "plain": training_step(plain, inputs, targets, autocast=True),
        "ours compiled": training_step(
            torch.compile(ours, backend=autoparallel_backend(), fullgraph=True),
            inputs,
            targets,
            autocast=False,
        ),
        "plain compiled": training_step(torch.compile(plain), inputs, targets, autocast=True),
    }
    medians: dict[str, list[float]] = {name: [] for name in steps_of}
    for round_index in range(rounds):
        for name, step in steps_of.items():
            timing = measure_step(
                step, steps=steps, warmup=3 if round_index == 0 else 1, device=device
            )
            medians[name].append(statistics.median(timing.step_ms))
    step_ms = {name: statistics.median(values) for name, values in medians.items()}
    layer = _layer_compute(plain, model, device, joint, plan)
    return {
        "model": model.name,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "step_ms": step_ms,
        "predicted_step_ms": plan.totals.total_us / 1e3,
        "priced_on": plan.priced_on,
        "layer": layer,
        "memory": {"predicted_peak": plan.memory.peak, **memory},
    }


def _peak_memory(device: torch.device, step: Callable[[], float]) -> dict:
    """The allocator's peak over three steps (CUDA only: a CPU has no such statistic)."""
    if device.type != "cuda":
        for _ in range(3):
            step()
        return {"measured_peak": None, "why_none": "the CPU allocator keeps no peak"}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    return {"measured_peak": torch.cuda.max_memory_allocated(device)}


LAYER = 1
"""The layer whose compute is set beside its prediction (not the first, whose input comes
straight from the embedding)."""


def _layer_compute(
    plain: nn.Module, model: CheckModel, device: torch.device, joint: Any, plan: Any
) -> dict:
    """The compute the plan charges layer ``LAYER`` (its forward and backward nodes) beside
    the forward and backward of that block of the plain model timed alone, in bf16."""
    from autoparallel.files.plan_json_graph import node_modules

    prefix = f"layers.{LAYER}"
    modules = node_modules(joint)
    predicted_us = sum(
        node.compute_us
        for name, node in plan.nodes.items()
        if modules.get(name, "") == prefix or modules.get(name, "").startswith(prefix + ".")
    )
    block = plain.layers[LAYER].to(torch.bfloat16)
    cos = plain.rope_cos[: model.seq].to(torch.bfloat16)
    sin = plain.rope_sin[: model.seq].to(torch.bfloat16)
    x = torch.randn(
        model.batch, model.seq, model.config.dim, device=device, dtype=torch.bfloat16
    ).requires_grad_()
    grad = torch.randn_like(x)

    def forward_backward() -> None:
        block(x, cos, sin).backward(grad)

    times = []
    for index in range(13):
        _synchronize(device)
        start = time.perf_counter()
        forward_backward()
        _synchronize(device)
        if index >= 3:
            times.append((time.perf_counter() - start) * 1e6)
    block.to(torch.float32)
    return {
        "layer": prefix,
        "predicted_compute_us": predicted_us,
        "measured_us": statistics.median(times),
    }


# ------------------------------------------------------------------- (c) two ranks, one GPU


def two_rank_training(
    rank: int, world_size: int, device_type: str, model: CheckModel, steps: int, compiled: bool
) -> list[float]:
    """Part (c): plan ``model`` on (2,) gloo ranks sharing the device and train ``steps``
    AdamW steps on this rank's rows; the global loss of each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from autoparallel import AutoParallel, autoparallel_backend

    device = device_of(device_type)
    mesh = init_device_mesh(device.type, (world_size,))
    with torch.device("meta"):
        meta_model = Llama(model.config)
    inputs, targets = model.global_batch()
    with AutoParallel(meta_model, lambda: inputs, mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        parallel = autop.apply_placement(autop.optimize_placement())
    parallel.to_empty(device=device)
    parallel.init_weights(seed=0)
    rows = model.batch // world_size
    local_inputs = inputs[rank * rows : (rank + 1) * rows].to(device)
    local_targets = targets[rank * rows : (rank + 1) * rows].to(device)
    run = (
        torch.compile(parallel, backend=autoparallel_backend(), fullgraph=True)
        if compiled
        else parallel
    )
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR, foreach=True)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(run(local_inputs), local_targets)
        (loss / world_size).backward()  # ours: gradients of the sum of the ranks' losses
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def one_device_losses(device_type: str, model: CheckModel, steps: int) -> list[float]:
    """The reference of part (c): the plain model on the whole batch."""
    device = device_of(device_type)
    plain = plain_model(model, device)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR, foreach=True)
    inputs, targets = (t.to(device) for t in model.global_batch())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(plain(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
