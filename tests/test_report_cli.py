"""The HTML report and the ``autoparallel plan`` command line.

The report is checked on a hand-made plan dict of the JSON schema (version 1) that
``ShardingOptimizer.get_json()`` returns, so these tests do not depend on the planner. The CLI
is run end to end on the tiny LLaMA: once as a user runs it (``python -m autoparallel.cli``
in a fresh interpreter), otherwise through ``main()`` in this process, which is the same code
without an interpreter's start-up (``plan`` destroys its fake process group when it ends).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.planning import TINY_PLAN_ARGS, run_cli

from autoparallel.files.plan_json import (
    READ_VERSIONS,
    SCHEMA_VERSION,
    PlanJsonError,
    read_plan_json,
)
from autoparallel.report import render_html, write_html
from autoparallel.report.diff import diff_plan_json
from autoparallel.report.summary import collapse_layers, summary_lines

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")

SAMPLE_PLAN_JSON = r"""
{"version": 1,
 "mesh": {"shape": [2, 4], "dim_names": ["dp", "tp"]},
 "hardware": {"name": "h100", "gpus_per_node": 8},
 "totals": {"total_us": 1500.5, "comm_us": 400.25, "compute_us": 1100.0, "transition_us": 0.25},
 "solver": {"status": "Optimal", "objective_us": 1500.5, "bound_us": 1500.5, "gap": 0.0, "time_s": 1.25,
            "num_variables": 1234, "num_constraints": 567},
 "parameters": [
  {"name": "tok_embeddings.weight", "shape": [256, 64], "dtype": "float32", "placements": "S(0)S(1)",
   "bytes_per_device": 8192, "module": "tok_embeddings"},
  {"name": "layers.0.attention.wq.weight", "shape": [64, 64], "dtype": "float32", "placements": "RS(0)",
   "bytes_per_device": 4096, "module": "layers.0.attention.wq"},
  {"name": "layers.1.attention.wq.weight", "shape": [64, 64], "dtype": "float32", "placements": "RS(0)",
   "bytes_per_device": 4096, "module": "layers.1.attention.wq"},
  {"name": "layers.0.feed_forward.w2.weight", "shape": [64, 128], "dtype": "float32", "placements": "S(0)S(1)",
   "bytes_per_device": 4096, "module": "layers.0.feed_forward.w2"},
  {"name": "layers.1.feed_forward.w2.weight", "shape": [64, 128], "dtype": "float32", "placements": "RS(1)",
   "bytes_per_device": 8192, "module": "layers.1.feed_forward.w2"},
  {"name": "norm.weight", "shape": [64], "dtype": "float32", "placements": "RR",
   "bytes_per_device": 256, "module": "norm"}],
 "inputs": [{"index": 0, "shape": [8, 32], "placements": "S(0)R"}],
 "outputs": [{"index": 0, "shape": [8, 32, 256], "placements": "S(0)R"}],
 "nodes": [
  {"name": "mm", "target": "aten.mm.default", "phase": "forward", "module": "layers.0.attention.wq",
   "shape": [256, 64], "placements": "S(0)S(1)", "input_placements": ["S(0)R", "RS(1)"],
   "compute_us": 12.5, "comm_us": 30.0, "transition_us": 0.01},
  {"name": "mm_1", "target": "aten.mm.default", "phase": "backward", "module": "layers.1.feed_forward.w2",
   "shape": [256, 128], "placements": "S(0)R", "input_placements": ["S(0)S(1)", "S(1)R"],
   "compute_us": 20.0, "comm_us": 0.0, "transition_us": 0.0}],
 "collectives": [
  {"consumer": "mm", "producer": "primals_2", "kind": "all_gather", "mesh_dims": [0], "src": "S(0)S(1)",
   "dst": "RS(1)", "comm_us": 30.0, "phase": "forward", "module": "layers.0.attention.wq"},
  {"consumer": "mm_1", "producer": "mm", "kind": "reduce_scatter+all_reduce", "mesh_dims": [0, 1],
   "src": "P(sum)P(sum)", "dst": "S(0)R", "comm_us": 250.0, "phase": "backward", "module": "layers.1.feed_forward.w2"},
  {"consumer": "view_3", "producer": "mm_1", "kind": "all_to_all", "mesh_dims": [1], "src": "S(0)S(1)",
   "dst": "S(0)S(0)", "comm_us": 120.25, "phase": "backward", "module": "layers.1.feed_forward.w2"},
  {"consumer": "t_2", "producer": "primals_3", "kind": "local", "mesh_dims": [1], "src": "RR",
   "dst": "RS(1)", "comm_us": 0.0, "phase": "forward", "module": "layers.0.feed_forward.w2"}],
 "layers": [
  {"module": "layers.0", "compute_us": 500.0, "comm_us": 30.0, "transition_us": 0.1},
  {"module": "layers.1", "compute_us": 550.0, "comm_us": 370.25, "transition_us": 0.15},
  {"module": "", "compute_us": 50.0, "comm_us": 0.0, "transition_us": 0.0}],
 "fallbacks": ["aten.nonzero.default (nonzero)"],
 "constraints": {"input:0": "input 0 placed S(0)R </script><b>not bold</b>",
                 "parameter_memory": "parameter memory <= 28,928 bytes per device"}}
