"""Search specs (``eblvm search SPEC.toml``): a recipe, the keys to search and their ranges, the
metric to optimise, and how (Optuna's sampler and pruner). ``is_search_spec`` tells one from a
recipe or a comparison spec; ``load_search_spec`` validates it, and the recipe at every end of
every range, before anything runs; ``read_search`` is what ``eblvm validate`` reads one with.
Optuna is not needed to read one (``check_optuna_options`` checks the sampler's and pruner's
options where it is installed).

A spec::

    [search]
    name = "bissm"                        # the study's name; results go to results/<name> (default: the file's stem)
    recipe = "../grbm_bissm.toml"         # relative to the spec file, else to the working directory
    metric = "eval/exact-loglik/test_loglik"
    direction = "maximize"                # or "minimize"
    n_trials = 40                         # the study's size: trials that completed, were pruned or diverged
    sampler = "tpe"                       # tpe, random, qmc, gp, cmaes
    seed = 0                              # the sampler's (each worker draws its own stream from it)
    pruner = "median"                     # median, percentile, successive-halving, hyperband, threshold, none
    pruner_options = { n_startup_trials = 5, n_warmup_steps = 2000 }
    overrides = ["run.steps=10000", "run.eval_every=1000"]   # every trial's recipe
    storage = ""                          # an SQLAlchemy URL; "" for sqlite:///<results>/study.db

    [params]                              # dotted recipe keys, quoted or not
    "optim.model.lr" = { low = 1e-4, high = 1e-2, log = true }    # float (log scale)
    "estimator.inner_lr" = { low = 0.1, high = 2.0 }              # float (linear)
    "estimator.inner_steps" = { low = 1, high = 20 }              # int (both ends ints); step = 2 for every other
    "posterior.temperature" = [0.05, 0.1, 0.2]                    # a choice (or { choices = [...] })

    [launcher]                            # optional: the workers' Slurm resources (--launcher slurm)
    time = "4:00:00"
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from eblvm.plugin import ConfigError, option, positive, structure
from eblvm.tools import apply_override, did_you_mean, read_recipe_file, recipe_file, set_value, validate_with
from eblvm_experiments.launcher import SlurmConfig, slurm_config
from eblvm_experiments.spec import resolve_recipe

SAMPLERS = {
    "tpe": "TPESampler",
    "random": "RandomSampler",
    "qmc": "QMCSampler",
    "gp": "GPSampler",
    "cmaes": "CmaEsSampler",
}
PRUNERS = {
    "median": "MedianPruner",
    "percentile": "PercentilePruner",
    "successive-halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
    "threshold": "ThresholdPruner",
    "none": "NopPruner",
}
NOT_SEARCHED = {"run.seed": "a search compares settings on the recipe's seed", "run.name": "each trial names its run"}
PARAM_EXAMPLE = "{ low = 1e-4, high = 1e-2, log = true }, { low = 1, high = 20 } or [5, 10, 20]"
PARAM_KEYS = ("low", "high", "log", "step", "type", "choices")


def is_search_spec(raw: dict[str, Any]) -> bool:
    """Whether a parsed TOML file is a search spec ([search])."""
    return "search" in raw


@attrs.frozen
class SearchConfig:
    """The [search] section of a spec."""

    recipe: str = option(help="recipe file, relative to the spec file or else to the working directory")
    metric: str = option(
        help="final evaluation scalar to optimise; evaluations during training report it to the pruner"
    )
    direction: Literal["maximize", "minimize"] = option(help="whether a larger or a smaller metric is better")
    name: str | None = option(None, "the study's name; results go to results/<name> (default: the spec file's stem)")
    n_trials: int = option(20, "the study's size: trials that completed, were pruned or diverged", positive)
    sampler: Literal["tpe", "random", "qmc", "gp", "cmaes"] = option("tpe", "Optuna's sampler")
    sampler_options: dict[str, Any] = option({}, "the sampler's keyword arguments, e.g. { n_startup_trials = 5 }")
    seed: int | None = option(
        None,
        "the sampler's seed: each worker (and each later command) draws its own stream from it; several "
        "commands started at once on one study need seeds of their own; None: unseeded",
    )
    pruner: Literal["median", "percentile", "successive-halving", "hyperband", "threshold", "none"] = option(
        "median", "Optuna's pruner, fed each evaluation during training ([run] eval_every)"
    )
    pruner_options: dict[str, Any] = option({}, "the pruner's keyword arguments, e.g. { n_warmup_steps = 2000 }")
    overrides: list[str] = option([], "overrides applied to every trial's recipe (before the searched values)")
    storage: str = option("", "the study's storage, an SQLAlchemy URL; '' for sqlite:///<results>/study.db")


@attrs.frozen
class Param:
    """One searched key: a float range (``log`` scale or linear, ``step`` optional), an int range,
    or a choice among values."""

    key: str
    kind: Literal["float", "int", "choice"]
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def ends(self) -> list[Any]:
        """The values a trial may take at the range's ends (every choice)."""
        return list(self.choices) if self.kind == "choice" else [self.low, self.high]

    def describe(self) -> dict[str, Any]:
        """TOML/JSON-ready, for the study's record of its search space."""
        if self.kind == "choice":
            return {"choices": list(self.choices)}
        out: dict[str, Any] = {"type": self.kind, "low": self.low, "high": self.high, "log": self.log}
        if self.step is not None:
            out["step"] = self.step
        return out

    def suggest(self, trial: Any) -> Any:
        """This parameter's value for an Optuna trial."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)


@attrs.frozen
class SearchSpec:
    """A validated search spec: its [search] settings, the searched keys, the recipe every trial
    starts from (TOML-ready data: the recipe file with the spec's and the command line's
    overrides), where that file is, and the [launcher] resources."""

    path: Path
    search: SearchConfig
    name: str
    params: tuple[Param, ...]
    recipe: dict[str, Any]
    recipe_path: Path
    launcher: SlurmConfig

    def trial_recipe(self, values: dict[str, Any], run_name: str) -> dict[str, Any]:
        """The recipe of a trial with ``values`` (by key), named ``run_name``."""
        raw = copy.deepcopy(self.recipe)
        for key, value in values.items():
            set_value(raw, key, value, f"[params] key '{key}'")
        set_value(raw, "run.name", run_name)
        return raw

    def fingerprint(self) -> dict[str, Any]:
        """What makes a study this spec's: its recipe, metric, direction and search space."""
        return json.loads(
            json.dumps(
                {
                    "recipe": self.recipe,
                    "metric": self.search.metric,
                    "direction": self.search.direction,
                    "params": {p.key: p.describe() for p in self.params},
                },
                sort_keys=True,
                default=str,
            )
        )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def param(key: str, body: Any) -> Param:
    """One [params] entry: ``{ low, high[, log][, step][, type] }``, ``{ choices = [...] }`` or a
    list (a choice)."""
    if isinstance(body, list):
        body = {"choices": body}
    if not isinstance(body, dict):
        raise ConfigError("params", key, f"must be a range or a list of choices, e.g. {PARAM_EXAMPLE}; got {body!r}")
    unknown = [k for k in body if k not in PARAM_KEYS]
    if unknown:
        raise ConfigError("params", key, f"unknown key '{unknown[0]}'; a searched key holds {', '.join(PARAM_KEYS)}")
    if "choices" in body:
        others = [k for k in body if k != "choices"]
        if others:
            raise ConfigError("params", key, f"choices take no '{others[0]}'")
        choices = body["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError("params", key, f"choices must be a non-empty list, got {choices!r}")
        if not all(isinstance(c, (bool, int, float, str)) for c in choices):
            raise ConfigError("params", key, f"choices must be numbers, strings or booleans, got {choices!r}")
        shown = [json.dumps(c) for c in choices]
        if len(set(shown)) != len(shown):
            raise ConfigError("params", key, f"choices must differ, got {choices!r}")
        return Param(key, "choice", choices=tuple(choices))
    if "low" not in body or "high" not in body:
        missing = "low" if "low" not in body else "high"
        raise ConfigError("params", key, f"a range needs low and high (no {missing}), e.g. {PARAM_EXAMPLE}")
    low, high, log, step = body["low"], body["high"], body.get("log", False), body.get("step")
    if not (_number(low) and _number(high)) or not all(map(math.isfinite, (low, high))):
        raise ConfigError("params", key, f"low and high must be finite numbers, got {low!r} and {high!r}")
    if not isinstance(log, bool):
        raise ConfigError("params", key, f"log must be true or false, got {log!r}")
    kind = body.get("type", "int" if isinstance(low, int) and isinstance(high, int) else "float")
    if kind not in ("int", "float"):
        raise ConfigError("params", key, f"type must be 'int' or 'float' (a choice lists its choices), got {kind!r}")
    if kind == "int" and not (isinstance(low, int) and isinstance(high, int)):
        raise ConfigError("params", key, f"an int range needs int ends, got {low!r} and {high!r}")
    if not low < high:
        raise ConfigError("params", key, f"low must be below high, got {low!r} and {high!r}")
    if log and low <= 0:
        raise ConfigError("params", key, f"a log range must stay above 0, got low = {low!r}")
    if step is not None:
        if not _number(step) or not step > 0 or (kind == "int" and not isinstance(step, int)):
            raise ConfigError("params", key, f"step must be a positive {kind}, got {step!r}")
        if log:
            raise ConfigError("params", key, "a log range takes no step")
    if kind == "float":
        low, high = float(low), float(high)
        step = float(step) if step is not None else None
    return Param(key, kind, low, high, log, step)


def params(body: Any) -> tuple[Param, ...]:
    """The [params] table's entries in the order written; keys are dotted recipe keys, quoted
    (``"optim.model.lr" = {...}``) or as nested tables."""
    if not isinstance(body, dict) or not body:
        raise ConfigError("params", None, f'list the recipe keys to search, e.g. "optim.model.lr" = {PARAM_EXAMPLE}')
    found: list[Param] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict) and value and not set(value) & set(PARAM_KEYS):
                walk(value, f"{key}.")  # written unquoted: optim.model.lr = {...}
                continue
            if "." not in key:
                raise ConfigError(
                    "params", key, f'must name a recipe key as section.key, e.g. "optim.model.lr" = {PARAM_EXAMPLE}'
                )
            if key in NOT_SEARCHED:
                raise ConfigError("params", key, f"cannot be searched: {NOT_SEARCHED[key]}")
            found.append(param(key, value))

    walk(body, "")
    return tuple(found)


