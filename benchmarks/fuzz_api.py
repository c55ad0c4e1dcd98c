"""Bad input, fuzzed: hundreds of wrong calls of the public API and the CLI, each classified.

    python -m benchmarks.fuzz_api --cases 300 --seed 0

Cases are drawn from input families (``benchmarks/fuzz_cases.py``: mesh, options,
placements, partial, contradiction; ``benchmarks/fuzz_runtime.py``: memory, runtime_inputs,
dynamic; ``benchmarks/fuzz_files.py``: plan_json, placements_json, saved_problem, profile,
cli), round robin, each family's catalogue in an order shuffled by ``--seed``, so the same arguments
draw the same cases. They plan the MLP and the tiny LLaMA on fake meshes (nothing
communicates). Every case runs in a worker process with a per-case timeout; a worker that
dies or times out is replaced. Each case ends in one of:

* ``ok-plan``: a plan (the API returned; the CLI exited 0);
* ``clear-error``: an exception of a type defined in ``autoparallel``, or a ``ValueError`` /
  ``TypeError`` whose raise site is autoparallel code, whose message names the argument (one
  of the case's words; a headline may be followed by detail lines); for the CLI, exit status
  2 and one ``...: error: ...`` line on stderr naming the flag or file;
* ``unclear-error``: anything else raised (from deep in torch, highspy or numpy, a type or
  message that does not name the argument, a traceback out of the CLI);
* ``hang``: past ``--timeout`` seconds; ``crash``: the worker died.

Prints the counts per category and per family, the cases that did not end well, and
appends one record (``benchmarks/results.py``: the figure, the counts per category and per
family, the cases not clear, date, commit, machine, command) to
``benchmarks/results/fuzz_api.jsonl``. Noise: none; the classification of a case is
deterministic, only its time varies.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import fuzz_cases, fuzz_files, fuzz_runtime
from benchmarks.fuzz_cases import Case
from benchmarks.results import record

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE_DIR = str(REPOSITORY / "autoparallel") + os.sep
CATEGORIES = ("ok-plan", "clear-error", "unclear-error", "hang", "crash")
FAMILIES: dict[str, Callable[[random.Random], list[Case]]] = {
    "mesh": fuzz_cases.mesh_family,
    "options": fuzz_cases.options_family,
    "placements": fuzz_cases.placements_family,
    "partial": fuzz_cases.partial_family,
    "contradiction": fuzz_cases.contradiction_family,
    "memory": fuzz_runtime.memory_family,
    "runtime_inputs": fuzz_runtime.runtime_inputs_family,
    "dynamic": fuzz_runtime.dynamic_family,
    "plan_json": fuzz_files.plan_json_family,
    "placements_json": fuzz_files.placements_json_family,
    "saved_problem": fuzz_files.saved_problem_family,
    "profile": fuzz_files.profile_family,
    "cli": fuzz_files.cli_family,
}
_CLI_ERROR = re.compile(r"^autoparallel(?: [\w-]+)?: error: \S")


# ---------------------------------------------------------------------------- drawing


def draw(count: int, seed: int, families: list[str]) -> list[Case]:
    """``count`` cases, round robin over ``families``: each family's catalogue shuffled,
    drawn again (with new random values) when used up."""
    rng = random.Random(seed)
    pending: dict[str, list[Case]] = {name: [] for name in families}
    cases = []
    for index in range(count):
        name = families[index % len(families)]
        if not pending[name]:
            pending[name] = FAMILIES[name](rng)
            rng.shuffle(pending[name])
        cases.append(pending[name].pop())
    return cases


# ---------------------------------------------------------------------------- classifying


def classify_exception(error: BaseException, names: tuple[str, ...]) -> tuple[str, str]:
    """(category, one-line detail) of an exception a case raised (see the module docstring)."""
    frames = traceback.extract_tb(error.__traceback__)
    site = frames[-1] if frames else None
    ours = site is not None and site.filename.startswith(PACKAGE_DIR)
    library_type = type(error).__module__.split(".")[0] == "autoparallel"
    message = str(error)
    headline = message.strip().splitlines()[0] if message.strip() else ""
    named = any(word.lower() in message.lower() for word in names)
    where = f"{Path(site.filename).name}:{site.lineno}" if site else "?"
    detail = f"{type(error).__name__} at {where}: {headline[:200]}"
    library_error = library_type or (isinstance(error, (ValueError, TypeError)) and ours)
    clear = library_error and bool(headline) and named
    return ("clear-error" if clear else "unclear-error"), detail


def classify_cli(status: int, stderr: str, names: tuple[str, ...]) -> tuple[str, str]:
    """(category, detail) of a command line that returned ``status``."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if status == 0:
        return "ok-plan", "exit 0"
    named = any(word.lower() in last.lower() for word in names)
    clear = status == 2 and bool(_CLI_ERROR.match(last)) and named and "Traceback" not in stderr
    return ("clear-error" if clear else "unclear-error"), f"exit {status}: {last[:200]}"


