"""The recipes and specs that come with eblvm, by name: ``grbm_bissm``, ``compare/checkerboard``,
``search/bissm_checkerboard``. A name stands for a file wherever a recipe file is read
(``eblvm run grbm_bissm``, ``eblvm.train("grbm_bissm")``, ``validate``), and ``eblvm:NAME``
stands for one from anywhere in an ``include`` or a spec's ``recipe``, so a plugin's recipe can
build on a bundled one. They live in the checkout's ``recipes/`` when eblvm runs from one, else
where the wheel installed them (``share/eblvm/recipes`` of the environment)."""

from __future__ import annotations

import difflib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from eblvm_core.errors import ConfigError

PREFIX = "eblvm:"  # a bundled recipe named from anywhere: include = ["eblvm:grbm_bissm"]
INSTALLED = "share/eblvm/recipes"  # where the wheel's data files put them, under the environment


def folder() -> Path | None:
    """The folder of the bundled recipes: the checkout's, else the installed one; None if neither."""
    from eblvm_core.plugins import checkout

    root = checkout()
    if root is not None and (root / "recipes").is_dir():
        return root / "recipes"
    try:
        files = distribution("eblvm").files or []
    except PackageNotFoundError:
        return None
    for file in files:
        if str(file).replace("\\", "/").endswith(f"{INSTALLED}/grbm_bissm.toml"):
            return Path(file.locate()).parent
    return None


def names() -> dict[str, Path]:
    """Every bundled recipe and spec by name (its path under the folder, without .toml)."""
    base = folder()
    if base is None:
        return {}
    return {p.relative_to(base).with_suffix("").as_posix(): p for p in sorted(base.rglob("*.toml"))}


def named(text: str) -> Path | None:
    """The bundled file ``text`` names (``eblvm:NAME``, or a bare ``NAME``), or None."""
    name = text.removeprefix(PREFIX).removesuffix(".toml")
    return names().get(name)


def did_you_mean(text: str) -> str:
    """A hint naming the closest bundled recipe, or nothing."""
    close = difflib.get_close_matches(text.removeprefix(PREFIX).removesuffix(".toml"), list(names()), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def recipe_file(path: str | Path) -> Path:
    """The file a recipe argument names: a path that exists, as it is, else the bundled recipe of
    that name; neither is a ConfigError naming the closest bundled name."""
    text = str(path)
    if not text.startswith(PREFIX) and Path(path).exists():
        return Path(path)
    found = named(text)
    if found is None:
        hint = did_you_mean(text)
        if text.endswith(".toml") and not hint:
            raise ConfigError("", None, "recipe file not found", file=text)
        what = "no bundled recipe" if text.startswith(PREFIX) else "recipe file not found, nor a bundled recipe"
        raise ConfigError("", None, f"{what}{hint}; `eblvm recipes` lists them", file=text)
    return found
