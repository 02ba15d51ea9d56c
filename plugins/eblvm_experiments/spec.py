"""Comparison specs (``eblvm compare SPEC.toml``): methods, each a recipe with overrides, run
over seeds and tabulated. ``is_spec`` tells a spec from a recipe; ``load_spec`` validates a spec
and every method's merged recipe before anything runs; ``read_compare`` is what ``eblvm
validate`` reads a spec with.

A spec::

    [compare]
    name = "checkerboard"                          # results go to results/<name> by default
    seeds = 3
    metrics = ["eval/exact-loglik/test_loglik"]    # table columns
    curve = "eval/exact-loglik/test_loglik"        # learning-curve metric ("" for none)
    image = "density-plot"                         # evaluator whose first image is shown, "samples", or "";
                                                   # absent: the recipes' first density-plot or sample-grid
    checkpoint = "last"                            # or "best" (the recipes' [run] select_metric)
    table_steps = [10000, 100000]                  # also tabulate the curve metric at these steps
    overrides = ["run.eval_every=1000"]            # applied to every method

    [[method]]
    name = "DSM"
    recipe = "../grbm_dsm.toml"                    # relative to the spec file (an absolute path as it is)
    overrides = []

    [[eval]]          # optional: added to (or, with eval_mode = "replace", instead of) each recipe's [[eval]]
    kind = "score-loss"
    split = "val"

    [[final_eval]]    # optional: run once on the tabulated checkpoint (else: the run's final evaluation)
    kind = "ais-loglik"

    [sweep]           # optional: a grid over recipe keys; each [[method]] gives one row per grid point
    "optim.model.lr" = [1e-3, 3e-3]                               # row label: the key's last part, "lr"
    "estimator.inner_steps" = { values = [5, 10], label = "K" }   # or a label of its own

    [launcher]        # optional: each job's resources with --launcher slurm (launcher.SlurmConfig)
    partition = "gpu"
    time = "12:00:00"
    gpus = 1

With the [sweep] above a method "BiSSM" gives the rows "BiSSM lr=0.001 K=5", "BiSSM lr=0.001
K=10", "BiSSM lr=0.003 K=5" and "BiSSM lr=0.003 K=10" (the first key varies slowest), each run
over the seeds; a point's values apply after the spec's and the method's overrides (before
``eblvm compare -o``). A method's own ``sweep = {...}`` replaces the spec's grid for it (``sweep =
{}``: no grid, one row named as the method). Method recipes may ``include`` others
(``eblvm.tools.read_recipe_file``).

Every path in a spec (a method's ``recipe``, an ``include``) is relative to the spec file, so a
spec works from any folder; docs/compare.md is the reference of every key with its default.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from eblvm.plugin import ConfigError, non_negative, option, positive, structure
from eblvm.tools import apply_override, did_you_mean, read_recipe_file, recipe_file, set_value, validate_with
from eblvm_experiments.launcher import SlurmConfig, slurm_config


def is_spec(raw: dict[str, Any]) -> bool:
    """Whether a parsed TOML file is a comparison spec ([compare] or [[method]]) rather than a
    recipe; a file with [search] is a search spec, whatever else it holds."""
    return ("compare" in raw or "method" in raw) and "search" not in raw


@attrs.frozen
class CompareConfig:
    """The [compare] section of a spec."""

    name: str = option("compare", "name of the comparison; results go to results/<name> unless --out is given")
    seeds: int = option(3, "seeds per method (seed_offset, seed_offset + 1, ...); --seeds overrides", positive)
    seed_offset: int = option(0, "first seed", non_negative)
    metrics: list[str] = option(
        ["eval/exact-loglik/test_loglik"],
        "final eval scalars to tabulate (mean ± std over seeds), each reported by an evaluator of the methods' "
        "recipes (of the [[final_eval]] tables when given)",
    )
    curve: str = option("", "scalar of metrics.jsonl drawn as learning curves ('' for none)")
    curve_range: list[float] | None = option(
        None,
        "[low, high] the curve plot's value axis may be narrowed to (values beyond are drawn as triangles on its "
        "edge); the later half of every curve stays in view; None fits all",
    )
    image: str | None = option(
        None,
        "evaluator whose first image shows each method (first seed, tabulated checkpoint), 'samples' for model "
        "samples, '' for none; absent: the first density-plot or sample-grid evaluator of the methods' recipes",
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
    recipe: str = option(help="recipe file, relative to the spec file (an absolute path as it is)")
    overrides: list[str] = option([], "section.key=value overrides of this method")
    sweep: dict[str, Any] | None = option(
        None, "this method's own grid, written as [sweep], instead of the spec's; {} for no grid"
    )


@attrs.frozen
class Axis:
    """One key of a grid: the dotted recipe key, its label in row names, and its values."""

    key: str
    label: str
    values: list[Any]


@attrs.frozen
class Row:
    """One row of the table (and of the figure): a [[method]] without a grid, named as it, or
    one grid point of a method, named "<method> <label>=<value> ..."; ``point`` maps each grid
    key to its value (empty without a grid)."""

    name: str
    method: str
    recipe: str
    overrides: list[str]
    point: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Spec:
    """A validated spec: its rows (``methods``: one per [[method]], or per grid point of a method
    that sweeps), each row's recipe merged with the spec's [[eval]] tables, overrides and grid
    values as TOML-ready data (``recipes``, by row name), the file it came from
    (``recipe_paths``); ``final_evals`` as raw tables."""

    path: Path
    compare: CompareConfig
    methods: list[Row]
    recipes: dict[str, dict[str, Any]]
    recipe_paths: dict[str, Path]
    final_evals: list[dict[str, Any]]
    launcher: SlurmConfig = attrs.field(factory=SlurmConfig)

    @property
    def sweeps(self) -> bool:
        """Whether some method has a grid."""
        return any(row.point for row in self.methods)


def slug(name: str) -> str:
    """A file-name-safe version of a method label."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "method"


