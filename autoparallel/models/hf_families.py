"""Common Hugging Face ``transformers`` architectures, as a user builds them, in small sizes.

Each :class:`HFFamily` names a config class, the model class a user would instantiate
(``*ForCausalLM``, ``*ForMaskedLM``, ``T5ForConditionalGeneration``, ``BartForConditionalGeneration``,
``ViTForImageClassification``) and the few config fields that make it small. Nothing else
is set: attention implementation, cache, dropout and masks stay the library's defaults, so
planning one of these is planning the model exactly as it comes from ``from_config``.

:func:`build_hf_family` builds one (on the meta device by default, no weights downloaded)
and :func:`hf_family_inputs` makes the keyword inputs of its kind: token ids for causal
LMs; token ids and a padding ``attention_mask`` for masked LMs; ``input_ids``,
``decoder_input_ids`` and ``attention_mask`` for encoder-decoders; ``pixel_values`` for
vision encoders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "HF_FAMILIES",
    "NO_DROPOUT",
    "HFFamily",
    "build_hf_family",
    "hf_family",
    "hf_family_inputs",
]

_VOCAB = 256
_IMAGE = 32  # ViT image side (4 x 4 patches of 8)


@dataclass(frozen=True)
class HFFamily:
    """One architecture: what a user would instantiate, made small by ``config``.

    Attributes:
        name: short name (``"llama"``, ``"t5"``, ...).
        config_class / model_class: class names in the ``transformers`` namespace.
        config: keyword arguments of the config class (sizes only).
        inputs: ``"causal"``, ``"masked"``, ``"seq2seq"`` or ``"vision"``; see
            :func:`hf_family_inputs`.
    """

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any] = field(default_factory=dict)
    inputs: str = "causal"


def _decoder(**extra: Any) -> dict[str, Any]:
    """The small size of a LLaMA-like decoder's config fields."""
    sizes = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": _VOCAB,
        "max_position_embeddings": 128,
    }
    return {**sizes, **extra}


HF_FAMILIES: tuple[HFFamily, ...] = (
    HFFamily(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": _VOCAB, "n_positions": 128},
    ),
    HFFamily("llama", "LlamaConfig", "LlamaForCausalLM", _decoder(num_key_value_heads=2)),
    HFFamily("mistral", "MistralConfig", "MistralForCausalLM", _decoder(num_key_value_heads=2)),
    HFFamily("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _decoder(num_key_value_heads=2)),
    HFFamily(
        "qwen3", "Qwen3Config", "Qwen3ForCausalLM", _decoder(num_key_value_heads=2, head_dim=16)
    ),
    HFFamily("phi3", "Phi3Config", "Phi3ForCausalLM", _decoder(pad_token_id=0)),
    HFFamily(
        "gemma2", "Gemma2Config", "Gemma2ForCausalLM", _decoder(num_key_value_heads=2, head_dim=16)
    ),
    HFFamily("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _decoder()),
    HFFamily("granite", "GraniteConfig", "GraniteForCausalLM", _decoder()),
    HFFamily("stablelm", "StableLmConfig", "StableLmForCausalLM", _decoder(num_key_value_heads=2)),
    HFFamily("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", _decoder()),
    HFFamily(
        "opt",
        "OPTConfig",
        "OPTForCausalLM",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "vocab_size": _VOCAB,
            "max_position_embeddings": 128,
        },
    ),
    HFFamily(
        "bloom",
        "BloomConfig",
        "BloomForCausalLM",
        {"hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": _VOCAB},
    ),
    HFFamily(
        "falcon",
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": _VOCAB},
    ),
    HFFamily(
        "starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", _decoder(num_key_value_heads=2)
    ),
    HFFamily(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        _decoder(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    ),
    HFFamily(
        "qwen3-moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        _decoder(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    ),
    HFFamily(
        "olmoe",
        "OlmoeConfig",
        "OlmoeForCausalLM",
        _decoder(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    ),
    HFFamily("bert", "BertConfig", "BertForMaskedLM", _decoder(), "masked"),
    HFFamily("roberta", "RobertaConfig", "RobertaForMaskedLM", _decoder(), "masked"),
    HFFamily(
        "modernbert",
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        _decoder(
            global_attn_every_n_layers=2,
            local_attention=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        "masked",
    ),
    HFFamily(
        "t5",
        "T5Config",
        "T5ForConditionalGeneration",
        {
            "d_model": 64,
            "d_ff": 128,
            "d_kv": 16,
            "num_layers": 2,
            "num_heads": 4,
            "vocab_size": _VOCAB,
            "decoder_start_token_id": 0,
        },
        "seq2seq",
    ),
    HFFamily(
        "bart",
        "BartConfig",
        "BartForConditionalGeneration",
        {
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "vocab_size": _VOCAB,
            "max_position_embeddings": 128,
        },
        "seq2seq",
    ),
    HFFamily(
        "vit",
        "ViTConfig",
        "ViTForImageClassification",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "image_size": _IMAGE,
            "patch_size": 8,
        },
        "vision",
    ),
    HFFamily(
        "swin",
        "SwinConfig",
        "SwinForImageClassification",
        {
            "image_size": _IMAGE,
            "patch_size": 4,
            "embed_dim": 16,
            "depths": [1, 1],
            "num_heads": [2, 2],
            "window_size": 4,
        },
        "vision",
    ),
)


def hf_family(name: str) -> HFFamily:
    """The family called ``name``; a ValueError lists the known names."""
    for family in HF_FAMILIES:
        if family.name == name:
            return family
    known = ", ".join(f.name for f in HF_FAMILIES)
    raise ValueError(f"unknown Hugging Face family {name!r}; known: {known}")


NO_DROPOUT = {
    name: 0.0
    for name in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "dropout_rate",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "hidden_dropout",
        "attention_dropout",
        "dropout",
    )
}
"""Config overrides that turn every family's dropout off (a config ignores the names it does
not have): training that must match a single-device run bit for bit cannot draw random
masks, which differ between processes."""


def build_hf_family(
    family: HFFamily, device: str | torch.device = "meta", **overrides: Any
) -> nn.Module:
    """``family.model_class(family.config_class(**family.config, **overrides))`` built on
    ``device`` (real values from transformers' own init when not on meta)."""
    from autoparallel.models.hf import _transformers

    transformers = _transformers()
    config = getattr(transformers, family.config_class)(**{**family.config, **overrides})
    with torch.device(device):
        return getattr(transformers, family.model_class)(config)


def hf_family_inputs(
    family: HFFamily,
    batch: int = 8,
    seq: int = 16,
    generator: torch.Generator | None = None,
    padded: bool = False,
) -> dict[str, torch.Tensor]:
    """Keyword inputs of ``family``'s kind (see the module doc); the masks pad the last two
    positions of every other row, so padding is really exercised. ``padded`` gives a causal
    LM such a mask too (right padding of a batch of unequal sequences)."""
    if family.inputs == "vision":
        return {"pixel_values": torch.randn(batch, 3, _IMAGE, _IMAGE, generator=generator)}
    tokens = torch.randint(0, _VOCAB, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1::2, -2:] = 0
    if family.inputs == "causal":
        return {"input_ids": tokens, "attention_mask": mask} if padded else {"input_ids": tokens}
    if family.inputs == "masked":
        return {"input_ids": tokens, "attention_mask": mask}
    decoder = torch.randint(0, _VOCAB, (batch, seq), generator=generator)
    return {"input_ids": tokens, "decoder_input_ids": decoder, "attention_mask": mask}
