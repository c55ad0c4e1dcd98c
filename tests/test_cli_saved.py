"""`autoparallel plan --save`, then `explain` and `diff` on the saved problems."""

from __future__ import annotations

import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoparallel.cli", *args], capture_output=True, text=True, timeout=300)


def test_explain_and_diff_saved_problems(tmp_path):
    fsdp, ddp = tmp_path / "fsdp.npz", tmp_path / "ddp.npz"
    common = ["plan", "--model", "tiny", "--mesh", "2", "--batch", "8", "--seq", "32"]
    assert _cli(*common, "--save", str(fsdp)).returncode == 0
    assert _cli(*common, "--memory-budget", "none", "--save", str(ddp)).returncode == 0

    diff = _cli("diff", str(fsdp), str(ddp))
    assert diff.returncode == 0, diff.stderr
    assert "parameter(s) changed placement" in diff.stdout and "layers.0.attention.wq.weight" in diff.stdout

    explain = _cli("explain", str(fsdp), "--placement", "R", "--node", "mm")
    assert explain.returncode == 0, explain.stderr
    assert "status (target R)" in explain.stdout

    costs = _cli("explain", str(fsdp), "--costs", "mm", "--arg", "1")
    assert costs.returncode == 0, costs.stderr
    assert "*" in costs.stdout

    summary = _cli("explain", str(fsdp))
    assert "total cost:" in summary.stdout and "tok_embeddings.weight" in summary.stdout


def test_bad_saved_arguments_exit_2(tmp_path):
    missing = _cli("explain", str(tmp_path / "nope.npz"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"junk")
    bad = _cli("diff", str(junk), str(junk))
    assert bad.returncode == 2 and "not a saved autoparallel problem" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
