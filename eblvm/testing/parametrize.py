"""One decorated test function for a plugin's whole contract, as scikit-learn's
``parametrize_with_checks``: every check that applies to each component, one test case each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from eblvm.testing.checks import check_divergence, check_objective
from eblvm_core.contracts import Divergence, ScoreObjective

CHECKS: tuple[tuple[type, Callable[[Any], Any]], ...] = (
    (Divergence, check_divergence),
    (ScoreObjective, check_objective),
)


def checks_of(component: Any) -> list[Callable[[Any], Any]]:
    """The contract checks that take ``component`` alone (its kind's, on the toolkit's exact setups)."""
    found = [check for kind, check in CHECKS if isinstance(component, kind)]
    if not found:
        kinds = ", ".join(kind.__name__ for kind, _check in CHECKS)
        raise TypeError(f"no contract check takes a {type(component).__name__} alone; these kinds have one: {kinds}")
    return found


def parametrize_with_checks(components: Sequence[Any]) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize("component, check", ...)`` over every (component, check) pair:

        @parametrize_with_checks([MyDivergence(alpha=0.5), MyDivergence(alpha=2.0)])
        def test_contract(component, check):
            check(component)

    Divergences get ``check_divergence`` and score objectives ``check_objective``; the checks of
    other kinds need the data a component works on, so they are called directly."""
    cases = [(component, check) for component in components for check in checks_of(component)]
    ids = [f"{type(component).__name__}{i}-{check.__name__}" for i, (component, check) in enumerate(cases)]
    return pytest.mark.parametrize("component, check", cases, ids=ids)
