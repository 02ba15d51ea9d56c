"""Pluggy hook specifications. Each hook receives ``register``: call it once per component.

``register(name, factory, config=AttrsClass)``; ``factory(config, parts)`` builds the component
(see ``eblvm_core.contracts.Parts``). ``register_commands`` receives ``register(fn, name=None)``
which adds a typer command to the ``eblvm`` CLI.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("eblvm")
hookimpl = pluggy.HookimplMarker("eblvm")


@hookspec
def register_models(register):
    """Register energy models (``EnergyModel`` subclasses)."""


@hookspec
def register_posteriors(register):
    """Register variational posteriors q(h|v) (``Posterior`` subclasses)."""


@hookspec
def register_objectives(register):
    """Register score-matching objectives (``ScoreObjective``)."""


@hookspec
def register_divergences(register):
    """Register lower-level divergences D(q(h|v) || p(h|v)) (``Divergence``)."""


@hookspec
def register_estimators(register):
    """Register learning algorithms (``Estimator``)."""


@hookspec
def register_datasets(register):
    """Register datasets (factories returning ``DataSplits``)."""


@hookspec
def register_evaluators(register):
    """Register evaluators (callables ``parts -> EvalResult``)."""


@hookspec
def register_samplers(register):
    """Register samplers of v (``Sampler``)."""


@hookspec
def register_loggers(register):
    """Register metric sinks (``Logger``); factories get ``(config, run_dir)``."""


@hookspec
def register_optimizers(register):
    """Register optimizers; factories get ``(config, params)`` and return a torch optimizer."""


@hookspec
def register_commands(register):
    """Register extra CLI commands: ``register(fn, name=None)``."""
