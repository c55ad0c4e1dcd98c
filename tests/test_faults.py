"""Faults on gloo ranks: a rank lost in the middle of a step makes the others raise
``RankLostError`` naming it (no hang; ``run_distributed``'s own timeout is the guard), and a
run checkpointed with torch.distributed.checkpoint, killed and resumed in fresh processes
trains exactly as one that was never interrupted. The gloo messages the error is built from
are checked on their own, without processes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.fault_cases import lose_rank_mid_step, resume_and_uninterrupted, train_then_killed
from helpers.runtime_cases import TOLERANCE

from autoparallel import RankLostError, translate_rank_loss
from autoparallel.runtime import faults
from autoparallel.runtime.launch import run_distributed

COLLECTIVE_TIMEOUT_S = 10.0
HANG_GUARD_S = 300  # run_distributed's own timeout: a hang fails the test instead of blocking


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_lost_rank_is_named_by_the_survivor(tmp_path, how):
    with pytest.raises(RuntimeError, match="rank 1 of 2") as lost:
        run_distributed(
            lose_rank_mid_step,
            2,
            how,
            str(tmp_path),
            COLLECTIVE_TIMEOUT_S,
            timeout_s=HANG_GUARD_S,
        )
    assert "timed out" not in str(lost.value)  # the victim ended; nobody hung
    found = json.loads((tmp_path / "rank0.json").read_text())
    assert found["type"] == "RankLostError", found
    assert found["lost_rank"] == 1
    assert found["timed_out"] == (how == "hang")
    assert found["phase"] == {"kill": "forward", "hang": "backward"}[how]  # both translate
    message = found["message"]
    assert "\n" not in message
    assert message.startswith("rank 1 ")
    assert "restart every rank from the last checkpoint" in message
    if how == "hang":
        assert f"within {COLLECTIVE_TIMEOUT_S:g} s, the collective timeout" in message


def test_resumed_run_equals_uninterrupted(tmp_path):
    with pytest.raises(RuntimeError, match="code -9"):  # run B: killed after step 4's save
        run_distributed(train_then_killed, 2, str(tmp_path), timeout_s=HANG_GUARD_S)
    assert (tmp_path / "b" / "step4" / ".metadata").exists()
    assert not (tmp_path / "b" / "step6").exists()
    results = run_distributed(resume_and_uninterrupted, 2, str(tmp_path), timeout_s=HANG_GUARD_S)
    for result in results:
        resumed, uninterrupted = result["resumed"], result["uninterrupted"]
        assert sorted(resumed["losses"]) == [5, 6]
        for step in (5, 6):
            assert resumed["losses"][step] == pytest.approx(
                uninterrupted["losses"][step], abs=TOLERANCE
            )
        assert uninterrupted["losses"][6] < uninterrupted["losses"][1]  # it did train
        for name, value in uninterrupted["params"].items():
            assert torch.allclose(resumed["params"][name], value, rtol=0, atol=TOLERANCE), name


# ---------------------------------------------------------------- gloo's messages, mapped

CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:{port}. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF!"
)
TIMED_OUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "10000ms for recv operation to complete"
)


@pytest.fixture
def peers():
    """The port table of a 3-rank mesh as rank 0 would have gathered it."""
    return faults.PeerPorts(
        {0: frozenset({29500, 41000}), 1: frozenset({45061, 33179}), 2: frozenset({54848})}
    )


@pytest.mark.parametrize("port", [45061, 1456])  # as is, and in network byte order
def test_closed_connection_names_the_rank_holding_the_port(peers, port):
    error = faults.as_rank_lost(RuntimeError(CLOSED.format(port=port)), peers)
    assert isinstance(error, RankLostError)
    assert error.lost_rank == 1 and not error.timed_out
    assert str(error).startswith("rank 1 was lost")


def test_unknown_address_and_timeout_name_no_rank_on_larger_meshes(peers):
    closed = faults.as_rank_lost(RuntimeError(CLOSED.format(port=1234)), peers)
    assert closed is not None and closed.lost_rank is None
    assert "a peer rank was lost" in str(closed) and "[127.0.0.1]:1234" in str(closed)
    timed_out = faults.as_rank_lost(RuntimeError(TIMED_OUT), peers)
    assert timed_out is not None and timed_out.lost_rank is None and timed_out.timed_out
    assert "within 10 s, the collective timeout" in str(timed_out)


def test_timeout_names_the_only_peer(monkeypatch):
    monkeypatch.setattr(faults.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(faults.dist, "get_rank", lambda: 0)
    two_ranks = faults.PeerPorts({0: frozenset({1}), 1: frozenset({2})})
    error = faults.as_rank_lost(RuntimeError(TIMED_OUT), two_ranks)
    assert error is not None and error.lost_rank == 1
    assert str(error).startswith("rank 1 did not answer rank 0 within 10 s")


def test_translate_rank_loss_keeps_other_errors_and_the_cause():
    with pytest.raises(ValueError, match="unrelated"), translate_rank_loss():
        raise ValueError("unrelated")
    with pytest.raises(RuntimeError, match="shape mismatch") as other, translate_rank_loss():
        raise RuntimeError("shape mismatch")
    assert type(other.value) is RuntimeError
    with pytest.raises(RankLostError) as lost, translate_rank_loss():
        raise RuntimeError(TIMED_OUT)
    assert "Timed out waiting" in str(lost.value.__cause__)


def test_rank_lost_error_pickles_whole():
    import pickle

    error = pickle.loads(pickle.dumps(RankLostError("rank 1 was lost", 0, 1, False)))
    assert (str(error), error.rank, error.lost_rank, error.timed_out) == (
        "rank 1 was lost",
        0,
        1,
        False,
    )
