"""``-o`` values: ``section.key=value`` sets (appending a table to [[eval]] or [[log]] at its
length), ``~section.key`` drops; applied in order; an error names the ``-o`` value that caused it."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from typing import Any

from eblvm_core.errors import ConfigError, from_override
from eblvm_core.recipe.schema import DEFAULT_LOGGER, LISTS, TOP_LEVEL
from eblvm_core.registry import did_you_mean


def parse_value(text: str) -> Any:
    """A TOML value (1e-3, true, "x", [1, 2]); anything else is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


INDEX = re.compile(r"[0-9]+")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """Apply ``-o`` values to ``raw`` in order (``apply_override``); an error names the ``-o``
    value (``from_override``)."""
    for override in overrides:
        try:
            apply_override(raw, override)
        except ConfigError as exc:
            raise from_override(exc, override) from None


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one ``-o`` override to ``raw`` (overrides apply left to right):

    - ``section.key=value`` sets a value (``optim.model.lr=1e-3``, ``eval.0.n_grid=200``);
      ``eval.N.key=value`` where N is the length of the [[eval]] (or [[log]]) list appends a new
      table (``eval.2.kind=density-plot`` on a recipe with two evaluators adds a third);
    - ``~section.key`` drops a key (its default applies again), ``~eval.N`` drops entry N of a
      list (the later ones move up), ``~section`` a whole section.
    """
    text = override.strip()
    if text.startswith("~"):
        _drop(raw, override, text[1:])
        return
    path, sep, value = override.partition("=")
    keys = path.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError(
            "", None, f"override '{override}' must look like section.key=value (or ~section.key to drop a key)"
        )
    set_value(raw, keys, parse_value(value.strip()), f"override '{override}'")


def _list_section(node: dict[str, Any], key: str) -> None:
    """Make an absent [[eval]] or [[log]] list explicit before an override addresses its entries:
    empty, or for [[log]] the default logger a recipe without [[log]] gets."""
    if key in LISTS and key not in node:
        node[key] = [{"kind": DEFAULT_LOGGER}] if key == "log" else []


def _entry(items: list[Any], keys: list[str], i: int, what: str, append: bool) -> Any:
    """Entry ``keys[i]`` of the list ``items`` (at ``keys[:i]``); ``append``: index len(items)
    adds an empty table to a list of tables."""
    key, n = keys[i], len(items)
    where, listed = ".".join(keys[: i + 1]), ".".join(keys[:i])
    if INDEX.fullmatch(key) and int(key) < n:
        return items[int(key)]
    tables = all(isinstance(item, dict) for item in items)
    if append and tables and INDEX.fullmatch(key) and int(key) == n:
        items.append({})
        return items[-1]
    if not INDEX.fullmatch(key):
        raise ConfigError(
            listed,
            None,
            f"{what}: [[{listed}]] is a list: name an entry by its index, e.g. {listed}.0.kind, not '{key}'",
        )
    adds = f"; {listed}.{n}.<key>=<value> adds one" if append and tables else ""
    raise ConfigError(where, None, f"{what}: no item {key} (there are {n}{adds})")


def set_value(raw: dict[str, Any], keys: list[str] | str, value: Any, what: str | None = None) -> None:
    """Set the recipe value at ``keys`` (a dotted path or its parts) in ``raw``, creating tables
    on the way; an index equal to the length of a list of tables appends one. An override never
    adds an [optim.<role>]. ``what`` (e.g. "override 'a.b=1'") starts error messages."""
    keys = keys.split(".") if isinstance(keys, str) else list(keys)
    what = what or f"'{'.'.join(keys)}'"
    node: Any = raw
    for i, key in enumerate(keys[:-1]):
        if isinstance(node, list):
            node = _entry(node, keys, i, what, append=True)
        elif isinstance(node, dict):
            if key not in node and i == 0 and key not in TOP_LEVEL:
                raise ConfigError(key, None, f"{what}: unknown section{did_you_mean(key, TOP_LEVEL)}")
            if key not in node and keys[0] == "optim" and i == 1:  # an override never adds a role
                hint = did_you_mean(key, list(node))
                raise ConfigError(f"optim.{key}", None, f"{what}: the recipe has no such role{hint}")
            if i == 0:
                _list_section(node, key)
            node = node.setdefault(key, {})
        else:
            raise ConfigError(".".join(keys[: i - 1]), keys[i - 1], f"{what}: a value, not a section holding '{key}'")
    if isinstance(node, list):
        listed = ".".join(keys[:-1])
        if not INDEX.fullmatch(keys[-1]):
            _entry(node, keys, len(keys) - 1, what, append=False)  # refuses a key that is no index
        raise ConfigError(
            listed, None, f"{what}: an entry of [[{listed}]] is a table: set its keys, e.g. {'.'.join(keys)}.kind=..."
        )
    if not isinstance(node, dict):
        section, key = ".".join(keys[:-2]), keys[-2]
        raise ConfigError(section, key, f"{what}: a value, not a section holding '{keys[-1]}'")
    node[keys[-1]] = value


def _drop(raw: dict[str, Any], override: str, path: str) -> None:
    """``~a.b.c``: remove key c of table a.b, or entry c of list a.b."""
    keys = path.strip().split(".")
    what = f"override '{override}'"
    if "=" in path or not all(keys):
        raise ConfigError("", None, f"{what}: a drop looks like ~section.key or ~eval.N, without a value")
    node: Any = raw
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if INDEX.fullmatch(key) and int(key) < len(node):
                if last:
                    del node[int(key)]
                    return
                node = node[int(key)]
            else:
                listed = ".".join(keys[:i])
                raise ConfigError(listed, None, f"{what}: no item {key} to drop (there are {len(node)})")
        elif isinstance(node, dict):
            if i == 0 and not last:
                _list_section(node, key)
            if key not in node:
                section = ".".join(keys[:i])
                hint = did_you_mean(key, [str(k) for k in node])
                raise ConfigError(
                    section or key, key if section else None, f"{what}: not in the recipe, nothing to drop{hint}"
                )
            if last:
                del node[key]
                return
            node = node[key]
        else:
            raise ConfigError(".".join(keys[: i - 1]), keys[i - 1], f"{what}: a value, not a section holding '{key}'")
