"""Per-rank body of the pipeline checks (tests/test_pipeline.py): the tiny LLaMA cut into 2
stages over "pp", each stage planned on "dp", trained by torch.distributed.pipelining's
schedule, against the same steps on one device."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel._testing.harness import full_grads, full_params
from autoparallel.models import Llama, llama_config

CONFIG = llama_config("tiny")
BATCH, SEQ, STEPS, LR = 8, 32, 2, 1e-3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=generator),
            torch.randn(BATCH, SEQ, CONFIG.vocab_size, generator=generator),
        )
        for _ in range(STEPS)
    ]


def initialized_model() -> Llama:
    model = Llama(CONFIG)
    model.init_weights(seed=0)
    return model


def _policy(bf16: bool) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None


def reference(bf16: bool = False) -> dict[str, Any]:
    """STEPS AdamW steps of the whole batch's mean squared error on one device (computing in
    bf16 under ``MixedPrecisionModule`` where ``bf16``)."""
    from autoparallel.trace.mixed_precision import MixedPrecisionModule

    model = initialized_model()
    run = MixedPrecisionModule(model, _policy(True)) if bf16 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step, (tokens, target) in enumerate(batches()):
        optimizer.zero_grad()
        loss = F.mse_loss(run(tokens).float(), target)
        loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def train_pipelined(
    rank: int,
    world_size: int,
    schedule: str,
    microbatches: int,
    checkpoint: str,
    bf16: bool = False,
    pp_alone: bool = False,
    on_meta: bool = False,
) -> dict[str, Any]:
    """Plan on a (2, world_size // 2) pp x dp gloo mesh (``pp_alone``: a (2,) pp mesh; ``bf16``:
    under a bf16/fp32 policy) with the schedule and microbatches
    fixed, then STEPS AdamW steps with ``pipe.step``: this rank's stage's losses per step
    (last stage only), its gradients of step 0, its parameters after, and whether a DCP
    checkpoint in ``checkpoint`` (a directory) gives them back. ``on_meta``: the model is
    built and planned on the meta device, its stage materialized by ``pipe.to_empty`` and
    ``pipe.init_weights(seed=0)`` (the reference's init); else built on CPU, and loaded
    again from the reference model's whole state dict by ``pipe.load_state_dict``."""
    dp = 1 if pp_alone else world_size // 2
    shape, names = ((2,), ("pp",)) if pp_alone else ((2, dp), ("pp", "dp"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # whole microbatches between stages, rows split over dp
    rows = (Replicate(),) if pp_alone else (Replicate(), Shard(0))
    all_batches = batches()
    if on_meta:
        with torch.device("meta"):
            model = Llama(CONFIG)
    else:
        model = initialized_model()
    policy = _policy(bf16)
    with AutoParallel(model, lambda: all_batches[0][0], mesh, policy, hardware="cpu") as autop:
        autop.add_pipeline_constraint(schedule=schedule, microbatches=microbatches)
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        plan = autop.optimize_placement()
        # each dp rank's loss counts 1/dp of the batch's mean: the gradients sum over dp
        pipe = autop.apply_placement(
            plan, loss_fn=lambda out, tgt: F.mse_loss(out.float(), tgt) / dp
        )
    if on_meta:
        pipe.to_empty(device="cpu")
        pipe.init_weights(seed=0)
    else:
        pipe.load_state_dict(initialized_model().state_dict())
    initial = full_params(pipe.module)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    row = 0 if pp_alone else mesh.get_local_rank("dp")
    losses, grads = [], {}
    for step, (tokens, target) in enumerate(all_batches):
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        pipe.step(tokens.chunk(dp)[row], target=target.chunk(dp)[row], losses=step_losses)
        if step == 0:
            grads = full_grads(pipe.module)
        optimizer.step()
        if step_losses:  # the mean over the microbatches of this rank's rows
            losses.append(float(torch.stack(step_losses).detach().mean()))
    params = full_params(pipe.module)
    # a torch.distributed.checkpoint of every stage, loaded back over zeroed parameters
    dcp.save(pipe.state_dict(), checkpoint_id=checkpoint)
    with torch.no_grad():
        for param in pipe.parameters():
            param.zero_()
    state = pipe.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    pipe.load_state_dict(state, strict=False)  # this stage's entries only
    reloaded = full_params(pipe.module)
    return {
        "reloaded_equal": all(torch.equal(params[k], reloaded[k]) for k in params),
        "initial": initial,
        "state_keys": sorted(state),
        "whole_model_on_meta": all(t.is_meta for t in (*model.parameters(), *model.buffers())),
        "stage": plan.pipeline.stage_index,
        "stages": plan.pipeline.stages,
        "losses": losses,
        "grads": grads,
        "params": params,
        "input_placements": [str(p) for p in plan.input_placements],
        "pipeline": plan.pipeline,
    }
