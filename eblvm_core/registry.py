"""Per-kind registries: name -> factory + attrs config class."""

from __future__ import annotations

import difflib
from typing import Any, Callable

import attrs

from eblvm_core.errors import ConfigError

KINDS = (
    "models",
    "posteriors",
    "objectives",
    "divergences",
    "estimators",
    "datasets",
    "evaluators",
    "samplers",
    "loggers",
    "optimizers",
)


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
    """Components of one kind. ``add`` is the callback handed to ``register_<kind>`` hooks."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self.current_plugin = "?"

    def add(self, name: str, factory: Callable[..., Any], config: type = NoConfig, doc: str | None = None) -> None:
        """Register ``factory(config_instance, parts)`` under ``name`` with an attrs config class."""
        if not attrs.has(config):
            raise TypeError(f"{self.kind} '{name}': config must be an attrs class, got {config!r}")
        if name in self._entries:
            other = self._entries[name].plugin
            raise ValueError(f"{self.kind} '{name}' registered twice (by {other} and {self.current_plugin})")
        text = doc or (factory.__doc__ or "").strip().split("\n")[0]
        self._entries[name] = Entry(name, factory, config, self.current_plugin, text)

    __call__ = add

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
