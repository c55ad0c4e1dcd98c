"""Choosing the mesh: every (dp,) and (dp, tp) shape of N devices (tensor parallelism within
a node), each planned on a fake mesh and ranked by predicted step time; the command plans
on the fastest."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import meta
from helpers.planning import run_cli
from torch.distributed.tensor import Replicate, Shard

from autoparallel import MeshSearchError, search_mesh
from autoparallel.mesh_search import candidate_shapes
from autoparallel.models import Llama, llama_config

CONFIG = llama_config("tiny")


def tokens(batch: int):
    return lambda: torch.randint(0, CONFIG.vocab_size, (batch, 32))


def test_candidates_keep_tensor_parallelism_within_a_node():
    assert candidate_shapes(8, 4) == [
        ((8,), ("dp",)),
        ((4, 2), ("dp", "tp")),
        ((2, 4), ("dp", "tp")),
    ]
    assert candidate_shapes(8, 4, tp_across_nodes=True)[-1] == ((8,), ("tp",))
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="devices must be a positive integer"):
            candidate_shapes(bad, 8)
    with pytest.raises(ValueError, match="gpus_per_node"):
        candidate_shapes(8, 0)


def test_meshes_are_planned_and_ranked_by_predicted_step_time():
    model = meta(lambda: Llama(CONFIG))
    found = search_mesh(model, tokens(6), 4, gpus_per_node=4, hardware="h100")
    planned = [c for c in found.candidates if c.plan is not None]
    skipped = [c for c in found.candidates if c.plan is None]
    assert {c.shape for c in planned} == {(2, 2), (4,)}
    assert [c.names for c in planned if c.shape == (4,)] == [("tp",)]
    times = [c.predicted_ms for c in planned]
    assert times == sorted(times) and found.best is planned[0]
    # the batch of 6 cannot split 4 ways: that candidate says so instead of a plan
    assert [(c.shape, c.names) for c in skipped] == [((4,), ("dp",))]
    assert "does not divide the batch 6" in skipped[0].skipped
    for c in planned:
        assert c.fits  # a tiny model on an H100
        assert c.predicted_ms == pytest.approx(c.plan.totals.total_us / 1e3)
        batch = (Shard(0), Replicate()) if c.names == ("dp", "tp") else (Replicate(),)
        assert c.plan.input_placements == [batch]
    assert "skipped" in found.table()[-1] and len(found.table()) == 4
    assert not dist.is_initialized()  # no fake process group left behind


def test_a_mesh_whose_peak_does_not_fit_ranks_after_those_that_do():
    from autoparallel.cost.hardware import HARDWARE_PRESETS

    small = dataclasses.replace(HARDWARE_PRESETS["h100"], memory_bytes=1.6 * 2**20)
    model = meta(lambda: Llama(CONFIG))
    found = search_mesh(model, tokens(8), 4, gpus_per_node=4, hardware=small)
    planned = [c for c in found.candidates if c.plan is not None]
    assert {c.fits for c in planned} == {True, False}  # 1.6 MiB: between their peaks
    assert [c.fits for c in planned] == sorted((c.fits for c in planned), reverse=True)
    assert found.best.fits and any("does not fit" in line for line in found.table())


def test_pipeline_meshes_are_candidates_when_asked_and_ranked_by_their_pipeline_step():
    assert candidate_shapes(4, 4, pipeline=True)[3:] == [
        ((2, 2), ("pp", "dp")),
        ((2, 2), ("pp", "tp")),
        ((4,), ("pp",)),
    ]
    # 4 nodes of 4: a stage spans whole nodes, so pp divides 4
    shapes = candidate_shapes(16, 4, pipeline=True)
    assert {shape[0] for shape, names in shapes if names[0] == "pp"} == {2, 4}
    model = meta(lambda: Llama(CONFIG))
    found = search_mesh(model, tokens(8), 2, gpus_per_node=2, hardware="cpu", pipeline=True)
    (pipelined,) = [c for c in found.candidates if c.names == ("pp",)]
    pipeline = pipelined.plan.pipeline
    assert pipeline.num_stages == 2 and pipelined.exposed_comm_ms is None
    assert pipelined.predicted_ms == pytest.approx(pipeline.cost.step_us / 1e3)
    assert pipelined.peak_memory_gib == pytest.approx(
        max(m.peak for m in pipeline.stage_memory) / 2**30
    )
    assert any(line.split()[1:3] == ["2", "(pp)"] for line in found.table())


def test_a_search_where_nothing_plans_names_every_reason():
    model = meta(lambda: Llama(CONFIG))
    with pytest.raises(MeshSearchError, match=r"2 \(dp\): dp 2 does not divide the batch 3"):
        search_mesh(model, tokens(3), 2, gpus_per_node=1)


def test_the_command_ranks_the_meshes_and_plans_on_the_fastest(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "tiny", "--layers", "1", "--batch", "8", "--seq", "32"]
    args += ["--gpus-per-node", "2"]
    result = run_cli(*args, "--devices", "4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    table = lines[lines.index("meshes of 4 devices, fastest first:") + 1 :][:3]
    assert table[0].split()[0] == "rank" and {r.split()[1] for r in table[1:]} == {"2x2", "4"}
    best = table[1].split()[1]
    assert f"planning on {best}" in result.stdout and out.exists()
    both = run_cli(*args, "--devices", "4", "--mesh", "2x2")
    assert both.returncode == 2 and "either --mesh" in both.stderr
