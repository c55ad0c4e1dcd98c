"""The fuzzer's API families: bad values drawn for each public entry point of the planner.

Each family is a function ``family(rng) -> list[Case]``: a fixed catalogue of mistakes users
make (and a few correct calls beside them, which must plan) plus values drawn at random from
the same pools. A :class:`Case` is plain data; ``benchmarks/fuzz_recipe.py`` runs its recipe
in the worker. ``names`` lists the words one of which a clear error's message must contain:
the argument (or file, or flag) the mistake is in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from benchmarks.fuzz_recipe import MLP_BATCH, MLP_DIM

R, P = Replicate(), Partial()
BATCH = (Shard(0), R)
"""The placements of a batch-sharded [16, 32] input on the (dp, tp) = (2, 2) mesh."""
NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Case:
    """One fuzz case: ``action`` says how the worker runs ``payload`` (a recipe, a command
    line, a file mutation); ``names`` are the words a clear error names."""

    family: str
    label: str
    action: str
    payload: Any
    names: tuple[str, ...] = field(default=())


def recipe(family: str, label: str, names: tuple[str, ...], **fields: Any) -> Case:
    return Case(family, label, "recipe", fields, names)


def step(method: str, *args: Any, target: str = "autop", **kwargs: Any) -> tuple:
    return (target, method, args, kwargs)


def t(*shape: int, dtype: str = "float32", device: str = "cpu") -> tuple:
    return ("t", shape, dtype, device)


def _random_placement(rng: random.Random) -> Any:
    return rng.choice([Shard(rng.randint(-4, 4)), R, R, P, "R", "S(0)", 0, None, [R]])


def _random_tuple(rng: random.Random) -> Any:
    length = rng.choice([0, 1, 2, 2, 2, 3])
    value = [_random_placement(rng) for _ in range(length)]
    return tuple(value) if rng.random() < 0.7 else value


# ---------------------------------------------------------------------------- mesh


def mesh_family(rng: random.Random) -> list[Case]:
    """fake_mesh's arguments, and values passed as ``mesh`` that are not a usable mesh."""
    cases = []
    shapes = [(0,), (-2,), (2, 0), ("2",), 2, "2x2", (2.5,), (), None, [2, 2], ((2,),), (1,)]
    for shape in shapes + [rng.choice([(rng.randint(-1, 3), rng.randint(-1, 3))])]:
        names = None if not isinstance(shape, (tuple, list)) or len(shape) != 2 else ("dp", "tp")
        cases.append(
            recipe(
                "mesh",
                f"fake_mesh({shape!r})",
                ("shape", "mesh"),
                mesh_arg="fake_mesh",
                fake_mesh=(shape, names, 0),
            )
        )
    for names in [("dp", "dp"), ("dp",), ("dp", 3), "dp,tp", ("dp", "tp", "cp"), ("", "tp")]:
        cases.append(
            recipe(
                "mesh",
                f"fake_mesh((2, 2), {names!r})",
                ("name",),
                mesh_arg="fake_mesh",
                fake_mesh=((2, 2), names, 0),
            )
        )
    for rank in [4, -1, "0", 1.5]:
        cases.append(
            recipe(
                "mesh",
                f"fake_mesh((2, 2), rank={rank!r})",
                ("rank",),
                mesh_arg="fake_mesh",
                fake_mesh=((2, 2), ("dp", "tp"), rank),
            )
        )
    for kind in ["none", "tuple", "str", "group", "device", "list", "outside", "part"]:
        cases.append(
            recipe("mesh", f"AutoParallel(mesh=<{kind}>)", ("mesh", "rank"), mesh_arg=kind)
        )
    for kind in ["str", "class", "function", "none"]:
        cases.append(recipe("mesh", f"AutoParallel(model=<{kind}>)", ("model",), model_arg=kind))
    cases.append(
        recipe(
            "mesh",
            "AutoParallel(input_fn=<a tensor>)",
            ("input_fn",),
            not_callable=True,
        )
    )
    return cases


# ---------------------------------------------------------------------------- options