SECTIONS = ("search", "params", "launcher")


def load_search_spec(path: str | Path, extra_overrides: Sequence[str] = ()) -> SearchSpec:
    """Read and validate a search spec: its keys, the recipe with the spec's overrides then
    ``extra_overrides`` (which may not set a searched key), and that recipe with each searched key
    at each end of its range (every choice), so a typo or a value the recipe refuses fails before
    a trial runs. Errors name the file."""
    path = recipe_file(path)
    raw = read_recipe_file(path)
    try:
        unknown = [k for k in raw if k not in SECTIONS]
        if unknown:
            raise ConfigError(unknown[0], None, "unknown section; a search spec has [search], [params] and [launcher]")
        search = structure(SearchConfig, raw.get("search", {}), "search")
        searched = params(raw.get("params"))
        launcher = slurm_config(raw.get("launcher", {}))
        keys = [p.key for p in searched]
        for override in extra_overrides:
            key = override.strip().lstrip("~").partition("=")[0].strip()
            if key in keys:
                raise ConfigError("params", key, f"-o {override}: the search sets this key in every trial")
    except ConfigError as exc:
        exc.file = exc.file or str(path)
        raise
    recipe_path = resolve_recipe(path, search.recipe, "search")
    merged = read_recipe_file(recipe_path)
    try:
        for override in [*search.overrides, *extra_overrides]:
            apply_override(merged, override)
        base = validate_with(merged, str(recipe_path))
    except ConfigError as exc:
        exc.file = str(recipe_path)
        raise
    name = search.name or path.stem
    spec = SearchSpec(path, search, name, searched, merged, recipe_path, launcher)
    _check_metric(spec, base)
    for p in searched:
        for value in p.ends():
            try:
                validate_with(spec.trial_recipe({p.key: value}, "trial"), str(recipe_path))
            except ConfigError as exc:
                exc.file = str(recipe_path)
                exc.message = f"{exc.message} (searched value {p.key} = {value!r} of {path})"
                raise
    return spec


