"""Per-rank bodies of the fault tests: a rank lost in the middle of a step, and a run
checkpointed with torch.distributed.checkpoint, killed and resumed in fresh processes.

Every body plans the MLP with its parameters sharded (FSDP-like: the forward gathers them,
the backward reduce-scatters their gradients, so every phase of a step communicates) on a
1-D gloo mesh of all ranks and trains it with AdamW on this rank's rows of a global batch.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel, RankLostError, translate_rank_loss
from autoparallel._testing.harness import full_params
from autoparallel.models import MLP

LR = 1e-2
ROWS = 256  # global batch rows


def batch_at(step: int) -> torch.Tensor:
    """The global batch of ``step``: the same in every run, whatever step it resumes from."""
    return torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(1000 + step))


def parallel_mlp(
    mesh: DeviceMesh, collective_timeout: float | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The planned, materialized (``init_weights(seed=0)``) MLP and its AdamW."""
    with torch.device("meta"):
        model = MLP(64, 256)
    with AutoParallel(model, lambda: torch.empty(ROWS, 64), mesh, hardware="cpu") as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, collective_timeout=collective_timeout)
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    return parallel, torch.optim.AdamW(parallel.parameters(), lr=LR)


def _rows(batch: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return batch.chunk(mesh.size())[mesh.get_local_rank()]


def _global_loss(output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """mean(output^2) over the global batch, as this rank's share (the ranks' sum is it)."""
    return output.pow(2).sum() / (output.numel() * mesh.size())


# ------------------------------------------------------------------------------ a lost rank


def lose_rank_mid_step(
    rank: int, world_size: int, how: str, directory: str, collective_timeout: float
) -> None:
    """Train; at step 1 the last rank dies (``how="kill"``: ``os._exit`` before its forward,
    so the others fail in their forward's parameter gathers) or hangs (``how="hang"``: it
    sleeps between its forward and its backward, its sockets open, until the others have
    reported, so they fail in their backward's gradient reductions). Each other rank writes
    what its step raised to ``directory/rank<r>.json``: ``{"type", "message", "lost_rank",
    "timed_out", "phase"}`` (phase: "forward" or "backward", the call that raised)."""
    mesh = init_device_mesh("cpu", (world_size,))
    parallel, optimizer = parallel_mlp(mesh, collective_timeout)
    victim = world_size - 1
    report = Path(directory) / f"rank{rank}.json"
    for step in range(3):
        phase = "forward"
        try:
            if step == 1 and rank == victim and how == "kill":
                os._exit(17)
            output = parallel(_rows(batch_at(step), mesh))
            if step == 1 and rank == victim and how == "hang":
                _hang(directory, world_size)
            phase = "backward"
            _global_loss(output, mesh).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except RankLostError as error:
            found = {
                "type": type(error).__name__,
                "message": str(error),
                "lost_rank": error.lost_rank,
                "timed_out": error.timed_out,
                "phase": phase,
            }
            report.write_text(json.dumps(found))
            return
    report.write_text(json.dumps({"type": None, "message": "every step finished"}))


def _hang(directory: str, world_size: int) -> None:
    """Alive, connections open, never sending; the rank goes once the others reported."""
    survivors = [Path(directory) / f"rank{r}.json" for r in range(world_size - 1)]
    while not all(path.exists() for path in survivors):
        time.sleep(0.05)
    os._exit(18)


# ------------------------------------------------------------------------------ checkpoints


def _save(parallel: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    model_state, optimizer_state = get_state_dict(parallel, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))


def _load(parallel: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    model_state, optimizer_state = get_state_dict(parallel, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        parallel,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def _train(
    mesh: DeviceMesh,
    directory: Path,
    steps: int,
    save_every: int,
    resume_from: int | None = None,
    kill_after_save: int | None = None,
) -> dict[str, Any]:
    """Train to ``steps``, saving to ``directory/step<n>`` after every ``save_every``-th
    step; from the checkpoint of step ``resume_from`` if given. With ``kill_after_save``
    every rank SIGKILLs itself once that step's checkpoint is written."""
    parallel, optimizer = parallel_mlp(mesh)
    first = 0
    if resume_from is not None:
        _load(parallel, optimizer, directory / f"step{resume_from}")
        first = resume_from
    losses = {}
    for step in range(first, steps):
        with translate_rank_loss(parallel):
            loss = _global_loss(parallel(_rows(batch_at(step), mesh)), mesh)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total, group=mesh.get_group())
        losses[step + 1] = total.item()
        if (step + 1) % save_every == 0:
            _save(parallel, optimizer, directory / f"step{step + 1}")
            if step + 1 == kill_after_save:
                dist.barrier()  # every rank's shards and the metadata are written
                os.kill(os.getpid(), signal.SIGKILL)
    return {"losses": losses, "params": full_params(parallel)}


def train_then_killed(rank: int, world_size: int, directory: str) -> None:
    """Run B: 4 steps, saving at 2 and 4, then every rank is killed."""
    mesh = init_device_mesh("cpu", (world_size,))
    _train(mesh, Path(directory) / "b", steps=4, save_every=2, kill_after_save=4)


def resume_and_uninterrupted(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """In fresh processes: run C (B's checkpoint of step 4, trained to 6) and run A (6 steps
    from the init, saving every 2), each with its own module and optimizer."""
    mesh = init_device_mesh("cpu", (world_size,))
    resumed = _train(mesh, Path(directory) / "b", steps=6, save_every=2, resume_from=4)
    uninterrupted = _train(mesh, Path(directory) / "a", steps=6, save_every=2)
    return {"resumed": resumed, "uninterrupted": uninterrupted}


def train_then_shut_down(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    """Train the sharded MLP a step, drop it, then leave with ``shutdown_distributed``: the
    gloo collective threads running before the shutdown and those still running after."""
    from autoparallel import shutdown_distributed
    from autoparallel.runtime.shutdown import collective_threads

    _train_one_step(rank, world_size)  # the module and the mesh die when it returns
    before = collective_threads()
    return before, shutdown_distributed()


def _train_one_step(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    parallel, optimizer = parallel_mlp(mesh)
    _global_loss(parallel(_rows(batch_at(0), mesh)), mesh).backward()
    optimizer.step()
