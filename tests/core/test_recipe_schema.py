"""recipe/schema.py: what a validated recipe is: [run] (``RunConfig``: its options and the checks
between them), ``Recipe`` (``to_dict``, ``default_of``, ``blame``) and ``with_run``."""

from __future__ import annotations

import tomllib

import attrs
import pytest
import tomli_w

from eblvm_core.recipe import RunConfig, with_run
from tests.support import SMALL_RECIPE

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
