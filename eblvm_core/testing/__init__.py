"""The plugin author's toolkit: exact test models, fixtures and the contract checks of each kind.

Every component of a kind must pass its kind's check; eblvm's bundled plugins run the same
checks over the registry (``tests/core/test_contracts.py``). In a plugin's own tests::

    from eblvm_core.testing import check_divergence
    from eblvm_mydiv import MyDivergence

    def test_contract():
        check_divergence(MyDivergence(n_samples=4))

The checks raise ``AssertionError`` with a message saying what failed and why it matters:
``check_divergence``, ``check_objective``, ``check_estimator``, ``check_model``,
``check_posterior``, ``check_dataset``, ``check_sampler``, ``check_evaluator``, ``check_logger``
and ``check_optimizer``. ``make(kind, name, parts, **options)`` builds a registered component
with its options validated as in a recipe; ``run_short`` trains a few steps of a recipe.

This package is also a pytest plugin (the ``eblvm`` entry of the ``pytest11`` group, loaded
automatically once eblvm is installed; ``-p no:eblvm`` turns it off) with the fixtures
``tiny_grbm`` and ``linear_gaussian`` (an :class:`Exact` setup each) and ``short_run``
(``short_run(recipe_text_or_path, steps=5, **overrides) -> RunResult``, run in a temporary folder).

Exact setups and the registered components they use (``grbm``, ``bernoulli``, ``gaussian``)
are built through the registry, so the bundled plugins must be loaded.
"""

from eblvm_core.testing.checks import (
    GaussianScore,
    check_dataset,
    check_divergence,
    check_estimator,
    check_evaluator,
    check_logger,
    check_model,
    check_objective,
    check_optimizer,
    check_posterior,
    check_sampler,
)
from eblvm_core.testing.fixtures import linear_gaussian, short_run, tiny_grbm
from eblvm_core.testing.references import (
    Exact,
    LinearGaussianEBLVM,
    linear_gaussian_parts,
    linear_gaussian_setup,
    make,
    tiny_grbm_setup,
)
from eblvm_core.testing.runs import RunResult, run_short

__all__ = [
    "Exact",
    "GaussianScore",
    "LinearGaussianEBLVM",
    "RunResult",
    "check_dataset",
    "check_divergence",
    "check_estimator",
    "check_evaluator",
    "check_logger",
    "check_model",
    "check_objective",
    "check_optimizer",
    "check_posterior",
    "check_sampler",
    "linear_gaussian",
    "linear_gaussian_parts",
    "linear_gaussian_setup",
    "make",
    "run_short",
    "short_run",
    "tiny_grbm",
    "tiny_grbm_setup",
]
