"""dynamic=True: other input sizes are traced again and checked against the plan."""

from __future__ import annotations

import pytest
import torch
from conftest import meta
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, InputMismatchError
from autoparallel.models import MLP
from autoparallel.runtime.dynamic import DynamicShapeError, check_same_structure
from autoparallel.trace.export import trace_joint

DP = (Shard(0), Replicate())


def _parallel(fake_mesh, dynamic, hidden_placements=None):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    model = meta(lambda: MLP(16, 32, hidden_placements=hidden_placements))
    with AutoParallel(model, lambda: torch.empty(8, 16), mesh, dynamic=dynamic) as autop:
        autop.add_input_constraints([DP])
        autop.add_output_constraints([DP])
        return autop.apply_placement(autop.optimize_placement())


def test_a_size_the_plan_does_not_divide_is_a_clear_error(fake_mesh):
    # the hidden activation is pinned to batch sharded over both mesh dims: global batch % 4 == 0
    parallel = _parallel(fake_mesh, True, hidden_placements=(Shard(0), Shard(0)))
    runtime = parallel._autoparallel
    local = torch.empty(3, 16, device="meta")  # global batch 6
    with pytest.raises(
        DynamicShapeError,
        match=r"global shape \(6, 32\) laid out S\(0\)S\(0\): dim 0 is 6, not a multiple of 4",
    ):
        runtime.for_inputs([local], runtime.joint.in_spec)
    other = runtime.for_inputs(
        [torch.empty(6, 16, device="meta")], runtime.joint.in_spec
    )  # global 12: fine
    assert other is not runtime
    assert tuple(other.joint.user_inputs[0].meta["val"].shape) == (12, 16)
    assert (
        runtime.for_inputs([torch.empty(6, 16, device="meta")], runtime.joint.in_spec) is other
    )  # traced once


def test_without_dynamic_another_size_is_an_input_mismatch(fake_mesh):
    parallel = _parallel(fake_mesh, False)
    runtime = parallel._autoparallel
    with pytest.raises(InputMismatchError, match="plan with dynamic=True to accept other sizes"):
        runtime.for_inputs([torch.empty(6, 16, device="meta")], runtime.joint.in_spec)
    with pytest.raises(InputMismatchError, match="expected 2 dimensions"):
        runtime.for_inputs([torch.empty(6, 16, 1, device="meta")], runtime.joint.in_spec)


def test_a_graph_that_changes_with_the_size_is_named():
    device = torch.device("cpu")
    planned = trace_joint(meta(lambda: MLP(16, 32)), lambda: torch.empty(8, 16), device)
    changed = trace_joint(meta(lambda: MLP(16, 32, bias=False)), lambda: torch.empty(4, 16), device)
    with pytest.raises(DynamicShapeError, match="differs from the planned one at node"):
        check_same_structure(planned, changed, "(2, 16)")
