"""The pytest fixtures of the toolkit (a test suite opts in: ``pytest_plugins = ["eblvm.testing"]``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from eblvm.testing.references import Exact, linear_gaussian_setup, tiny_grbm_setup
from eblvm.testing.runs import RunResult, run_short


@pytest.fixture
def tiny_grbm() -> Exact:
    """A GRBM (d=2, m=3) with its exact posterior: a linear Bernoulli q, logits c + Wᵀv/σ."""
    return tiny_grbm_setup()


@pytest.fixture
def linear_gaussian() -> Exact:
    """The linear-Gaussian EBLVM (d=3, m=2) with a linear Gaussian q set to p(h|v)."""
    return linear_gaussian_setup()


@pytest.fixture
def short_run(tmp_path: Path) -> Callable[..., RunResult]:
    """``short_run(recipe_text_or_path, steps=5, **overrides) -> RunResult`` in a temporary folder."""

    def go(recipe: str | Path | dict, steps: int = 5, loggers: bool = False, **overrides: Any) -> RunResult:
        return run_short(recipe, tmp_path / "short_run", steps, loggers, **overrides)

    return go
