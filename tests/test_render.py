"""The figures in the docs are the ones in benchmarks/results/*.jsonl (benchmarks/render.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

GOOD = {
    "benchmark": "plan_time",
    "question": "tiny-2x2",
    "what": "planning time, tiny, mesh 2x2",
    "figure": 1.5,
    "unit": "s",
    "date": "2026-12-06T10:00:00+00:00",
    "commit": "abc1234",
    "machine": {"hostname": "h", "cpu_count": 2, "torch": "2.13.0"},
    "command": "python -m benchmarks.plan_time --model tiny --mesh 2x2",
}


def render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.render", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def make_root(tmp_path: Path, lines: list[str], readme: str = "# r\n") -> Path:
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "plan_time.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


def test_docs_match_the_results_files() -> None:
    result = render("--check")
    assert result.returncode == 0, result.stderr


def test_malformed_record_names_its_file_and_line(tmp_path: Path) -> None:
    root = make_root(tmp_path, [json.dumps(GOOD), '{"benchmark": "plan_time", '])
    result = render("--check", "--root", str(root))
    assert result.returncode == 2
    assert "benchmarks/results/plan_time.jsonl:2: not a JSON object" in result.stderr


def test_record_missing_a_field_is_named(tmp_path: Path) -> None:
    record = {key: value for key, value in GOOD.items() if key != "question"}
    root = make_root(tmp_path, [json.dumps(GOOD), json.dumps(record)])
    result = render("--check", "--root", str(root))
    assert result.returncode == 2
    assert "plan_time.jsonl:2: missing question" in result.stderr


def test_readme_figure_is_the_latest_record(tmp_path: Path) -> None:
    newer = dict(GOOD, figure=1.2, date="2026-12-07")
    readme = "| planning | <!-- figure: plan_time/tiny-2x2 -->old<!-- /figure --> |\n"
    root = make_root(tmp_path, [json.dumps(GOOD), json.dumps(newer)], readme)
    assert render("--root", str(root)).returncode == 0
    text = (root / "README.md").read_text()
    assert "**1.2 s**: planning time, tiny, mesh 2x2" in text
    assert "(benchmarks/results/plan_time.jsonl), 2026-12-07)" in text
    assert render("--check", "--root", str(root)).returncode == 0
    measurements = (root / "docs" / "measurements.md").read_text()
    assert measurements.index("**1.2 s**") < measurements.index("| 1.5 s |")


def test_readme_naming_an_unknown_question_fails(tmp_path: Path) -> None:
    readme = "<!-- figure: plan_time/nothing -->x<!-- /figure -->\n"
    root = make_root(tmp_path, [json.dumps(GOOD)], readme)
    result = render("--check", "--root", str(root))
    assert result.returncode == 2
    assert "no record of plan_time/nothing" in result.stderr


def test_a_time_twice_its_previous_run_is_flagged(tmp_path: Path) -> None:
    slower = dict(GOOD, figure=3.3, date="2026-12-07", commit="def5678")
    other = dict(GOOD, question="tiny-4", figure=1.0)
    a_bit_slower = dict(other, figure=1.9, date="2026-12-07")
    lines = [json.dumps(r) for r in (GOOD, slower, other, a_bit_slower)]
    root = make_root(tmp_path, lines)
    result = render("--root", str(root))
    assert result.returncode == 0
    assert "REGRESSION plan_time/tiny-2x2: 2.2x its previous figure (1.5 s, abc1234)" in (
        result.stderr
    )
    assert "tiny-4" not in result.stderr  # 1.9x: within a noisy machine's reach
    measurements = (root / "docs" / "measurements.md").read_text()
    assert "- `plan_time/tiny-2x2`: 2.2x its previous figure" in measurements
    assert "| REGRESSION: 2.2x its previous figure (1.5 s, abc1234) |" in measurements
