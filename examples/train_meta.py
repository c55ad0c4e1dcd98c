"""The meta-device workflow: build on meta, plan, materialize shards, init or load, train.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_meta.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_meta.py --compile
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_meta.py --checkpoint full.pt

Needs exactly 4 ranks: gloo on CPU (nccl when CUDA is available). Steps:

1. build the tiny LLaMA-style model under ``torch.device("meta")`` (no memory is allocated);
2. plan it with ``AutoParallel`` on a 2-D mesh (2, 2) named ("dp", "tp"): the token batch
   (and the logits) sharded on batch over dp, parameter memory pushed toward 1/world-size,
   and mixed precision (parameters stored in float32, computed in bfloat16, gradients
   reduced in float32);
3. ``apply_placement``: the parallel module, its parameters DTensors still on meta;
4. ``to_empty``: allocate this rank's shards only;
5. fill them: ``init_weights(seed=...)`` (the same values as the unsharded model), or with
   ``--checkpoint PATH`` the full tensors of ``torch.save(model.state_dict())`` of the
   unsharded model, which ``load_state_dict`` shards on the way in;
6. optionally ``torch.compile(parallel, backend=autoparallel_backend(), fullgraph=True)``;
7. train with AdamW; rank 0 prints the plan summary and the global loss of every step.

A checkpoint this script can load (same model config), written on one process:

    python -c "import torch, train_meta as t; m = t.build_model('cpu'); m.init_weights(seed=1); \
torch.save(m.state_dict(), 'full.pt')"          # run from examples/
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

if __package__ in (None, ""):  # run from a checkout: make `autoparallel` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autoparallel import (
    AutoParallel,
    Plan,
    autoparallel_backend,
    serial_gloo_backend,
    shutdown_distributed,
)
from autoparallel.models import Llama, llama_config
from autoparallel.types.placements import placement_str

MESH_SHAPE, MESH_NAMES = (2, 2), ("dp", "tp")
WORLD_SIZE = MESH_SHAPE[0] * MESH_SHAPE[1]
CONFIG = llama_config("tiny")  # 2 layers, dim 64, 4 heads (2 kv heads), vocab 256
GLOBAL_BATCH, SEQ = 8, 32
MP_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BATCH_OVER_DP = (
    Shard(0),
    Replicate(),
)  # mesh order: dim 0 of the tokens over dp, same on every tp rank
LAUNCH = f"OMP_NUM_THREADS=1 torchrun --nproc_per_node {WORLD_SIZE} examples/train_meta.py"


def build_model(device: str = "meta") -> Llama:
    """The model of this example, uninitialized, on ``device``."""
    with torch.device(device):
        return Llama(CONFIG)


def token_batch(step: int) -> torch.Tensor:
    """The GLOBAL batch of step ``step`` (inputs and shifted targets), identical on every rank.

    Each row counts up by 7 (mod vocab) from a random start: a rule the model can learn in a
    few steps, so the loss visibly falls (on uniform random tokens it would stay at ln(vocab)).
    """
    generator = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=generator)
    return (start + 7 * torch.arange(SEQ + 1)) % CONFIG.vocab_size


def check_launch() -> str | None:
    """Why this process cannot run (not under torchrun, wrong world size), or None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return f"error: launch this example with torchrun, on {WORLD_SIZE} processes:\n    {LAUNCH}"
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != WORLD_SIZE:
        return (
            f"error: this example plans on a {MESH_SHAPE[0]}x{MESH_SHAPE[1]} mesh {MESH_NAMES} and needs "
            f"exactly {WORLD_SIZE} processes, got {world_size}; run:\n    {LAUNCH}"
        )
    return None


