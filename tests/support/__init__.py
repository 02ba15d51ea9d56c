"""What many tests share: the repository's paths, small recipes, random GRBMs away from their
initial values, a run killed (kill -9) mid-training, a step poisoned with a NaN, and the check of a
one-line CLI error. Fixtures are in tests/conftest.py; test plugins beside this file."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from eblvm_grbm.model import GRBM

ROOT = Path(__file__).resolve().parents[2]  # the repository
RECIPES = ROOT / "recipes"

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


def grbm_away_from_init(
    d: int,
    m: int,
    *,
    sigma: float,
    weight_std: float,
    seed: int = 0,
    coupling: str = "scaled",
    dtype: torch.dtype = torch.float64,
) -> GRBM:
    """A GRBM with d visible and m hidden units and every parameter away from its initial value:
    σ = ``sigma``, W ~ N(0, weight_std²), b and c ~ N(0, 0.5²), drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    model = GRBM(d, m, init_sigma=sigma, init_weight_std=weight_std, coupling=coupling).to(dtype)
    with torch.no_grad():
        model.b.normal_(0.0, 0.5)
        model.c.normal_(0.0, 0.5)
    return model


def kill_run_when(recipe: Path, out: Path, ready: Callable[[Path], bool], timeout: float = 120.0) -> None:
    """Start ``eblvm run RECIPE --out OUT`` in a process and kill it (SIGKILL) as soon as a
    ``last.pt`` checkpoint exists for which ``ready(path)`` holds, or when it ends or times out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "eblvm_core.cli", "run", str(recipe), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = list(out.glob("*/*/checkpoints/last.pt"))
        if found and ready(found[0]):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def poison_at(monkeypatch, step: int, what) -> None:
    """Make the built estimator call ``what(built, metrics)`` after its ``step``-th step (counted
    from the build), with that step's metrics, which it may change in place."""
    import eblvm_core.session as session_module

    real_build = session_module.build

    def build(*args, **kwargs):
        built = real_build(*args, **kwargs)
        real_step, count = built.parts.estimator.step, [0]

        def poisoned(batch):
            metrics = real_step(batch)
            count[0] += 1
            if count[0] == step:
                what(built, metrics)
            return metrics

        built.parts.estimator.step = poisoned
        return built

    monkeypatch.setattr(session_module, "build", build)


def one_line_error(result) -> str:
    """The one line a bad input gets from the CLI: exit code 2, no traceback, "error: ..."."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    return lines[0]