"""


@pytest.fixture
def sample() -> dict:
    return json.loads(SAMPLE_PLAN_JSON)


def embedded_json(page: str) -> str:
    match = re.search(r'<script type="application/json" id="plan-data">(.*?)</script>', page, re.S)
    assert match, "the page embeds the plan as JSON"
    return match.group(1)


# ---------------------------------------------------------------------------- HTML report


def test_embedded_json_round_trips(sample: dict) -> None:
    page = render_html(sample)
    assert json.loads(embedded_json(page)) == sample
    assert "</script><b>" not in page, "a </script> inside the data must not close the element"


def test_page_shows_parameters_collectives_and_no_network(sample: dict) -> None:
    page = render_html(sample)
    for param in sample["parameters"]:
        assert param["name"] in page
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "local"):
        assert f">{kind}<" in page
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and "src=" not in page, "no external resources"
    assert "&lt;b&gt;not bold&lt;/b&gt;" in page, "text from the data is escaped"
    assert "us" in page and "1,500.50 us" in page
    assert "aten.nonzero.default (nonzero)" in page


def test_collectives_sorted_by_cost_and_hot_spots(sample: dict) -> None:
    page = render_html(sample)
    table = page[page.index('id="collective-table"') :]
    positions = [table.index(f'data-v="{v}"') for v in (250.0, 120.25, 30.0, 0.0)]
    assert positions == sorted(positions), "most expensive collective first"
    assert 'id="hotspot-table"' in page


def test_identical_layers_marked(sample: dict) -> None:
    page = render_html(sample)
    assert "same placements as" not in page  # the two layers differ in w2
    sample["parameters"][4]["placements"] = "S(0)S(1)"
    assert "same placements as layers.0" in render_html(sample)


def test_partial_plan_and_non_finite_values(tmp_path: Path, sample: dict) -> None:
    """A dict built from a Plan alone (no nodes/collectives/layers) still renders."""
    subset = {
        k: sample[k]
        for k in (
            "version",
            "mesh",
            "hardware",
            "totals",
            "solver",
            "parameters",
            "inputs",
            "outputs",
        )
    }
    subset["totals"]["comm_us"] = float("inf")
    path = write_html(subset, tmp_path / "plan.html")
    page = path.read_text(encoding="utf-8")
    assert json.loads(embedded_json(page))["totals"]["comm_us"] is None
    assert "not recorded in this data" in page


def test_collapse_layers() -> None:
    rows = collapse_layers(
        {
            "tok.weight": "RR",
            "layers.0.wq.weight": "S(0)S(1)",
            "layers.1.wq.weight": "S(0)S(1)",
            "layers.2.wq.weight": "RS(0)",
            "layers.3.wq.weight": "S(0)S(1)",
            "norm.weight": "RR",
        }
    )
    assert rows == [
        ("tok.weight", "RR"),
        ("layers.0-1,3.wq.weight", "S(0)S(1)"),
        ("layers.2.wq.weight", "RS(0)"),
        ("norm.weight", "RR"),
    ]


def test_summary_lines_have_units(sample: dict) -> None:
    text = "\n".join(summary_lines(sample))
    assert "layers.0-1.attention.wq.weight" in text
    assert "comm 400.25 us" in text and "comm 26.7%" in text
    assert "250.00 us" in text  # the top collective


# ---------------------------------------------------------------------------- reading and comparing plan JSONs


def test_read_plan_json_checks_version_and_sections(tmp_path: Path, sample: dict) -> None:
    assert SCHEMA_VERSION in READ_VERSIONS, "the JSON written must be one this code reads back"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(sample))
    assert read_plan_json(path) == sample
    for broken, needle in (
        ({**sample, "version": 7}, "newer"),
        ({**sample, "version": "1"}, "does not read"),
        ({k: v for k, v in sample.items() if k != "parameters"}, "'parameters'"),
        ([1, 2], "no schema"),
    ):
        path.write_text(json.dumps(broken))
        with pytest.raises(PlanJsonError, match=needle):
            read_plan_json(path)


def test_diff_plan_json_counts_moves_and_deltas(sample: dict) -> None:
    other = json.loads(json.dumps(sample))
    other["mesh"]["dim_names"] = ["tp", "dp"]
    other["totals"]["comm_us"] = 300.25
    other["solver"]["objective_us"] = None
    other["parameters"][0]["placements"] = "RR"
    other["nodes"][0]["placements"] = "RR"
    other["nodes"][1]["name"] = "mm_9"
    diff = diff_plan_json(sample, other)
    assert diff.delta["comm_us"] == pytest.approx(-100.0) and diff.delta["compute_us"] == 0.0
    assert diff.objective_delta_us is None
    assert diff.parameters == [("tok_embeddings.weight", "S(0)S(1)", "RR")]
    assert diff.moves == {("S(0)S(1)", "RR"): 1} and diff.num_moved == 1
    assert diff.only_in_a == ["mm_1"] and diff.only_in_b == ["mm_9"]
    text = str(diff)
    assert "meshes differ: a (dp=2, tp=4), b (tp=2, dp=4)" in text
    assert "comm -100.00 us" in text and "solver objective n/a" in text
    assert "S(0)S(1) -> RR: 1 node" in text and "only in a: mm_1; only in b: mm_9" in text
    subset = {k: v for k, v in sample.items() if k != "nodes"}
    assert "not recorded" in str(diff_plan_json(subset, sample))
    assert str(diff_plan_json(sample, sample)).splitlines()[0].startswith("total +0.00 us")


# ---------------------------------------------------------------------------- the page in a real browser


def test_page_renders_in_headless_chromium(tmp_path: Path, sample: dict) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium to run this check)")
    path = write_html(sample, tmp_path / "plan.html")
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--dump-dom",
        path.as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    assert 'id="parameter-tree"' in dom and 'class="params sortable"' in dom
    assert "layers.1.feed_forward.w2.weight" in dom
    assert 'id="collective-table"' in dom


# ---------------------------------------------------------------------------- command line


def run_cli_process(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The command as a user runs it: a fresh interpreter, ``python -m autoparallel.cli``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "autoparallel.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def test_cli_plans_tiny_model(tmp_path: Path) -> None:
    out, page = tmp_path / "p.json", tmp_path / "p.html"
    result = run_cli_process(
        "plan",
        "--model",
        "tiny",
        "--mesh",
        "2x2",
        "--batch",
        "8",
        "--seq",
        "32",
        "--out",
        str(out),
        "--html",
        str(page),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["mesh"]["shape"] == [2, 2]
    assert {p["name"] for p in data["parameters"]} >= {"tok_embeddings.weight", "output.weight"}
    assert data["inputs"][0]["placements"].startswith("S(0)")
    assert json.loads(embedded_json(page.read_text())) == data
    assert data["problem"] == "p.npz" and (tmp_path / "p.npz").is_file(), (
        "--out saves the problem next to it"
    )
    assert "total cost:" in result.stdout and " us" in result.stdout
    assert "layers.0-1." in result.stdout or "layers.0." in result.stdout


def test_cli_says_when_identical_layers_were_traced_once(tmp_path: Path) -> None:
    for flags, expected in (([], "layers"), (["--trace-all-layers"], None)):
        out = tmp_path / "p.json"
        result = run_cli(
            "plan",
            "--model",
            "tiny",
            "--layers",
            "6",
            "--mesh",
            "2",
            "--batch",
            "8",
            "--seq",
            "32",
            "--no-save",
            "--out",
            str(out),
            *flags,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        run = json.loads(out.read_text())["run"]
        assert run["layers"] == 6 and run["layers_traced_once"] == expected


def test_cli_plans_in_mixed_precision(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = run_cli(
        *TINY_PLAN_ARGS,
        "--param-dtype",
        "bf16",
        "--reduce-dtype",
        "fp32",
        "--no-save",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(out.read_text())["run"]
    assert (run["param_dtype"], run["reduce_dtype"]) == ("bf16", "fp32")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mesh", "2xfoo"], "--mesh"),
        (["--mesh", "2x2", "--mesh-names", "dp"], "--mesh-names"),
        (["--mesh", "2x2", "--hardware", "tpu"], "--hardware"),
        (["--mesh", "2x2", "--batch", "3"], "--batch"),
        (["--mesh", "2x2", "--seq", "0"], "--seq"),
        (["--mesh", "2x2", "--memory-budget", "lots"], "--memory-budget"),
        (["--mesh", "2x2", "--parameter-memory", "lots"], "--parameter-memory"),
        (["--mesh", "2x2", "--optimizer", "lion"], "--optimizer"),
        (["--mesh", "2x2", "--batch", "eight"], "--batch"),
        (["--mesh", "2x2", "--reduce-dtype", "fp32"], "--reduce-dtype"),
        (["--mesh", "2x2", "--param-dtype", "int8"], "--param-dtype"),
    ],
)
def test_cli_bad_arguments(args: list[str], needle: str) -> None:
    base = {"--model": "tiny", "--batch": "8", "--seq": "32"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["plan"] + [item for pair in base.items() for item in pair]
    result = run_cli(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0] and "error" in lines[0]
    assert result.stdout == ""


def test_cli_save_and_no_save_exclude_each_other(tmp_path: Path) -> None:
    result = run_cli(
        *TINY_PLAN_ARGS,
        "--save",
        str(tmp_path / "p.npz"),
        "--no-save",
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--no-save" in result.stderr and "not allowed" in result.stderr


def test_cli_help_mentions_layer_default() -> None:
    result = run_cli("plan", "--help")
    assert result.returncode == 0
    assert "--layers" in result.stdout and "the model's own depth" in " ".join(
        result.stdout.split()
    )


def test_cli_no_save_writes_the_json_and_no_problem(tmp_path: Path) -> None:
    """``--no-save``: the plan JSON has every section a report reads, and no problem is saved."""
    out = tmp_path / "p.json"
    result = run_cli(
        *("plan", "--model", "tiny", "--mesh", "2", "--batch", "4", "--seq", "16"),
        *("--parameter-memory", "1MiB", "--no-save", "--out", str(out)),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert {"mesh", "hardware", "totals", "solver", "parameters", "inputs", "outputs"} <= set(data)
    assert data["mesh"] == {"shape": [2], "dim_names": ["dp"]}
    assert "parameter_memory" in data["constraints"]
    assert "problem" not in data and not (tmp_path / "p.npz").exists(), "--no-save saves no problem"
    param = next(p for p in data["parameters"] if p["name"] == "output.weight")
    assert param["bytes_per_device"] in (256 * 64 * 4, 256 * 64 * 4 // 2)
