"""Per-rank bodies of the Hugging Face training tests: families from transformers as they
come, planned on a gloo mesh and trained against the single-device model."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel._testing.harness import full_params
from autoparallel.types.placements import placement_str
from helpers.runtime_cases import LR, STEPS, _attention_output, _learn_from, _local_rows


def _mesh_of(world_size: int) -> Any:
    if world_size == 4:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))


def train_hf_family(
    rank: int,
    world_size: int,
    name: str,
    padded: bool = False,
    heads_sharded: bool = False,
    experts_split: bool = False,
) -> dict[str, Any]:
    """A Hugging Face family as it comes (dropout off), built on CPU from seed 0 on every
    rank, planned on a gloo mesh of the ranks ((2, 2) as dp x tp for 4, else 1-D dp) with
    every input and output split by rows over dp,
    trained STEPS AdamW steps on the loss of its logits. Returns what ``train`` returns.

    ``padded``: a causal LM gets a padding mask too; ``heads_sharded``: every attention
    output is pinned sharded on heads over tp (its mask, broadcast over heads, replicated)."""
    from autoparallel.models.hf_families import (
        NO_DROPOUT,
        build_hf_family,
        hf_family,
    )

    family = hf_family(name)
    mesh = _mesh_of(world_size)
    torch.manual_seed(0)
    model = build_hf_family(family, "cpu", **NO_DROPOUT)
    batches = hf_family_batches(name, padded)
    rows = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
    with AutoParallel(model, lambda: batches[0], mesh, hardware="cpu") as autop:
        autop.add_input_constraints([rows] * len(batches[0]))
        outputs = [o for o in autop.sharding_optimizer.problem.joint.user_outputs if o is not None]
        autop.add_output_constraints([rows] * len(outputs))
        if heads_sharded:
            _shard_attention_heads(autop.sharding_optimizer)
        if experts_split:
            _split_expert_features(autop.sharding_optimizer)
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR)
    result: dict[str, Any] = {
        "losses": [],
        "param_placements": {k: placement_str(v) for k, v in plan.param_placements.items()},
        "attention": sorted(
            {
                placement_str(n.strategy.output[0])
                for n in plan.nodes.values()
                if n.target.endswith("flash_attention_for_cpu.default")
            }
        ),
        "grouped_mm": sorted(
            {
                placement_str(n.strategy.output)
                for n in plan.nodes.values()
                if n.target.startswith("transformers.grouped_mm_fallback")
            }
        ),
    }
    for step, batch in enumerate(batches):
        local = {key: _local_rows(value, mesh) for key, value in batch.items()}
        _learn_from(parallel(**local).logits, parallel, optimizer, mesh, step, result)
    result["params"] = full_params(parallel)
    return result


def _shard_attention_heads(optimizer) -> None:
    graph = optimizer.problem.joint.graph
    for node in graph.nodes:
        if "flash_attention_for_cpu.default" in str(node.target):
            output = _attention_output(node)
            optimizer.add_node_constraint(
                output, (Shard(0), Shard(1)), name=f"heads of {node.name}"
            )


GROUPED_MM = "transformers.grouped_mm_fallback.default"


def _split_expert_features(optimizer) -> None:
    """Pin each layer's first grouped matmul (the experts' up-projection) split by its
    output features over tp: the tokens whole (its offsets group them), the weights split."""
    joint = optimizer.problem.joint
    grouped = [
        n for n in joint.graph.nodes if str(n.target) == GROUPED_MM and n in joint.forward_nodes
    ]
    for node in grouped[::2]:
        optimizer.add_node_constraint(node, (Replicate(), Shard(1)), name=f"experts of {node.name}")


def hf_family_batches(name: str, padded: bool = False) -> list[dict[str, torch.Tensor]]:
    from autoparallel.models.hf_families import hf_family, hf_family_inputs

    generator = torch.Generator().manual_seed(1234)
    family = hf_family(name)
    return [hf_family_inputs(family, generator=generator, padded=padded) for _ in range(STEPS)]


def hf_family_reference(name: str) -> torch.nn.Module:
    from autoparallel.models.hf_families import NO_DROPOUT, build_hf_family, hf_family

    torch.manual_seed(0)
    return build_hf_family(hf_family(name), "cpu", **NO_DROPOUT)


UNEVEN_VOCAB = 1001  # tp 2 splits it 501 / 500


def uneven_gpt2_reference() -> torch.nn.Module:
    from autoparallel.models.hf_families import NO_DROPOUT, build_hf_family, hf_family

    torch.manual_seed(0)
    return build_hf_family(hf_family("gpt2"), "cpu", vocab_size=UNEVEN_VOCAB, **NO_DROPOUT)


def train_uneven_gpt2(rank: int, world_size: int) -> dict[str, Any]:
    """GPT-2 with a vocabulary tp does not divide, its (tied) embedding pinned sharded on the
    vocabulary over tp: trained STEPS steps, then its state saved with DCP and loaded into a
    fresh parallel module."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = hf_family_batches("gpt2")
    plan, parallel = _plan_uneven_gpt2(uneven_gpt2_reference(), mesh, batches[0])
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR)
    embedding = parallel.transformer.wte.weight
    result: dict[str, Any] = {
        "losses": [],
        "embedding": placement_str(plan.param_placements["transformer.wte.weight"]),
        "local_rows": embedding.to_local().shape[0],
    }
    for step, batch in enumerate(batches):
        local = {key: _local_rows(value, mesh) for key, value in batch.items()}
        _learn_from(parallel(**local).logits, parallel, optimizer, mesh, step, result)
    result["params"] = full_params(parallel)

    directory = os.path.join(tempfile.gettempdir(), f"autoparallel-uneven-{os.getppid()}")
    dcp.save(parallel.state_dict(), checkpoint_id=directory)
    torch.manual_seed(1)  # other values, overwritten by the load
    _, fresh = _plan_uneven_gpt2(uneven_gpt2_reference(), mesh, batches[0])
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=directory)
    fresh.load_state_dict(state)
    loaded = full_params(fresh)
    result["dcp_error"] = max(
        (loaded[k] - v).abs().max().item() for k, v in result["params"].items()
    )
    dist.barrier()  # every rank has loaded: the checkpoint can go
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return result


def _plan_uneven_gpt2(model: torch.nn.Module, mesh: Any, example: dict) -> tuple[Any, Any]:
    rows = (Shard(0), Replicate())
    with AutoParallel(model, lambda: example, mesh, hardware="cpu") as autop:
        autop.add_input_constraints([rows] * len(example))
        autop.add_output_constraints([rows])
        optimizer = autop.sharding_optimizer
        embedding = optimizer.problem.joint.params["transformer.wte.weight"]
        optimizer.add_node_constraint(embedding, (Replicate(), Shard(0)), name="vocab over tp")
        plan = autop.optimize_placement()
        return plan, autop.apply_placement(plan)