def setup() -> tuple[torch.device, int]:
    """Join the process group torchrun describes; return (device, rank)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank), dist.get_rank()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    # gloo with one worker thread per group: several in flight are safe (docs/usage.md)
    dist.init_process_group(serial_gloo_backend())
    return torch.device("cpu"), dist.get_rank()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--seed", type=int, default=0, help="init_weights seed (ignored with --checkpoint)"
    )
    parser.add_argument(
        "--checkpoint", metavar="PATH", help="full (unsharded) state dict saved by torch.save"
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile with autoparallel_backend()"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    problem = check_launch()
    if problem is not None:
        if os.environ.get("RANK", "0") == "0":  # one message, not one per rank
            print(problem, file=sys.stderr)
        return 2
    if args.checkpoint and not Path(args.checkpoint).is_file():
        if os.environ["RANK"] == "0":
            print(f"error: --checkpoint {args.checkpoint}: no such file", file=sys.stderr)
        return 2

    device, rank = setup()
    try:
        train(args, device, rank)
        return 0
    finally:
        shutdown_distributed()  # joins gloo's threads before the interpreter exits


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def train(args: argparse.Namespace, device: torch.device, rank: int) -> None:
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=MESH_NAMES)
    model = build_model("meta")  # 1. nothing allocated

    def input_fn() -> torch.Tensor:  # GLOBAL example inputs, for planning only
        return torch.empty(GLOBAL_BATCH, SEQ, dtype=torch.long)

    # 2.-3. plan and apply. Every rank traces the model and builds the problem (apply_placement
    # needs its graph); optimize_placement lets rank 0 solve and broadcasts its plan, so every
    # rank applies the very same plan.
    start = time.perf_counter()
    with AutoParallel(model, input_fn, mesh, mp_policy=MP_POLICY, hardware="cpu") as autop:
        autop.add_input_constraints([BATCH_OVER_DP])
        autop.add_output_constraints([BATCH_OVER_DP])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
        constraints = autop.sharding_optimizer.constraints()
    log(rank, f"planned in {time.perf_counter() - start:.1f} s")
    print_plan(rank, plan, constraints)

    # 4.-5. materialize this rank's shards, then fill them
    parallel.to_empty(device=device)
    if args.checkpoint:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        try:
            parallel.load_state_dict(state)  # full tensors: each rank keeps its own shard
        except (RuntimeError, ValueError) as exc:
            log(
                rank,
                f"error: {args.checkpoint} does not fit this example's model (Llama, llama_config('tiny')):\n{exc}",
            )
            raise SystemExit(2) from None
        parallel.reset_rotary()  # non-persistent buffers are not in a state dict
        log(rank, f"loaded {len(state)} full tensors from {args.checkpoint}")
    else:
        parallel.init_weights(seed=args.seed)
        log(rank, f"initialized with init_weights(seed={args.seed})")
    local_bytes = sum(
        p.to_local().numel() * p.to_local().element_size() for p in parallel.parameters()
    )
    full_bytes = sum(p.numel() * p.element_size() for p in parallel.parameters())
    log(
        rank,
        f"parameters: {local_bytes:,} bytes on this rank of {full_bytes:,} ({full_bytes / local_bytes:.2f}x less)",
    )

    # 6. optional compile (the first step compiles; the plan and gradients are unchanged)
    run = (
        torch.compile(parallel, backend=autoparallel_backend(), fullgraph=True)
        if args.compile
        else parallel
    )

    # 7. train
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=args.lr)
    dp_rank, dp_size = mesh.get_coordinate()[0], MESH_SHAPE[0]
    rows = GLOBAL_BATCH // dp_size
    for step in range(args.steps):
        start = time.perf_counter()
        tokens = token_batch(step)[dp_rank * rows : (dp_rank + 1) * rows].to(device)  # LOCAL rows
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        logits = run(inputs)  # LOCAL logits of this dp rank's rows, in bfloat16
        # The parallel module computes the GLOBAL model: gradients are those of the sum of the
        # losses over the distinct output shards (here: one per dp rank). Normalizing by the
        # global token count makes that sum the global mean loss.
        global_tokens = GLOBAL_BATCH * SEQ
        loss = (
            F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            / global_tokens
        )
        loss.backward()
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=mesh.get_group("dp"))  # tp ranks hold the same rows
        first = (
            ""
            if step
            else (", with compilation" if args.compile else ", with tracing the local graphs")
        )
        log(
            rank,
            f"step {step}: loss {global_loss.item():.4f}  ({1e3 * (time.perf_counter() - start):.0f} ms{first})",
        )


def print_plan(rank: int, plan: Plan, constraints: dict[str, str]) -> None:
    if rank != 0:
        return
    names = " x ".join(f"{n}={s}" for n, s in zip(MESH_NAMES, MESH_SHAPE))
    print(f"plan on mesh {names}: placements in mesh order ({', '.join(MESH_NAMES)})")
    for name, placements in plan.param_placements.items():
        if name.startswith("layers.0."):
            print(f"  {name:40s} {placement_str(placements)}")
    sharded = sum(any(p.is_shard() for p in pl) for pl in plan.param_placements.values())
    print(f"  ... {sharded} of {len(plan.param_placements)} parameters sharded")
    totals = plan.totals
    print(
        f"  estimated step: total {totals.total_us:.1f} us = compute {totals.compute_us:.1f} + "
        f"comm {totals.comm_us:.1f} + transition {totals.transition_us:.2f}"
    )
    mixed = sum(1 for name in constraints if name.startswith("mixed_precision:"))
    print(
        f"  constraints: {len(constraints)} ({mixed} keep a gradient unreduced until it is float32)"
    )
    print(
        f"  solver: {plan.solver.status}, {plan.solver.num_variables:,} variables, {plan.solver.time_s:.2f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
