"""The bundled recipes by name (eblvm_core.recipe.library): a bare name or ``eblvm:NAME`` wherever a
recipe file is read, in an include and in a spec's method, and one line with the closest name
when a name is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from eblvm_core.recipe import load_recipe, parse, read
from eblvm_core.recipe.library import names, recipe_file
from tests.support import RECIPES, SMALL_RECIPE, one_line_error


def test_every_bundled_file_has_its_name_and_a_name_reads_that_file():
    expected = {p.relative_to(RECIPES).with_suffix("").as_posix() for p in RECIPES.rglob("*.toml")}
    assert set(names()) == expected and "grbm_bissm" in expected and "compare/checkerboard" in expected
    for name in ("grbm_bissm", "eblvm:grbm_bissm", "grbm_bissm.toml", "compare/checkerboard"):
        assert recipe_file(name).samefile(RECIPES / f"{name.removeprefix('eblvm:').removesuffix('.toml')}.toml")
    assert read("eblvm:grbm_dsm") == parse(RECIPES / "grbm_dsm.toml")


def test_a_file_of_the_name_here_wins_over_the_bundled_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("grbm_bissm").write_text(SMALL_RECIPE)
    assert recipe_file("grbm_bissm") == Path("grbm_bissm")
    assert recipe_file("eblvm:grbm_bissm").samefile(RECIPES / "grbm_bissm.toml")  # the prefix: always bundled


def test_an_include_of_a_bundled_recipe_works_from_any_folder(tmp_path):
    mine = tmp_path / "deep" / "mine.toml"
    mine.parent.mkdir()
    mine.write_text('include = ["eblvm:grbm_ssm"]\n[run]\nsteps = 7\n')
    recipe = load_recipe(mine)
    base = load_recipe(RECIPES / "grbm_ssm.toml")
    assert recipe.run.steps == 7 and recipe.to_dict()["estimator"] == base.to_dict()["estimator"]


@pytest.mark.parametrize(
    "argument, said",
    [
        ("grbm_bisssm", "grbm_bisssm: recipe file not found, nor a bundled recipe (did you mean 'grbm_bissm'?)"),
        ("eblvm:grbm_bisssm", "eblvm:grbm_bisssm: no bundled recipe (did you mean 'grbm_bissm'?)"),
        ("nowhere/x.toml", "nowhere/x.toml: recipe file not found"),
    ],
)
def test_a_wrong_name_is_one_line_with_the_closest_bundled_name(cli, tmp_path, argument, said):
    for command in (["validate", argument], ["run", argument, "--out", tmp_path / "runs"]):
        result = cli(command)
        assert result.exit_code == 2
        assert one_line_error(result).startswith(f"error: {said}")
    assert not (tmp_path / "runs").exists()


def test_a_wrong_bundled_include_names_the_including_file_and_key(cli, tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('include = ["eblvm:grbm_dssm"]\n')
    line = one_line_error(cli(["validate", path]))
    assert line == f"error: {path}: include: 'eblvm:grbm_dssm': no bundled recipe (did you mean 'grbm_ssm'?)"


def test_validate_and_a_spec_take_bundled_names(cli, tmp_path):
    result = cli(["validate", "grbm_bissm", "compare/checkerboard", "search/bissm_checkerboard"])
    assert result.exit_code == 0, result.output
    spec = tmp_path / "spec.toml"  # a spec outside the checkout naming a bundled recipe
    spec.write_text('[compare]\nseeds = 1\n[[method]]\nname = "ssm"\nrecipe = "eblvm:grbm_ssm"\n')
    result = cli(["validate", spec])
    assert result.exit_code == 0, result.output
    spec.write_text('[compare]\nseeds = 1\n[[method]]\nname = "ssm"\nrecipe = "eblvm:grbm_sm"\n')
    line = one_line_error(cli(["validate", spec]))
    assert line.startswith(f"error: {spec}: [method.0] recipe: 'eblvm:grbm_sm': no bundled recipe (did you mean")


def test_the_bundled_specs_name_their_recipes_portably():
    """A copied spec still finds its recipes: every bundled spec names them as eblvm:NAME."""
    for spec in [*(RECIPES / "compare").glob("*.toml"), *(RECIPES / "search").glob("*.toml")]:
        tables = parse(spec).get("method", []) + [parse(spec).get("search", {})]
        for table in tables:
            if "recipe" in table:
                assert table["recipe"].startswith("eblvm:") and recipe_file(table["recipe"]), (spec, table)
