"""recipe/schema.py: what a validated recipe is: [run] (``RunConfig``: its options and the checks
between them), ``Recipe`` (``to_dict``, ``default_of``, ``blame``) and ``with_run``."""

from __future__ import annotations

import functools
import tomllib
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import attrs
import pytest
import tomli_w
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from eblvm_core.recipe import RunConfig, with_run
from eblvm_core.registry import option_default
from tests.support import ROOT, SMALL_RECIPE, strategies

# ---- [run] ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["run.patience=2"], "[run] patience: counts evaluations without improvement of select_metric"),
        (
            ['run.select_metric="eval/exact-loglik/test_loglik"', "run.patience=2"],
            "[run] patience: counts evaluations, but eval_every = 0",
        ),
        (["run.keep_every=0"], "[run] keep_every: must be > 0"),
    ],
)
def test_patience_and_keep_every_are_checked_before_a_run(cli, write_recipe, tmp_path, overrides, message):
    result = cli(["validate", write_recipe(), *[a for o in overrides for a in ("-o", o)]])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def small():
    from eblvm_core.recipe import validate

    return validate(tomllib.loads(SMALL_RECIPE), "r.toml")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "/abs"])
def test_a_run_name_is_one_folder_inside_out(name):
    with pytest.raises(ValueError, match="must be a plain folder name"):
        RunConfig(name=name)
    assert RunConfig(name="grbm-dsm_2").name == "grbm-dsm_2"


def test_to_dict_is_the_resolved_recipe_and_validates_to_itself():
    """Every default filled in (the seed as given), what a run writes as recipe.toml: validated
    again it gives the same recipe."""
    from eblvm_core.recipe import validate

    recipe = small()
    resolved = recipe.to_dict()
    assert resolved["run"]["seed"] == 7 and resolved["run"]["log_every"] == 10 and resolved["run"]["threads"] == 0
    assert resolved["optim"]["model"]["beta1"] == 0.9 and resolved["optim"]["model"]["schedule"] == {"kind": "constant"}
    assert [log["kind"] for log in resolved["log"]] == ["tensorboard"], "no [[log]]: the default logger, written out"
    again = validate(tomllib.loads(tomli_w.dumps(resolved)), "again.toml")
    assert again.to_dict() == resolved
    silent = attrs.evolve(recipe, logs=[])
    assert silent.to_dict()["log"] == [] and validate(silent.to_dict(), "x").logs == []


def test_default_of_finds_the_option_at_a_dotted_path():
    recipe = small()
    assert recipe.default_of("run.steps") == 1000 and recipe.default_of("run.seed") is None
    assert recipe.default_of("optim.model.lr") == 1e-3 and recipe.default_of("optim.model.beta1") == 0.9
    assert recipe.default_of("model.coupling") == "plain" and recipe.default_of("objective.sigma") == 0.1
    for nowhere in ("optim.model.kind", "optim.other.lr", "nope.x", "model.nope", "run"):
        assert recipe.default_of(nowhere) is attrs.NOTHING, nowhere


def test_with_run_changes_a_copy():
    recipe = small()
    changed = with_run(recipe, seed=8, steps=3)
    assert (changed.run.seed, changed.run.steps) == (8, 3) and (recipe.run.seed, recipe.run.steps) == (7, 30)
    assert changed.parts == recipe.parts and changed.path == recipe.path


def test_blame_names_the_recipes_file_where_no_override_caused_the_error():
    from eblvm_core.errors import ConfigError
    from eblvm_core.recipe import validate_with

    recipe = validate_with(tomllib.loads(SMALL_RECIPE), "r.toml", ["model.n_hidden=6"])
    assert recipe.overrides == ("model.n_hidden=6",)
    by_override, by_file = ConfigError("model", "n_hidden", "too many"), ConfigError("data", "n_train", "too few")
    recipe.blame(by_override)
    recipe.blame(by_file)
    assert str(by_override) == "-o model.n_hidden=6: [model] n_hidden: too many"
    assert str(by_file) == "r.toml: [data] n_train: too few"


# ---- properties (hypothesis) ---------------------------------------------------------------------

