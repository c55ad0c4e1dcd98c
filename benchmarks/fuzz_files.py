"""The fuzzer's file and command-line families: files on disk made wrong, and argv mistakes.

:func:`make_fixtures` writes the correct files once per worker (a plan JSON and its saved
problem from ``autoparallel plan``, the MLP's saved problem and placements, a hardware
profile); each file case copies one, applies a mutation (truncated, emptied, garbage, a key
deleted or set to a wrong value, an array of the ``.npz`` dropped or shortened) and hands the
result to the API or the CLI. Mutations are plain tuples so that cases stay picklable:

* ``("truncate", fraction)``, ``("flip", fraction)`` (16 bytes inverted), ``("empty",)``, ``("garbage",)``, ``("text", str)``, ``("missing",)``;
* ``("delete", path)``, ``("set", path, value)``: a key of the JSON (of the ``.npz``'s
  ``meta`` record for a saved problem), ``path`` a tuple of keys and list indices;
* ``("drop", array)``, ``("shorten", array)``: an array of a saved problem.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.fuzz_cases import INF, NAN, Case, recipe, step

TINY_PLAN = ["--model", "tiny", "--mesh", "2x2", "--batch", "4", "--seq", "16"]
"""The command line of the CLI fixture (and the base the CLI family edits)."""
MUTATED = "mutated"
"""The stem of the file a file case writes (cases run one at a time in a worker)."""


# ---------------------------------------------------------------------------- fixtures


def make_fixtures(workdir: Path) -> None:
    """Write the correct files the file cases mutate (once: kept while they exist)."""
    if (workdir / "ready").exists():
        return
    import contextlib

    import torch
    import torch.distributed as dist

    from autoparallel import AutoParallel, fake_mesh
    from autoparallel.cli import main
    from autoparallel.cost.hardware import HARDWARE_PRESETS
    from autoparallel.cost.profile import write_profile
    from autoparallel.models import MLP

    with contextlib.redirect_stdout(io.StringIO()):
        status = main(["plan", *TINY_PLAN, "--out", str(workdir / "plan.json")])
    assert status == 0, "the CLI fixture did not plan"
    for name, shape in (("mlp", (2, 2)), ("mlp_mesh4", (4,))):
        mesh = fake_mesh(shape)
        with torch.device("meta"):
            model = MLP(32, 64)
        with AutoParallel(model, lambda: torch.randn(16, 32), mesh) as autop:
            plan = autop.optimize_placement()
            autop.save_placements(str(workdir / f"{name}_placements.json"), plan)
            autop.sharding_optimizer.save(str(workdir / f"{name}.npz"))
        dist.destroy_process_group()
    write_profile(HARDWARE_PRESETS["cpu"], workdir / "profile.json")
    data = json.loads((workdir / "profile.json").read_text())
    data["hardware"]["collectives"] = [
        {"link": "intra", "collective": "all_reduce", "latency_us": 5.0, "bandwidth": 1e9}
    ]
    (workdir / "profile.json").write_text(json.dumps(data))
    (workdir / "ready").write_text("")


def mutate(workdir: Path, fixture: str, mutation: tuple, suffix: str) -> Path:
    """Copy ``fixture`` to the mutated file with ``mutation`` applied; returns its path."""
    target = workdir / f"{MUTATED}{suffix}"
    source = workdir / fixture
    kind = mutation[0]
    if target.is_dir():
        shutil.rmtree(target)
    target.unlink(missing_ok=True)
    if kind == "missing":
        return target
    raw = source.read_bytes()
    if kind == "truncate":
        target.write_bytes(raw[: int(len(raw) * mutation[1])])
    elif kind == "flip":  # 16 bytes inverted at a fraction of the file
        start = int(len(raw) * mutation[1])
        flipped = bytes(b ^ 0xFF for b in raw[start : start + 16])
        target.write_bytes(raw[:start] + flipped + raw[start + 16 :])
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "garbage":
        target.write_bytes(bytes(random.Random(len(raw)).randrange(256) for _ in range(512)))
    elif kind == "text":
        target.write_text(mutation[1])
    elif fixture.endswith(".npz"):
        target.write_bytes(_mutate_npz(raw, mutation))
    else:
        data = json.loads(raw)
        target.write_text(json.dumps(_edit(data, mutation)))
    return target


def _edit(data: Any, mutation: tuple) -> Any:
    kind, path = mutation[0], mutation[1]
    if not path:
        return mutation[2]
    owner = data
    for key in path[:-1]:
        owner = owner[key]
    if kind == "delete":
        del owner[path[-1]]
    else:
        owner[path[-1]] = mutation[2]
    return data


def _mutate_npz(raw: bytes, mutation: tuple) -> bytes:
    arrays = dict(np.load(io.BytesIO(raw), allow_pickle=False))
    kind = mutation[0]
    if kind == "drop":
        del arrays[mutation[1]]
    elif kind == "shorten":
        arrays[mutation[1]] = arrays[mutation[1]][:-1]
    elif kind == "meta_bytes":
        arrays["meta"] = np.frombuffer(mutation[1], dtype=np.uint8)
    else:
        meta = _edit(json.loads(arrays["meta"].tobytes().decode()), mutation)
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def file_case(
    family: str, fixture: str, mutation: tuple, then: tuple, names: tuple[str, ...], label: str
) -> Case:
    """A case that mutates ``fixture`` and then runs ``then``: ("recipe", recipe fields),
    ("cli", argv with {file} and {wd}) or ("load_problem",)."""
    payload = {"fixture": fixture, "mutation": mutation, "then": then}
    return Case(family, f"{label} <- {_short(mutation)}", "file", payload, (MUTATED, *names))


def _short(mutation: tuple) -> str:
    return " ".join(repr(part) for part in mutation)[:90]


# ---------------------------------------------------------------------------- families


def _json_mutations(rng: random.Random, keys: list[tuple]) -> list[tuple]:
    """The generic mutations of a JSON file, plus deleting or mistyping each of ``keys``."""
    wrong = [None, "x", -1, [1, 2], {"a": 1}, NAN, True]
    mutations: list[tuple] = [
        ("truncate", rng.uniform(0.05, 0.95)),
        ("truncate", 0.5),
        ("flip", rng.uniform(0.0, 0.95)),
        ("empty",),
        ("garbage",),
        ("text", "[]"),
        ("text", "null"),
        ("text", '{"version": 1}'),
        ("missing",),
        ("set", ("version",), 2),
        ("set", ("version",), "1"),
        ("set", ("version",), None),
    ]
    for key in keys:
        mutations.append(("delete", key))
        mutations.append(("set", key, rng.choice(wrong)))
    return mutations


def plan_json_family(rng: random.Random) -> list[Case]:
    """A plan JSON (``plan --out``) truncated or edited, read by explain and diff."""
    keys = [
        ("mesh",),
        ("totals",),
        ("parameters",),
        ("nodes",),
        ("problem",),
        ("hardware",),
        ("mesh", "shape"),
        ("totals", "total_us"),
        ("parameters", 0),
        ("parameters", 0, "placements"),
        ("parameters", 0, "name"),
        ("nodes", 0, "name"),
        ("memory",),
        ("solver",),
        ("layers",),
        ("run",),
    ]
    commands = [
        ["explain", "{file}"],
        ["diff", "{file}", "{wd}/plan.json"],
        ["explain", "{file}", "--placement", "S(0)R"],
    ]
    cases = []
    for mutation in _json_mutations(rng, keys):
        argv = rng.choice(commands)
        cases.append(
            file_case(
                "plan_json",
                "plan.json",
                mutation,
                ("cli", argv),
                (),
                " ".join(argv[:1]) + " plan.json",
            )
        )
    for problem in ("plan.json", "missing.npz", 5):  # the problem it names is wrong
        cases.append(
            file_case(
                "plan_json",
                "plan.json",
                ("set", ("problem",), problem),
                ("cli", commands[2]),
                ("problem",),
                "explain plan.json --placement S(0)R",
            )
        )
    return cases


def placements_json_family(rng: random.Random) -> list[Case]:
    """A placements file (``save_placements``) truncated or edited, read by load_placements."""
    keys = [
        ("params",),
        ("inputs",),
        ("outputs",),
        ("mesh_shape",),
        ("graph_fingerprint",),
        ("format",),
    ]
    mutations = _json_mutations(rng, keys) + [
        ("set", ("params", "w1.weight"), "S(9)R"),
        ("set", ("params", "w1.weight"), "X"),
        ("set", ("params", "w1.weight"), "P(sum)R"),
        ("set", ("params", "w1.weight"), "S(0)"),
        ("set", ("params", "w1.weight"), 5),
        ("set", ("params", "nope.weight"), "RR"),
        ("set", ("inputs",), ["S(0)"]),
        ("set", ("inputs",), "S(0)R"),
        ("set", ("inputs",), ["P(sum)R"]),
        ("set", ("mesh_shape",), "2x2"),
        ("set", ("mesh_shape",), 5),
        ("set", ("mesh_shape",), [4]),
    ]
    load = step("load_placements", ("file", f"{MUTATED}.json"))
    cases = [
        file_case(
            "placements_json",
            "mlp_placements.json",
            mutation,
            ("recipe", {"steps": [load]}),
            ("placements", "params", "inputs", "mesh"),
            "load_placements",
        )
        for mutation in mutations
    ]
    cases.append(
        recipe(
            "placements_json",
            "load_placements(<a file planned on mesh (4,)>)",
            ("mesh",),
            steps=[step("load_placements", ("file", "mlp_mesh4_placements.json"))],
        )
    )
    cases.append(
        recipe(
            "placements_json",
            "load_placements(<plan.json, another kind of file>)",
            ("placements",),
            steps=[step("load_placements", ("file", "plan.json"))],
        )
    )
    return cases


def saved_problem_family(rng: random.Random) -> list[Case]:
    """A saved problem (``ShardingOptimizer.save``, ``plan --save``) truncated or edited."""
    meta_keys = [
        ("nodes",),
        ("edges",),
        ("strategy_lists",),
        ("mesh_shape",),
        ("hardware",),
        ("roles",),
        ("user_constraints",),
        ("choice",),
        ("pair_tables",),
        ("nodes", 0, "columns"),
        ("nodes", 0, "inputs"),
        ("edges", 0, "producer"),
        ("hardware", "flops_fp32"),
        ("solver",),
    ]
    wrong = [None, "x", -1, [1, 2], {"a": 1}, 10**6]
    mutations: list[tuple] = [
        ("truncate", rng.uniform(0.05, 0.95)),
        ("flip", rng.uniform(0.0, 0.95)),
        ("flip", rng.uniform(0.0, 0.95)),
        ("empty",),
        ("garbage",),
        ("missing",),
        ("set", ("version",), 2),
        ("set", ("format",), "x"),
        ("set", ("choice", "addmm"), 10**6),
        ("set", ("choice", "nope"), 0),
        ("set", ("nodes", 1, "inputs"), ["nope"]),
        ("drop", "objective"),
        ("drop", "integrality"),
        ("drop", "rows_columns"),
        ("shorten", "objective"),
        ("shorten", "integrality"),
        ("meta_bytes", b"not json"),
    ]
    for key in meta_keys:
        mutations.append(("delete", key))
        mutations.append(("set", key, rng.choice(wrong)))
    cases = []
    for mutation in mutations:
        if rng.random() < 0.7:
            cases.append(
                file_case(
                    "saved_problem",
                    "mlp.npz",
                    mutation,
                    ("load_problem",),
                    ("saved", "problem"),
                    "ShardingOptimizer.load",
                )
            )
        else:
            cases.append(
                file_case(
                    "saved_problem",
                    "plan.npz",
                    mutation,
                    ("cli", ["explain", "{file}"]),
                    ("saved", "problem"),
                    "explain plan.npz",
                )
            )
    return cases


def profile_family(rng: random.Random) -> list[Case]:
    """A hardware profile (``hardware="profile.json"``, ``--hardware``) missing or edited."""
    keys = [
        ("format",),
        ("hardware",),
        ("hardware", "flops_fp32"),
        ("hardware", "memory_bandwidth"),
        ("hardware", "name"),
        ("hardware", "collectives"),
        ("hardware", "collectives", 0),
        ("hardware", "collectives", 0, "bandwidth"),
        ("hardware", "collectives", 0, "link"),
        ("hardware", "overlap_fraction"),
        ("hardware", "memory_bytes"),
        ("hardware", "supports_fp8"),
    ]
    mutations = _json_mutations(rng, keys) + [
        ("set", ("hardware", "flops_fp32"), INF),
        ("set", ("hardware", "flops_fp32"), 0),
        ("set", ("hardware", "matmul_table"), {"dtype": "float32"}),
        (
            "set",
            ("hardware", "matmul_table"),
            {"dtype": "x", "dims": "ab", "warm_us": [], "cold_us": [], "cold_bytes": 1},
        ),
        ("set", ("hardware", "extra_key"), 1),
    ]
    cases = []
    for mutation in mutations:
        if rng.random() < 0.6:
            then: tuple = ("recipe", {"options": {"hardware": ("file", f"{MUTATED}.json")}})
            label = "AutoParallel(hardware=profile.json)"
        else:
            then = ("cli", ["plan", *TINY_PLAN, "--hardware", "{file}"])
            label = "plan --hardware profile.json"
        cases.append(
            file_case("profile", "profile.json", mutation, then, ("profile", "hardware"), label)
        )
    return cases


def cli_family(rng: random.Random) -> list[Case]:
    """Mistakes on the ``autoparallel`` command line, in-process and (a few) as a subprocess."""
    flag_mistakes = [
        ("--mesh", "3xq"),
        ("--mesh", "0"),
        ("--mesh", ""),
        ("--mesh", "2x2x"),
        ("--mesh", "-2"),
        ("--model", "unknown"),
        ("--model", "nonexistent.module:f"),
        ("--model", "json:dumps"),
        ("--model", "math:pi"),
        ("--model", "autoparallel.models:MLP"),
        ("--model", "os:getcwd"),
        ("--batch", "0"),
        ("--batch", "abc"),
        ("--batch", "3"),
        ("--seq", "-1"),
        ("--seq", "1000"),
        ("--mesh-names", "dp"),
        ("--mesh-names", "dp,dp"),
        ("--mesh-names", "dp,1x"),
        ("--hardware", "foo"),
        ("--hardware", "{wd}/missing.json"),
        ("--parameter-memory", "-5"),
        ("--parameter-memory", "1"),
        ("--parameter-memory", "lots"),
        ("--memory-budget", "1"),
        ("--memory-budget", "-1GiB"),
        ("--optimizer", "foo"),
        ("--optimizer", "nan"),
        ("--optimizer", "inf"),
        ("--optimizer", "-1"),
        ("--activation-checkpointing", "auto"),
        ("--layers", "0"),
        ("--gpus-per-node", "0"),
        ("--gpus-per-node", "3"),
        ("--reduce-dtype", "bf16"),
        ("--param-dtype", "fp8"),
        ("--out", "/nonexistent/x.json"),
        ("--html", "/nonexistent/x.html"),
        ("--save", "{wd}"),
    ]
    cases = []
    for flag, value in flag_mistakes:
        argv = _with_flag(["plan", *TINY_PLAN], flag, value)
        cases.append(Case("cli", f"plan {flag} {value!r}", "cli", argv, (flag,)))
    plan = "{wd}/plan.json"
    commands = [
        ([], ("command",)),
        (["plan"], ("--model", "required")),
        (["frobnicate"], ("frobnicate", "command")),
        (["explain"], ("plan", "required")),
        (["explain", "{wd}/missing.json"], ("missing.json",)),
        (["explain", plan, "--placement", "XYZ"], ("--placement",)),
        (["explain", plan, "--placement", "S(9)R"], ("--placement", "S(9)")),
        (["explain", plan, "--placement", "S(0)"], ("--placement",)),
        (["explain", plan, "--costs", "nope"], ("--costs", "nope")),
        (["explain", plan, "--costs", "primals_1", "--arg", "99"], ("--arg", "99")),
        (["explain", plan, "--node", "x"], ("--node",)),
        (["diff", plan], ("b", "required")),
        (["diff", plan, "{wd}"], ("wd", "directory", "exist")),
        (["calibrate"], ("--out",)),
        (["calibrate", "--out", "{wd}/p.json", "--nproc", "0"], ("--nproc",)),
        (["calibrate", "--out", "{wd}/p.json", "--nproc", "2", "--mesh", "3xq"], ("--mesh",)),
        (["calibrate", "--out", "/nonexistent/p.json", "--nproc", "2"], ("--out",)),
        (
            ["calibrate", "--out", "{wd}/p.json", "--nproc", "2", "--max-bytes", "lots"],
            ("--max-bytes",),
        ),
        (["calibrate", "--out", "{wd}/p.json", "--nproc", "2", "--repeats", "0"], ("--repeats",)),
    ]
    for argv, names in commands:
        cases.append(Case("cli", " ".join(argv) or "<no arguments>", "cli", argv, names))
    flag, value = rng.choice(flag_mistakes)
    cases.append(
        Case(
            "cli",
            f"subprocess: plan {flag} {value!r}",
            "cli_subprocess",
            _with_flag(["plan", *TINY_PLAN], flag, value),
            (flag,),
        )
    )
    cases.append(
        Case(
            "cli",
            "subprocess: explain missing.json",
            "cli_subprocess",
            ["explain", "{wd}/missing.json"],
            ("missing.json",),
        )
    )
    return cases


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (replaced where it is, else appended)."""
    if flag in argv:
        argv = list(argv)
        argv[argv.index(flag) + 1] = value
        return argv
    return [*argv, flag, value]
