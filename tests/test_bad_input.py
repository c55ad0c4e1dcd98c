"""Bad input ends in a clear error: one case of each family ``benchmarks/fuzz_api.py`` found
ending in an error from deep in torch, numpy or HiGHS (or a KeyError/AttributeError of the
decoding) before the library checked it. Each case asserts the error's type and that its
message names the argument, file entry or flag that is wrong."""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import meta
from torch.distributed.tensor import Replicate, Shard

from autoparallel import (
    HARDWARE_PRESETS,
    AutoParallel,
    InitError,
    InputMismatchError,
    auto_parallel,
)
from autoparallel.cli import main
from autoparallel.cost.profile import ProfileError, write_profile
from autoparallel.files.placements import PlacementFileError
from autoparallel.files.plan_json import PlanJsonError, read_plan_json
from autoparallel.models import MLP
from autoparallel.optimizer import ShardingOptimizer
from autoparallel.runtime.launch import fake_mesh as make_fake_mesh
from autoparallel.types.problem import UnknownNameError

BATCH = (Shard(0), Replicate())


def _mlp_planner(mesh: Any, **options: Any) -> AutoParallel:
    return AutoParallel(meta(lambda: MLP(32, 64)), lambda: torch.randn(16, 32), mesh, **options)


def _with_planner(action: Callable[[AutoParallel], Any]) -> Callable[[Any, Path], Any]:
    """A case that plans the MLP on a (2, 2) mesh and then does ``action`` in the context."""

    def case(fake_mesh: Any, tmp_path: Path) -> Any:
        with _mlp_planner(fake_mesh((2, 2), ("dp", "tp"))) as autop:
            return action(autop)

    return case


def _solved(action: Callable[[ShardingOptimizer], Any]) -> Callable[[AutoParallel], Any]:
    def after_solving(autop: AutoParallel) -> Any:
        autop.optimize_placement()
        return action(autop.sharding_optimizer)

    return after_solving


def _saved_files(fake_mesh: Any, tmp_path: Path) -> tuple[Path, Path]:
    """(placements JSON, saved problem) of the MLP planned on (2, 2)."""
    with _mlp_planner(fake_mesh((2, 2), ("dp", "tp"))) as autop:
        autop.optimize_placement()
        autop.save_placements(str(tmp_path / "placements.json"))
        autop.sharding_optimizer.save(str(tmp_path / "problem.npz"))
    return tmp_path / "placements.json", tmp_path / "problem.npz"


def _load_placements_without(key: str) -> Callable[[Any, Path], Any]:
    def case(fake_mesh: Any, tmp_path: Path) -> Any:
        path, _ = _saved_files(fake_mesh, tmp_path)
        data = json.loads(path.read_text())
        del data[key]
        path.write_text(json.dumps(data))
        with _mlp_planner(fake_mesh((2, 2), ("dp", "tp"))) as autop:
            return autop.load_placements(str(path))

    return case


def _load_problem_edited(edit: Callable[[dict, dict], None]) -> Callable[[Any, Path], Any]:
    """A case that saves the MLP's problem, ``edit(arrays, meta)``-s it and loads it."""

    def case(fake_mesh: Any, tmp_path: Path) -> Any:
        _, path = _saved_files(fake_mesh, tmp_path)
        arrays = dict(np.load(path, allow_pickle=False))
        metadata = json.loads(arrays["meta"].tobytes().decode())
        edit(arrays, metadata)
        arrays["meta"] = np.frombuffer(json.dumps(metadata).encode(), dtype=np.uint8)
        np.savez_compressed(path, **arrays)
        return ShardingOptimizer.load(str(path)).resolve()

    return case


def _call_parallel_with(
    local: torch.Tensor, materialize: bool = True
) -> Callable[[Any, Path], Any]:
    def case(fake_mesh: Any, tmp_path: Path) -> Any:
        with _mlp_planner(fake_mesh((2, 2), ("dp", "tp"))) as autop:
            autop.add_input_constraints([BATCH])
            parallel = autop.apply_placement(autop.optimize_placement())
        if materialize:
            parallel.to_empty(device="cpu")
        return parallel(local)

    return case


def _profile_with(**hardware: Any) -> Callable[[Any, Path], Any]:
    """A case that plans with a profile whose hardware entries ``hardware`` replaces."""

    def case(fake_mesh: Any, tmp_path: Path) -> Any:
        path = tmp_path / "profile.json"
        write_profile(HARDWARE_PRESETS["cpu"], path)
        data = json.loads(path.read_text())
        data["hardware"].update(hardware)
        path.write_text(json.dumps(data))
        return _mlp_planner(fake_mesh((2,)), hardware=str(path))

    return case


