"""The component kinds (the one list of them) and a registry per kind: name -> factory + attrs config."""

from __future__ import annotations

import difflib
import inspect
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from eblvm_core.errors import ConfigError


@attrs.frozen
class Kind:
    """A kind of component: its registry and hook name, and the recipe section that selects one.

    ``section`` is None for kinds that no top-level section selects (optimizers and schedules
    live inside ``[optim.<role>]``). ``many`` marks array-of-tables sections (``[[eval]]``).
    Sections are built in the order of ``KINDS``, so a factory sees everything listed before it.
    """

    name: str
    section: str | None
    doc: str
    required: bool = False
    many: bool = False


KINDS: tuple[Kind, ...] = (
    Kind(
        "datasets",
        "data",
        "Data sets: factories return ``DataSplits`` (train/test/val, event shape, transform).",
        required=True,
    ),
    Kind("models", "model", "Energy models (``EnergyModel``): E(v, h) or, fully visible, E(v).", required=True),
    Kind("posteriors", "posterior", "Variational posteriors q(h|v) (``Posterior``); also encoders."),
    Kind("generators", "generator", "Generators G(h) -> v (``nn.Module``), e.g. BiDVL's."),
    Kind("objectives", "objective", "Score-matching objectives (``ScoreObjective``)."),
    Kind("divergences", "divergence", "Lower-level divergences D(q(h|v) || p(h|v)) (``Divergence``)."),
    Kind("samplers", "sampler", "Samplers of v (``Sampler``)."),
    Kind("estimators", "estimator", "Learning algorithms (``Estimator``): roles, ``step``.", required=True),
    Kind("evaluators", "eval", "Evaluators: callables ``parts -> EvalResult``.", many=True),
    Kind("loggers", "log", "Metric sinks (``Logger``); factories get ``(config, run_dir)``.", many=True),
    Kind("optimizers", None, "Optimizers; factories get ``(config, params)`` and return a torch optimizer."),
    Kind("schedules", None, "Learning-rate schedules (``Schedule``): a factor of the base rate per step."),
    Kind(
        "launchers", None, "Launchers (``Launcher``) of runs elsewhere than this process; factories get ``(config)``."
    ),
    Kind(
        "spec_readers",
        None,
        "Readers of specs ``validate`` checks: ``reader(path, overrides) -> {name: Recipe} | None``.",
    ),
)
KIND_NAMES = tuple(k.name for k in KINDS)
SECTION_KINDS = {k.section: k for k in KINDS if k.section is not None}


@attrs.define
class NoConfig:
    """A component with no options."""


@attrs.frozen
class Entry:
    """One registered component of kind ``of_kind`` ("models", ...): ``factory(config, parts)``
    builds it. ``doc`` is the first paragraph of the factory's docstring (what ``eblvm plugins``
    shows); ``reports`` and the fields after it are what the plugin declared when it registered
    the component (``Registry.add``)."""

    name: str
    factory: Callable[..., Any]
    config: type
    plugin: str
    doc: str
    of_kind: str
    reports: tuple[str, ...] | None = None
    requires: str | None = None
    extra: str | None = None
    install: str | None = None
    default_for: tuple[str, ...] = ()

    def reported_keys(self, config: Any = None) -> tuple[str, ...] | None:
        """The declared keys, each ``{option}`` replaced by its value in ``config`` (default: the
        options' defaults; a required option stays ``{option}``); None when nothing is declared."""
        if self.reports is None:
            return None
        if config is None:
            values = {f.name: _default(f) for f in attrs.fields(self.config)}
        else:
            values = {f.name: getattr(config, f.name) for f in attrs.fields(type(config))}
        return tuple(template.format_map(values) for template in self.reports)


def option_default(field: attrs.Attribute) -> Any:
    """An option's default value (a factory's called), or ``attrs.NOTHING`` for a required option."""
    default: Any = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]  # attrs types Factory as a function
        return default.factory()
    return default


def _default(field: attrs.Attribute) -> Any:
    """An option's default; a required option stays ``{name}``."""
    default = option_default(field)
    return f"{{{field.name}}}" if default is attrs.NOTHING else default


def first_paragraph(text: str) -> str:
    """A docstring's first paragraph as one line."""
    return " ".join(re.split(r"\n\s*\n", inspect.cleandoc(text))[0].split())


def _check_templates(keys: tuple[str, ...], config: type, what: str) -> None:
    """Refuse a key that holds a space or a ``{field}`` that is not an option of ``config``."""
    options = sorted(f.name for f in attrs.fields(config))
    for key in keys:
        if not isinstance(key, str) or not key or " " in key:
            raise TypeError(f"{what}: reported key {key!r} must be a non-empty string without spaces")
        for _text, field, _spec, _conversion in string.Formatter().parse(key):
            if field is not None and field not in options:
                raise TypeError(
                    f"{what}: reported key '{key}' names {{{field}}}, not an option of "
                    f"{config.__name__}{did_you_mean(field, options)}"
                )


def did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Registry:
    """Components of one kind, each credited to the plugin that registered it."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def add(
        self,
        name: str,
        factory: Callable[..., Any],
        config: type = NoConfig,
        doc: str | None = None,
        *,
        plugin: str = "?",
        reports: Sequence[str] | None = None,
        requires: str | None = None,
        extra: str | None = None,
        install: str | None = None,
        default_for: Sequence[str] = (),
    ) -> None:
        """Register ``factory(config_instance, parts)`` under ``name`` with an attrs config class.

        What a plugin may declare besides (each documented with its hook, ``hookspecs``):
        ``reports``, an evaluator's scalar keys (``{option}`` stands for an option's value:
        ``"{split}_loglik"``); ``requires``, a module the component needs that may be missing
        (``validate`` refuses it in one line), with ``extra`` (eblvm's extra that brings it) or
        ``install`` (the command that does); ``default_for``, the model kinds for which a sampler
        is the one ``eblvm sample`` uses by default."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind}: a component name must be a non-empty string, got {name!r}")
        if not attrs.has(config):
            raise TypeError(f"{self.kind} '{name}': config must be an attrs class, got {config!r}")
        if name in self._entries:
            other = self._entries[name].plugin
            raise ValueError(f"{self.kind} '{name}' registered twice (by {other} and {plugin})")
        if reports is not None:
            reports = tuple(reports)
            _check_templates(reports, config, f"{self.kind} '{name}'")
        text = first_paragraph(doc or factory.__doc__ or "")
        self._entries[name] = Entry(
            name, factory, config, plugin, text, self.kind, reports, requires, extra, install, tuple(default_for)
        )

    def withdraw(self, plugin: str) -> None:
        """Remove every component ``plugin`` registered (a plugin that failed part-way)."""
        self._entries = {n: e for n, e in self._entries.items() if e.plugin != plugin}

    def get(self, name: str, section: str | None = None) -> Entry:
        if name not in self._entries:
            names = self.names()
            hint = did_you_mean(name, names)
            valid = ", ".join(names) or "none registered"
            raise ConfigError(section or self.kind, "kind", f"unknown {self.kind[:-1]} '{name}'{hint}; valid: {valid}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._entries
