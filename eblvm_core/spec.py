"""Comparison specs (``eblvm compare SPEC.toml``): methods, each a recipe with overrides, run
over seeds and tabulated. ``is_spec`` tells a spec from a recipe (``eblvm validate`` takes
both); ``load_spec`` validates a spec and every method's merged recipe before anything runs.

A spec::

    [compare]
    name = "checkerboard"                          # results go to results/<name> by default
    seeds = 3
    metrics = ["eval/exact-loglik/test_loglik"]    # table columns
    curve = "eval/exact-loglik/test_loglik"        # learning-curve metric ("" for none)
    image = "density-plot"                         # evaluator whose first image is shown, "samples", or ""
    checkpoint = "last"                            # or "best" (the recipes' [run] select_metric)
    table_steps = [10000, 100000]                  # also tabulate the curve metric at these steps
    overrides = ["run.eval_every=1000"]            # applied to every method

    [[method]]
    name = "DSM"
    recipe = "../grbm_dsm.toml"                    # relative to the spec file, else to the working directory
    overrides = []

    [[eval]]          # optional: added to (or, with eval_mode = "replace", instead of) each recipe's [[eval]]
    kind = "score-loss"
    split = "val"

    [[final_eval]]    # optional: run once on the tabulated checkpoint (else: the run's final evaluation)
    kind = "ais-loglik"
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import attrs

from eblvm_core.config import non_negative, option, positive, structure
from eblvm_core.errors import ConfigError
from eblvm_core.plugins import load
from eblvm_core.recipe import _component, apply_override, read, validate


def is_spec(raw: dict[str, Any]) -> bool:
    """Whether a parsed TOML file is a comparison spec ([compare] or [[method]]) rather than a recipe."""
    return "compare" in raw or "method" in raw


@attrs.frozen
class CompareConfig:
    """The [compare] section of a spec."""

    name: str = option("compare", "name of the comparison; results go to results/<name> unless --out is given")
    seeds: int = option(3, "seeds per method (seed_offset, seed_offset + 1, ...); --seeds overrides", positive)
    seed_offset: int = option(0, "first seed", non_negative)
    metrics: list[str] = option(
        ["eval/exact-loglik/test_loglik"], "final eval scalars to tabulate (mean ± std over seeds)"
    )
    curve: str = option("", "scalar of metrics.jsonl drawn as learning curves ('' for none)")
    curve_range: list[float] | None = option(
        None,
        "[low, high] the curve plot's value axis may be narrowed to (values beyond are drawn as triangles on its "
        "edge); the later half of every curve stays in view; None fits all",
    )
    image: str = option(
        "",
        "evaluator whose first image shows each method (first seed, tabulated checkpoint), 'samples' for model samples, '' for none",
    )
    n_samples: int = option(1000, "samples drawn when image = 'samples'", positive)
    checkpoint: Literal["last", "best"] = option(
        "last", "tabulate the final evaluation, or re-evaluate checkpoints/best.pt"
    )
    eval_mode: Literal["append", "replace"] = option(
        "append", "the spec's [[eval]] tables extend or replace each recipe's [[eval]] list"
    )
    overrides: list[str] = option([], "overrides applied to every method's recipe")
    table_steps: list[int] = option(
        [], "steps at which the table also gives the curve metric (mean ± std over seeds, from metrics.jsonl)"
    )


@attrs.frozen
class MethodConfig:
    """One [[method]] of a spec: a recipe plus overrides."""

    name: str = option(help="label in the table and figure")
    recipe: str = option(help="recipe file, relative to the spec file or else to the working directory")
    overrides: list[str] = option([], "section.key=value overrides of this method")


@attrs.frozen
class Spec:
    """A validated spec: each method's recipe, merged with the spec's [[eval]] tables and
    overrides, as TOML-ready data (``recipes``), the file it came from (``recipe_paths``);
    ``final_evals`` as raw tables."""

    path: Path
    compare: CompareConfig
    methods: list[MethodConfig]
    recipes: dict[str, dict[str, Any]]
    recipe_paths: dict[str, Path]
    final_evals: list[dict[str, Any]]


def slug(name: str) -> str:
    """A file-name-safe version of a method label."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "method"


def _tables(raw: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = raw.get(key, [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ConfigError(key, None, f"must be an array of tables: write [[{key}]]")
    return items


def load_spec(path: str | Path, extra_overrides: list[str] = ()) -> Spec:
    """Read and validate a spec: its own keys, every method's recipe merged with the spec's
    [[eval]] tables and overrides (spec, then method, then ``extra_overrides``), and the
    [[final_eval]] tables, so a typo fails before anything runs. Errors name the file."""
    path = Path(path)
    raw = read(path)
    try:
        unknown = [k for k in raw if k not in ("compare", "method", "eval", "final_eval")]
        if unknown:
            raise ConfigError(
                unknown[0], None, "unknown section; a spec has [compare], [[method]], [[eval]] and [[final_eval]]"
            )
        compare = structure(CompareConfig, raw.get("compare", {}), "compare")
        if compare.table_steps and not compare.curve:
            raise ConfigError("compare", "table_steps", "needs a curve metric: set curve")
        if any(step < 1 for step in compare.table_steps):
            raise ConfigError("compare", "table_steps", f"steps must be positive, got {compare.table_steps}")
        if compare.curve_range is not None and not (
            len(compare.curve_range) == 2 and compare.curve_range[0] < compare.curve_range[1]
        ):
            raise ConfigError(
                "compare", "curve_range", f"must be [low, high] with low < high, got {compare.curve_range}"
            )
        methods = [structure(MethodConfig, body, f"method.{i}") for i, body in enumerate(_tables(raw, "method"))]
        if not methods:
            raise ConfigError("method", None, "a spec needs at least one [[method]]")
        names = [slug(m.name) for m in methods]
        if len(set(names)) != len(names):
            raise ConfigError("method", "name", f"method names must differ as file names: {names}")
        evals, final_evals = _tables(raw, "eval"), _tables(raw, "final_eval")
        for i, body in enumerate(final_evals):
            _component(f"final_eval.{i}", body, "evaluators", load())
    except ConfigError as exc:
        exc.file = exc.file or str(path)
        raise
    recipes, recipe_paths = {}, {}
    for i, method in enumerate(methods):
        recipe_path = resolve_recipe(path, method.recipe, f"method.{i}")
        merged = read(recipe_path)
        merged["eval"] = [*(merged.get("eval", []) if compare.eval_mode == "append" else []), *evals]
        try:
            for override in [*compare.overrides, *method.overrides, *extra_overrides]:
                apply_override(merged, override)
        except ConfigError as exc:
            exc.file = str(recipe_path)
            raise
        validate(merged, str(recipe_path))
        recipes[method.name], recipe_paths[method.name] = merged, recipe_path
    return Spec(path, compare, methods, recipes, recipe_paths, final_evals)


def resolve_recipe(spec_path: Path, recipe: str, section: str) -> Path:
    """A method's recipe file: relative to the spec file, else to the working directory (a spec
    copied elsewhere still finds recipes named from the project's root); absolute paths as they
    are. A ConfigError naming every place looked at when none holds it."""
    places = [Path(recipe)] if Path(recipe).is_absolute() else [spec_path.parent / recipe, Path.cwd() / recipe]
    for place in places:
        if place.is_file():
            return place.resolve()
    where = " nor ".join(str(p) for p in dict.fromkeys(places))
    raise ConfigError(
        section,
        "recipe",
        f"no recipe file {recipe!r}: neither {where}" if len(places) > 1 else f"no recipe file {where}",
        file=str(spec_path),
    )
