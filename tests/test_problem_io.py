"""save / ShardingOptimizer.load: a problem re-solved and questioned without the model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import meta
from helpers.planning import Shard

from autoparallel import AutoParallel
from autoparallel.files.placements import PlacementFileError
from autoparallel.models import Llama, llama_config
from autoparallel.optimizer import ShardingOptimizer

CONFIG = llama_config("tiny", n_layers=4)


def test_saved_problem_loads_resolves_and_explains(fake_mesh, tmp_path):
    mesh = fake_mesh((2,))
    path = tmp_path / "problem.npz"
    with AutoParallel(
        meta(lambda: Llama(CONFIG)), lambda: torch.randint(0, 256, (8, 32)), mesh
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        autop.sharding_optimizer.save(str(path))

    # a fresh interpreter: no model code imported, no process group, no GPU
    script = f"""
import sys
sys.modules["autoparallel.models"] = None  # loading must not need the model code
from autoparallel.optimizer import ShardingOptimizer
opt = ShardingOptimizer.load({str(path)!r})
saved = opt.get_solution()
again = opt.resolve()
print(saved.solver.objective, again.solver.objective, len(opt.constraints()))
print(sorted(saved.param_placements.items()) == sorted(again.param_placements.items()))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = result.stdout.strip().splitlines()[-2:]
    saved_objective, again_objective, constraints = first.split()
    assert float(saved_objective) == pytest.approx(plan.solver.objective, rel=1e-9)
    assert float(again_objective) == pytest.approx(plan.solver.objective, rel=1e-6)
    assert int(constraints) == 2  # input:0 and parameter_memory survive the round trip
    assert second == "True"


def test_loaded_problem_takes_new_constraints_and_tools(fake_mesh, tmp_path):
    mesh = fake_mesh((2,))
    path = tmp_path / "problem.npz"
    with AutoParallel(
        meta(lambda: Llama(llama_config("tiny"))), lambda: torch.randint(0, 256, (8, 32)), mesh
    ) as autop:
        autop.add_input_constraints([(Shard(0),)])
        first = autop.optimize_placement()
        autop.sharding_optimizer.save(str(path))
    optimizer = ShardingOptimizer.load(str(path))
    param = optimizer.problem.joint.params["output.weight"]
    optimizer.add_node_constraint(param, (Shard(0),))
    second = optimizer.resolve()
    assert second.param_placements["output.weight"] == (Shard(0),)
    diff = optimizer.diff_solutions(first, second)
    assert "output.weight" in str(diff)
    matmul = next(n for n in optimizer.problem.space.nodes if str(n.target) == "aten.mm.default")
    assert "*" in optimizer.print_costs_for_node(matmul.name, arg=0)
    assert optimizer.get_json()["parameters"]


def test_not_a_problem_file(tmp_path):
    path = tmp_path / "junk.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(PlacementFileError, match="not a saved autoparallel problem"):
        ShardingOptimizer.load(str(path))
