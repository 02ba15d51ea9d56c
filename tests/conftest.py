"""Fixtures every test may use: a recipe written to a temporary folder and the CLI run in-process.
Shared constants and helpers are in ``tests.support``."""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from typer.testing import CliRunner

from tests.support import SMALL_RECIPE, train_small

pytest_plugins = ["eblvm.testing"]  # the plugin kit's fixtures (short_run, tiny_grbm, linear_gaussian)

# The tests' tensors are tiny: one thread avoids oversubscribing a small CI machine.
torch.set_num_threads(1)

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

    def write(text: str = SMALL_RECIPE, name: str = "r.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def cli():
    """invoke(args) -> click Result of the eblvm app, with the plugins' commands, in-process."""
    from eblvm_core.cli import add_plugin_commands, app

    add_plugin_commands(echo=lambda _line: None)

    runner = CliRunner()
    return lambda args: runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 30-step run of the small recipe (checkpoints at 10, 20, 30; none kept, no best),
    trained once per test module."""
    return train_small(tmp_path_factory.mktemp("trained"))


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A private copy of the trained run."""
    return Path(shutil.copytree(trained, tmp_path / "run"))
