"""save_placements / load_placements: a plan kept as JSON and reapplied, with clear mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import meta
from helpers.planning import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.files.placements import PlacementFileError
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.types.placements import PlacementSyntaxError, parse_placements

CONFIG = llama_config("tiny")


def _tokens():
    return torch.randint(0, CONFIG.vocab_size, (8, 32))


def test_placements_round_trip_and_reapply(fake_mesh, tmp_path):
    mesh = fake_mesh((2, 2))
    inp = (Shard(0), Replicate())
    path = tmp_path / "plan.json"
    with AutoParallel(meta(lambda: Llama(CONFIG)), _tokens, mesh) as autop:
        autop.add_input_constraints([inp])
        autop.add_parameter_memory_constraint()
        original = autop.optimize_placement()
        autop.save_placements(str(path))
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["mesh_shape"] == [2, 2]
    assert data["params"]["layers.0.attention.wq.weight"]  # seed notation strings

    with AutoParallel(meta(lambda: Llama(CONFIG)), _tokens, mesh) as autop:
        names = autop.load_placements(str(path))  # no memory constraint this time
        reapplied = autop.optimize_placement()
    assert "param:output.weight" in names
    assert reapplied.param_placements == original.param_placements
    assert reapplied.input_placements == original.input_placements


def test_mismatches_are_named(fake_mesh, tmp_path):
    path = tmp_path / "plan.json"
    mesh = fake_mesh((2,))
    with AutoParallel(meta(lambda: MLP(16, 64)), lambda: torch.randn(8, 16), mesh) as autop:
        autop.optimize_placement()
        autop.save_placements(str(path))
    with AutoParallel(meta(lambda: MLP(16, 128)), lambda: torch.randn(8, 16), mesh) as autop:
        with pytest.raises(PlacementFileError, match="another graph"):
            autop.load_placements(str(path))
    mesh = fake_mesh((4,))
    with AutoParallel(meta(lambda: MLP(16, 64)), lambda: torch.randn(8, 16), mesh) as autop:
        with pytest.raises(PlacementFileError, match=r"mesh \(2,\), this mesh is \(4,\)"):
            autop.load_placements(str(path))
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with AutoParallel(meta(lambda: MLP(16, 64)), lambda: torch.randn(8, 16), mesh) as autop:
        with pytest.raises(PlacementFileError, match="version 99"):
            autop.load_placements(str(path))


def test_parse_placements():
    from torch.distributed.tensor import Partial

    assert parse_placements("S(0)RS(1)") == (Shard(0), Replicate(), Shard(1))
    assert parse_placements("P(sum)R") == (Partial("sum"), Replicate())
    with pytest.raises(PlacementSyntaxError, match="cannot read"):
        parse_placements("S0R")
