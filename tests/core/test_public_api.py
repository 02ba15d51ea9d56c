"""The public API. The examples in its docstrings run as written: every ``>>>`` example of
``eblvm``, ``eblvm.plugin``, ``eblvm.tools`` and ``eblvm.testing`` (their module docstrings, and
the docstrings of what each exports, wherever it is defined), each in a fresh namespace and an
empty folder of its own. What ``eblvm``, ``eblvm.plugin`` and ``eblvm.tools`` export is annotated
in full, and the packages say so to type checkers (``py.typed``)."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

from tests.support import ROOT

PUBLIC = ("eblvm", "eblvm.plugin", "eblvm.tools", "eblvm.testing")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def public_doctests() -> list[doctest.DocTest]:
    """Every doctest of the public modules and of each object in their ``__all__`` (classes with
    their methods), each found once."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: dict[str, doctest.DocTest] = {}
    for name in PUBLIC:
        module = importlib.import_module(name)
        tests = finder.find(module, name)
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj):
                tests += finder.find(obj, f"{name}.{attr}", module=False, globs={})
        for test in tests:
            if test.examples:
                found.setdefault(test.name, test)
    return sorted(found.values(), key=lambda test: test.name)


DOCTESTS = public_doctests()


def test_each_public_module_shows_an_example():
    """The modules users and plugin authors import each open with a runnable example."""
    for name in ("eblvm", "eblvm.plugin", "eblvm.tools"):
        assert any(test.name == name for test in DOCTESTS), f"{name}'s docstring has no >>> example"


@pytest.mark.parametrize("test", DOCTESTS, ids=[test.name for test in DOCTESTS])
def test_docstring_example(test: doctest.DocTest, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that trains writes ./runs here
    test.globs = {}
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def annotated_gaps(obj: object, name: str) -> list[str]:
    """The parameters and returns of a function, or of a class's public methods (``__init__`` and
    ``__call__`` included), that have no annotation."""
    if inspect.isclass(obj):
        gaps = []
        for key, member in vars(obj).items():
            if key.startswith("_") and key not in ("__init__", "__call__"):
                continue
            func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if inspect.isfunction(func):
                gaps += annotated_gaps(func, f"{name}.{key}")
        return gaps
    if not inspect.isfunction(obj):
        return []
    signature = inspect.signature(obj)
    gaps = [f"{name}({p})" for p, par in signature.parameters.items() if par.annotation is inspect.Parameter.empty]
    gaps = [gap for gap in gaps if not gap.endswith(("(self)", "(cls)"))]
    if signature.return_annotation is inspect.Signature.empty and not name.endswith("__init__"):
        gaps.append(f"{name} -> ?")
    return gaps


def test_the_public_api_is_annotated_in_full_and_typed_for_checkers():
    """Every function, and every public method of every class, that ``eblvm``, ``eblvm.plugin``
    and ``eblvm.tools`` export has its parameters and return annotated; the packages ship py.typed."""
    gaps = []
    for name in ("eblvm", "eblvm.plugin", "eblvm.tools"):
        module = importlib.import_module(name)
        for attr in module.__all__:
            gaps += annotated_gaps(getattr(module, attr), f"{name}.{attr}")
    assert not gaps, f"not annotated: {gaps}"
    assert (ROOT / "eblvm" / "py.typed").is_file() and (ROOT / "eblvm_core" / "py.typed").is_file()
