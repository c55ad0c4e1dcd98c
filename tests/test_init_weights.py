"""Initialization code written for one device, run on the parallel module (runtime/init.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.init_cases import (
    SEED,
    init_and_train_titan,
    plan_titan,
    titan_args,
    titan_batches,
    titan_reference,
)
from helpers.runtime_cases import LR, STEPS, TOLERANCE, assert_trained_alike, max_error
from torch.distributed.tensor import Replicate, distribute_tensor

from autoparallel import AutoParallel, InitError, full_value_init
from autoparallel._testing.harness import reference_training
from autoparallel.models.titan_like import TitanLlama


def _loss(output, batch):
    return output.float().pow(2).mean()


# untied on a (2, 2) dp x tp mesh; tied on 2 ranks (the tie is what it adds)
@pytest.mark.parametrize(
    "tied,world_size", [(False, 4), (True, 2)], ids=["untied", "tied-embeddings"]
)
def test_torchtitan_style_init_weights_gives_single_device_values(ranks, tied, world_size):
    """The model's own init_weights on the FSDP-sharded parallel module (nn.init draws, a new
    full Parameter assigned, a write through .data[:], a recomputed rotary buffer with a second
    name, a submodule's load_state_dict) gives the single-device values from the same seed,
    keeps the parameter objects the optimizer holds, and trains to the single-device numbers."""
    reference_init = {name: p.detach() for name, p in titan_reference(tied).named_parameters()}
    reference = reference_training(
        lambda: titan_reference(tied), titan_batches(), STEPS, LR, loss_fn=_loss
    )
    results = ranks(world_size).run(init_and_train_titan, tied, timeout_s=600)
    placements = results[0]["param_placements"]
    assert all("S(" in p for p in placements.values()), placements
    for result in results:
        assert result["same_objects"]
        assert result["tied"] == tied
        assert set(result["initial"]) == set(reference_init)
        assert max_error(result["initial"], reference_init) == 0.0
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
        assert_trained_alike(result, reference)


@pytest.fixture
def parallel_titan(fake_mesh):
    """The parallel TitanLlama on a fake (2, 2) mesh, materialized and initialized."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model = TitanLlama(titan_args(tied=False))
    _, parallel = plan_titan(model, mesh, titan_batches()[0])
    parallel.to_empty(device="cpu")
    torch.manual_seed(SEED)
    parallel.init_weights()
    return parallel


def test_wrong_assignments_within_full_value_init_raise_with_what_to_do(parallel_titan):
    """`.data = ...`, a tensor of another shape or of a dtype torch would not cast to the
    planned one, and a DTensor of another placement each raise at once, naming the parameter
    and what to do instead; a safe cast is copied (one plan for every case: planning is the
    expensive part)."""
    with pytest.raises(
        InitError, match=r"output\.weight was assigned with `\.data = \.\.\.`.*copy_"
    ):
        with full_value_init(parallel_titan):
            parallel_titan.output.weight.data = torch.zeros(parallel_titan.output.weight.shape)
    # a DTensor value would leave the shards as they were without a trace: raised at once
    weight = parallel_titan.output.weight
    zeros = distribute_tensor(
        torch.zeros(weight.shape), weight.device_mesh, weight.placements, src_data_rank=None
    )
    with pytest.raises(InitError, match=r"output\.weight was assigned with `\.data"):
        with full_value_init(parallel_titan):
            weight.data = zeros
    wq = parallel_titan.layers["0"].attention.wq
    with pytest.raises(
        InitError, match=r"layers\.0\.attention\.wq\.weight: .*shape \(3, 3\).*planned"
    ):
        with full_value_init(parallel_titan):
            wq.weight = nn.Parameter(torch.zeros(3, 3))
    replicated = distribute_tensor(
        torch.zeros(wq.weight.shape), wq.weight.device_mesh, [Replicate()] * 2
    )
    with pytest.raises(InitError, match="tie them in the model before planning"):
        with full_value_init(parallel_titan):
            wq.weight = nn.Parameter(replicated)
    # another dtype: copied where torch casts it safely (the reference implementation's own
    # test assigns torch.arange to a float32 buffer), refused where it does not
    table = parallel_titan.freqs_cis
    positions = torch.arange(table.numel()).view(table.shape)  # int64
    with full_value_init(parallel_titan):
        parallel_titan.freqs_cis = positions
    assert parallel_titan.freqs_cis is table and table.dtype == torch.float32
    assert torch.equal(table.full_tensor(), positions.float())
    with pytest.raises(InitError, match=r"wq\.weight: assigned a torch\.complex64 tensor"):
        with full_value_init(parallel_titan):
            wq.weight = nn.Parameter(torch.zeros(wq.weight.shape, dtype=torch.complex64))


def test_assignments_outside_init_weights(parallel_titan):
    """full_value_init around user code: the assigned value lands as the plan's shard; a
    `.data` write without it is caught by the next forward."""
    weight = parallel_titan.output.weight
    full = torch.arange(weight.numel(), dtype=torch.float32).view(weight.shape)
    with full_value_init(parallel_titan):
        parallel_titan.output.weight = nn.Parameter(full)
    assert parallel_titan.output.weight is weight
    expected = distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None)
    assert torch.equal(weight.to_local(), expected.to_local())

    weight.data = torch.zeros(weight.shape)
    tokens = torch.zeros(4, 32, dtype=torch.long)  # the local rows of the planned batch
    with pytest.raises(InitError, match=r"output\.weight was assigned with `\.data"):
        parallel_titan(tokens)


def test_full_value_init_names_what_it_expects():
    with pytest.raises(TypeError, match="expects a parallel module"):
        with full_value_init(nn.Linear(2, 2)):
            pass


def test_hugging_face_init_weights_on_the_parallel_module_equals_one_device(fake_mesh):
    """HF's own init_weights (normal_ per module, zeroed norms' biases) on a parallel LLaMA
    built on meta gives every rank the shard of the single-device values (same seed)."""
    pytest.importorskip("transformers")
    from autoparallel.models.hf_families import (
        NO_DROPOUT,
        build_hf_family,
        hf_family,
        hf_family_inputs,
    )

    mesh = fake_mesh((2, 2), ("dp", "tp"))
    family = hf_family("llama")
    inputs = hf_family_inputs(family, 4, 16, torch.Generator().manual_seed(0), False)
    with AutoParallel(
        build_hf_family(family, "meta", **NO_DROPOUT), lambda: inputs, mesh, hardware="cpu"
    ) as autop:
        autop.add_parameter_memory_constraint()
        parallel = autop.apply_placement(autop.optimize_placement())
    parallel.to_empty(device="cpu")
    torch.manual_seed(SEED)
    parallel.init_weights()
    reference = build_hf_family(family, "meta", **NO_DROPOUT)
    reference.to_empty(device="cpu")
    torch.manual_seed(SEED)
    reference.init_weights()
    expected = dict(reference.named_parameters())
    sharded = 0
    for name, param in parallel.named_parameters():
        shard = distribute_tensor(
            expected[name].detach(), mesh, param.placements, src_data_rank=None
        )
        assert torch.equal(param.to_local(), shard.to_local()), name
        sharded += any(p.is_shard() for p in param.placements)
    assert sharded > 0
