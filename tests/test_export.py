"""The plan as torch code: what the export writes, that it trains as the plan does, and that
choices torch's styles cannot write are named (issue 47)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import meta
from helpers.export_cases import (
    llama_reference,
    mlp_reference,
    train_exported_llama,
    train_exported_mlp,
)
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel._testing.harness import reference_training
from autoparallel.cli import main
from autoparallel.export import PlanView, plan_in_torch_styles, to_torch_code
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.types.placements import placement_str
from autoparallel.types.plan import ParameterUse
from autoparallel.types.tensors import local_shape

LR = 1e-3  # as the runtime cases: Adam turns rounding of tiny gradients into LR-sized steps
STEPS = 3


def _mlp_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(64, 64, generator=generator) for _ in range(STEPS)]


def _planned_mlp(mesh):
    with AutoParallel(
        meta(lambda: MLP(64, 256)), lambda: torch.randn(64, 64), mesh, hardware="cpu"
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        free = autop.optimize_placement()
        restricted = plan_in_torch_styles(
            autop.sharding_optimizer, free, data_dim=0, model_dim=None
        )
        return autop, free, restricted


def test_an_fsdp_plan_exported_as_torch_code_trains_equal_to_one_device(fake_mesh, ranks):
    """The MLP's plan under the parameter memory constraint, within torch's styles, written
    as fully_shard calls: on 2 gloo ranks the exported code shards every parameter as the
    plan does and trains to the single-device losses and parameters."""
    _, _, restricted = _planned_mlp(fake_mesh((2,), ("dp",)))
    plan = restricted.plan
    code = to_torch_code(plan)
    assert code.unexpressed == ()
    assert "fully_shard(model, mesh=dp, mp_policy=policy" in code.source
    assert "parallelize_module" not in code.source  # no model dim
    compile(code.source, "parallelize_model.py", "exec")
    batches = _mlp_batches()
    reference = reference_training(mlp_reference, batches, STEPS, LR)
    results = ranks(2).run(train_exported_mlp, code.source, batches, LR, timeout_s=300)
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=1e-5)
        planned = {name: placement_str(p) for name, p in plan.param_placements.items()}
        assert result["placements"] == planned


def _tiny_llama(mesh) -> AutoParallel:
    """The tiny LLaMA on ``mesh``, batch 8 x 32, priced on the cpu preset."""
    config = llama_config("tiny")
    return AutoParallel(
        meta(lambda: Llama(config)),
        lambda: torch.randint(0, config.vocab_size, (8, 32)),
        mesh,
        hardware="cpu",
    )


def test_a_plan_torch_cannot_write_is_named_and_the_restricted_plan_is_priced(fake_mesh):
    """A free plan of the tiny LLaMA on (dp, tp) shards weights at rest on tp and gathers
    them for a replicated compute: the export names each such parameter and why. Planned
    again within torch's styles, nothing is left unexpressed and the cost of the
    restriction is the ratio of the two predicted steps."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    inputs = (Shard(0), Replicate())
    with _tiny_llama(mesh) as autop:
        autop.add_input_constraints([inputs])
        autop.add_output_constraints([inputs])
        autop.add_parameter_memory_constraint()
        free = autop.optimize_placement()
        unexpressed = to_torch_code(free).unexpressed
        # torch's styles keep norms whole on tp, so the 1/world-size minimum is out of reach:
        # the restriction is priced against the free plan without it
        restricted = plan_in_torch_styles(
            autop.sharding_optimizer, free, 0, 1, drop_parameter_memory=True
        )
    ratio = restricted.cost_ratio
    assert unexpressed, "the free plan was expected to gather weights on tp"
    assert all("tp" in u.why or "model dim" in u.why for u in unexpressed)
    assert ratio >= 1 - 1e-3  # the restriction cannot beat the free optimum (up to the gap)
    code = to_torch_code(restricted.plan)
    assert code.unexpressed == ()
    assert any(name.startswith("torch_styles:") for name in autop.sharding_optimizer.constraints())


def test_tensor_parallel_styles_give_the_plans_placements_and_train_equal(fake_mesh, ranks):
    """The tiny LLaMA on a tp mesh of 2 with a parameter budget that forces splits, planned
    within torch's styles: the exported parallelize_module calls, applied to the model on
    the same (fake) mesh, leave every parameter in the plan's placement; on 2 gloo ranks the
    exported code hands every linear its input and passes on its output in the plan's
    placements (their local shapes), and trains to the single-device losses and parameters."""
    config = llama_config("tiny")
    mesh = fake_mesh((2,), ("tp",))
    with _tiny_llama(mesh) as autop:
        autop.add_input_constraints([(Replicate(),)])
        autop.add_output_constraints([(Replicate(),)])
        autop.add_parameter_memory_constraint(high=0.3 * 2**20)
        free = autop.optimize_placement()
        plan = plan_in_torch_styles(autop.sharding_optimizer, free, None, 0).plan
    code = to_torch_code(plan)
    assert code.unexpressed == ()
    styles = {style.style for style in code.recipe.styles}
    assert "colwise" in styles, code.source
    namespace: dict = {}
    exec(compile(code.source, "parallelize_model.py", "exec"), namespace)
    model = namespace["parallelize"](meta(lambda: Llama(config)), mesh)
    for name, param in model.named_parameters():
        placements = param.placements if isinstance(param, DTensor) else (Replicate(),)
        assert placement_str(placements) == placement_str(plan.param_placements[name]), name
    generator = torch.Generator().manual_seed(3)
    batches = [
        torch.randint(0, config.vocab_size, (8, 32), generator=generator) for _ in range(STEPS)
    ]
    reference = reference_training(llama_reference, batches, STEPS, LR)
    # every linear's activations at its edges, as the plan places them: the input as the
    # module is handed it, the output as its consumer reads it
    linears = {
        name.removesuffix(".weight"): use
        for name, use in plan.parameter_uses.items()
        if use.op == "linear" and name.endswith(".weight")
    }
    results = ranks(2).run(
        train_exported_llama, code.source, batches, LR, tuple(linears), timeout_s=300
    )
    single = llama_reference()
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-4)
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-4, rtol=1e-4)
        for module, use in linears.items():
            linear = single.get_submodule(module)
            expected = (
                local_shape((8, 32, linear.in_features), use.arrives, (2,)),
                # the head's result is the model's output: no consumer in the graph reads it
                local_shape(
                    (8, 32, linear.out_features), use.leaves or plan.output_placements[0], (2,)
                ),
            )
            assert tuple(result["shapes"][module]) == expected, module