def _tables(raw: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = raw.get(key, [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ConfigError(key, None, f"must be an array of tables: write [[{key}]]")
    return items


SECTIONS = ("compare", "method", "eval", "final_eval", "sweep", "launcher")
IMAGE_EVALUATORS = ("density-plot", "sample-grid")  # what [compare] image defaults to, the first a recipe runs


def default_image(recipes: list[dict[str, Any]]) -> str:
    """The evaluator a comparison shows each method by when [compare] image is absent: the first
    density-plot or sample-grid evaluator of the rows' recipes (their [[eval]] as merged with the
    spec's), in row order; "" (no images) when none has one."""
    for recipe in recipes:
        for table in recipe.get("eval", []):
            if isinstance(table, dict) and table.get("kind") in IMAGE_EVALUATORS:
                return table["kind"]
    return ""


NOT_SWEPT = {"run.seed": "seeds come from [compare] seeds and seed_offset", "run.name": "each row names its runs"}
SWEEP_EXAMPLE = '"optim.model.lr" = [1e-3, 3e-3] or "estimator.inner_steps" = { values = [5, 10], label = "K" }'


def grid(body: Any, section: str) -> list[Axis]:
    """The axes of a [sweep] table (or a method's ``sweep``), in the order written. Keys are dotted
    recipe keys, quoted or not; each holds a list of values or ``{ values = [...], label = "K" }``."""
    if not isinstance(body, dict):
        raise ConfigError(section, None, f"must be a table of recipe keys and their values, e.g. {SWEEP_EXAMPLE}")
    axes: list[Axis] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            label = key.rpartition(".")[2]
            if isinstance(value, dict) and "values" in value:
                unknown = [k for k in value if k not in ("values", "label")]
                if unknown:
                    raise ConfigError(section, key, f"unknown key '{unknown[0]}'; a grid key holds values and label")
                label, value = value.get("label", label), value["values"]
                if not isinstance(label, str) or not label.strip():
                    raise ConfigError(section, key, f"label must be a non-empty string, got {label!r}")
            elif isinstance(value, dict) and value:  # written unquoted: optim.model.lr = [...]
                walk(value, f"{key}.")
                continue
            if "." not in key:
                raise ConfigError(section, key, f"must name a recipe key as section.key, e.g. {SWEEP_EXAMPLE}")
            if key in NOT_SWEPT:
                raise ConfigError(section, key, f"cannot be swept: {NOT_SWEPT[key]}")
            if not isinstance(value, list) or not value:
                raise ConfigError(
                    section, key, f"must be a non-empty list of values, e.g. {SWEEP_EXAMPLE}; got {value!r}"
                )
            shown = [show(v) for v in value]
            if len(set(shown)) != len(shown):
                raise ConfigError(section, key, f"values must differ, got {value!r}")
            same = next((a for a in axes if a.label == label), None)
            if same is not None:
                raise ConfigError(
                    section,
                    key,
                    f"its label '{label}' is also {same.key}'s: give each a label, e.g. "
                    f'{{ values = [...], label = "{key.replace(".", " ")}" }}',
                )
            if any(a.key == key for a in axes):
                raise ConfigError(section, key, "given twice")
            axes.append(Axis(key, label, value))

    walk(body, "")
    return axes


def show(value: Any) -> str:
    """A grid value as it appears in a row name: 0.001, 5, true, adam, [64, 64]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value, separators=(", ", " = "), default=str)


def rows(spec_sweep: list[Axis], methods: list[MethodConfig]) -> list[Row]:
    """The table's rows: one per method without a grid, one per grid point otherwise."""
    found = []
    for i, method in enumerate(methods):
        axes = spec_sweep if method.sweep is None else grid(method.sweep, f"method.{i}.sweep")
        if not axes:
            found.append(Row(method.name, method.name, method.recipe, method.overrides))
            continue
        for values in itertools.product(*(axis.values for axis in axes)):
            name = " ".join([method.name, *(f"{a.label}={show(v)}" for a, v in zip(axes, values))])
            point = {a.key: v for a, v in zip(axes, values)}
            found.append(Row(name, method.name, method.recipe, method.overrides, point))
    return found


def load_spec(path: str | Path, extra_overrides: Sequence[str] = ()) -> Spec:
    """Read and validate a spec: its own keys, every row's recipe (a method's, or one grid point
    of it) merged with the spec's [[eval]] tables and overrides (spec, method, grid point, then
    ``extra_overrides``), the [[final_eval]] tables, and that an evaluator reports each of the
    [compare] metrics, so a typo fails before anything runs. Errors name the file (and the grid
    point)."""
    path = recipe_file(path)
    raw = read_recipe_file(path)
    try:
        unknown = [k for k in raw if k not in SECTIONS]
        if unknown:
            raise ConfigError(
                unknown[0],
                None,
                "unknown section; a spec has [compare], [[method]], [[eval]], [[final_eval]], [sweep] and [launcher]",
            )
        compare = structure(CompareConfig, raw.get("compare", {}), "compare")
        launcher = slurm_config(raw.get("launcher", {}))
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
        table = rows(grid(raw.get("sweep", {}), "sweep"), methods)
        names = [slug(r.name) for r in table]
        if len(set(names)) != len(names):
            twice = next(r.name for r in table if names.count(slug(r.name)) > 1)
            raise ConfigError("sweep", None, f"two rows would share the file name of '{twice}': {names}")
        evals, final_evals = _tables(raw, "eval"), _tables(raw, "final_eval")
    except ConfigError as exc:
        exc.file = exc.file or str(path)
        raise
    recipes, recipe_paths, where, resolved = {}, {}, {}, []
    for row in table:
        if row.method not in where:
            index = next(i for i, m in enumerate(methods) if m.name == row.method)
            where[row.method] = resolve_recipe(path, row.recipe, f"method.{index}")
        recipe_path = where[row.method]
        merged = read_recipe_file(recipe_path)
        merged["eval"] = [*(merged.get("eval", []) if compare.eval_mode == "append" else []), *evals]
        try:
            try:
                for override in [*compare.overrides, *row.overrides]:
                    apply_override(merged, override)
                for key, value in row.point.items():
                    set_value(merged, key, value, f"[sweep] key '{key}'")
            except ConfigError as exc:
                for error in exc.errors:
                    error.file = str(recipe_path)
                raise
            resolved.append(validate_with(merged, str(recipe_path), extra_overrides))  # -o: its errors name it
        except ConfigError as exc:
            for error in exc.errors:
                if row.point:
                    error.message = f"{error.message} (grid point '{row.name}' of {path})"
            raise
        recipes[row.name], recipe_paths[row.name] = merged, recipe_path
    final = check_final_evals(final_evals, recipes[table[0].name], path)
    check_metrics(compare.metrics, [final] if final is not None else resolved, final is not None, path)
    if compare.image is None:
        compare = attrs.evolve(compare, image=default_image(list(recipes.values())))
    return Spec(path, compare, table, recipes, recipe_paths, final_evals, launcher)


def check_final_evals(tables: list[dict[str, Any]], recipe: dict[str, Any], spec_path: Path) -> Any:
    """The [[final_eval]] tables checked as what they run as: the [[eval]] of a row's recipe
    (``recipe``, valid, TOML-ready), in place of its own; returns that ``Recipe`` (None without
    tables). A ConfigError names [final_eval.N] of the spec."""
    if not tables:
        return None
    try:
        return validate_with({**recipe, "eval": [dict(table) for table in tables]}, str(spec_path))
    except ConfigError as exc:
        for error in exc.errors:
            error.section = "final_" + error.section
            error.file = str(spec_path)
        raise


def check_metrics(metrics: list[str], tabulated: list[Any], final: bool, spec_path: Path) -> None:
    """Every [compare] metric is reported by an evaluator of what the table reads (``tabulated``:
    the ``Recipe`` of the [[final_eval]] tables when ``final``, else every row's), as a search
    spec's metric is: one ConfigError line per metric none reports, with the nearest reported key.
    Where an evaluator does not declare its keys, nothing is refused (the table says n/a)."""
    keys: set[str] = set()
    for recipe in tabulated:
        reported = recipe.reported_keys()
        if reported is None:
            return
        keys |= reported
    who = "no [[final_eval]] evaluator" if final else "no evaluator of the methods' recipes"
    listed = ", ".join(sorted(keys)) or "nothing"
    errors = [
        ConfigError(
            "compare",
            "metrics",
            f"{who} reports '{metric}'{did_you_mean(metric, sorted(keys))}; reported: {listed}",
            file=str(spec_path),
        )
        for metric in metrics
        if metric not in keys
    ]
    if errors:
        raise ConfigError.combine(errors)


def select(spec: Spec, only: list[str]) -> set[str] | None:
    """The rows ``--only`` names: a row by its name, or every row of a [[method]] by the method's
    name; None (every row) when ``only`` is empty. A name that is neither is a ConfigError."""
    if not only:
        return None
    chosen: set[str] = set()
    for name in only:
        named = {row.name for row in spec.methods if name in (row.name, row.method)}
        if not named:
            if spec.sweeps:
                methods = ", ".join(dict.fromkeys(row.method for row in spec.methods))
                points = ", ".join(f"'{row.name}'" for row in spec.methods)
                message = (
                    f"--only {name!r} is neither a method nor a row of the spec (methods: {methods}; rows: {points})"
                )
            else:
                message = f"--only {name!r} is not a method of the spec ({', '.join(spec.recipes)})"
            raise ConfigError("method", "name", message, file=str(spec.path))
        chosen |= named
    return chosen


def resolve_recipe(spec_path: Path, recipe: str, section: str) -> Path:
    """A method's recipe file, relative to the spec file (an absolute path as it is): one rule, so
    a spec works from any folder. When it is not there, a ConfigError naming the spec, the
    [method.N] and the place looked at, with a hint when the path would name a file from the
    working directory (a spec written for the project's root). ``eblvm:NAME`` is a bundled recipe."""
    if recipe.startswith("eblvm:"):
        try:
            return recipe_file(recipe)
        except ConfigError as exc:
            raise ConfigError(section, "recipe", f"{recipe!r}: {exc.message}", file=str(spec_path)) from None
    place = Path(recipe) if Path(recipe).is_absolute() else spec_path.parent / recipe
    if place.is_file():
        return place.resolve()
    what = "is a directory, not a recipe file" if place.is_dir() else "no such file"
    message = f"no recipe file {recipe!r}: {place} {what}; a recipe is named relative to the spec file"
    try:
        here = Path.cwd() / recipe
    except OSError:  # the working directory is gone
        here = place
    if here != place and here.is_file():
        relative = os.path.relpath(here, spec_path.parent)
        named = relative if relative.count("..") <= 3 else str(here.resolve())
        message += f" ({here} exists relative to the working directory: write recipe = {named!r})"
    raise ConfigError(section, "recipe", message, file=str(spec_path))


def spec_recipes(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Every row's ``Recipe`` of a comparison spec (includes merged, overrides applied, defaults
    filled in), by row name: what ``eblvm validate`` builds and ``--show`` prints."""
    spec = load_spec(path, overrides)
    return {m.name: validate_with(spec.recipes[m.name], str(spec.recipe_paths[m.name])) for m in spec.methods}


def read_compare(path: Path, overrides: list[str]) -> dict[str, Any] | None:
    """Comparison specs ([compare] and [[method]]): every row's recipe, checked row by row, each
    grid point of a [sweep] its own."""
    return spec_recipes(path, overrides) if is_spec(read_recipe_file(path)) else None
