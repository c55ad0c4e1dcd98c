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


def initialized_model(n_layers: int = CONFIG.n_layers) -> Llama:
    model = Llama(llama_config("tiny", n_layers=n_layers))
    model.init_weights(seed=0)
    return model


def _policy(bf16: bool) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None


def reference(bf16: bool = False, n_layers: int = CONFIG.n_layers) -> dict[str, Any]:
    """STEPS AdamW steps of the whole batch's mean squared error on one device (computing in
    bf16 under ``MixedPrecisionModule`` where ``bf16``), the tiny LLaMA with ``n_layers``."""
    from autoparallel.trace.mixed_precision import MixedPrecisionModule

    model = initialized_model(n_layers)
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
    n_layers: int = CONFIG.n_layers,
    stages_per_rank: int | None = None,
    inner: str = "dp",
) -> dict[str, Any]:
    """Plan on a (2, world_size // 2) pp x dp gloo mesh (``pp_alone``: a (2,) pp mesh; ``bf16``:
    under a bf16/fp32 policy) with the schedule and microbatches
    fixed, then STEPS AdamW steps with ``pipe.step``: this rank's stage's losses per step
    (last stage only), its gradients of step 0, its parameters after, and whether a DCP
    checkpoint in ``checkpoint`` (a directory) gives them back. ``on_meta``: the model is
    built and planned on the meta device, its stage materialized by ``pipe.to_empty`` and
    ``pipe.init_weights(seed=0)`` (the reference's init); else built on CPU, and loaded
    again from the reference model's whole state dict by ``pipe.load_state_dict``.
    ``n_layers``: the tiny LLaMA's depth; ``stages_per_rank``: fixed where given;
    ``inner="tp"``: the second mesh dim is ("pp", "tp"), every rank of a stage fed the same
    rows, the parameters as sharded as they can be (the parameter memory constraint)."""
    tensor_parallel = inner == "tp" and not pp_alone
    dp = 1 if pp_alone or tensor_parallel else world_size // 2
    width = world_size // 2
    shape, names = ((2,), ("pp",)) if pp_alone else ((2, width), ("pp", inner))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # whole microbatches between stages, rows split over dp (whole over tp)
    rows = (
        (Replicate(),) if pp_alone else (Replicate(), Replicate() if tensor_parallel else Shard(0))
    )
    all_batches = batches()
    if on_meta:
        with torch.device("meta"):
            model = Llama(llama_config("tiny", n_layers=n_layers))
    else:
        model = initialized_model(n_layers)
    policy = _policy(bf16)
    with AutoParallel(model, lambda: all_batches[0][0], mesh, policy, hardware="cpu") as autop:
        autop.add_pipeline_constraint(
            schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank
        )
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        if tensor_parallel:
            autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        # each dp rank's loss counts 1/dp of the batch's mean: the gradients sum over dp
        pipe = autop.apply_placement(
            plan, loss_fn=lambda out, tgt: F.mse_loss(out.float(), tgt) / dp
        )
    if on_meta:
        pipe.to_empty(device="cpu")
        pipe.init_weights(seed=0)
    else:
        pipe.load_state_dict(initialized_model(n_layers).state_dict())
    initial = _full_params(pipe)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    row = 0 if pp_alone or tensor_parallel else mesh.get_local_rank("dp")
    losses, grads = [], {}
    for step, (tokens, target) in enumerate(all_batches):
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        pipe.step(tokens.chunk(dp)[row], target=target.chunk(dp)[row], losses=step_losses)
        if step == 0:
            grads = {k: v for m in pipe.modules for k, v in full_grads(m).items()}
        optimizer.step()
        if step_losses:  # the mean over the microbatches of this rank's rows
            losses.append(float(torch.stack(step_losses).detach().mean()))
    params = _full_params(pipe)
    # a torch.distributed.checkpoint of every stage, loaded back over zeroed parameters
    dcp.save(pipe.state_dict(), checkpoint_id=checkpoint)
    with torch.no_grad():
        for param in pipe.parameters():
            param.zero_()
    state = pipe.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    pipe.load_state_dict(state, strict=False)  # this stage's entries only
    reloaded = _full_params(pipe)
    return {
        "reloaded_equal": all(torch.equal(params[k], reloaded[k]) for k in params),
        "initial": initial,
        "state_keys": sorted(state),
        "whole_model_on_meta": all(t.is_meta for t in (*model.parameters(), *model.buffers())),
        "stage": plan.pipeline.stage_index,
        "rank_stages": plan.pipeline.rank_stages,
        "order": torch_order(pipe.schedule),
        "stages": plan.pipeline.stages,
        "losses": losses,
        "grads": grads,
        "params": params,
        "input_placements": [str(p) for p in plan.input_placements],
        "param_placements": {k: str(v) for k, v in plan.param_placements.items()},
        "pipeline": plan.pipeline,
    }


def _full_params(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v for module in pipe.modules for k, v in full_params(module).items()}


def torch_order(schedule: Any) -> dict[int, list[tuple[int, str, int]]] | None:
    """torch's own order of every rank's passes (multi-stage schedules only): (stage,
    "forward"/"backward", microbatch), to compare with cost/pipeline.py's."""
    order = getattr(schedule, "pipeline_order", None)
    if order is None:
        return None
    kinds = {"FORWARD": "forward", "FULL_BACKWARD": "backward"}
    return {
        rank: [
            (a.stage_index, kinds[a.computation_type.name], a.microbatch_index)
            for a in actions
            if a is not None and a.computation_type.name in kinds
        ]
        for rank, actions in order.items()
    }