def _check_metric(spec: SearchSpec, recipe: Any) -> None:
    """The metric is reported by the recipe's evaluators (where they declare their keys), and a
    pruner has evaluations during training to go by; ``recipe`` is the spec's ``Recipe``."""
    search = spec.search
    keys = recipe.reported_keys()  # None: an evaluator does not declare its keys, checked when a trial ends
    if keys is not None and search.metric not in keys:
        raise ConfigError(
            "search",
            "metric",
            f"no evaluator of the recipe reports '{search.metric}'{did_you_mean(search.metric, sorted(keys))}; "
            f"reported: {', '.join(sorted(keys)) or 'nothing'}",
            file=str(spec.path),
        )
    if search.pruner != "none" and not recipe.run.eval_every:
        raise ConfigError(
            "search",
            "pruner",
            f"'{search.pruner}' goes by evaluations during training: set [run] eval_every (in the recipe or "
            "[search] overrides), or pruner = 'none'",
            file=str(spec.path),
        )


def check_optuna_options(spec: SearchSpec) -> None:
    """The sampler's and pruner's options against Optuna's own classes (where Optuna is
    installed): a ConfigError naming the option Optuna would refuse."""
    import inspect

    try:
        import optuna
    except ImportError:
        return
    search = spec.search
    checks = [
        ("sampler", "sampler_options", getattr(optuna.samplers, SAMPLERS[search.sampler]), search.sampler_options),
        ("pruner", "pruner_options", getattr(optuna.pruners, PRUNERS[search.pruner]), search.pruner_options),
    ]
    for what, key, cls, options in checks:
        if what == "sampler" and "seed" in options:
            raise ConfigError("search", f"{key}.seed", "set the sampler's seed as [search] seed", file=str(spec.path))
        try:
            inspect.signature(cls).bind(**options)
        except TypeError as exc:
            takes = ", ".join(p for p in inspect.signature(cls).parameters if p not in ("self", "seed"))
            raise ConfigError(
                "search", key, f"{exc} for Optuna's {cls.__name__} (it takes: {takes})", file=str(spec.path)
            ) from None
    if search.sampler == "cmaes":
        try:
            import cmaes  # noqa: F401
        except ImportError:
            raise ConfigError(
                "search", "sampler", "'cmaes' needs the cmaes package: pip install cmaes", file=str(spec.path)
            ) from None


def search_recipes(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """What ``eblvm validate`` builds of a search spec: a trial's ``Recipe`` with every searched
    key at the low end of its range (its first choice); every end was validated already."""
    spec = load_search_spec(path, overrides)
    check_optuna_options(spec)
    low = {p.key: p.ends()[0] for p in spec.params}
    label = f"{spec.name}: a trial's recipe, " + ", ".join(f"{k} = {v!r}" for k, v in low.items())
    return {label: validate_with(spec.trial_recipe(low, f"{spec.name}-trial"), str(spec.recipe_path))}


def read_search(path: Path, overrides: list[str]) -> dict[str, Any] | None:
    """Search specs ([search] and [params]): a trial's recipe, after the recipe at every end of
    every searched range was checked."""
    return search_recipes(path, overrides) if is_search_spec(read_recipe_file(path)) else None
