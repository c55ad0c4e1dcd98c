"""The package's layout contract: no import cycle, and the types between stages import no stage.

Read from the source with ``ast`` (nothing is imported), so a cycle that only a function-local
import hides still counts; imports under ``if TYPE_CHECKING:`` are annotations and do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autoparallel"
# modules that may sit at the package's top level: orchestration, the facade above the
# solver, the questions that need a Problem, and the wrapper of torch's private APIs
TOP_LEVEL = {"__init__", "api", "optimizer", "explain", "_torch_internals"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST) -> list[str]:
    """Every ``autoparallel...`` module name or ``module.attribute`` an import statement names."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
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
            assert not stages, f"{name} imports {stages}: types must import only other types"


def test_the_solver_imports_no_reader_of_its_plan():
    """Layering: the solver does not import the tools that read its output."""
    readers = (
        "autoparallel.explain",
        "autoparallel.files",
        "autoparallel.report",
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
        "(trace/, strategies/, cost/, solver/, runtime/, files/, report/, cli/) or types/"
    )


def test_the_cycle_check_sees_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