def test_the_command_writes_the_plan_as_torch_code(fake_mesh, tmp_path, capsys):
    """`autoparallel plan --torch-styles` prints what the restriction costs and writes a plan
    that `autoparallel export --strict` writes whole, as a module defining
    parallelize(model, mesh); a plan JSON without the section export reads is refused in one
    line; --strict refuses a plan with unexpressed choices."""
    path = tmp_path / "plan.json"
    tiny = ["--model", "tiny", "--mesh", "2x2", "--mesh-names", "dp,tp", "--batch", "8"]
    assert main(["plan", *tiny, "--seq", "32", "--torch-styles", "--out", str(path)]) == 0
    assert "within torch's styles: predicted step" in capsys.readouterr().out
    out = tmp_path / "parallelize_model.py"
    assert main(["export", str(path), "--strict", "-o", str(out)]) == 0
    assert "def parallelize(" in out.read_text()
    assert "0 choices not expressed" in capsys.readouterr().out
    autop, free, _ = _planned_mlp(fake_mesh((2,), ("dp",)))
    path.write_text(json.dumps(autop.sharding_optimizer.get_json()))
    data = json.loads(path.read_text())
    del data["parameter_uses"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert main(["export", str(old)]) == 2
    assert "parameter_uses" in capsys.readouterr().err
    data = autop.sharding_optimizer.get_json()
    first = data["parameters"][0]
    data["parameter_uses"][first["name"]]["at_use"] = first["placements"] = "S(1)"
    data["parameter_uses"][first["name"]]["op"] = "other"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert main(["export", str(edited), "--strict"]) == 1
    assert "not expressed" in capsys.readouterr().err


def test_a_move_inside_the_models_own_code_is_named():
    """A plan that gathers on tp between two modules (inside the model's code, away from
    every linear's edges) has no torch style: the export names the move, not only the
    parameters. A move at a linear's edge is a style's own and is not named."""
    split, whole = (Shard(0),), (Replicate(),)
    column = ParameterUse("linear", "mm", activation=whole, at_use=split, leaves=split)
    view = PlanView(
        mesh_shape=(2,),
        mesh_dim_names=("tp",),
        params={"w1.weight": split},
        uses={"w1.weight": replace(column, boundary=("view", "mm", "_unsafe_view"))},
        inputs=[whole],
        outputs=[whole],
        forward_moves=(
            ("_unsafe_view", "gelu", (Shard(2),), whole),  # out of the linear: its style's
            ("gelu", "mul", (Shard(2),), whole),  # between modules: no style moves it
        ),
    )
    named = [u.name for u in to_torch_code(view).unexpressed]
    assert named == ["gelu -> mul"]


def test_the_mixed_precision_policy_is_written_as_the_default():
    """The policy a plan was made under becomes the exported function's default policy, so
    the code casts as the plan priced."""
    split, whole = (Shard(0),), (Replicate(),)
    view = PlanView(
        mesh_shape=(2,),
        mesh_dim_names=("dp",),
        params={"w1.weight": split},
        uses={"w1.weight": ParameterUse("linear", "mm", activation=split, at_use=whole)},
        inputs=[split],
        outputs=[split],
    )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    source = to_torch_code(view, policy).source
    expected = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    assert f"policy = mp_policy or {expected}" in source
    assert "MixedPrecisionPolicy()" in to_torch_code(view).source


def test_a_layer_the_plan_keeps_gathered_for_its_backward_is_not_resharded():
    """The plan gathers layer 0's weight again in the backward and keeps layer 1's from its
    forward: FSDP2 reshards layer 0 after the forward (its default) and not layer 1."""
    split, whole = (Shard(0),), (Replicate(),)

    def use(node: str, placeholder: str) -> ParameterUse:
        return ParameterUse("linear", node, activation=split, at_use=whole, placeholder=placeholder)

    view = PlanView(
        mesh_shape=(2,),
        mesh_dim_names=("dp",),
        params={"layers.0.w.weight": split, "layers.1.w.weight": split},
        uses={
            "layers.0.w.weight": use("mm", "p0"),
            "layers.1.w.weight": use("mm_1", "p1"),
        },
        inputs=[split],
        outputs=[split],
        backward_reads=(("p0", split, whole),),
    )
    units = {unit.module: unit.reshard_after_forward for unit in to_torch_code(view).recipe.units}
    assert units == {"layers.0": True, "layers.1": False, "": True}
    source = to_torch_code(view).source
    kept = 'fully_shard(model.get_submodule("layers.1"), mesh=dp, mp_policy=policy, '
    assert kept + "reshard_after_forward=False)" in source
