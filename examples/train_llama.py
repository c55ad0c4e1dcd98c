"""Train a tiny LLaMA with the plan autoparallel finds, on real processes.

    torchrun --nproc_per_node 2 examples/train_llama.py --steps 5

Uses gloo on CPU (nccl when CUDA is available). The model is built on the meta device,
planned on a 1-D mesh of all ranks (batch sharded in and out, parameter memory pushed
toward 1/world-size), turned into a parallel module whose parameters are DTensors, then
materialized and initialized. Each rank feeds its LOCAL rows of one global token batch
(batch 8, sequence 32) and rank 0 prints the global loss of every step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

if __package__ in (None, ""):  # run from a checkout: make `autoparallel` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autoparallel import AutoParallel, serial_gloo_backend, shutdown_distributed
from autoparallel.models import Llama, llama_config

GLOBAL_BATCH, SEQ = 8, 32


def setup() -> tuple[torch.device, int, int]:
    """Join the process group torchrun describes; return (device, rank, world size)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        # gloo with one worker thread per group: several in flight are safe (docs/usage.md)
        dist.init_process_group(serial_gloo_backend())
        device = torch.device("cpu")
    return device, dist.get_rank(), dist.get_world_size()


def token_batch(step: int, vocab: int) -> torch.Tensor:
    """The global batch of step ``step``: identical on every rank (seeded by the step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=generator)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    device, rank, world_size = setup()
    try:
        if not hasattr(AutoParallel, "apply_placement"):
            if rank == 0:
                print(
                    "error: AutoParallel.apply_placement is not implemented yet in this checkout, "
                    "so the planned model cannot be run; see README.md (Status).",
                    file=sys.stderr,
                )
            return 1
        if GLOBAL_BATCH % world_size:
            raise SystemExit(
                f"the global batch ({GLOBAL_BATCH}) must divide evenly over {world_size} ranks"
            )
        train(args, device, rank, world_size)
        return 0
    finally:
        shutdown_distributed()  # joins gloo's threads before the interpreter exits


def train(args: argparse.Namespace, device: torch.device, rank: int, world_size: int) -> None:
    config = llama_config("tiny")
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = Llama(config)

    def input_fn() -> torch.Tensor:  # GLOBAL example inputs, for planning only
        return torch.randint(0, config.vocab_size, (GLOBAL_BATCH, SEQ))

    with AutoParallel(model, input_fn, mesh) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    parallel.to_empty(device=device)
    parallel.init_weights(seed=0)
    if rank == 0:
        sharded = sum(any(p.is_shard() for p in pl) for pl in plan.param_placements.values())
        print(
            f"plan: {sharded} of {len(plan.param_placements)} parameters sharded over {world_size} ranks"
        )

    optimizer = torch.optim.AdamW(parallel.parameters(), lr=args.lr)
    rows = GLOBAL_BATCH // world_size
    for step in range(args.steps):
        tokens = token_batch(step, config.vocab_size)[rank * rows : (rank + 1) * rows].to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        logits = parallel(inputs)  # LOCAL logits of this rank's rows
        # The parallel module computes the GLOBAL model: gradients are those of the sum of
        # the ranks' losses. Normalizing by the global token count makes that sum the
        # global mean loss, so gradients equal the single-device ones.
        global_tokens = GLOBAL_BATCH * targets.shape[1]
        loss = (
            F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            / global_tokens
        )
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(parallel.parameters(), 1.0)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # the global mean loss
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if rank == 0:
            print(f"step {step}: loss {global_loss.item():.4f}  grad norm {grad_norm.item():.4f}")


if __name__ == "__main__":
    sys.exit(main())
