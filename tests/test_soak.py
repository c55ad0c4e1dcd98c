"""A short soak (benchmarks/soak.py, whose full runs are measurements): fresh launches of
the tiny LLaMA on 2 gloo ranks, as a user launches them, under glibc's heap checks, each
training 5 steps to the one-device losses with the same collectives on both ranks, and
leaving without an abort (at exit included) and without a collective thread left over."""

from __future__ import annotations

from benchmarks.soak import launch, reference_losses

LAUNCHES = 2
TIMEOUT_S = 300.0


def test_fresh_launches_train_right_and_exit_clean(tmp_path):
    reference = reference_losses("llama-tiny")
    for _ in range(LAUNCHES):
        result = launch("llama-tiny", 2, False, TIMEOUT_S, tmp_path, reference)
        assert result.outcome == "ok", result.detail
