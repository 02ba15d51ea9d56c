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


@pytest.mark.parametrize("module", ["saved", "build", "state", "rundir", "checkpoint", "plan"])
def test_working_on_saved_runs_needs_no_training_loop(module):
    """``eval``/``sample`` restore a run through the run-state and checkpoint modules, never the loop."""
    imported = below(core_graph(), f"eblvm_core.{module}")
    assert not {"eblvm_core.trainer", "eblvm_core.session"} & imported, imported


@pytest.mark.parametrize("module", ["build", "session", "trainer", "state", "plan"])
def test_the_engine_does_not_import_the_cli(module):
    reached = below(core_graph(), f"eblvm_core.{module}")
    assert "eblvm_core.cli" not in reached, reached


def test_the_core_imports_neither_the_experiments_nor_their_packages():
    """compare, search and the Slurm launcher are a plugin (plugins/eblvm_experiments): nothing in the
    core imports it, submitit or Optuna, anywhere in a file."""
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            assert not {"eblvm_experiments", "submitit", "optuna"} & set(tops), f"{path}: imports {tops}"
    assert not (CORE / "experiments").exists()


PUBLIC = {"eblvm", "eblvm.plugin", "eblvm.tools"}  # what a plugin may import of eblvm
ENGINE = {"eblvm_core.trainer", "eblvm_core.session", "eblvm_core.build", "eblvm_core.state", "eblvm_core.cli"}


def plugin_packages() -> list[Path]:
    """Every bundled plugin package and the example third-party plugin's."""
    bundled = sorted(p for p in (ROOT / "plugins").iterdir() if p.is_dir() and p.name.startswith("eblvm_"))
    return [*bundled, ROOT / "examples" / "eblvm-renyi" / "eblvm_renyi"]


def eblvm_imports(path: Path) -> list[str]:
    """The eblvm and eblvm_core modules a file imports, anywhere in it (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = (
                [node.module]
                if node.module not in ("eblvm", "eblvm_core")
                else [node.module]
                + [f"{node.module}.{a.name}" for a in node.names if a.name in ("plugin", "tools", "testing")]
            )
        elif isinstance(node, ast.Import):
            mods = [alias.name for alias in node.names]
        else:
            continue
        found += [mod for mod in mods if mod.split(".")[0] in ("eblvm", "eblvm_core")]
    return found


def test_plugins_import_eblvm_through_its_public_modules_alone_and_no_other_plugin():
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
            wrong = [mod for mod in eblvm_imports(path) if mod not in PUBLIC]
            assert not wrong, f"{path}: imports {wrong}; a plugin imports eblvm through {sorted(PUBLIC)} alone"


def public_graph() -> set[str]:
    """The core modules the plugin modules reach."""
    graph = core_graph()
    reached: set[str] = set()
    for module in ("plugin", "tools"):
        direct = imported_modules(ROOT / "eblvm" / f"{module}.py")
        reached |= direct | {m for d in direct for m in below(graph, d)}
    return reached


def test_the_plugin_modules_reach_no_training_machinery():
    assert not ENGINE & public_graph(), ENGINE & public_graph()


def test_the_layer_check_sees_a_plugin_that_reaches_past_the_public_modules(tmp_path):
    """The control: a file importing a core module directly, at the top or inside a function, is seen."""
    path = tmp_path / "plugin.py"
    path.write_text("from eblvm.plugin import Parts\n\ndef f():\n    from eblvm_core import distributed\n")
    assert eblvm_imports(path) == ["eblvm.plugin", "eblvm_core"]


def test_the_former_plugin_module_still_works_and_says_where_to_go():
    import importlib
    import sys
    import warnings

    sys.modules.pop("eblvm_core.plugin_api", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("eblvm_core.plugin_api")
    assert any(issubclass(w.category, DeprecationWarning) and "eblvm.plugin" in str(w.message) for w in caught)
    import eblvm.plugin
    import eblvm.tools

    assert old.Divergence is eblvm.plugin.Divergence and old.fit_posterior is eblvm.tools.fit_posterior


def test_contributings_map_names_every_module_and_package_and_nothing_else():
    """CONTRIBUTING.md's layout block lists each module of eblvm/ and eblvm_core/ (a name, or names
    separated by commas) and each bundled plugin family; a file added or removed without the map
    changing fails here."""
    import re

    text = (ROOT / "CONTRIBUTING.md").read_text()
    layout = text[text.index("## Layout") : text.index("## How a plugin registers components")]
    listed = set(re.findall(r"(?<![\w/.])([a-z_]+(?:\.py|/))(?=[ ,])", layout))
    for package in ("eblvm", "eblvm_core"):
        for path in (ROOT / package).iterdir():
            if path.name.startswith("__") or path.name.startswith("."):
                continue
            name = path.name + "/" if path.is_dir() else path.name
            if path.suffix == ".py" or path.is_dir():
                assert name in listed, f"{package}/{name} is not in CONTRIBUTING.md's layout"
    modules = {p.name for package in ("eblvm", "eblvm_core") for p in (ROOT / package).glob("*.py")}
    directories = {
        p.name + "/" for package in ("eblvm", "eblvm_core", "docs") for p in (ROOT / package).iterdir() if p.is_dir()
    }
    top = {
        "eblvm/",
        "eblvm_core/",
        "plugins/",
        "recipes/",
        "tests/",
        "benchmarks/",
        "studies/",
        "docs/",
        "core/",
        "e2e/",
    }
    stale = {name for name in listed if name.endswith(".py") and name not in modules}
    stale |= {
        name
        for name in listed
        if name.endswith("/") and name not in directories | top and not name.startswith("eblvm_")
    }
    assert not stale, f"CONTRIBUTING.md names what the tree does not hold: {sorted(stale)}"
