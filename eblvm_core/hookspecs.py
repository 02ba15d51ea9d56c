"""The hooks a plugin implements, each written out. A plugin marks a module-level function
``@hookimpl`` with a hook's name; eblvm calls it once, bundled plugins first, and the function
calls ``register`` once per component it offers.

For a component kind, ``register(name, factory, Config, **declared)`` adds ``factory`` under
``name``: ``factory(config, parts)`` builds the component from ``Config`` (an attrs class whose
fields, made with ``option``, are the recipe section's keys) and the parts built before it
(``Parts``, in the order of ``registry.KINDS``). The factory's docstring's first paragraph is what
``eblvm plugins`` shows; its return annotation says what it returns (for an estimator, the class
whose ``graph_safe`` decides the device before anything is built). What ``register`` may also
take is said by each hook below; ``Registry.add`` checks it.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("eblvm")
hookimpl = pluggy.HookimplMarker("eblvm")


@hookspec
def register_datasets(register):
    """Data sets, selected by ``[data] kind``: factories return ``DataSplits`` (train, test, val,
    event shape, transforms). A data set whose files are absent may return
    ``DataSplits.stand_in`` while ``parts.dry_run`` (``eblvm validate``), after ``parts.warn``."""


@hookspec
def register_models(register):
    """Energy models, ``[model] kind``: factories return an ``EnergyModel``, E(v, h) or, fully
    visible, E(v)."""


@hookspec
def register_posteriors(register):
    """Variational posteriors q(h|v), ``[posterior] kind``: factories return a ``Posterior``
    (also BiDVL's encoders)."""


@hookspec
def register_generators(register):
    """Generators G(h) -> v, ``[generator] kind``: factories return an ``nn.Module`` (BiDVL's)."""


@hookspec
def register_objectives(register):
    """Score-matching objectives, ``[objective] kind``: factories return a ``ScoreObjective``."""


@hookspec
def register_divergences(register):
    """Lower-level divergences D(q(h|v) ‖ p(h|v)), ``[divergence] kind``: factories return a
    ``Divergence``."""


@hookspec
def register_samplers(register):
    """Samplers of v, ``[sampler] kind``: factories return a ``Sampler``. ``register(...,
    default_for=("grbm",))`` makes it the sampler ``eblvm sample`` uses for those model kinds
    when the recipe names none."""


@hookspec
def register_estimators(register):
    """Learning algorithms, ``[estimator] kind``: factories return an ``Estimator`` (annotate the
    return type with its class: its ``graph_safe`` is read before anything is built)."""


@hookspec
def register_evaluators(register):
    """Evaluators, ``[[eval]] kind``: factories return an ``Evaluator`` (or a function ``parts ->
    EvalResult``). ``register(..., reports=("{split}_loglik", "{split}_loglik_stderr"))`` declares
    the scalar keys it returns, ``{option}`` standing for an option's value: ``eblvm plugins``
    lists them, ``validate`` checks ``[run] select_metric`` and the specs' metrics against them. An
    evaluator that draws samples with a registered sampler names it in its config options ``sampler``
    and ``sampler_options``: ``eblvm sample`` then draws as it does."""


@hookspec
def register_loggers(register):
    """Metric sinks, ``[[log]] kind``: factories get ``(config, run_dir)`` and return a ``Logger``.
    ``register(..., requires="wandb", extra="wandb")`` names a module the logger needs and
    eblvm's extra that installs it (or ``install="pip install ..."``): a recipe naming the
    logger where the module is missing is refused by ``validate`` and ``run`` in one line."""


@hookspec
def register_optimizers(register):
    """Optimizers, ``[optim.<role>] kind``: factories get ``(config, params)`` and return a torch
    optimizer. A config option ``max_grad_norm`` (a float or None) is the role's gradient clipping."""


@hookspec
def register_schedules(register):
    """Learning-rate schedules, ``[optim.<role>.schedule] kind``: factories return a ``Schedule``,
    a factor of the base rate per step."""


@hookspec
def register_launchers(register):
    """Where ``eblvm run --launcher NAME`` trains when not in this process (a cluster):
    factories get ``(config)`` and return a ``Launcher``; the config's options are the command's
    ``--option`` flags with the launcher."""


@hookspec
def register_spec_readers(register):
    """Readers of files ``eblvm validate`` checks besides recipes (comparison and search specs):
    ``register(name, reader)`` with ``reader(path, overrides) -> dict[str, Recipe] | None``, the
    recipes a file holds, each named, or None when it is not that reader's kind of file."""


@hookspec
def register_commands(register):
    """Extra ``eblvm`` commands: ``register(fn, name=None, **settings)`` adds the typer command ``fn``
    (named after it, ``_`` as ``-``) with the settings ``typer.Typer.command`` takes
    (``context_settings``, ``epilog``...). A command cannot replace one of eblvm's own or another
    plugin's."""