BUNDLED = sorted((ROOT / "recipes").glob("*.toml"))


@functools.cache
def bundled(path: Path) -> Any:
    from eblvm_core.recipe import load_recipe

    return load_recipe(path)


def option_values(tp: Any, default: Any = None) -> st.SearchStrategy[Any] | None:
    """Values of an option's annotation that TOML and ``coerce`` accept, of the default's sign
    (and in (0, 1) where the default is), which its validators mostly accept too; None for a type
    drawn from nothing here."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        inner = [option_values(a, default) for a in args if a is not type(None)]
        if any(s is None for s in inner):
            return None
        return st.one_of(*inner, *([st.none()] if type(None) in args else []))
    if origin is list:
        item = option_values(args[0], default[0] if default else None) if args else None
        return None if item is None else st.lists(item, min_size=1, max_size=3)
    if tp is float and isinstance(default, (int, float)) and 0 < default < 1:
        return st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True)
    if tp is float and isinstance(default, (int, float)) and default > 0:
        return st.floats(min_value=0.0, exclude_min=True, allow_infinity=False)
    if tp is int and isinstance(default, int) and default > 0:
        return st.integers(min_value=1, max_value=2**63 - 1)
    return {
        bool: st.booleans(),
        int: st.integers(min_value=0, max_value=2**63 - 1),
        float: st.floats(allow_nan=False, allow_infinity=False),
        str: strategies.texts,
    }.get(tp)


def sections(raw: dict[str, Any], recipe: Any) -> list[tuple[dict[str, Any], Any]]:
    """(table of ``raw``, its attrs config) for every section of a recipe's ``to_dict()``."""
    found = [(raw["run"], recipe.run)] + [(raw[label], s.config) for label, s in recipe.parts.items()]
    for name, role in recipe.optim.items():
        found += [(raw["optim"][name], role.optimizer.config), (raw["optim"][name]["schedule"], role.schedule.config)]
    found += [(raw["eval"][i], s.config) for i, s in enumerate(recipe.evals)]
    return found + [(raw["log"][i], s.config) for i, s in enumerate(recipe.logs)]


@st.composite
def valid_recipes(draw: st.DrawFn) -> Any:
    """A bundled recipe with up to four of its options (in any section, unset ones included) set to
    values of their type, [optim.*] ema too; only those the recipe's checks accept."""
    from eblvm_core.errors import ConfigError
    from eblvm_core.recipe import validate

    recipe = bundled(draw(st.sampled_from(BUNDLED)))
    raw = recipe.to_dict()
    slots = []
    for table, config in sections(raw, recipe):
        attrs.resolve_types(type(config))
        slots += [(table, f.name, option_values(f.type, option_default(f))) for f in attrs.fields(type(config))]
    slots += [
        (table, "ema", st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True))
        for table in raw.get("optim", {}).values()
    ]
    chosen = draw(st.lists(st.sampled_from([s for s in slots if s[2] is not None]), max_size=4, unique_by=id))
    for table, key, values in chosen:
        value = draw(values)
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
    try:
        return validate(raw, "<drawn>")
    except ConfigError:
        reject()


@pytest.mark.property
@settings(max_examples=40, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(recipe=valid_recipes())
def test_any_valid_recipe_written_to_toml_and_read_back_is_the_same_recipe(recipe):
    """What a run writes as recipe.toml (``write_recipe``) and a resume, ``eval`` or ``load`` reads
    back (``load_recipe``) is the recipe it was, for any values of its options: strings with any
    character TOML must escape, 64-bit integers, floats to the last bit, booleans, lists, options
    left unset."""
    import tempfile

    from eblvm_core.recipe import load_recipe
    from eblvm_core.rundir import RECIPE, write_recipe

    with tempfile.TemporaryDirectory() as tmp:
        write_recipe(recipe, Path(tmp))
        back = load_recipe(Path(tmp) / RECIPE)
    assert back == attrs.evolve(recipe, path=str(Path(tmp) / RECIPE))
    assert strategies.same(back.to_dict(), recipe.to_dict())
