"""``eblvm.add_plugin``, which the new-divergence tutorial uses to register a divergence defined in
the notebook itself. The tutorials themselves are executed by the docs build (``mkdocs build``,
which CI runs; a failing cell fails it)."""

from __future__ import annotations

import os
import textwrap

import pytest

import eblvm
from eblvm_core import plugins
from eblvm_core.errors import EblvmError

PLUGIN = """
from eblvm.plugin import Divergence, NoConfig, hookimpl


class Zero(Divergence):
    def __call__(self, model, posterior, v):
        return v.new_zeros(len(v))


@hookimpl
def register_divergences(register):
    register("tutorial-zero", lambda config, parts: Zero(), NoConfig)
"""


@pytest.fixture
def clean_plugins(tmp_path, monkeypatch):
    """A folder on sys.path for plugin modules; EBLVM_PLUGIN_MODULES and the loaded plugins are put
    back as they were after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    # set, then deleted: monkeypatch records only a variable it changes, and add_plugin sets this one
    # itself, which would otherwise outlive the test and reach every process the worker starts later
    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "")
    monkeypatch.delenv("EBLVM_PLUGIN_MODULES")
    monkeypatch.setattr(plugins, "_loaded", None)
    return tmp_path


def test_add_plugin_registers_a_module_once_and_refuses_a_broken_one(clean_plugins):
    (clean_plugins / "tutorial_zero_plugin.py").write_text(textwrap.dedent(PLUGIN))
    assert "tutorial-zero" not in plugins.load(force=True, warn=False)["divergences"].names()
    for _ in range(2):
        eblvm.add_plugin("tutorial_zero_plugin")
    assert os.environ["EBLVM_PLUGIN_MODULES"] == "tutorial_zero_plugin"
    assert plugins.load()["divergences"].get("tutorial-zero").plugin == "tutorial_zero_plugin"

    (clean_plugins / "tutorial_broken_plugin.py").write_text("raise RuntimeError('no such luck')\n")
    with pytest.raises(EblvmError, match="plugin 'tutorial_broken_plugin' failed to load: RuntimeError: no such luck"):
        eblvm.add_plugin("tutorial_broken_plugin")
    assert os.environ["EBLVM_PLUGIN_MODULES"] == "tutorial_zero_plugin"  # taken out again
    loaded = plugins.load()
    assert not loaded.failed and "tutorial-zero" in loaded["divergences"].names()


def test_a_plugin_that_fails_to_load_leaves_the_environment_as_it_was(clean_plugins):
    (clean_plugins / "tutorial_broken_plugin.py").write_text("raise RuntimeError('no such luck')\n")
    names = plugins.load(force=True, warn=False)["divergences"].names()
    with pytest.raises(EblvmError, match="plugin 'tutorial_broken_plugin' failed to load: RuntimeError: no such luck"):
        eblvm.add_plugin("tutorial_broken_plugin")
    assert "EBLVM_PLUGIN_MODULES" not in os.environ
    loaded = plugins.load()
    assert not loaded.failed and loaded["divergences"].names() == names
