"""The 2-D recipe an engineer writes by hand for a LLaMA, with torch's own APIs only.

torchtitan's pattern (``parallelize_llama``): Megatron-style tensor parallelism with sequence
parallelism on the ``tp`` mesh dim (``parallelize_module``), then ``fully_shard`` of every
layer and of the root on the ``dp`` dim. It is what our plans are measured against
(``python -m benchmarks.step_time --model llama-tiny --mesh 2x2``): the same model, init,
batch and optimizer, in the same set of ranks.

Along the residual stream the activations stay split by sequence over ``tp`` (plain local
tensors of ``seq / tp`` rows); each norm runs on its shard (``SequenceParallel``), the input of
attention and of the feed-forward is all-gathered to the whole sequence (``PrepareModuleInput``),
the column-parallel projections split heads and the hidden dim, and the row-parallel ones
reduce-scatter back to sequence shards. The head all-gathers the sequence and returns
replicated logits, so any loss applies (no ``loss_parallel``).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autoparallel.models import Llama


def parallelize_llama_2d(
    model: Llama, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """Tensor + sequence parallel on ``mesh["tp"]``, FSDP2 on ``mesh["dp"]``; in place, the
    model returned. Works on a materialized model (values distributed from each rank's
    copy) or on meta (``to_empty`` and ``init_weights`` after)."""
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in model.layers:
        parallelize_module(
            layer,
            tp,
            {
                "attention_norm": SequenceParallel(),
                # (x, cos, sin): the hidden states gathered, the rotary tables left alone
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)
    return model
