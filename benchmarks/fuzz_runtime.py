"""The fuzzer's families of budgets and run-time inputs: memory budgets out of range, local
inputs the parallel module cannot take, and ``dynamic=True`` modules fed other sizes (see
``benchmarks/fuzz_cases.py`` for the :class:`Case` and the other API families)."""

from __future__ import annotations

import random
from typing import Any

from benchmarks.fuzz_cases import BATCH, INF, NAN, Case, recipe, step, t
from benchmarks.fuzz_recipe import LLAMA_BATCH, LLAMA_SEQ, MLP_BATCH, MLP_DIM

# ---------------------------------------------------------------------------- memory budgets


def memory_family(rng: random.Random) -> list[Case]:
    """Budgets out of range or of the wrong type, unknown optimizers and modes."""
    cases = []
    budgets = [
        -1,
        0,
        NAN,
        INF,
        -INF,
        "10GB",
        None,
        [1],
        1,
        1e30,
        True,
        "1e9",
        rng.uniform(-1e9, 10),
    ]
    for budget in budgets:
        cases.append(
            recipe(
                "memory",
                f"add_memory_constraint({budget!r})",
                ("budget",),
                steps=[step("add_memory_constraint", budget)],
            )
        )
    for optimizer in ["foo", -3, NAN, None, "ADAMW", INF, "8", 8]:
        cases.append(
            recipe(
                "memory",
                f"add_memory_constraint(1e12, optimizer={optimizer!r})",
                ("optimizer",),
                steps=[step("add_memory_constraint", 1e12, optimizer)],
            )
        )
    for mode in ["yes", True, None, "AUTO", "auto"]:
        cases.append(
            recipe(
                "memory",
                f"add_memory_constraint(1e12, activation_checkpointing={mode!r})",
                ("activation_checkpointing",),
                steps=[step("add_memory_constraint", 1e12, "adamw", mode)],
            )
        )
    for low, high in [
        (-1, None),
        (None, -1),
        (NAN, None),
        (None, NAN),
        ("1GB", None),
        (None, "1GB"),
        (None, INF),
        (None, 0),
        ([1], None),
    ]:
        cases.append(
            recipe(
                "memory",
                f"add_parameter_memory_constraint({low!r}, {high!r})",
                ("low", "high", "parameter memory"),
                steps=[step("add_parameter_memory_constraint", low, high)],
            )
        )
    for key, value in [
        ("memory_budget", -5),
        ("memory_budget", "40GiB"),
        ("memory_budget", NAN),
        ("parameter_memory_budget", (1,)),
        ("parameter_memory_budget", "default"),
        ("parameter_memory_budget", 5),
        ("parameter_memory_budget", (None, None, None)),
        ("activation_checkpointing", "auto"),
        ("optimizer", "lion"),
    ]:
        cases.append(
            recipe(
                "memory",
                f"auto_parallel({key}={value!r})",
                (key, "budget"),
                end="auto_parallel",
                auto_parallel={
                    key: value,
                    **({"memory_budget": 1e12} if key == "optimizer" else {}),
                },
            )
        )
    return cases


# ---------------------------------------------------------------------------- parallel module inputs


def _run(family: str, label: str, calls: list, names: tuple[str, ...], **fields: Any) -> Case:
    fields.setdefault("steps", [step("add_input_constraints", [BATCH])])
    return recipe(family, label, names, end="run", calls=calls, **fields)


