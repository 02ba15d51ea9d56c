"""The core's rooms: imports between eblvm_core modules (at the top of a file or inside a function)
form no circle, so every module can be read knowing only those below it; working on a saved run
(``evaluate``) needs no training loop; and no bundled plugin imports another plugin or the
parts of the core that run training."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import ROOT

CORE = ROOT / "eblvm_core"


def imported_modules(path: Path, package: str) -> set[str]:
    """Names of the ``package`` modules a file imports anywhere in it (``from package import x``
    counts as ``package.x`` when x is a module of the package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    modules = {f"{package}.{p.stem}" for p in (ROOT / package).glob("*.py")}
    return {name for name in names if name in modules}


def core_graph() -> dict[str, set[str]]:
    """eblvm_core module -> the eblvm_core modules it imports (``__init__`` left out)."""
    return {
        f"eblvm_core.{p.stem}": imported_modules(p, "eblvm_core") - {"eblvm_core.__init__", f"eblvm_core.{p.stem}"}
        for p in CORE.glob("*.py")
        if p.stem != "__init__"
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def below(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_the_core():
    graph = core_graph()
    assert "eblvm_core.build" in graph["eblvm_core.cli"], "the graph misses imports inside functions"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["evaluate", "compare", "build", "state", "rundir", "checkpoint"])
def test_working_on_saved_runs_needs_no_training_loop(module):
    """``eval``/``sample`` restore a run through the run-state and checkpoint modules; ``compare``
    starts runs through ``session`` only (itself importing the loop), never the loop directly."""
    graph = core_graph()
    imported = below(graph, f"eblvm_core.{module}")
    if module == "compare":
        assert "eblvm_core.trainer" not in graph["eblvm_core.compare"]
    else:
        assert not {"eblvm_core.trainer", "eblvm_core.session"} & imported, imported


def test_plugins_import_no_other_plugin_and_no_training_machinery():
    plugin_dirs = sorted(p for p in (ROOT / "plugins").iterdir() if p.is_dir() and p.name.startswith("eblvm_"))
    names = {p.name for p in plugin_dirs}
    forbidden = {"eblvm_core.trainer", "eblvm_core.session", "eblvm_core.cli", "eblvm_core.compare"}
    for plugin in plugin_dirs:
        for path in plugin.rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                elif isinstance(node, ast.Import):
                    mods = [alias.name for alias in node.names]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    assert top not in names or top == plugin.name, f"{path}: imports plugin {top}"
                    assert mod not in forbidden, f"{path}: imports {mod}"
