"""Under ``torch.compile(..., backend=autoparallel_backend(), fullgraph=True)`` (Inductor's C++
path) the parallel module trains to the same numbers as the single-device model; its own
file so that a test worker runs it beside the eager runtime tests."""

from __future__ import annotations

import pytest
from helpers.runtime_cases import check_parallel_training


# the MLP runs Megatron's column/row split on 2 ranks; the LLaMA's plan recomputes a layer
# and shards some parameters; the MoE runs its token dispatch in local_map regions (opaque
# ops of the compiled graphs, each finding its body) with its experts over "ep". Each rank
# compiles its own graphs: a 2-D case costs twice the compile time of a 1-D one on this
# 2-core machine, so the compiled cases are 1-D (the eager ones cover 2-D meshes).
@pytest.mark.parametrize(
    "model_name,shape,kind",
    [("mlp", (2,), "tp"), ("llama", (2,), "recompute"), ("moe", (2,), "expert-parallel")],
)
def test_compiled_training_matches_single_device(ranks, references, model_name, shape, kind):
    check_parallel_training(ranks, references(model_name), model_name, shape, kind, compiled=True)