def options_family(rng: random.Random) -> list[Case]:
    """AutoParallel's keyword options with values of the wrong type or range."""
    pools = {
        "hardware": [123, "h999", "", "profile.txt", ["h100"], "H100", "cpu"],
        "gpus_per_node": [0, -1, "8", 2.5, 3, 1],
        "time_limit_s": [-1, 0, NAN, "10", None, INF],
        "relative_gap": [-1, NAN, "x", 2.0, 0.0],
        "mp_policy": ["bf16", 1, ("bfloat16",)],
        "trace_layers_once": ["no"],
        "fold": ["yes", 1],
        "dynamic": [None],
    }
    cases = [
        recipe("options", f"AutoParallel({name}={value!r})", (name,), options={name: value})
        for name, values in pools.items()
        for value in values
    ]
    name = rng.choice(sorted(pools))
    value = rng.choice([-rng.random() * 10, rng.randint(-5, 9), str(rng.random())])
    cases.append(
        recipe("options", f"AutoParallel({name}={value!r})", (name,), options={name: value})
    )
    return cases


# ---------------------------------------------------------------------------- placements


def placements_family(rng: random.Random) -> list[Case]:
    """Placement tuples of the wrong length or type, for every method that takes them."""
    values = [
        None,
        "S(0)R",
        [(Shard(5), R)],
        [("S(0)", "R")],
        [(0, 1)],
        [[[Shard(0)], [R]]],
        [(Shard(0),)],
        [(Shard(0), R, R)],
        [(Shard(-3), R)],
        [Shard(0)],
        [(Shard(True), R)],
        [BATCH, BATCH],
        [],
        {0: BATCH},
        (BATCH,),
        [(R, Shard(1))],
        [(Shard(0), Shard(0))],
        [_random_tuple(rng)],
        [_random_tuple(rng)],
    ]
    cases = []
    for value in values:
        for method, what in (
            ("add_input_constraints", "input"),
            ("add_output_constraints", "output"),
        ):
            cases.append(
                recipe(
                    "placements",
                    f"{method}({value!r})",
                    (what, "constraint", "placement"),
                    steps=[step(method, value)],
                )
            )
    for node, value in [
        ("addmm", (Shard(2), R)),
        ("addmm", "S(0)R"),
        ("addmm", (Shard(0),)),
        ("nope", BATCH),
        (123, BATCH),
        (None, BATCH),
        ("addmm", _random_tuple(rng)),
    ]:
        cases.append(
            recipe(
                "placements",
                f"add_node_constraint({node!r}, {value!r})",
                ("node", "addmm", "nope", "placement"),
                steps=[step("add_node_constraint", node, value, target="opt")],
            )
        )
    for target in ["S(0)R", (Shard(0),), (Shard(9), R), 5, (Partial(), R)]:
        cases.append(
            recipe(
                "placements",
                f"explain_placement({target!r})",
                ("placement", "target"),
                after=[("explain_placement", (target,))],
            )
        )
    for node, arg in [("addmm", 99), ("addmm", -9), ("addmm", "x"), ("nope", 0)]:
        cases.append(
            recipe(
                "placements",
                f"print_costs_for_node({node!r}, arg={arg!r})",
                ("arg", "node", "nope"),
                after=[("print_costs_for_node", (node, arg))],
            )
        )
    for out in ["S(0)", (Shard(0),), {"y": BATCH}, [[Shard(0)]], None, [(Shard(7), R)]]:
        cases.append(
            recipe(
                "placements",
                f"auto_parallel(out_shardings={out!r})",
                ("out_shardings", "output"),
                end="auto_parallel",
                auto_parallel={"out_shardings": out},
            )
        )
    return cases


# ---------------------------------------------------------------------------- Partial


