"""`autoparallel explain` and `autoparallel diff` on plan JSONs (`plan --out`) and saved
problems (`plan --save`).

The two plans are made once per module; everything runs in this process through ``main``
(``plan`` destroys its fake process group when it ends; explain and diff never start one).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from autoparallel.cli.plan import main

REPO = Path(__file__).resolve().parents[1]


def _plan(*args: str) -> None:
    common = ["plan", "--model", "tiny", "--mesh", "2", "--batch", "8", "--seq", "32"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*common, *args]) == 0


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """Two plans of the tiny LLaMA on a 2-device mesh: FSDP-like (memory constraint, mesh dim
    ``dp``; problem saved by default next to the JSON) and DDP-like (no constraint, mesh dim
    ``tp``; problem saved with --save into a sub-folder)."""
    root = tmp_path_factory.mktemp("plans")
    (root / "saved").mkdir()
    _plan("--out", str(root / "fsdp.json"))
    _plan(
        "--mesh-names",
        "tp",
        "--parameter-memory",
        "none",
        "--out",
        str(root / "ddp.json"),
        "--save",
        str(root / "saved" / "ddp.npz"),
    )
    return {
        "fsdp.json": root / "fsdp.json",
        "fsdp.npz": root / "fsdp.npz",
        "ddp.json": root / "ddp.json",
        "ddp.npz": root / "saved" / "ddp.npz",
    }


def _run(capsys, *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line_error(capsys, *args: object) -> str:
    code, out, err = _run(capsys, *args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    return lines[0]


# ---------------------------------------------------------------------------- plan JSON


def test_plan_out_saves_the_problem_next_to_the_json(plans):
    assert json.loads(plans["fsdp.json"].read_text())["problem"] == "fsdp.npz"
    assert plans["fsdp.npz"].is_file()
    assert json.loads(plans["ddp.json"].read_text())["problem"] == "saved/ddp.npz"
    assert plans["ddp.npz"].is_file() and not plans["ddp.json"].with_suffix(".npz").exists()


def test_explain_plan_json(plans, capsys):
    code, out, _ = _run(capsys, "explain", plans["fsdp.json"])
    assert code == 0
    assert "tok_embeddings.weight" in out and "total cost:" in out and " us" in out
    data = json.loads(plans["fsdp.json"].read_text())
    placement = next(p["placements"] for p in data["parameters"] if p["name"] == "output.weight")
    assert re.search(rf"output\.weight\s+{re.escape(placement)}\n", out)


def test_explain_placement_and_costs_on_plan_json(plans, capsys):
    code, out, _ = _run(capsys, "explain", plans["fsdp.json"], "--placement", "R", "--node", "mm")
    assert code == 0
    assert "status (target R)" in out and re.search(r"^mm\s", out, re.M)
    code, out, _ = _run(capsys, "explain", plans["ddp.json"], "--costs", "mm", "--arg", "1")
    assert code == 0
    assert "redistribution cost of" in out and "*" in out


def test_diff_plan_jsons_shows_moved_nodes(plans, capsys):
    code, out, _ = _run(capsys, "diff", plans["fsdp.json"], plans["ddp.json"])
    assert code == 0
    assert "meshes differ: a (dp=2), b (tp=2)" in out
    assert "layers.0.attention.wq.weight" in out and "-> R" in out
    moved = int(re.search(r"(\d+) node\(s\) changed output placement", out).group(1))
    assert moved > 0
    per_move = [int(n) for n in re.findall(r"^  (?:.+) -> (?:.+): (\d+) nodes?$", out, re.M)]
    assert sum(per_move) == moved
    # the JSONs alone give what the whole saved problems give
    code, from_problems, _ = _run(capsys, "diff", plans["fsdp.npz"], plans["ddp.npz"])
    assert code == 0
    assert out.splitlines()[1:] == from_problems.splitlines()[1:]


def test_explain_json_without_its_problem_exits_2(plans, tmp_path, capsys):
    alone = tmp_path / "fsdp.json"
    shutil.copy(plans["fsdp.json"], alone)
    line = _one_line_error(capsys, "explain", alone, "--placement", "R")
    assert "fsdp.npz" in line and "does not exist" in line and "autoparallel plan" in line
    unnamed = tmp_path / "unnamed.json"
    data = json.loads(alone.read_text())
    del data["problem"]
    unnamed.write_text(json.dumps(data))
    line = _one_line_error(capsys, "explain", unnamed, "--costs", "mm")
    assert "names no saved problem" in line and "--out" in line
    assert _run(capsys, "explain", unnamed)[0] == 0, "placements and totals need the JSON only"


def test_explain_refuses_a_problem_of_another_plan(plans, tmp_path, capsys):
    data = json.loads(plans["fsdp.json"].read_text())
    data["problem"] = str(plans["ddp.npz"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert "holds another plan" in _one_line_error(capsys, "explain", other, "--placement", "R")


def test_old_and_invalid_plan_json_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.json"
    junk.write_text("not json {")
    assert "is not a plan JSON" in _one_line_error(capsys, "explain", junk)
    newer = tmp_path / "newer.json"
    newer.write_text(
        json.dumps({"version": 99, "mesh": {"shape": [2]}, "totals": {}, "parameters": []})
    )
    assert "schema version 99, newer" in _one_line_error(capsys, "diff", newer, newer)
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps({"version": 0, "mesh": {"shape": [2]}, "totals": {}, "parameters": []})
    )
    assert "schema version 0" in _one_line_error(capsys, "explain", old)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"version": 1, "mesh": {"shape": [2]}}))
    assert "'totals'" in _one_line_error(capsys, "explain", partial)


# ---------------------------------------------------------------------------- saved problems


def test_explain_and_diff_saved_problems(plans, capsys):
    code, out, _ = _run(capsys, "diff", plans["fsdp.npz"], plans["ddp.npz"])
    assert code == 0
    assert "parameter(s) changed placement" in out and "layers.0.attention.wq.weight" in out

    code, out, _ = _run(capsys, "explain", plans["fsdp.npz"], "--placement", "R", "--node", "mm")
    assert code == 0 and "status (target R)" in out

    code, out, _ = _run(capsys, "explain", plans["fsdp.npz"], "--costs", "mm", "--arg", "1")
    assert code == 0 and "*" in out

    code, out, _ = _run(capsys, "explain", plans["fsdp.npz"])
    assert code == 0 and "total cost:" in out and "tok_embeddings.weight" in out


def test_bad_saved_arguments_exit_2(plans, tmp_path, capsys):
    assert "does not exist" in _one_line_error(capsys, "explain", tmp_path / "nope.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"junk")
    assert "not a saved autoparallel problem" in _one_line_error(capsys, "diff", junk, junk)
    assert "--placement" in _one_line_error(capsys, "explain", plans["fsdp.json"], "--node", "mm")
    assert "--costs" in _one_line_error(capsys, "explain", plans["fsdp.json"], "--arg", "1")
    assert "1-D mesh" in _one_line_error(capsys, "explain", plans["fsdp.json"], "--placement", "RR")
    assert "--costs nope" in _one_line_error(
        capsys, "explain", plans["fsdp.npz"], "--costs", "nope"
    )
