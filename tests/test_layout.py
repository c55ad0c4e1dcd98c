"""The package's layout contract, read from the source with ``ast`` (nothing is imported).

- no import cycle, counting function-local imports and imports under ``if TYPE_CHECKING:``;
- the types between stages (``types/``) import nothing of the package;
- the pipeline stages are folders, in order, and nothing else sits at the top level;
- private torch modules (a dotted name with a ``_part``) are named only in ``_torch_internals/``
  (and in tests, which check those wrappers against the objects they wrap);
- no library module imports ``_testing`` (helpers for tests and benchmarks only);
- no Python file of the repository passes 600 lines (past that a file holds two ideas).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE = REPOSITORY / "autoparallel"
PIPELINE = ("trace", "graph", "strategies", "cost", "problem", "solver", "runtime")
MAX_LINES = 600
# modules that may sit at the package's top level: orchestration, the facade above the
# solver, the questions that need a Problem, and the wrapper of torch's private APIs
# orchestration above the stages: AutoParallel, the optimizer facade, explain, the mesh search,
# the pipeline stages' setup and the pipeline side of AutoParallel
TOP_LEVEL = {
    "__init__",
    "api",
    "optimizer",
    "explain",
    "mesh_search",
    "stage_setup",
    "pipeline_planning",
    "_torch_internals",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported_names(tree: ast.AST) -> list[str]:
    """Every ``autoparallel...`` module name or ``module.attribute`` an import statement names."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import sub`` names the module pkg.sub; ``from pkg import name``
            # resolves to pkg below (the longest prefix that is a module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [name for name in names if name == "autoparallel" or name.startswith("autoparallel.")]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules importing it runs: the modules it names, and the
    ``__init__`` of every subpackage it enters from outside (the root ``autoparallel``
    only where a module imports a name from it)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for imported in _imported_names(ast.parse(path.read_text())):
            while imported not in modules:  # ``pkg.module.attribute`` -> ``pkg.module``
                imported = imported.rpartition(".")[0]
            parts = imported.split(".")
            # importing a submodule runs its parent packages first, except the ones the
            # importer lives in (they are already running) and the root (always running)
            parents = (".".join(parts[:i]) for i in range(2, len(parts)))
            targets.update(p for p in parents if not name.startswith(p + "."))
            targets.add(imported)
        targets.discard(name)
        graph[name] = {t for t in targets if t in modules}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_types_between_stages_import_no_stage():
    graph = _import_graph()
    for name, targets in graph.items():
        if name.startswith("autoparallel.types"):
            stages = sorted(t for t in targets if not t.startswith("autoparallel.types"))
            assert not stages, (
                f"{name} imports {stages}: types must import only other types "
                "(even under TYPE_CHECKING; name what a type needs with a Protocol)"
            )


def test_the_solver_imports_no_reader_of_its_plan():
    """Layering: the solver does not import the tools that read its output."""
    readers = (
        "autoparallel.explain",
        "autoparallel.files",
        "autoparallel.report",
        "autoparallel.export",
        "autoparallel.cli",
    )
    for name, targets in _import_graph().items():
        if name.startswith("autoparallel.solver"):
            wrong = sorted(t for t in targets if t.startswith(readers))
            assert not wrong, f"{name} imports {wrong}"


def test_each_stage_has_its_own_folder():
    flat = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem not in TOP_LEVEL)
    assert not flat, (
        f"modules at the top of autoparallel/: {flat}; put each in the folder of its stage "
        f"({', '.join(s + '/' for s in PIPELINE)}, files/, report/, cli/) or types/"
    )


def test_the_cycle_check_sees_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _python_files(
    folders: tuple[str, ...] = ("autoparallel", "tests", "benchmarks", "examples"),
) -> list[Path]:
    return sorted(path for folder in folders for path in (REPOSITORY / folder).rglob("*.py"))


def _private_torch_names(tree: ast.AST) -> list[str]:
    """Dotted torch names with a private part (``torch.utils._pytree``, ``torch._ops.X``)
    that a module imports or reads; ``torch.ops.<namespace>`` is the public op registry."""

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        if parts[0] != "torch" or parts[1:2] == ["ops"]:
            return False
        return any(part.startswith("_") and not part.startswith("__") for part in parts[1:])

    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names if private(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found.extend(name for name in names if private(name))
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and private(dotted):
                found.append(dotted)
    return found


def _dotted(node: ast.Attribute) -> str | None:
    parts: list[str] = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if not isinstance(current, ast.Name):
        return None
    return ".".join([current.id, *reversed(parts)])


def test_private_torch_apis_are_named_only_in_torch_internals():
    internals = PACKAGE / "_torch_internals"
    offenders = {
        str(path.relative_to(REPOSITORY)): sorted(set(names))
        for path in _python_files(("autoparallel", "benchmarks", "examples"))
        if internals not in path.parents
        and (names := _private_torch_names(ast.parse(path.read_text())))
    }
    assert not offenders, (
        f"private torch APIs outside autoparallel/_torch_internals/: {offenders}; wrap each "
        "there with a comment saying why no public API does"
    )


def test_the_private_torch_check_sees_private_names():
    tree = ast.parse(
        "import torch.utils._pytree\nfrom torch._ops import OpOverload\n"
        "x = torch.distributed._functional_collectives.wait_tensor\ny = torch.ops._c10d.x"
    )
    assert _private_torch_names(tree) == [
        "torch.utils._pytree",
        "torch._ops.OpOverload",
        "torch.distributed._functional_collectives.wait_tensor",
        "torch.distributed._functional_collectives",
    ]


def test_no_library_module_imports_the_test_helpers():
    wrong = {
        name: sorted(t for t in targets if t.startswith("autoparallel._testing"))
        for name, targets in _import_graph().items()
        if not name.startswith("autoparallel._testing")
    }
    wrong = {name: targets for name, targets in wrong.items() if targets}
    assert not wrong, f"library modules importing autoparallel._testing: {wrong}"


def test_the_pipeline_stages_are_folders():
    missing = [stage for stage in PIPELINE if not (PACKAGE / stage / "__init__.py").is_file()]
    assert not missing, f"pipeline stages without their folder: {missing}"


def test_no_python_file_passes_the_line_limit():
    long = {
        str(path.relative_to(REPOSITORY)): count
        for path in _python_files()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split each by idea): {long}"


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level (what ``from it import x`` finds)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        targets: list[ast.AST] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, (ast.Try, ast.If)):
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in child.names)
        for target in targets:
            elements = target.elts if isinstance(target, ast.Tuple) else [target]
            names.update(e.id for e in elements if isinstance(e, ast.Name))
    return names


def test_every_import_of_the_package_resolves():
    """A move or rename leaves no import behind, function-local ones included (they only fail
    when their function runs: in a benchmark, a spawned rank, an error path)."""
    modules = _modules()
    broken: list[str] = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module != "autoparallel" and not node.module.startswith("autoparallel."):
                continue
            where = f"{path.relative_to(REPOSITORY)}:{node.lineno}"
            if node.module not in modules:
                broken.append(f"{where}: no module {node.module}")
                continue
            defined = _top_level_names(modules[node.module])
            for alias in node.names:
                if alias.name not in defined and f"{node.module}.{alias.name}" not in modules:
                    broken.append(f"{where}: {node.module} has no {alias.name}")
    assert not broken, "imports that no longer resolve:\n" + "\n".join(broken)
