"""The core's rooms: imports between eblvm_core modules (at the top of a file or inside a function)
form no circle, so every module can be read knowing only those below it; working on a saved run
(``evaluate``) needs no training loop; and no bundled plugin imports another plugin or the
parts of the core that run training."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.support import ROOT

CORE = ROOT / "eblvm_core"


def module_name(path: Path) -> str:
    """The dotted name of a module file under the repository (a package's ``__init__`` is the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


CORE_MODULES = {module_name(p) for p in CORE.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """The eblvm_core modules a file imports anywhere in it (``from package import x`` counts as
    ``package.x`` when x is a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in CORE_MODULES}


@functools.cache
def core_graph() -> dict[str, set[str]]:
    """eblvm_core module -> the eblvm_core modules it imports (the top package left out)."""
    graph = {module_name(p): imported_modules(p) for p in CORE.rglob("*.py")}
    return {name: deps - {"eblvm_core", name} for name, deps in graph.items() if name != "eblvm_core"}


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


@pytest.mark.parametrize("module", ["evaluate", "experiments.compare", "build", "state", "rundir", "checkpoint"])
def test_working_on_saved_runs_needs_no_training_loop(module):
    """``eval``/``sample`` restore a run through the run-state and checkpoint modules; ``compare``
    starts runs through ``session`` only (itself importing the loop), never the loop directly."""
    graph = core_graph()
    imported = below(graph, f"eblvm_core.{module}")
    if module == "experiments.compare":
        assert "eblvm_core.trainer" not in graph["eblvm_core.experiments.compare"]
    else:
        assert not {"eblvm_core.trainer", "eblvm_core.session"} & imported, imported


@pytest.mark.parametrize("module", ["build", "session", "trainer", "state"])
def test_the_engine_does_not_import_the_commands_of_many_runs(module):
    """``compare`` and its spec reach the CLI through the command hook; nothing that trains a run
    imports them (or the CLI)."""
    reached = below(core_graph(), f"eblvm_core.{module}")
    assert not {m for m in reached if m.startswith("eblvm_core.experiments") or m == "eblvm_core.cli"}, reached


PLUGIN_API = "eblvm_core.plugin_api"
ENGINE = {"eblvm_core.trainer", "eblvm_core.session", "eblvm_core.build", "eblvm_core.state", "eblvm_core.cli"}


def plugin_packages() -> list[Path]:
    """Every bundled plugin package and the example third-party plugin's."""
    bundled = sorted(p for p in (ROOT / "plugins").iterdir() if p.is_dir() and p.name.startswith("eblvm_"))
    return [*bundled, ROOT / "examples" / "eblvm-renyi" / "eblvm_renyi"]


def core_imports(path: Path) -> list[str]:
    """The eblvm_core modules a file imports, anywhere in it (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module] if node.module != "eblvm_core" else [f"eblvm_core.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [alias.name for alias in node.names]
        else:
            continue
        found += [mod for mod in mods if mod.split(".")[0] == "eblvm_core"]
    return found


def test_plugins_import_the_core_through_the_plugin_api_alone_and_no_other_plugin():
    packages = plugin_packages()
    names = {p.name for p in packages}
    for package in packages:
        for path in package.rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                elif isinstance(node, ast.Import):
                    tops = [alias.name.split(".")[0] for alias in node.names]
                else:
                    continue
                for top in tops:
                    assert top not in names or top == package.name, f"{path}: imports plugin {top}"
            wrong = [mod for mod in core_imports(path) if mod != PLUGIN_API]
            assert not wrong, f"{path}: imports {wrong}; a plugin imports the core through {PLUGIN_API} alone"


def test_the_plugin_api_reaches_no_training_machinery():
    graph = core_graph()
    reached = below(graph, PLUGIN_API) | {PLUGIN_API}
    assert not ENGINE & reached, ENGINE & reached


def test_the_layer_check_sees_a_plugin_that_reaches_past_the_plugin_api(tmp_path):
    """The control: a file importing a core module directly, at the top or inside a function, is seen."""
    path = tmp_path / "plugin.py"
    path.write_text("from eblvm_core.plugin_api import Parts\n\ndef f():\n    from eblvm_core import distributed\n")
    assert core_imports(path) == [PLUGIN_API, "eblvm_core.distributed"]