CASES: dict[str, tuple[Callable[[Any, Path], Any], type[BaseException], str]] = {
    "mesh: fake_mesh names repeated": (
        lambda fm, tmp: make_fake_mesh((2, 2), ("dp", "dp")),
        ValueError,
        "mesh_dim_names",
    ),
    "mesh: fake_mesh shape an int": (lambda fm, tmp: make_fake_mesh(2), TypeError, "shape"),
    "options: time_limit_s=0": (
        lambda fm, tmp: _mlp_planner(fm((2,)), time_limit_s=0),
        ValueError,
        "time_limit_s",
    ),
    "options: relative_gap a string": (
        lambda fm, tmp: _mlp_planner(fm((2,)), relative_gap="x"),
        TypeError,
        "relative_gap",
    ),
    "options: a flag that is not a bool": (
        lambda fm, tmp: _mlp_planner(fm((2,)), trace_layers_once="no"),
        TypeError,
        "trace_layers_once",
    ),
    "profile: a name that is not a string": (
        _profile_with(name=True),
        ProfileError,
        "hardware.name",
    ),
    "profile: collectives that are not a list": (
        _profile_with(collectives=True),
        ProfileError,
        "hardware.collectives",
    ),
    "placements: unknown node": (
        _with_planner(lambda a: a.sharding_optimizer.add_node_constraint("nope", BATCH)),
        ValueError,
        "nope",
    ),
    "placements: explain_placement(5)": (
        _with_planner(_solved(lambda o: o.explain_placement(5))),
        TypeError,
        "target_placement",
    ),
    "placements: print_costs_for_node arg out of range": (
        _with_planner(_solved(lambda o: o.print_costs_for_node("addmm", arg=99))),
        ValueError,
        "99",
    ),
    "contradiction: remove_constraints(a string)": (
        _with_planner(lambda a: a.sharding_optimizer.remove_constraints("input:0")),
        TypeError,
        "remove_constraints",
    ),
    "memory: budget a string": (
        _with_planner(lambda a: a.add_memory_constraint("10GB")),
        TypeError,
        "budget",
    ),
    "memory: parameter memory NaN": (
        _with_planner(lambda a: a.add_parameter_memory_constraint(math.nan)),
        ValueError,
        "parameter memory low",
    ),
    "memory: auto_parallel parameter_memory_budget a string": (
        lambda fm, tmp: auto_parallel(
            meta(lambda: MLP(32, 64)),
            fm((2,)),
            torch.randn(16, 32),
            [(Shard(0),)],
            parameter_memory_budget="default",
        ),
        TypeError,
        "parameter_memory_budget",
    ),
    "runtime_inputs: a meta tensor": (
        _call_parallel_with(torch.empty(8, 32, device="meta")),
        InputMismatchError,
        "input 0",
    ),
    "runtime_inputs: called before to_empty": (
        _call_parallel_with(torch.empty(8, 32), materialize=False),
        InitError,
        "to_empty",
    ),
    "placements_json: an entry missing": (
        _load_placements_without("inputs"),
        PlacementFileError,
        "'inputs'",
    ),
    "saved_problem: an entry missing": (
        _load_problem_edited(lambda a, m: m.pop("strategy_lists")),
        PlacementFileError,
        "problem.npz",
    ),
    "saved_problem: the objective shortened": (
        _load_problem_edited(lambda a, m: a.update(objective=a["objective"][:-1])),
        PlacementFileError,
        "problem.npz",
    ),
    "saved_problem: a choice past the strategies": (
        _load_problem_edited(lambda a, m: m["choice"].update(addmm=10**6)),
        PlacementFileError,
        "addmm",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_a_clear_error(name: str, fake_mesh: Any, tmp_path: Path) -> None:
    case, error_type, named = CASES[name]
    with pytest.raises(error_type) as raised:
        case(fake_mesh, tmp_path)
    assert named in str(raised.value), str(raised.value)


def test_an_unknown_name_is_still_the_key_error_it_was() -> None:
    error = UnknownNameError("no node named 'nope' in the traced graph")
    assert isinstance(error, KeyError) and str(error) == "no node named 'nope' in the traced graph"


def test_a_plan_json_with_a_mistyped_section(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    data = {"version": 1, "mesh": {"shape": [2]}, "totals": {}, "parameters": [], "memory": "x"}
    path.write_text(json.dumps(data))
    with pytest.raises(PlanJsonError, match="'memory'"):
        read_plan_json(path)
    data.update(memory=None, totals={"total_us": "x"})
    path.write_text(json.dumps(data))
    with pytest.raises(PlanJsonError, match="totals.total_us"):
        read_plan_json(path)
    status, stderr = _cli(["explain", str(path)])
    assert status == 2 and stderr.count("\n") == 1 and "totals.total_us" in stderr


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--model", "json:dumps"], "--model"),  # a factory that raises
        (["--model", "tiny", "--memory-budget", "1"], "memory"),  # no plan fits the budget
    ],
)
def test_cli_errors_after_validation_are_one_line(argv: list[str], named: str) -> None:
    status, stderr = _cli(["plan", *argv, "--mesh", "2", "--batch", "2", "--seq", "8"])
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("autoparallel plan: error:") and named in stderr


def _cli(argv: list[str]) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        status = main(argv)
    return status, stderr.getvalue()
