"""Shared fixtures: small recipes written to a temporary folder, and a CLI runner."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

# The tests' tensors are tiny: one thread avoids oversubscribing a small CI machine.
torch.set_num_threads(1)

# A small exact-score DSM run on a small checkerboard: fast enough for end-to-end tests.
SMALL_RECIPE = """
[run]
name = "small"
seed = 7
steps = 30
batch_size = 50
log_every = 10
checkpoint_every = 10

[data]
kind = "checkerboard"
n_train = 2000
n_test = 500

[model]
kind = "grbm"
n_hidden = 4

[objective]
kind = "dsm"
sigma = 0.1

[estimator]
kind = "exact-score"

[optim.model]
kind = "adam"
lr = 1e-2

[[eval]]
kind = "exact-loglik"
"""

# SMALL_RECIPE trained by BiSM: a Bernoulli posterior, the KL lower level, one inner and one unrolled step
BISM = SMALL_RECIPE.replace(
    '[estimator]\nkind = "exact-score"',
    """[posterior]
kind = "bernoulli"

[divergence]
kind = "kl"

[estimator]
kind = "bism-unrolled"
inner_steps = 1
unroll_steps = 1

[optim.posterior]
kind = "adam\"""",
)


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
    """invoke(args) -> click Result of the eblvm app, in-process."""
    from eblvm_core.cli import app

    runner = CliRunner()
    return lambda args: runner.invoke(app, [str(a) for a in args])