# ---------------------------------------------------------------------------- running (worker)


def _substitute(argv: list[str], workdir: Path, file: Path | None = None) -> list[str]:
    values = {"{wd}": str(workdir), "{file}": str(file) if file else ""}
    out = []
    for arg in argv:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def _run_cli(argv: list[str]) -> tuple[int, str]:
    from autoparallel.cli import main

    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        status = main(argv)
    return int(status), stderr.getvalue()


def _run_subprocess(argv: list[str]) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "autoparallel.cli", *argv],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stderr


def _cli_outcome(
    argv: list[str], names: tuple[str, ...], subprocess_: bool = False
) -> tuple[str, str]:
    """(category, detail) of a command line; an exception out of ``main`` is a traceback
    the user would see, so it is unclear whatever its type."""
    try:
        status, stderr = (_run_subprocess if subprocess_ else _run_cli)(argv)
    except Exception as error:  # main() must not raise: classified as unclear
        _, detail = classify_exception(error, names)
        return "unclear-error", f"raised out of the CLI: {detail}"
    return classify_cli(status, stderr, names)


def run_case(case: Case, workdir: Path) -> tuple[str, str]:
    """Run one case in this process; returns (category, detail)."""
    from benchmarks.fuzz_recipe import run_recipe

    try:
        if case.action == "recipe":
            return "ok-plan", run_recipe(workdir, case.payload)
        if case.action in ("cli", "cli_subprocess"):
            argv = _substitute(case.payload, workdir)
            return _cli_outcome(argv, case.names, case.action == "cli_subprocess")
        payload = case.payload
        then = payload["then"]
        suffix = ".npz" if payload["fixture"].endswith(".npz") else ".json"
        path = fuzz_files.mutate(workdir, payload["fixture"], payload["mutation"], suffix)
        if then[0] == "cli":
            return _cli_outcome(_substitute(then[1], workdir, path), case.names)
        if then[0] == "recipe":
            return "ok-plan", run_recipe(workdir, then[1])
        from autoparallel.optimizer import ShardingOptimizer

        plan = ShardingOptimizer.load(str(path)).resolve()
        return "ok-plan", f"plan of {len(plan.param_placements)} parameters"
    except Exception as error:  # every exception is a finding: classify it
        return classify_exception(error, case.names)


def worker_main(connection: Any, workdir: str) -> None:
    """The worker: fixtures once, then one case per message until the pipe closes."""
    import logging
    import warnings

    log = open(Path(workdir) / "worker.log", "a")  # noqa: SIM115 - lives as long as the worker
    os.dup2(log.fileno(), 1)  # HiGHS and torch print on the C streams
    os.dup2(log.fileno(), 2)
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    fuzz_files.make_fixtures(Path(workdir))
    connection.send("ready")
    while True:
        try:
            case = connection.recv()
        except EOFError:
            return
        connection.send(run_case(case, Path(workdir)))


# ---------------------------------------------------------------------------- running (driver)


