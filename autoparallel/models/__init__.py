"""Reference models for tests, examples and benchmarks.

``MLP`` and ``Llama`` are plain ``nn.Module``s that trace cleanly with
``aot_export_joint_with_descriptors`` from meta-device parameters; the
``hf_*`` builders make small Hugging Face models from a config alone and
import ``transformers`` only when called.
"""

from autoparallel.models.hf import CAUSAL_SDPA, HFLogits, hf_gpt2, hf_llama
from autoparallel.models.llama import (
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA_TINY,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    llama_config,
)
from autoparallel.models.mlp import MLP

__all__ = [
    "CAUSAL_SDPA",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "LLAMA_TINY",
    "MLP",
    "HFLogits",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "hf_gpt2",
    "hf_llama",
    "llama_config",
]
