"""TOML recipes -> validated, frozen configs, by job: ``schema`` (what a recipe is), ``includes``
(reading files, ``include``), ``overrides`` (``-o`` values), ``validation`` (checking every section
against the registries, ``load_recipe``) and ``resume`` (what may change when a run continues).
Every error names the file (or the ``-o`` value), section and key."""

from __future__ import annotations

from eblvm_core.errors import blame
from eblvm_core.recipe.includes import INCLUDE, REPLACE, merge, parse, read
from eblvm_core.recipe.overrides import apply_override, apply_overrides, parse_value, set_value
from eblvm_core.recipe.resume import RESUMABLE, check_unchanged, differences, training_part
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
    with_run,
)
from eblvm_core.recipe.validation import _component, load_recipe, validate, validate_with

__all__ = [
    "DEFAULT_LOGGER",
    "INCLUDE",
    "LISTS",
    "REPLACE",
    "REQUIRED",
    "RESUMABLE",
    "SINGLE",
    "TOP_LEVEL",
    "Recipe",
    "Role",
    "RunConfig",
    "Section",
    "_component",
    "apply_override",
    "apply_overrides",
    "blame",
    "check_unchanged",
    "differences",
    "load_recipe",
    "merge",
    "parse",
    "parse_value",
    "read",
    "set_value",
    "training_part",
    "validate",
    "validate_with",
    "with_run",
]