def partial_family(rng: random.Random) -> list[Case]:
    """``Partial`` where a constraint refuses it: boundaries, nodes, the model's own
    ``with_sharding_constraint``, DTensor sample inputs, saved placements."""
    partials = [P, Partial("max"), Partial("avg")]
    cases = []
    for partial in partials:
        for method, what in (
            ("add_input_constraints", "input"),
            ("add_output_constraints", "output"),
        ):
            value = [rng.choice([(Shard(0), partial), (partial, R), (partial, partial)])]
            cases.append(
                recipe(
                    "partial",
                    f"{method}({value!r})",
                    (what, "Partial"),
                    steps=[step(method, value)],
                )
            )
        cases.append(
            recipe(
                "partial",
                f"add_node_constraint('addmm', ({partial!r}, R))",
                ("node", "addmm", "Partial"),
                steps=[step("add_node_constraint", "addmm", (partial, R), target="opt")],
            )
        )
        cases.append(
            recipe(
                "partial",
                f"with_sharding_constraint(hidden, (R, {partial!r}))",
                ("with_sharding_constraint", "Partial"),
                model="wsc",
                wsc=(R, partial),
            )
        )
        cases.append(
            recipe(
                "partial",
                f"auto_parallel(sample_inputs=DTensor({partial!r}, R))",
                ("input", "Partial", "sample_inputs"),
                end="auto_parallel",
                auto_parallel={
                    "sample_inputs": ("dtensor", (MLP_BATCH, MLP_DIM), (partial, R)),
                },
            )
        )
        cases.append(
            recipe(
                "partial",
                f"auto_parallel(out_shardings=[({partial!r}, R)])",
                ("output", "Partial", "out_shardings"),
                end="auto_parallel",
                auto_parallel={"out_shardings": [(partial, R)]},
            )
        )
    cases.append(
        recipe(
            "partial",
            "with_sharding_constraint(hidden, (Shard(1), R)) (allowed)",
            ("with_sharding_constraint",),
            model="wsc",
            wsc=(Shard(1), R),
        )
    )
    cases.append(
        recipe(
            "partial",
            "with_sharding_constraint(hidden, 'S(1)R')",
            ("with_sharding_constraint", "placement"),
            model="wsc",
            wsc="S(1)R",
        )
    )
    return cases


# ---------------------------------------------------------------------------- contradictions


def contradiction_family(rng: random.Random) -> list[Case]:
    """Constraints that cannot hold together, or cannot hold at all."""
    family, names = "contradiction", ("constraint", "cannot", "memory", "input", "output")
    batch_input = step("add_input_constraints", [BATCH])
    cases = [
        recipe(
            family,
            "add_input_constraints([S(0)R]); add_node_constraint(input, RR)",
            names,
            steps=[batch_input, step("add_node_constraint", "primals_5", (R, R), target="opt")],
        ),
        recipe(
            family,
            "add_node_constraint(addmm, S(0)R) and (addmm, RR)",
            names,
            steps=[
                step("add_node_constraint", "addmm", BATCH, "a", target="opt"),
                step("add_node_constraint", "addmm", (R, R), "b", target="opt"),
            ],
        ),
        recipe(
            family,
            "add_parameter_memory_constraint(low=10, high=5)",
            names,
            steps=[step("add_parameter_memory_constraint", 10, 5)],
        ),
        recipe(
            family,
            "add_parameter_memory_constraint(high=1)",
            names,
            steps=[step("add_parameter_memory_constraint", None, 1)],
        ),
        recipe(
            family,
            "add_parameter_memory_constraint(low=1e15)",
            names,
            steps=[step("add_parameter_memory_constraint", 1e15, None)],
        ),
        recipe(
            family,
            "add_input_constraints([S(0)R]) on a batch of 1",
            names,
            inputs=t(1, MLP_DIM),
            steps=[batch_input],
        ),
        recipe(
            family,
            "add_input_constraints twice, S(0)R then RS(1)",
            names,
            steps=[batch_input, step("add_input_constraints", [(R, Shard(1))])],
        ),
        recipe(
            family,
            "with_sharding_constraint(hidden, S(1)R) vs add_node_constraint(relu, RR)",
            names,
            model="wsc",
            wsc=(Shard(1), R),
            steps=[step("add_node_constraint", "relu", (R, R), target="opt")],
        ),
        recipe(
            family,
            "memory budget of the smallest peak + parameter memory low=1e15",
            names,
            steps=[
                step("add_memory_constraint", 1e12),
                step("add_parameter_memory_constraint", 1e15, None),
            ],
        ),
        recipe(
            family,
            "remove_constraints(['nope'])",
            ("nope", "constraint"),
            steps=[step("remove_constraints", ["nope"], target="opt")],
        ),
        recipe(
            family,
            "remove_constraints('input:0')",
            ("constraint", "names"),
            steps=[batch_input, step("remove_constraints", "input:0", target="opt")],
        ),
    ]
    shard = rng.randint(0, 1)
    cases.append(
        recipe(
            family,
            f"add_output_constraints([S({shard})R]) with add_node_constraint(addmm_1, RR)",
            names,
            steps=[
                step("add_output_constraints", [(Shard(shard), R)]),
                step("add_node_constraint", "addmm_1", (R, R), target="opt"),
                step("add_node_constraint", "addmm_1", (Shard(0), Shard(1)), "c", target="opt"),
            ],
        )
    )
    return cases
