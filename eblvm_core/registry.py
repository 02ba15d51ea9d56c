"""The component kinds (the one list of them) and a registry per kind: name -> factory + attrs config."""

from __future__ import annotations

import difflib
from collections.abc import Callable
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
    Kind("estimators", "estimator", "Learning algorithms (``Estimator``): roles, optimizers, ``step``.", required=True),
    Kind("evaluators", "eval", "Evaluators: callables ``parts -> EvalResult``.", many=True),
    Kind("loggers", "log", "Metric sinks (``Logger``); factories get ``(config, run_dir)``.", many=True),
    Kind("optimizers", None, "Optimizers; factories get ``(config, params)`` and return a torch optimizer."),
    Kind("schedules", None, "Learning-rate schedules (``Schedule``): a factor of the base rate per step."),
)
KIND_NAMES = tuple(k.name for k in KINDS)
SECTION_KINDS = {k.section: k for k in KINDS if k.section is not None}


@attrs.define
class NoConfig:
    """A component with no options."""


@attrs.frozen
class Entry:
    """One registered component: ``factory(config, parts)`` builds it."""

    name: str
    factory: Callable[..., Any]
    config: type
    plugin: str
    doc: str


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
    ) -> None:
        """Register ``factory(config_instance, parts)`` under ``name`` with an attrs config class."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind}: a component name must be a non-empty string, got {name!r}")
        if not attrs.has(config):
            raise TypeError(f"{self.kind} '{name}': config must be an attrs class, got {config!r}")
        if name in self._entries:
            other = self._entries[name].plugin
            raise ValueError(f"{self.kind} '{name}' registered twice (by {other} and {plugin})")
        text = doc or (factory.__doc__ or "").strip().split("\n")[0]
        self._entries[name] = Entry(name, factory, config, plugin, text)

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