class Worker:
    """A worker process, started on demand and replaced after a hang or a crash."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.process: Any = None
        self.connection: Any = None

    def run(self, case: Case, timeout_s: float) -> tuple[str, str]:
        if self.process is None:
            self._start()
        self.connection.send(case)
        if not self.connection.poll(timeout_s):
            self.stop()
            return "hang", f"no answer within {timeout_s:.0f} s"
        try:
            return self.connection.recv()
        except EOFError:
            self.process.join(5)
            code = self.process.exitcode
            self.process = None
            return "crash", f"worker died (exit code {code})"

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=worker_main, args=(child, str(self.workdir)), daemon=True
        )
        self.process.start()
        if not self.connection.poll(600) or self.connection.recv() != "ready":
            raise RuntimeError(f"the fuzz worker did not start; see {self.workdir}/worker.log")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(10)
            self.process = None


def figures(
    args: argparse.Namespace, results: list[tuple[Case, str, str]], elapsed: float
) -> dict[str, Any]:
    """The run's figure for ``benchmarks.results.record``: how many cases ended in a plan or
    a clear error, with the counts per category and per family and the cases that did not."""
    counts = Counter(category for _, category, _ in results)
    families: dict[str, dict[str, int]] = {}
    for case, category, _ in results:
        families.setdefault(case.family, {c: 0 for c in CATEGORIES})[category] += 1
    good = counts["ok-plan"] + counts["clear-error"]
    return {
        "question": f"cases-{args.cases}-seed-{args.seed}",
        "what": "fuzz cases of the public API and the CLI that end in a plan or a clear "
        "library error (the rest: unclear errors, hangs, crashes)",
        "figure": f"{good} of {len(results)}",
        "note": args.note,
        "counts": {c: counts[c] for c in CATEGORIES},
        "families": families,
        "not_clear": [
            {"family": case.family, "case": case.label, "category": category, "detail": detail}
            for case, category, detail in results
            if category not in ("ok-plan", "clear-error")
        ],
        "elapsed_s": round(elapsed, 1),
    }


def report(results: list[tuple[Case, str, str]]) -> None:
    """Print the counts per category and per family, then the cases that did not end well."""
    counts = Counter(category for _, category, _ in results)
    print("\n" + "  ".join(f"{c}: {counts[c]}" for c in CATEGORIES))
    print(f"\n{'family':<16}" + "".join(f"{c:>15}" for c in CATEGORIES))
    for family in FAMILIES:
        row = Counter(cat for case, cat, _ in results if case.family == family)
        if row:
            print(f"{family:<16}" + "".join(f"{row[c]:>15}" for c in CATEGORIES))
    bad = [(case, cat, detail) for case, cat, detail in results if cat not in CATEGORIES[:2]]
    if bad:
        print("\nnot clear:")
        for case, category, detail in bad:
            print(f"  [{category}] {case.family}: {case.label}\n      {detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="cases to draw (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated families to draw from"
    )
    parser.add_argument("--no-record", action="store_true", help="print only; append no record")
    parser.add_argument("--note", default="", help="a note for the record (e.g. what changed)")
    parser.add_argument("--verbose", action="store_true", help="print every case as it ends")
    args = parser.parse_args(argv)
    families = [name.strip() for name in args.families.split(",") if name.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or args.cases < 1:
        parser.error(f"unknown families {unknown}" if unknown else "--cases must be positive")
    cases = draw(args.cases, args.seed, families)
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="fuzz_api_") as workdir:
        worker = Worker(Path(workdir))
        try:
            for index, case in enumerate(cases):
                category, detail = worker.run(case, args.timeout)
                results.append((case, category, detail))
                if args.verbose or category not in CATEGORIES[:2]:
                    print(
                        f"[{index + 1:>4}/{len(cases)}] {category:<13} {case.family}: {case.label}"
                    )
                    print(f"       {detail}", flush=True)
        finally:
            worker.stop()
    report(results)
    if not args.no_record:
        record("fuzz_api", figures(args, results, time.perf_counter() - start), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
