"""Hugging Face models as they come train on gloo ranks to the single-device numbers."""

from __future__ import annotations

import pytest
from runtime_cases import (
    LR,
    STEPS,
    TOLERANCE,
    hf_family_batches,
    hf_family_reference,
    max_error,
    train_hf_family,
)

from autoparallel._testing.harness import reference_training

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["llama", "mixtral", "bert", "t5", "vit"])
def test_hugging_face_models_train_as_they_come(ranks, name):
    """A causal LM, a mixture of experts, a masked LM (padding mask as an input), an
    encoder-decoder and a vision encoder, from transformers as they come: 3 AdamW steps on
    a (2, 2) gloo mesh equal the single-device run."""

    def loss(output, batch):
        return output.logits.float().pow(2).mean()

    reference = reference_training(
        lambda: hf_family_reference(name), hf_family_batches(name), STEPS, LR, loss_fn=loss
    )
    for result in ranks(4).run(train_hf_family, name, timeout_s=600):
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
        assert max_error(result["grads"], reference["grads"]) < TOLERANCE
        assert max_error(result["params"], reference["params"]) < TOLERANCE
