"""Mixed precision: the plan casts before it gathers, reduces in reduce_dtype, and trains
like torch's fully_shard with the same MixedPrecisionPolicy."""

from __future__ import annotations

import pytest
import torch
from conftest import meta
from helpers.mixed_precision_cases import (
    LR,
    POLICY,
    STEPS,
    build,
    global_batches,
    loss_of,
    train_autoparallel,
    train_fully_shard,
)
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel._testing.harness import reference_training
from autoparallel.models import MLP
from autoparallel.trace.mixed_precision import MixedPrecisionModule

BF16_TOLERANCE = 2e-2


def _plan_fsdp(fake_mesh, policy, batch=4096, dims=(256, 1024)):
    mesh = fake_mesh((4,))
    with AutoParallel(
        meta(lambda: MLP(*dims)), lambda: torch.empty(batch, dims[0]), mesh, policy
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
    return autop, plan


def _dtype_of(autop, node_name):
    nodes = {n.name: n for n in autop.sharding_optimizer.problem.joint.graph.nodes}
    return nodes[node_name].meta["val"].dtype


def _gathers_and_reductions(autop, plan):
    gathers, reductions = [], []
    for consumer, arg in plan.redistributions():
        src, dst = arg.src[0], arg.dst[0]
        dtype = _dtype_of(autop, arg.producer)
        if (
            isinstance(src, Shard)
            and isinstance(dst, Replicate)
            and plan.nodes[consumer].phase == "forward"
        ):
            gathers.append(dtype)
        if isinstance(src, Partial) and not isinstance(dst, Partial):
            reductions.append((dtype, arg.kind))
    return gathers, reductions


def test_parameters_are_cast_before_they_are_gathered(fake_mesh):
    autop, plan = _plan_fsdp(fake_mesh, POLICY)
    assert isinstance(plan.param_placements["w1.weight"][0], Shard)  # stored sharded, in float32
    assert (
        _dtype_of(autop, autop.sharding_optimizer.problem.joint.params["w1.weight"].name)
        == torch.float32
    )
    gathers, reductions = _gathers_and_reductions(autop, plan)
    assert gathers and set(gathers) == {torch.bfloat16}
    param_grad_reductions = [dtype for dtype, kind in reductions if kind == "param_grad"]
    assert len(param_grad_reductions) == 4
    assert set(param_grad_reductions) == {torch.float32}


def test_gradients_are_reduced_in_reduce_dtype_only_because_of_the_policy(fake_mesh):
    """Without the policy's constraints the cheaper bf16 reduction would be chosen: gradients
    large enough that halving their bytes saves more than the latency a gradient bucket
    shares (reductions inside the graph are not coalesced; those at its boundary are)."""
    autop, _ = _plan_fsdp(fake_mesh, POLICY, dims=(1024, 4096))
    optimizer = autop.sharding_optimizer
    names = [name for name in optimizer.constraints() if name.startswith("mixed_precision:")]
    assert len(names) == 4
    optimizer.remove_constraints(names)
    _, reductions = _gathers_and_reductions(autop, optimizer.resolve())
    assert torch.bfloat16 in {dtype for dtype, _ in reductions}


def test_bf16_reduce_policy_reduces_in_bf16_by_constraint(fake_mesh):
    """No reduce_dtype: gradients are reduced in param_dtype, although the fp32 reduction at
    the boundary is coalesced (one latency for all) and priced cheaper; the policy's
    constraints, not the prices, decide."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    autop, plan = _plan_fsdp(fake_mesh, policy)
    names = [n for n in autop.sharding_optimizer.constraints() if n.startswith("mixed_precision:")]
    assert len(names) == 4
    _, reductions = _gathers_and_reductions(autop, plan)
    assert {dtype for dtype, kind in reductions if kind != "output"} == {torch.bfloat16}
    autop.sharding_optimizer.remove_constraints(names)
    _, unconstrained = _gathers_and_reductions(autop, autop.sharding_optimizer.resolve())
    assert torch.float32 in {dtype for dtype, _ in unconstrained}


def test_mixed_precision_costs_less_communication_than_float32(fake_mesh):
    _, fp32 = _plan_fsdp(fake_mesh, None)
    _, bf16 = _plan_fsdp(fake_mesh, POLICY)
    assert bf16.totals.comm_us < fp32.totals.comm_us


def test_bad_policy_is_rejected(fake_mesh):
    mesh = fake_mesh((2,))
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        AutoParallel(
            meta(lambda: MLP(8, 16)),
            lambda: torch.empty(4, 8),
            mesh,
            {"param_dtype": torch.bfloat16},
        )
    with pytest.raises(ValueError, match="floating dtype"):
        AutoParallel(
            meta(lambda: MLP(8, 16)),
            lambda: torch.empty(4, 8),
            mesh,
            MixedPrecisionPolicy(param_dtype=torch.int32),
        )


def _reference():
    def factory():
        model = build("cpu")
        model.init_weights(seed=0)
        return MixedPrecisionModule(model, POLICY)

    batches = global_batches()
    result = reference_training(
        factory, batches, STEPS, LR, loss_fn=lambda out, batch: loss_of(out, batch.numel())
    )
    result["params"] = {k.removeprefix("module."): v for k, v in result["params"].items()}
    result["grads"] = {k.removeprefix("module."): v for k, v in result["grads"].items()}
    return result


def _max_relative_error(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def _max_abs_error(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def test_training_matches_fully_shard_and_single_process_in_bf16(ranks):
    ours = ranks(2).run(train_autoparallel, timeout_s=240)[0]
    theirs = ranks(2).run(train_fully_shard, timeout_s=240)[0]
    reference = _reference()
    assert ours["param_dtypes"] == ["torch.float32"]  # stored in full precision
    assert ours["output_dtype"] == theirs["output_dtype"] == "torch.bfloat16"  # computed in bf16
    for other in (theirs, reference):
        assert ours["losses"] == pytest.approx(other["losses"], rel=1e-3)
        assert _max_relative_error(ours["grads"], other["grads"]) < BF16_TOLERANCE
        # AdamW moves a weight by about lr whatever its gradient's size, so a near-zero
        # gradient whose sign bf16 rounding flips differs by up to 2 * lr per step.
        assert _max_abs_error(ours["params"], other["params"]) < 2 * STEPS * LR


def test_auto_parallel_takes_the_policy_too(fake_mesh):
    from autoparallel import auto_parallel

    mesh = fake_mesh((4,))
    sample = torch.empty(4096, 256)
    parallel = auto_parallel(
        meta(lambda: MLP(256, 1024)),
        mesh,
        sample,
        out_shardings=(Shard(0),),
        mp_policy=POLICY,
        parameter_memory_budget=(None, None),
    )
    runtime = parallel._autoparallel
    nodes = {n.name: n for n in runtime.joint.graph.nodes}
    gathered = {
        nodes[a.producer].meta["val"].dtype
        for _, a in runtime.plan.redistributions()
        if isinstance(a.src[0], Shard) and isinstance(a.dst[0], Replicate)
    }
    assert torch.bfloat16 in gathered
    assert {p.dtype for p in parallel.parameters()} == {torch.float32}


def _llama_under_policy(fake_mesh, layers: int):
    from autoparallel.models import Llama, llama_config

    config = llama_config("tiny", n_layers=layers)
    with AutoParallel(
        meta(lambda: Llama(config)),
        lambda: torch.randint(0, config.vocab_size, (8, 64)),
        fake_mesh((4,)),
        POLICY,
    ) as autop:
        return autop.joint, autop.sharding_optimizer.problem


def test_each_layer_casts_its_own_parameters_and_gradients(fake_mesh):
    """The policy's casts run where their layer reads the parameter (and where its gradient
    is computed), not all at the ends of the graph: a layer's bf16 copy is not alive for
    the whole forward, its gradient can be reduced while the backward goes on, and identical
    layers fold into the same decision variables however deep the model is."""
    joint, problem = _llama_under_policy(fake_mesh, layers=4)
    casts = [n for n in joint.parameter_sources() if n.op == "call_function"]
    assert len(casts) == len(joint.params)
    assert all(cast.next in cast.users for cast in casts)
    for gradient in joint.param_grads.values():
        computed = gradient.all_input_nodes[0]
        assert computed.next is gradient, f"{gradient} is not cast where it is computed"
    _, deeper = _llama_under_policy(fake_mesh, layers=6)
    assert deeper.folding.num_classes == problem.folding.num_classes
    assert deeper.num_variables == problem.num_variables
