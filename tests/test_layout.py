"""The package's layout is its architecture: concepts in subpackages, imports that flow one way.

docs/architecture.md draws the floors; these tests hold the walls between them, so that a change
that crosses one fails here rather than in a reader's head.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"
SUBPACKAGES = ("cli", "devices", "engine", "integrations", "parallel", "plans", "store", "workloads")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "migrations" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The autotune and api modules a file imports (the module named, or the package an imported
    name lives in); with top_level_only, only the imports that run when the module is imported."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []
    if top_level_only:
        pending: list[ast.AST] = list(tree.body)
        while pending:
            node = pending.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue  # for the type checker only
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue  # a function's imports run when it is called, not when the module is imported
            nodes.append(node)
            pending.extend(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("autotune", "api", "torch")}


def test_the_top_level_holds_only_the_package_s_face() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    assert set(top) <= {"__init__", "client", "errors", "plot", "progress", "request", "results", "settings", "units"}


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_subpackage_says_what_it_owns(name: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 15, f"autotune/{name}/__init__.py needs a docstring saying what it owns"


def test_no_module_level_import_circle() -> None:
    modules = _modules()
    graph = {
        name: {m for m in _imports(path, top_level_only=True) if m in modules and m != name}
        for name, path in modules.items()
    }
    # A package's __init__ that imports its own modules is not a circle with them: drop package -> child.
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# Which floors each may import (anywhere in the file, lazily too): the walls of docs/architecture.md.
WALLS = {
    "autotune.devices": ("autotune.engine", "autotune.workloads", "autotune.plans", "autotune.cli", "api"),
    "autotune.workloads": ("autotune.engine", "autotune.cli", "api", "autotune.store"),
    "autotune.plans": ("autotune.workloads", "autotune.cli", "api", "autotune.store", "autotune.devices"),
    "autotune.engine": ("autotune.cli", "autotune.store", "autotune.integrations", "api"),
    "autotune.store": ("autotune.engine", "autotune.cli", "api"),
    "autotune.results": ("autotune.engine", "autotune.devices", "autotune.workloads", "autotune.cli", "api"),
    "autotune.request": ("autotune.engine", "autotune.devices", "autotune.workloads", "autotune.cli", "api"),
}


def test_imports_respect_the_walls() -> None:
    crossings = []
    for name, path in _modules().items():
        if name == "autotune.cli.service":
            continue  # `autotune serve` starts the service: the one door from autotune/ into api/
        for floor, forbidden in WALLS.items():
            if name == floor or name.startswith(floor + "."):
                for imported in _imports(path, top_level_only=False):
                    if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                        crossings.append(f"{name} imports {imported}")
        if not name.startswith("autotune.cli"):
            crossings += [f"{name} imports {m}" for m in _imports(path, top_level_only=False) if m.startswith("api")]
    assert not crossings, crossings


@pytest.mark.parametrize("name", ["autotune.engine.search", "autotune.plans.plan", "autotune.plans.mixed"])
def test_the_pure_cores_import_no_torch(name: str) -> None:
    """The search and the plans are arithmetic: no torch, even lazily (tests/test_search.py imports
    them and finds no torch in the process)."""
    path = _modules()[name]
    assert not [m for m in _imports(path, top_level_only=False) if m.startswith("torch")]


def test_every_module_imports_alone() -> None:
    """Each module imported first, with every autotune module forgotten before: an import that works
    only after another module was imported fails here. In this process, whose autotune modules are
    put back after; the third-party ones (torch, lightning, transformers), which no order of ours
    can break, stay imported (a new interpreter for this test spent 6 s of CPU importing them again)."""
    names = [n for n in _modules() if not n.endswith("__main__")]

    def ours() -> list[str]:
        return [key for key in sys.modules if key.split(".")[0] in ("autotune", "api")]

    saved = {key: sys.modules[key] for key in ours()}
    failed = []
    try:
        for name in names:
            for key in ours():
                del sys.modules[key]
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - every module's failure, each named
                failed.append(f"{name}: {exc!r}")
    finally:
        for key in ours():
            del sys.modules[key]
        sys.modules.update(saved)
    assert not failed, "\n".join(failed)


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_the_command_line_reads_in_short_pieces() -> None:
    long = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > 400:
            long.append(f"{path.name}: {lines} lines")
        long += [f"{path.name}: {name}() is {n} lines" for name, n in _function_lengths(path) if n > 80]
    assert not long, long