def runtime_inputs_family(rng: random.Random) -> list[Case]:
    """Local inputs of the wrong rank, dtype, device, shape or kind for the parallel module."""
    local = (MLP_BATCH // 2, MLP_DIM)
    family, names = "runtime_inputs", ("input",)
    calls = {
        "a correct local input": ([t(*local)], {}),
        "rank 3": ([t(*local, 2)], {}),
        "rank 1": ([t(MLP_DIM)], {}),
        "rank 0": ([t()], {}),
        "float64": ([t(*local, dtype="float64")], {}),
        "int64": ([t(*local, dtype="int64")], {}),
        "bfloat16": ([t(*local, dtype="bfloat16")], {}),
        "meta device": ([t(*local, device="meta")], {}),
        "the global shape": ([t(MLP_BATCH, MLP_DIM)], {}),
        "a wrong feature size": ([t(local[0], MLP_DIM - 1)], {}),
        "an empty batch": ([t(0, MLP_DIM)], {}),
        "a list of a tensor": ([[t(*local)]], {}),
        "a numpy array": ([("np", local)], {}),
        "None": ([None], {}),
        "no argument": ([], {}),
        "two arguments": ([t(*local), t(*local)], {}),
        "a keyword argument": ([], {"x": t(*local)}),
        "a DTensor": ([("dtensor", local, BATCH)], {}),
        "a float": ([1.5], {}),
    }
    cases = [_run(family, f"parallel(<{what}>)", [call], names) for what, call in calls.items()]
    tokens = (LLAMA_BATCH // 2, LLAMA_SEQ)
    for what, call in {
        "correct tokens": [t(*tokens, dtype="int64")],
        "float tokens": [t(*tokens)],
        "a longer sequence": [t(tokens[0], LLAMA_SEQ + 1, dtype="int64")],
        "int32 tokens": [t(*tokens, dtype="int32")],
    }.items():
        cases.append(
            _run(
                family,
                f"llama parallel(<{what}>)",
                [(call, {})],
                names,
                model="llama",
                steps=[step("add_input_constraints", [BATCH])],
            )
        )
    cases.append(
        _run(
            family,
            "parallel(<a correct local input>) before to_empty",
            [calls["a correct local input"]],
            ("to_empty", "meta"),
            materialize=False,
        )
    )
    what = rng.choice(sorted(calls))
    cases.append(_run(family, f"parallel(<{what}>) twice", [calls[what]] * 2, names))
    return cases


# ---------------------------------------------------------------------------- dynamic sizes


def dynamic_family(rng: random.Random) -> list[Case]:
    """``dynamic=True`` modules fed other sizes, and example inputs of odd sizes or kinds."""
    family, names = "dynamic", ("input", "dynamic")
    cases = []
    for rows, cols in [(4, MLP_DIM), (3, MLP_DIM), (1, MLP_DIM), (0, MLP_DIM), (8, 31), (8, 64)]:
        cases.append(
            _run(
                family,
                f"dynamic parallel(<local [{rows}, {cols}]>)",
                [([t(rows, cols)], {})],
                names,
                options={"dynamic": True},
            )
        )
    cases.append(
        _run(
            family,
            "dynamic parallel(<rank 3>)",
            [([t(4, MLP_DIM, 2)], {})],
            names,
            options={"dynamic": True},
        )
    )
    cases.append(
        _run(
            family,
            "dynamic parallel(<float64 [4, 32]>)",
            [([t(4, MLP_DIM, dtype="float64")], {})],
            names,
            options={"dynamic": True},
        )
    )
    rows = rng.randint(1, 12)
    cases.append(
        _run(
            family,
            f"dynamic parallel(<local [{rows}, 32]>)",
            [([t(rows, MLP_DIM)], {})],
            names,
            options={"dynamic": True},
        )
    )
    example_inputs = {
        "[0, 32]": t(0, MLP_DIM),
        "[15, 32] (uneven over dp)": t(15, MLP_DIM),
        "[16, 31]": t(MLP_BATCH, 31),
        "[16, 32] float64": t(MLP_BATCH, MLP_DIM, dtype="float64"),
        "[16, 32] int64": t(MLP_BATCH, MLP_DIM, dtype="int64"),
        "[16, 32] on meta": t(MLP_BATCH, MLP_DIM, device="meta"),
        "a string": "x",
        "None": None,
        "a list of ints": [1, 2, 3],
        "a dict with an int key": {1: t(MLP_BATCH, MLP_DIM)},
        "an empty tuple": (),
        "[32]": t(MLP_DIM),
    }
    for what, value in example_inputs.items():
        cases.append(
            recipe(
                family,
                f"input_fn() -> {what}",
                ("input", "input_fn"),
                inputs=value,
                steps=[step("add_input_constraints", [BATCH])] if "[1" in what else [],
            )
        )
    return cases
