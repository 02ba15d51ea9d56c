"""Fixtures every test may use: a recipe written to a temporary folder and the CLI run in-process.
Shared constants and helpers are in ``tests.support``."""

from __future__ import annotations

import gc
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings


def pytest_configure(config: pytest.Config) -> None:
    """In each process that runs tests: one CPU thread (the tests' tensors are tiny; more would
    oversubscribe a small CI machine) and the plugin kit's fixtures (short_run, tiny_grbm,
    linear_gaussian), as ``pytest_plugins = ["eblvm.testing"]`` loads them. pytest-xdist's
    controlling process only hands tests out: it skips both, so the workers start without
    waiting for it to import torch (3 s sooner on 2 cores)."""
    distributes = config.getoption("dist", "no") != "no" and config.getoption("tx", None)  # as xdist decides
    if distributes and not hasattr(config, "workerinput") and not config.getoption("collectonly"):
        return  # the controlling process
    gc.disable()  # until collection ends (pytest_collection_finish), as eblvm's commands load torch
    import torch

    torch.set_num_threads(1)
    config.pluginmanager.import_plugin("eblvm.testing")


def pytest_collection_finish(session: pytest.Session) -> None:
    """torch, the plugins and the test modules, loaded with the garbage collector off, live to the
    end: frozen, no later collection walks them (eblvm_core.startup does the same for a command)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


# Property tests: no deadline (a shared 2-core machine times an example anywhere from 1x to 10x),
# the failing example printed in full; HYPOTHESIS_PROFILE=thorough tries ten times as many.
settings.register_profile(
    "quick", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("thorough", settings.get_profile("quick"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))


@pytest.fixture
def write_recipe(tmp_path: Path):
    """write_recipe(text, name="r.toml") -> path of a recipe file in tmp_path."""

    from tests.support import SMALL_RECIPE

    def write(text: str = SMALL_RECIPE, name: str = "r.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


# The click command typer builds from the app, with what it was built from: building it reads every
# command's signature and type hints (some 10 ms), which typer's CliRunner does on every invocation.
_built: tuple[tuple[int, ...], Any] | None = None


@pytest.fixture
def cli():
    """invoke(args) -> click Result of the eblvm app, with the plugins' commands, in-process."""
    from click.testing import CliRunner
    from typer.main import get_command

    from eblvm_core.cli import add_plugin_commands, app

    add_plugin_commands(echo=lambda _line: None)

    def command() -> Any:
        global _built
        made_of = tuple(map(id, [app.registered_callback, *app.registered_commands, *app.registered_groups]))
        if _built is None or _built[0] != made_of:
            _built = (made_of, get_command(app))
        return _built[1]

    runner = CliRunner()
    return lambda args: runner.invoke(command(), [str(a) for a in args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 30-step run of the small recipe (checkpoints at 10, 20, 30; none kept, no best),
    trained once per test module."""
    from tests.support import train_small

    return train_small(tmp_path_factory.mktemp("trained"))


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A private copy of the trained run."""
    return Path(shutil.copytree(trained, tmp_path / "run"))
