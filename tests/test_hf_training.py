"""Hugging Face models as they come train on gloo ranks to the single-device numbers."""

from __future__ import annotations

import pytest
from helpers.hf_cases import (
    UNEVEN_VOCAB,
    hf_family_batches,
    hf_family_reference,
    train_hf_family,
    train_uneven_gpt2,
    uneven_gpt2_reference,
)
from helpers.runtime_cases import LR, STEPS, TOLERANCE, assert_trained_alike

from autoparallel._testing.harness import reference_training

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "name,world_size",
    [("llama", 4), ("mixtral", 4), ("bert", 2), ("t5", 2), ("vit", 2), ("swin", 2)],
)
def test_hugging_face_models_train_as_they_come(ranks, name, world_size):
    """A causal LM, a mixture of experts, a masked LM (padding mask as an input), an
    encoder-decoder and two vision encoders (Swin's window buffers written in place), from
    transformers as they come: 3 AdamW steps
    equal the single-device run, the decoders on a (2, 2) dp x tp gloo mesh, the others on
    2 ranks (what they add is their tracing: padding mask, encoder-decoder, vision stem)."""

    def loss(output, batch):
        return output.logits.float().pow(2).mean()

    reference = reference_training(
        lambda: hf_family_reference(name), hf_family_batches(name), STEPS, LR, loss_fn=loss
    )
    for result in ranks(world_size).run(train_hf_family, name, timeout_s=600):
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
        assert_trained_alike(result, reference)


def test_hugging_face_experts_split_by_features_train_as_on_one_device(ranks):
    """Qwen3-MoE as it comes, its experts' grouped matmuls (transformers' own op) planned
    with our rules: the up-projection pinned split by features over tp, the rest chosen;
    3 AdamW steps on a (2, 2) dp x tp gloo mesh equal the single-device run."""

    def loss(output, batch):
        return output.logits.float().pow(2).mean()

    name = "qwen3-moe"
    reference = reference_training(
        lambda: hf_family_reference(name), hf_family_batches(name), STEPS, LR, loss_fn=loss
    )
    results = ranks(4).run(train_hf_family, name, False, False, True, timeout_s=600)
    assert "RS(1)" in results[0]["grouped_mm"]
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
        assert_trained_alike(result, reference)


def test_masked_attention_sharded_on_heads_trains_as_on_one_device(ranks):
    """A causal LM with a padding mask, every attention pinned sharded on heads over tp: the
    [batch, 1, q, k] mask is sharded with the batch and replicated over the heads it
    broadcasts to, and training still equals the single-device run."""

    def loss(output, batch):
        return output.logits.float().pow(2).mean()

    reference = reference_training(
        lambda: hf_family_reference("llama"),
        hf_family_batches("llama", padded=True),
        STEPS,
        LR,
        loss_fn=loss,
    )
    results = ranks(4).run(train_hf_family, "llama", True, True, timeout_s=600)
    assert results[0]["attention"] == ["S(0)S(1)"]
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
        assert_trained_alike(result, reference)


def test_a_vocabulary_tp_does_not_divide_shards_unevenly_and_trains(ranks):
    """GPT-2 with a vocabulary of 1001 on tp 2, its tied embedding sharded on the vocabulary
    (501 and 500 rows): trains as on one device, and its state round-trips through DCP."""

    def loss(output, batch):
        return output.logits.float().pow(2).mean()

    reference = reference_training(
        uneven_gpt2_reference, hf_family_batches("gpt2"), STEPS, LR, loss_fn=loss
    )
    results = ranks(4).run(train_uneven_gpt2, timeout_s=600)
    assert results[0]["embedding"] == "RS(0)"
    assert sorted({r["local_rows"] for r in results}) == [500, 501]
    assert UNEVEN_VOCAB == 1001
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
        assert_trained_alike(result, reference)
        assert result["dcp_error"] == 0.0
