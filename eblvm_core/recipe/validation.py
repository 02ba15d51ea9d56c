"""Parsed recipe data -> a validated ``Recipe``: every section against its registry entry's config
(unknown keys with "did you mean", types, ranges), every bad key reported at once; and
``load_recipe``, which reads, overrides and validates a file."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from eblvm_core.config import coerce, structure
from eblvm_core.errors import ConfigError, blame
from eblvm_core.plugins import Loaded, load
from eblvm_core.recipe.includes import INCLUDE, REPLACE, read
from eblvm_core.recipe.library import recipe_file
from eblvm_core.recipe.overrides import apply_overrides
from eblvm_core.recipe.schema import (
    DEFAULT_LOGGER,
    LISTS,
    REQUIRED,
    SINGLE,
    TOP_LEVEL,
    Recipe,
    Role,
    RunConfig,
    Section,
    _ema,
)
from eblvm_core.registry import did_you_mean


def _component(label: str, body: Any, kind: str, plugins: Loaded) -> Section:
    if not isinstance(body, dict):
        raise ConfigError(label, None, "must be a table")
    if "kind" not in body:
        names = ", ".join(plugins[kind].names())
        raise ConfigError(label, "kind", f"missing; choose one of: {names}")
    name = body["kind"]
    if not isinstance(name, str):
        raise ConfigError(label, "kind", f"must be a string, got {name!r}")
    entry = plugins[kind].get(name, section=label)
    values = {k: v for k, v in body.items() if k != "kind"}
    return Section(label, entry, structure(entry.config, values, label))


def _role(name: str, body: Any, plugins: Loaded) -> Role:
    label = f"optim.{name}"
    if not isinstance(body, dict):
        raise ConfigError(label, None, "must be a table")
    body = dict(body)
    schedule = body.pop("schedule", {"kind": "constant"})
    ema = body.pop("ema", None)
    if ema is not None:
        try:
            ema = float(coerce(ema, float))
            _ema(None, None, ema)
        except (TypeError, ValueError) as exc:
            raise ConfigError(label, "ema", str(exc)) from None
    return Role(
        _component(label, body, "optimizers", plugins),
        _component(f"{label}.schedule", schedule, "schedules", plugins),
        ema,
    )


def _check_text(node: Any, section: str, key: str | None = None) -> None:
    """Refuse a NUL byte in any key or string of the recipe, naming its section and key."""
    if isinstance(node, str) and "\x00" in node:
        raise ConfigError(section, key, f"must not contain a NUL byte, got {node!r}")
    if isinstance(node, list):
        for child in node:
            _check_text(child, section, key)
    if not isinstance(node, dict):
        return
    for name, child in node.items():
        if "\x00" in name:
            raise ConfigError(section, repr(name), "a key must not contain a NUL byte")
        tables = isinstance(child, list) and bool(child) and all(isinstance(c, dict) for c in child)
        if key is None and (isinstance(child, dict) or tables):
            sub = f"{section}.{name}" if section else name
            for i, table in enumerate(child if tables else [child]):
                _check_text(table, f"{sub}.{i}" if tables else sub)
        else:
            _check_text(child, section, key or name)


def validate(raw: dict[str, Any], path: str, plugins: Loaded | None = None) -> Recipe:
    """Check every section of a parsed recipe against the registries; raise a ConfigError naming
    every bad key at once (``ConfigError.combine``: one line each), in the order of the sections."""
    plugins = plugins or load()
    errors: list[ConfigError] = []

    def checked(work: Callable[[], Any]) -> Any:
        try:
            return work()
        except ConfigError as exc:
            errors.append(exc)
            return None

    try:
        _check_text(raw, "")
    except ConfigError as exc:
        exc.file = exc.file or path
        raise
    meant = set()  # the sections an unknown one is a misspelling of: not also reported missing
    for key in raw:
        if key in (INCLUDE, REPLACE):
            errors.append(
                ConfigError("", key, "is resolved when a recipe file is read (recipe.read): give the recipe as a file")
            )
        elif key not in TOP_LEVEL:
            meant.update(difflib.get_close_matches(key, TOP_LEVEL, n=1))
            errors.append(
                ConfigError(key, None, f"unknown section{did_you_mean(key, TOP_LEVEL)}; valid: {', '.join(TOP_LEVEL)}")
            )
    missing = [key for key in REQUIRED if key not in raw and key not in meant]
    if missing:
        also = f" (so are {', '.join(f'[{key}]' for key in missing[1:])})" if missing[1:] else ""
        errors.append(ConfigError(missing[0], None, f"required section is missing{also}"))
    run_body = raw.get("run", {})
    if not isinstance(run_body, dict):
        errors.append(ConfigError("run", None, "must be a table"))
        run_body = {}
    run = checked(lambda: structure(RunConfig, run_body, "run"))
    parts = {}
    for label, kind in SINGLE.items():
        if label in raw:
            parts[label] = checked(functools.partial(_component, label, raw[label], kind, plugins))
    optim_raw = raw.get("optim", {})
    if not isinstance(optim_raw, dict):
        errors.append(ConfigError("optim", None, "must hold tables such as [optim.model]"))
        optim_raw = {}
    optim = {name: checked(functools.partial(_role, name, body, plugins)) for name, body in optim_raw.items()}
    lists: dict[str, list[Section]] = {}
    for label, kind in LISTS.items():
        items = raw.get(label, [])
        if not isinstance(items, list):
            errors.append(ConfigError(label, None, f"must be an array of tables: write [[{label}]]"))
            items = []
        lists[label] = [
            checked(functools.partial(_component, f"{label}.{i}", body, kind, plugins)) for i, body in enumerate(items)
        ]
    if errors:
        found = ConfigError.combine(errors)
        for error in found.errors:
            error.file = error.file or path
        raise found
    if "log" not in raw and DEFAULT_LOGGER in plugins["loggers"]:
        lists["log"] = [_component("log.0", {"kind": DEFAULT_LOGGER}, "loggers", plugins)]
    return Recipe(path, run, parts, optim, lists["eval"], lists["log"])


def load_recipe(
    path: str | Path,
    overrides: Sequence[str] = (),
    plugins: Loaded | None = None,
    evals: list[dict[str, Any]] | None = None,
) -> Recipe:
    """Read (includes resolved, ``read``), override (``apply_override``, in order) and validate a
    recipe file (or a bundled one by name); ``evals`` ([[eval]] tables) replace its evaluators
    before the overrides apply."""
    path = recipe_file(path)
    raw = read(path)
    if evals is not None:
        raw["eval"] = [dict(table) for table in evals]
    return validate_with(raw, str(path), overrides, plugins)


def validate_with(
    raw: dict[str, Any], path: str, overrides: Sequence[str] = (), plugins: Loaded | None = None
) -> Recipe:
    """``validate`` ``raw`` (read from ``path``) with ``-o`` values applied (``apply_overrides``):
    an error an override caused names it (``blame``), as do the errors the recipe meets later
    (``Recipe.blame``)."""
    overrides = list(overrides)
    apply_overrides(raw, overrides)
    try:
        recipe = validate(raw, path, plugins)
    except ConfigError as exc:
        blame(exc, overrides, path)
        raise
    return attrs.evolve(recipe, overrides=tuple(overrides))
