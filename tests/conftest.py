"""Fixtures every test may use: a recipe written to a temporary folder and the CLI run in-process.
Shared constants and helpers are in ``tests.support``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.support import SMALL_RECIPE

pytest_plugins = ["eblvm.testing"]  # the plugin kit's fixtures (short_run, tiny_grbm, linear_gaussian)

# The tests' tensors are tiny: one thread avoids oversubscribing a small CI machine.
torch.set_num_threads(1)


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
