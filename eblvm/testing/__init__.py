"""The plugin author's test kit: exact test models, fixtures and the contract checks of each kind.

Every component of a kind must pass its kind's check; eblvm's bundled plugins run the same
checks over the registry (``tests/core/test_contracts.py``). In a plugin's own tests::

    from eblvm.testing import check_divergence
    from eblvm_mydiv import MyDivergence

    def test_contract():
        check_divergence(MyDivergence(n_samples=4))

The checks raise ``AssertionError`` with a message saying what failed and why it matters:
``check_divergence``, ``check_objective``, ``check_estimator``, ``check_model``,
``check_posterior``, ``check_dataset``, ``check_sampler``, ``check_evaluator``, ``check_logger``
and ``check_optimizer``. ``make(kind, name, parts, **options)`` builds a registered component
with its options validated as in a recipe; ``entry(kind, name)`` is a registered component's entry
(its plugin, description, config class); ``run_short`` trains a few steps of a recipe.

``parametrize_with_checks([components])`` makes a plugin's whole contract test one decorated
function. The kit needs pytest. Its fixtures (``tiny_grbm`` and ``linear_gaussian``, an
:class:`Exact` setup each, and ``short_run``: ``short_run(recipe_text_or_path, steps=5,
**overrides) -> RunResult``, run in a temporary folder) are a pytest plugin a test suite opts into
with one line in its conftest.py: ``pytest_plugins = ["eblvm.testing"]``.

Exact setups and the registered components they use (``grbm``, ``bernoulli``, ``gaussian``)
are built through the registry, so the bundled plugins must be loaded.
"""

from eblvm.testing.checks import (
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
from eblvm.testing.fixtures import linear_gaussian, short_run, tiny_grbm
from eblvm.testing.parametrize import parametrize_with_checks
from eblvm.testing.references import (
    Exact,
    LinearGaussianEBLVM,
    linear_gaussian_parts,
    linear_gaussian_setup,
    make,
    tiny_grbm_setup,
)
from eblvm.testing.runs import RunResult, run_short
from eblvm_core.plugins import load
from eblvm_core.registry import Entry


def entry(kind: str, name: str) -> Entry:
    """The registered component ``name`` of ``kind`` ("divergences", ...), the installed plugins loaded."""
    return load()[kind].get(name)


__all__ = [
    "entry",
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
    "parametrize_with_checks",
    "run_short",
    "short_run",
    "tiny_grbm",
    "tiny_grbm_setup",
]
