"""A short soak (benchmarks/soak.py, whose full runs are measurements): fresh launches as a
user launches them, under glibc's heap checks, each training 5 steps to the one-device
losses with the same collectives on every rank, and leaving without an abort (at exit
included) and without a collective thread left over. One launch of the MLP on 4 ranks as a
(2, 2) dp x tp mesh, its parameters sharded over both dims: two process groups per rank
with collectives of both in flight, where gloo's two-worker groups corrupted the heap
(runtime/gloo.py). The LLaMA and the MoE soak in the benchmark, 50 launches each. (Fresh
2-rank launches on one group: tests/test_faults.py and tests/test_shutdown.py.)"""

from __future__ import annotations

from benchmarks.soak import launch, reference_losses

TIMEOUT_S = 300.0


def test_a_fresh_launch_trains_right_and_exits_clean(tmp_path):
    reference = reference_losses("mlp")
    result = launch("mlp", 4, "2d", False, TIMEOUT_S, tmp_path, reference)
    assert result.outcome == "ok", result.detail
    # every step gathered parameters and reduced gradients over the groups
    assert result.issued and all(n > 0 for n in result.issued), result.issued
