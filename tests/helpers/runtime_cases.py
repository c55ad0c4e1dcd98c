"""Per-rank bodies of the multi-process runtime tests (module level, so spawn can pickle them).

Every case plans on the real gloo mesh of its ranks, applies the plan, materializes with
``to_empty`` + ``init_weights(seed=0)`` and trains with stock AdamW, returning plain numbers
and full (gathered) tensors that the test compares with the single-process reference.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, InputMismatchError, autoparallel_backend
from autoparallel._testing.harness import full_grads, full_params
from autoparallel._torch_internals import is_mask_partial
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.models.moe import MOE_TINY, MoETransformer
from autoparallel.regions.local_map import region_forward_op
from autoparallel.types.placements import placement_str
from helpers.planning import budget_only_recomputing_meets

LLAMA = llama_config("tiny", dim=128, ffn_hidden=384, vocab_size=512)
# deep enough that its graph is built from 3- and 4-layer traces (repeated_layers.py)
LLAMA_DEEP = llama_config("tiny", dim=128, ffn_hidden=384, vocab_size=512, n_layers=6)
STEPS = 3
LR = 1e-3
TOLERANCE = 1e-4  # losses, gradients and parameters against the single-device run


def max_error(a: dict, b: dict) -> float:
    """The largest absolute difference between two ``{name: tensor}`` maps (b's names)."""
    return max((a[k] - b[k]).abs().max().item() for k in b if b[k] is not None)


RELATIVE_TOLERANCE = 1e-3
"""Each parameter's gradient against the single-device one, relative to that gradient's
largest entry: the absolute TOLERANCE alone misses a gradient that is wrong by half its
size when the whole gradient is ~1e-5 (the tiny MoE's router under torch 2.14.1's Inductor)."""


def assert_trained_alike(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """Step 0's gradients (absolutely and per parameter relative to its own size) and the
    parameters after the last step equal the single-device run's."""
    assert max_error(result["grads"], reference["grads"]) < TOLERANCE
    error, name = worst_relative_error(result["grads"], reference["grads"])
    assert error < RELATIVE_TOLERANCE, f"{name}'s gradient is {error:.1%} off"
    assert max_error(result["params"], reference["params"]) < TOLERANCE


NUMERICAL_ZERO = 1e-6
"""A gradient whose largest entry is below this share of the model's largest is zero up to
rounding (a key projection's bias, which softmax ignores: ~1e-15 against 1e-2); its
relative error is noise, and the absolute check covers it."""


def worst_relative_error(a: dict, b: dict) -> tuple[float, str]:
    """The largest ``max|a - b| / max|b|`` over ``b``'s names (those whose b is not zero up
    to rounding, see NUMERICAL_ZERO), and the name it is at."""
    worst = (0.0, "")
    scales = {n: 0.0 if e is None else e.abs().max().item() for n, e in b.items()}
    floor = NUMERICAL_ZERO * max(scales.values(), default=0.0)
    for name, expected in b.items():
        scale = scales[name]
        if scale > floor and scale > 0.0:
            error = (a[name] - expected).abs().max().item() / scale
            worst = max(worst, (error, name))
    return worst


def build(model_name: str, device: str = "meta") -> torch.nn.Module:
    with torch.device(device):
        if model_name == "moe":
            return MoETransformer(MOE_TINY)
        if model_name == "mlp-constrained":  # hidden activation pinned replicated
            return MLP(64, 256, hidden_placements=(Replicate(),))
        if model_name == "llama-deep":
            return Llama(LLAMA_DEEP)
        return MLP(64, 256) if model_name == "mlp" else Llama(LLAMA)


def global_batches(model_name: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    if model_name.startswith("mlp"):
        return [torch.randn(1024, 64, generator=generator) for _ in range(STEPS)]
    if model_name == "moe":
        return [
            torch.randint(0, MOE_TINY.vocab_size, (8, 32), generator=generator)
            for _ in range(STEPS)
        ]
    return [torch.randint(0, LLAMA.vocab_size, (8, 64), generator=generator) for _ in range(STEPS)]


def reference_model(model_name: str) -> torch.nn.Module:
    model = build(model_name, "cpu")
    model.init_weights(seed=0)
    return model


BF16 = "-bf16"
"""A kind ending in this plans under a bf16/fp32 MixedPrecisionPolicy."""


def _plan_and_apply(model_name: str, mesh, kind: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = build(model_name)
    batch_sharded = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
    example = global_batches(model_name)[0]
    mp_policy = None
    if kind.endswith(BF16):
        kind = kind.removesuffix(BF16)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with AutoParallel(
        model, lambda: torch.empty_like(example), mesh, mp_policy, hardware="cpu"
    ) as autop:
        autop.add_input_constraints([batch_sharded])
        autop.add_output_constraints([batch_sharded])
        if kind == "fsdp":
            autop.add_parameter_memory_constraint()
        if kind == "tp":
            optimizer = autop.sharding_optimizer
            params = optimizer.problem.joint.params
            column, row = (
                ("w1.weight", "w2.weight")
                if model_name == "mlp"
                else ("layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight")
            )
            free = (Replicate(),) * (mesh.ndim - 1)  # tensor parallel over the last dim
            optimizer.add_node_constraint(params[column], (*free, Shard(0)))
            optimizer.add_node_constraint(params[row], (*free, Shard(1)))
        if kind == "gathered-heads":
            _gather_heads_before_transpose(autop.sharding_optimizer)
        if kind == "vocab-parallel":
            _rowwise_embedding(autop.sharding_optimizer)
        if kind == "ddp-pinned":  # every parameter replicated: DDP's plan
            optimizer = autop.sharding_optimizer
            for node in optimizer.problem.joint.params.values():
                optimizer.add_node_constraint(node, (Replicate(),) * mesh.ndim)
        if kind == "tokens-replicated":  # the region's free dp dim: every dp rank all tokens
            _pin_region_layout(autop.sharding_optimizer, ((Replicate(), Shard(0)),))
        if kind == "recompute":  # a budget only recomputing a layer meets
            budget = budget_only_recomputing_meets(autop.sharding_optimizer)
            autop.add_memory_constraint(budget, activation_checkpointing="auto")
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    return plan, parallel


def _pin_region_layout(optimizer, outputs) -> None:
    """Every call of the model's region to the layout that gives ``outputs``."""
    for node in optimizer.problem.joint.graph.find_nodes(
        op="call_function", target=region_forward_op
    ):
        optimizer.add_placement_constraint(node, outputs, f"layout of {node.name}", node.name)


def _gather_heads_before_transpose(optimizer) -> None:
    """Attention computed sharded on heads and gathered BEFORE the transpose back to
    [batch, seq, heads, head_dim]: the gathered copy is contiguous in the head-major order,
    so the traced ``view`` that merges heads (legal on the traced strides) needs a copy."""
    graph = optimizer.problem.joint.graph
    attention = next(n for n in graph.nodes if "scaled_dot_product" in str(n.target))
    output = _attention_output(attention)
    transpose = next(u for u in output.users if "transpose" in str(u.target))
    optimizer.add_node_constraint(output, (Shard(1),), name="heads sharded")
    optimizer.add_node_constraint(transpose, (Replicate(),), name="gathered before transpose")


def _rowwise_embedding(optimizer) -> None:
    """The embedding looked up in a table split by rows over "tp" (DTensor's vocabulary-
    parallel strategy, ids and result marked ``_MaskPartial``); its result is read twice
    (the residual and the first RMSNorm), so it is reduced once per reader."""
    graph = optimizer.problem.joint.graph
    lookup = next(
        iter(graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default))
    )
    rowwise = next(
        s.output
        for s in optimizer.problem.space[lookup].strategies
        if s.output[0] == Replicate() and is_mask_partial(s.output[1])
    )
    optimizer.add_placement_constraint(lookup, rowwise, "rows of the table over tp", lookup.name)


def _local_rows(batch: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's rows of a global batch sharded on batch over mesh dim 0."""
    coordinate = mesh.get_coordinate()[0]
    return batch.chunk(mesh.shape[0])[coordinate]


def train(
    rank: int,
    world_size: int,
    model_name: str,
    shape: tuple[int, ...],
    kind: str,
    compiled: bool = False,
) -> dict[str, Any]:
    with (
        _logged("autoparallel.trace") as trace_logs,
        _logged("autoparallel.runtime.compile") as compiled_logs,
    ):
        return _train(
            model_name, _mesh(model_name, shape), kind, compiled, trace_logs, compiled_logs
        )


def _mesh(model_name: str, shape: tuple[int, ...]) -> Any:
    """The gloo mesh of a case; the MoE's is ("dp", "ep"): its experts go over "ep"."""
    if model_name == "moe":
        return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ep")[-len(shape) :])
    return init_device_mesh("cpu", shape)


@contextlib.contextmanager
def _logged(logger_name: str) -> Iterator[list[str]]:
    """The INFO messages of one logger while the block runs (this rank's pool process keeps
    running other checks afterwards, so the handler is removed again)."""
    records: list[str] = []
    logger = logging.getLogger(logger_name)
    handler, level = _Records(records), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _train(
    model_name: str,
    mesh: Any,
    kind: str,
    compiled: bool,
    trace_logs: list[str],
    compiled_logs: list[str],
) -> dict[str, Any]:
    plan, parallel = _plan_and_apply(model_name, mesh, kind)
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR)
    run = (
        torch.compile(parallel, backend=autoparallel_backend(), fullgraph=True)
        if compiled
        else parallel
    )
    reference_out = reference_model(model_name)(global_batches(model_name)[0]).detach()
    result: dict[str, Any] = {
        "losses": [],
        "recompute": plan.recompute,
        "param_placements": {k: placement_str(v) for k, v in plan.param_placements.items()},
    }
    result["region_layouts"] = sorted(
        placement_str(n.strategy.output)
        for n in plan.nodes.values()
        if n.target.endswith("local_map.default")
    )
    result["layers_traced_once"] = any("identical layers" in message for message in trace_logs)
    result["constrained"] = sorted(
        placement_str(n.strategy.output)
        for n in plan.nodes.values()
        if "sharding_constraint" in n.target
    )
    result["all_reduces"] = sum(
        1
        for _, a in plan.redistributions()
        if "P" in placement_str(a.src) and "P" not in placement_str(a.dst)
    )
    result["rowwise_lookups"] = sum(
        1
        for n in plan.nodes.values()
        if n.target.endswith("embedding.default") and "MaskP" in str(n.strategy.output)
    )
    result["heads_gathered"] = any(
        "transpose" in consumer and placement_str(a.src) == "S(1)" and placement_str(a.dst) == "R"
        for consumer, a in plan.redistributions()
    )
    for step, batch in enumerate(global_batches(model_name)):
        local = _local_rows(batch, mesh)
        output = run(local)
        if step == 0:
            result["output_error"] = (output - _local_rows(reference_out, mesh)).abs().max().item()
        _learn_from(output, parallel, optimizer, mesh, step, result)
    result["params"] = full_params(parallel)
    if not compiled:
        result["compute_behind_first_reduction"] = _compute_behind_first_reduction(parallel)
        backward = parallel._autoparallel.backward_phase.eager_module.graph
        result["reduced_in_place"] = len(
            backward.find_nodes(
                op="call_function", target=torch.ops._c10d_functional.all_reduce_.default
            )
        )
        result["backward_all_reduces"] = result["reduced_in_place"] + len(
            backward.find_nodes(
                op="call_function", target=torch.ops._c10d_functional.all_reduce.default
            )
        )
    result["gradient_buckets"] = [
        b.description for b in plan.buckets if b.kind == "gradient_reduction"
    ]
    result["gather_buckets"] = [b.description for b in plan.buckets if b.kind == "parameter_gather"]
    result["trained_parameters"] = len(plan.param_placements)
    if compiled:
        local = _local_rows(global_batches(model_name)[0], mesh)
        with torch.no_grad():
            result["compiled_inference_error"] = (run(local) - parallel(local)).abs().max().item()
        result["compiled_graphs"] = len(compiled_logs)
    return result


def _compute_behind_first_reduction(parallel) -> int:
    """Matrix multiplies of the traced backward between the first gradient all-reduce and
    its wait: the compute that reduction overlaps."""
    graph = parallel._autoparallel.backward_phase.graph_module.graph
    nodes = list(graph.nodes)
    starts = [i for i, n in enumerate(nodes) if "all_reduce" in str(n.target)]
    if not starts:
        return 0
    start = nodes[starts[0]]
    wait = next(
        i for i, n in enumerate(nodes) if "wait_tensor" in str(n.target) and start in n.args
    )
    return sum(1 for n in nodes[starts[0] : wait] if n.target == torch.ops.aten.mm.default)


def _learn_from(output, parallel, optimizer, mesh, step: int, result: dict[str, Any]) -> None:
    """One step on this rank's rows of ``output``: the loss mean(output^2) of the GLOBAL
    batch (rows split over mesh dim 0), backward, step 0's full gradients and every step's
    global loss into ``result``, then the optimizer step."""
    loss = output.float().pow(2).sum() / (output.numel() * mesh.shape[0])
    loss.backward()
    if step == 0:
        result["grads"] = full_grads(parallel)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group(0))
    result["losses"].append(total.item())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _Records(logging.Handler):
    def __init__(self, records: list) -> None:
        super().__init__(logging.INFO)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def memory_matches_plan(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """plan.memory of the LLaMA planned as ``kind`` beside what one AdamW step of the
    parallel module holds on this rank (autoparallel.measure_memory)."""
    from autoparallel import measure_memory

    mesh = init_device_mesh("cpu", (world_size,))
    plan, parallel = _plan_and_apply("llama", mesh, kind)
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    rows = _local_rows(global_batches("llama")[0], mesh).clone()  # this rank's rows only
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    measured = measure_memory(
        parallel, optimizer, rows, lambda out: out.float().pow(2).mean(), plan
    )
    return {
        "placements": sorted({str(p) for p in plan.param_placements.values()}),
        "recompute": plan.recompute,
        "predicted": measured.predicted,
        "measured": {
            name: getattr(measured, name)
            for name in ("parameters", "gradients", "optimizer_state", "activations")
        },
    }


def inference_and_state(rank: int, world_size: int) -> dict[str, Any]:
    """no_grad forward, load_state_dict of full tensors, DCP round trip, input checks."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    _, parallel = _plan_and_apply("llama", mesh, "fsdp")
    parallel.to_empty(device="cpu")
    reference = reference_model("llama")
    parallel.load_state_dict(reference.state_dict())
    parallel.reset_rotary()  # non-persistent buffers are not in a state dict
    batch = global_batches("llama")[0]
    with torch.no_grad():
        output = parallel(_local_rows(batch, mesh))
        expected = _local_rows(reference(batch), mesh)
    result = {
        "inference_error": (output - expected).abs().max().item(),
        "requires_grad": output.requires_grad,
    }

    state = parallel.state_dict()
    result["state_is_dtensor"] = all(type(v).__name__ == "DTensor" for v in state.values())
    directory = os.path.join(tempfile.gettempdir(), f"autoparallel-dcp-{os.getppid()}")
    dcp.save(state, checkpoint_id=directory)
    _, fresh = _plan_and_apply("llama", mesh, "fsdp")
    fresh.to_empty(device="cpu")
    fresh.init_weights(seed=1)  # different values, overwritten by the load
    fresh_state = fresh.state_dict()
    dcp.load(fresh_state, checkpoint_id=directory)
    fresh.load_state_dict(fresh_state)
    fresh.reset_rotary()
    with torch.no_grad():
        result["dcp_error"] = (fresh(_local_rows(batch, mesh)) - expected).abs().max().item()
    dist.barrier()  # every rank has loaded: the checkpoint can go
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)

    try:
        parallel(batch)  # the global batch instead of the local one
    except InputMismatchError as error:
        result["input_error"] = str(error)
    return result


def init_matches_reference(rank: int, world_size: int) -> float:
    """to_empty + init_weights on the parallel module equals init_weights on the original."""
    mesh = init_device_mesh("cpu", (world_size,))
    _, parallel = _plan_and_apply("mlp", mesh, "fsdp")
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    reference = reference_model("mlp")
    gathered = full_params(parallel)
    return max((gathered[name] - p).abs().max().item() for name, p in reference.named_parameters())


__all__ = [
    "train",
    "inference_and_state",
    "init_matches_reference",
    "global_batches",
    "reference_model",
    "simple_api",
]


def simple_api(rank: int, world_size: int) -> float:
    """auto_parallel(): DTensor sample inputs carry their placement; outputs as requested."""
    from torch.distributed.tensor import DTensor

    from autoparallel import auto_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    batch = global_batches("mlp")[0]
    sample = DTensor.from_local(_local_rows(batch, mesh), mesh, [Shard(0)], run_check=False)
    parallel = auto_parallel(
        build("mlp"),
        mesh,
        sample,
        out_shardings=(Shard(0),),
        parameter_memory_budget=(None, None),
        hardware="cpu",
    )
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    output = parallel(_local_rows(batch, mesh))
    expected = _local_rows(reference_model("mlp")(batch), mesh)
    return (output - expected).abs().max().item()


def dynamic_batch_sizes(rank: int, world_size: int) -> dict[int, tuple[float, float]]:
    """auto_parallel(dynamic=True) planned for a global batch of 8 runs 4 and 12 unchanged.

    Returns per global batch size: (max output error, max gradient error) against the
    single-process model on the same tokens.
    """
    from torch.distributed.tensor import DTensor

    from autoparallel import auto_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    planned = global_batches("llama")[0]
    sample = DTensor.from_local(_local_rows(planned, mesh), mesh, [Shard(0)], run_check=False)
    parallel = auto_parallel(
        build("llama"),
        mesh,
        sample,
        out_shardings=(Shard(0),),
        parameter_memory_budget=(None, None),
        hardware="cpu",
        dynamic=True,
    )
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    reference = reference_model("llama")
    generator = torch.Generator().manual_seed(99)
    errors = {}
    for batch_size in (4, 12, 8):
        tokens = torch.randint(
            0, LLAMA.vocab_size, (batch_size, planned.shape[1]), generator=generator
        )
        output = parallel(_local_rows(tokens, mesh))
        (output.float().pow(2).sum() / (output.numel() * world_size)).backward()
        grads = full_grads(parallel)
        expected = reference(tokens)
        expected.float().pow(2).mean().backward()
        output_error = (output - _local_rows(expected.detach(), mesh)).abs().max().item()
        grad_error = max(
            (grads[name] - p.grad).abs().max().item() for name, p in reference.named_parameters()
        )
        errors[batch_size] = (output_error, grad_error)
        parallel.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    return errors


def _attention_output(attention) -> Any:
    """The node of an attention op's first result (getitem 0; the others are statistics)."""
    return next(user for user in attention.users if user.args[1] == 0)


def check_parallel_training(
    ranks: Any,
    reference: dict[str, Any],
    model_name: str,
    shape: tuple[int, ...],
    kind: str,
    compiled: bool = False,
) -> None:
    """Train ``model_name`` planned ``kind`` on a gloo mesh of ``shape`` (``train``) and
    assert what the plan must show and that losses, gradients and parameters equal
    ``reference`` (``reference_training`` of the same model and batches)."""
    world_size = 1
    for size in shape:
        world_size *= size
    results = ranks(world_size).run(train, model_name, shape, kind, compiled, timeout_s=600)
    rank0 = results[0]
    placements = rank0["param_placements"]
    assert rank0["layers_traced_once"] == (model_name == "llama-deep")
    if model_name == "mlp-constrained":  # the hidden activation and its gradient, replicated
        assert rank0["constrained"] == ["R", "R"]
    elif kind in ("ddp", "ddp-pinned"):
        assert set(placements.values()) == {"R" * len(shape)}
        assert rank0["all_reduces"] >= 1  # gradients are summed across ranks
        if kind == "ddp-pinned":  # the first bucket's all-reduce runs behind the backward
            assert rank0["compute_behind_first_reduction"] > 0
            assert rank0["reduced_in_place"] >= 1  # a bucket is reduced without a copy
        if kind == "ddp-pinned" and len(shape) == 2:  # gradients pending over both mesh dims
            assert any("mesh dims 0, 1" in d for d in rank0["gradient_buckets"])
            # coalesced: a few all-reduces per mesh dim, not two per parameter
            assert rank0["backward_all_reduces"] < rank0["trained_parameters"]
    elif kind == "gathered-heads":
        assert rank0["heads_gathered"]
    elif kind == "vocab-parallel":
        assert rank0["rowwise_lookups"] == 1
    elif kind == "fsdp":
        assert all("S(" in p for p in placements.values() if p), placements
        if len(shape) == 2:  # sharded over both mesh dims, gathered and reduced in buckets
            assert any("mesh dims 0, 1" in d for d in rank0["gather_buckets"])
            assert any("mesh dims 0, 1" in d for d in rank0["gradient_buckets"])
    elif kind == "recompute":
        assert rank0["recompute"], "the budget needs a recomputed layer"
    elif kind in ("expert-parallel", "tokens-replicated"):  # the experts split over "ep"
        experts = {name: p for name, p in placements.items() if ".experts." in name}
        assert experts and all(p.endswith("S(0)") for p in experts.values()), experts
        # the tokens are free over dp: split with the batch, or pinned replicated there
        layout = "(" + "S(0)" * len(shape) + ")" if kind == "expert-parallel" else "(RS(0))"
        assert set(rank0["region_layouts"]) == {layout}, rank0["region_layouts"]
    else:
        assert any(p.endswith("S(0)") or p.endswith("S(1)") for p in placements.values()), (
            placements
        )
    if compiled:  # Inductor compiled the training graph and, under no_grad, the inference one
        assert rank0["compiled_graphs"] >= 2
        assert rank0["compiled_inference_error"] < TOLERANCE
    for result in results:
        assert result["output_error"] < TOLERANCE
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
        assert_trained_alike(result, reference)


def reference_of(model_name: str) -> dict[str, Any]:
    """The single-device run ``check_parallel_training`` compares with."""
    from autoparallel._testing.harness import reference_training

    return reference_training(
        lambda: reference_model(model_name),
        global_batches(model_name),
        STEPS,
        LR,
        loss_fn=lambda output, batch: output.float().pow(2).mean(),
    )
