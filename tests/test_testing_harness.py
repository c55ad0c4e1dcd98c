"""The multi-process harness (autoparallel._testing.harness) on real gloo process groups.

The FSDP2 test is the pattern the runtime tests follow: train a known-good sharding on
LOCAL per-rank batch slices and compare with the single-process reference.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from autoparallel._testing.harness import full_grads, full_params, gather_full, reference_training
from autoparallel.models import MLP
from autoparallel.runtime.launch import RankPool, run_distributed

DIM, HIDDEN, BATCH, STEPS, LR = 16, 32, 8, 2, 1e-2


# Rank functions must live at module level so the spawned processes can unpickle them.


def _all_reduce_rank(rank: int, world_size: int, scale: int = 1, offset: float = 0.0) -> dict:
    value = torch.tensor([float(rank + 1) * scale + offset])
    dist.all_reduce(value)
    return {"rank": rank, "world_size": world_size, "sum": value.item()}


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one exploded on purpose")
    return rank


def _fail_while_peer_waits(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("rank one failed before the collective")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: its peer never joins


def _cores(rank: int, world_size: int) -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _hang(rank: int, world_size: int) -> None:
    time.sleep(600)


def make_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randn(BATCH, DIM, generator=generator) for _ in range(STEPS)]


def make_mlp() -> MLP:
    model = MLP(DIM, HIDDEN)
    model.init_weights(seed=0)
    return model


def _fsdp2_mlp(rank: int, world_size: int, batches: list[torch.Tensor]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = MLP(DIM, HIDDEN)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = BATCH // world_size
    losses, grads = [], None
    for step in range(STEPS):
        local = batches[step][rank * rows : (rank + 1) * rows]
        optimizer.zero_grad(set_to_none=True)
        loss = model(local).float().pow(2).mean()
        loss.backward()
        if step == 0:
            grads = full_grads(model)
        optimizer.step()
        # gloo has no ReduceOp.AVG: sum the per-rank means, then divide.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
    placements = {name: tuple(p.placements) for name, p in model.named_parameters()}
    grad_is_dtensor = all(type(p.grad).__name__ == "DTensor" for p in model.parameters())
    return {
        "losses": losses,
        "params": full_params(model),
        "grads": grads,
        "placements": placements,
        "grad_is_dtensor": grad_is_dtensor,
    }


def test_run_distributed_returns_values_in_rank_order():
    results = run_distributed(_all_reduce_rank, 2, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert [r["sum"] for r in results] == [3.0, 3.0]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_pinned_ranks_run_on_one_core_each_in_turn():
    cores = sorted(os.sched_getaffinity(0))
    pinned = run_distributed(_cores, 3, timeout_s=60, pin_cores=True)
    assert pinned == [[cores[rank % len(cores)]] for rank in range(3)]
    assert run_distributed(_cores, 2, timeout_s=60) == [cores, cores]  # unpinned by default


def test_run_distributed_passes_arguments():
    # run_distributed's own timeout_s bounds the call, so this cannot hang
    results = run_distributed(_all_reduce_rank, 2, 10, timeout_s=60, offset=0.5)
    assert [r["sum"] for r in results] == [31.0, 31.0]


def test_run_distributed_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match="^rank 1 of 2 failed") as info:
        run_distributed(_fail_on_rank_one, 2, timeout_s=60)
    message = str(info.value)
    assert "ValueError: rank one exploded on purpose" in message
    assert "Traceback" in message and "_fail_on_rank_one" in message


def test_a_failing_rank_does_not_leave_its_peer_hanging():
    # a peer left hanging would end in run_distributed's "timed out" error instead
    with pytest.raises(RuntimeError, match="^rank 1 of 2 failed") as info:
        run_distributed(_fail_while_peer_waits, 2, timeout_s=60)
    assert "rank one failed before the collective" in str(info.value)
    assert "timed out" not in str(info.value)


def test_run_distributed_times_out_and_kills_children():
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="timed out"):
        run_distributed(_hang, 2, timeout_s=8)
    # every rank it started is gone (active_children also reaps the finished ones)
    assert set(multiprocessing.active_children()) - before == set()


def test_gather_full_leaves_plain_tensors_alone():
    tensor = torch.arange(4.0)
    assert gather_full(tensor) is tensor
    assert gather_full(None) is None


def test_reference_training_shapes_and_custom_loss():
    batches = make_batches()
    ref = reference_training(make_mlp, batches, steps=STEPS, lr=LR)
    assert len(ref["losses"]) == STEPS and ref["losses"][1] < ref["losses"][0]
    assert (
        set(ref["params"]) == set(ref["grads"]) == {"w1.weight", "w1.bias", "w2.weight", "w2.bias"}
    )
    assert not torch.equal(ref["params"]["w1.weight"], make_mlp().w1.weight.detach())

    def l1(output, batch):
        return (output - batch).abs().mean()

    other = reference_training(make_mlp, batches, steps=1, lr=LR, loss_fn=l1)
    expected = (make_mlp()(batches[0]) - batches[0]).abs().mean().item()
    assert other["losses"][0] == pytest.approx(expected)


def test_fsdp2_matches_reference_training():
    batches = make_batches()
    ref = reference_training(make_mlp, batches, steps=STEPS, lr=LR)
    results = run_distributed(_fsdp2_mlp, 2, batches, timeout_s=120)
    for result in results:
        assert result["grad_is_dtensor"]
        assert all(len(p) == 1 and p[0].is_shard(0) for p in result["placements"].values())
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5
        )
        for name, value in ref["grads"].items():
            torch.testing.assert_close(result["grads"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        for name, value in ref["params"].items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name
            )


def _pid_and_sum(rank: int, world_size: int, scale: int = 1) -> tuple[int, float]:
    import os

    value = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(value)
    return os.getpid(), value.item()


def test_a_rank_pool_reuses_its_ranks_and_restarts_after_a_failure():
    with RankPool(2) as pool:
        first = pool.run(_pid_and_sum, timeout_s=60)
        second = pool.run(_pid_and_sum, 10, timeout_s=60)
        assert [value for _, value in first] == [3.0, 3.0]
        assert [value for _, value in second] == [30.0, 30.0]
        assert [pid for pid, _ in first] == [pid for pid, _ in second], "the same processes"
        with pytest.raises(RuntimeError, match="^rank 1 of 2 failed") as info:
            pool.run(_fail_while_peer_waits, timeout_s=60)
        assert "rank one failed before the collective" in str(info.value)
        third = pool.run(_pid_and_sum, timeout_s=60)
        assert [value for _, value in third] == [3.0, 3.0]
        assert not {pid for pid, _ in third} & {pid for pid, _ in first}, "fresh ranks"
