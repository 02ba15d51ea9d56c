"""Reading recipe files: TOML parsed with every error named by file, and ``include`` resolved
(included files merged in order, this file's keys over them, ``replace`` for the other way)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from eblvm_core.errors import ConfigError
from eblvm_core.recipe.library import PREFIX, named, recipe_file
from eblvm_core.recipe.library import did_you_mean as did_you_mean_bundled
from eblvm_core.registry import did_you_mean


def parse(path: str | Path) -> dict[str, Any]:
    """Parse one TOML file, includes unresolved; a missing, unreadable, binary or malformed file
    becomes a ConfigError."""
    path = Path(path)
    file = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("", None, "recipe file not found", file=file) from None
    except IsADirectoryError:
        raise ConfigError("", None, "is a directory, not a recipe file", file=file) from None
    except OSError as exc:
        raise ConfigError("", None, f"cannot read the recipe: {exc.strerror or exc}", file=file) from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (some editors save one, unseen) is read past
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "",
            None,
            f"not a UTF-8 text file (byte 0x{data[exc.start]:02x} at offset {exc.start}): a recipe is TOML text",
            file=file,
        ) from None
    if "\x00" in text:
        raise ConfigError(
            "", None, f"holds a NUL byte at offset {text.index(chr(0))}: a recipe is TOML text", file=file
        )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", None, f"invalid TOML: {exc}", file=file) from None


INCLUDE, REPLACE = "include", "replace"  # top-level keys of composition, resolved by ``read``


def read(path: str | Path) -> dict[str, Any]:
    """Parse a recipe (or comparison spec) file, or a bundled one by name (``library``), and resolve
    its includes: ``include = ["base.toml"]`` (paths relative to the including file,
    ``eblvm:NAME`` a bundled one; included files may include others) merges the
    included files in order, then this file's own keys over them (``merge``); ``replace =
    ["eval"]`` lists keys of this file that replace the included value instead of being merged
    with (or appended to) it. A file reached twice (two files that include one base) is merged
    once, where it is first included. The result has neither key. A missing include, an include
    cycle or a wrong ``replace`` is a ConfigError naming the including file and the key."""
    path = recipe_file(path)
    return _compose(path, str(path), (), set())


def _compose(path: Path, file: str, chain: tuple[tuple[Path, str], ...], done: set[Path]) -> dict[str, Any]:
    """``read`` of ``path`` (named ``file`` in errors), included from the files of ``chain``
    ((resolved path, name), outermost first); ``done`` holds the files merged so far."""
    raw = parse(path)
    includes, replace = raw.pop(INCLUDE, None), raw.pop(REPLACE, None)
    if includes is None:
        if replace is not None:
            raise ConfigError("", REPLACE, "names keys that replace the included files' values: set include", file=file)
        return raw
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not includes or not all(isinstance(n, str) and n for n in includes):
        raise ConfigError(
            "",
            INCLUDE,
            f'must be a file name or a list of them, e.g. include = ["base.toml"], got {includes!r}',
            file=file,
        )
    replaced = _replaced(replace, raw, file)
    chain = (*chain, (path.resolve(), file))
    merged: dict[str, Any] = {}
    for name in includes:
        target = named(name) if name.startswith(PREFIX) else Path(name)
        if target is None:
            raise ConfigError("", INCLUDE, f"'{name}': no bundled recipe{did_you_mean_bundled(name)}", file=file)
        target = target if target.is_absolute() else path.parent / target
        shown = os.path.normpath(target)
        if not target.is_file():
            what = "is a directory, not a recipe file" if target.is_dir() else "no such file"
            raise ConfigError("", INCLUDE, f"'{name}': {what} ({shown})", file=file)
        resolved = target.resolve()
        on_chain = [p for p, _ in chain]
        if resolved in on_chain:
            loop = [named for _, named in chain[on_chain.index(resolved) :]]
            raise ConfigError(
                "", INCLUDE, f"'{name}' makes an include cycle: {' -> '.join([*loop, loop[0]])}", file=file
            )
        if resolved not in done:
            merged = merge(merged, _compose(target, shown, chain, done))
            done.add(resolved)
    return merge(merged, raw, replaced)


def _replaced(replace: Any, raw: dict[str, Any], file: str) -> frozenset[str]:
    """The dotted keys of a ``replace`` list, each a key of the file's own ``raw``."""
    if replace is None:
        return frozenset()
    if isinstance(replace, str):
        replace = [replace]
    if not isinstance(replace, list) or not all(isinstance(p, str) for p in replace):
        raise ConfigError(
            "", REPLACE, f'must be a list of keys of this file, e.g. replace = ["eval"], got {replace!r}', file=file
        )

    def paths(node: Any, prefix: str = "") -> list[str]:
        if not isinstance(node, dict):
            return []
        return [p for k, v in node.items() for p in [f"{prefix}{k}", *paths(v, f"{prefix}{k}.")]]

    own = paths(raw)
    for path in replace:
        if path not in own:
            raise ConfigError(
                "",
                REPLACE,
                f"'{path}' is not a key of this file{did_you_mean(path, own)}: nothing to replace with",
                file=file,
            )
    return frozenset(replace)


def _tables(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def merge(
    base: dict[str, Any], top: dict[str, Any], replace: frozenset[str] = frozenset(), prefix: str = ""
) -> dict[str, Any]:
    """``top`` over ``base`` (parsed TOML): tables merge key by key, a non-empty array of tables
    ([[eval]], [[log]]) is appended to the base's, anything else (values, plain arrays, ``eval =
    []``) replaces the base's, as does every dotted key in ``replace``."""
    out = dict(base)
    for key, value in top.items():
        path = f"{prefix}{key}"
        old = out.get(key)
        if path in replace or key not in out:
            out[key] = value
        elif isinstance(old, dict) and isinstance(value, dict):
            out[key] = merge(old, value, replace, f"{path}.")
        elif value and _tables(value) and isinstance(old, list) and _tables(old):
            out[key] = [*old, *value]
        else:
            out[key] = value
    return out
