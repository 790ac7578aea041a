"""The package's layout: floors that import only downwards, no import circles between files, and no command
importing another command.

Imports are read with `ast` (function-level ones included: an import inside a function is still a dependency;
imports under `if TYPE_CHECKING:` are not, they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "raydiff"
LIBRARY = ("raydiff.storage", "raydiff.seeds", "raydiff.config", "raydiff.cluster", "raydiff.model", "raydiff.data",
           "raydiff.quality", "raydiff.runs", "raydiff.training")
# The floors, from the ground up: a module may import its own package and the packages on floors below it. The
# ground (storage, seeds, config, the cluster) holds what every domain needs; the domains (the model, the data,
# quality) come next; then what a run leaves (runs), running it (training), and the commands on top.
FLOORS = (("raydiff.storage", "raydiff.seeds"), ("raydiff.config",), ("raydiff.cluster",), ("raydiff.model",),
          ("raydiff.data",), ("raydiff.quality",), ("raydiff.runs",), ("raydiff.training",))
COMMAND_FLOOR = len(FLOORS)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, here: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `tree` (module `here`) imports when it runs."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = here.split(".")[: len(here.split(".")) - node.level + (1 if _is_package(here) else 0)]
                base = ".".join(package + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    def _is_package(name: str) -> bool:
        return modules[name].name == "__init__.py"

    visit(tree)
    return {name for name in found if name in modules and name != here}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(ast.parse(path.read_text()), name, modules) for name, path in modules.items()}


def commands() -> set[str]:
    """Modules a user runs (`python -m raydiff.<command>`), and the helpers only commands use: the top-level
    modules with a main, the benchmarks, and `raydiff.cli`. (A library module may have a main of its own for
    maintainers, such as regenerating a doc page; that does not make it a command.)"""
    found = {"raydiff.cli"}
    for name, path in _modules().items():
        top_level = name.count(".") == 1
        if top_level and 'if __name__ == "__main__"' in path.read_text():
            found.add(name)
    found |= {name for name in _modules() if name == "raydiff.bench" or name.startswith("raydiff.bench.")}
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return circles


def floor_of(module: str) -> int:
    """The floor of a module: its package's (commands and their helpers: the top)."""
    for floor, packages in enumerate(FLOORS):
        if any(module == p or module.startswith(f"{p}.") for p in packages):
            return floor
    return COMMAND_FLOOR


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a package to a package on the same floor or above (its own package excepted)."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if _package(a) != _package(b) and floor_of(a) <= floor_of(b) and floor_of(a) < COMMAND_FLOOR)


def test_packages_import_only_the_floors_below():
    assert arrows_up(import_graph()) == []


def test_no_command_imports_another_command():
    graph, cmds = import_graph(), commands()
    helpers = {"raydiff.cli", "raydiff.plots"}  # what the commands share, no main
    wrong = {name: sorted((graph[name] & cmds) - helpers - {name} - {m for m in cmds if m.startswith("raydiff.bench")})
             for name in cmds if not name.startswith("raydiff.bench")}
    assert {name: found for name, found in wrong.items() if found} == {}


def test_no_import_circles():
    assert _circles(import_graph()) == []


def test_no_library_module_imports_a_command():
    graph, cmds = import_graph(), commands()
    library = [name for name in graph if name in LIBRARY or name.startswith(tuple(f"{p}." for p in LIBRARY))]
    assert library and not set(library) & cmds
    wrong = {name: sorted(graph[name] & cmds) for name in library if graph[name] & cmds}
    assert wrong == {}


def test_the_wheel_ships_every_package():
    """pyproject.toml names raydiff's packages one by one: a folder left out installs in editable mode (the tests')
    and is missing from a wheel (a cluster image's `pip install`), where importing it fails."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert "raydiff.cluster.files" in folders
    assert folders - listed == set()


def test_the_checks_see_what_they_look_for(tmp_path):
    """The walker finds function-level imports and circles (a check that sees nothing passes everything)."""
    graph = import_graph()
    assert "raydiff.cluster.start" in graph["raydiff.prepare"]  # imported at the top
    assert {"raydiff.train", "raydiff.prepare", "raydiff.bench"} <= commands()
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert arrows_up({"raydiff.data.loader": {"raydiff.training.step", "raydiff.seeds", "raydiff.data.order"}}) == [
        "raydiff.data.loader -> raydiff.training.step"]
    assert floor_of("raydiff.storage.fs") == 0 and floor_of("raydiff.train") == COMMAND_FLOOR
    tree = ast.parse("def f():\n    from raydiff.cluster import start\nif TYPE_CHECKING:\n    import raydiff.cli\n")
    assert _imported(tree, "raydiff.prepare", _modules()) == {"raydiff.cluster", "raydiff.cluster.start"}
