"""How recipe errors are reported: an error an `-o` value caused names that `-o` value in place of
the recipe file (`error: -o run.stepz=3: [run] stepz: unknown key ...`), and every bad key of a
recipe is reported at once, one line each (`error: file: [section] key: message`), exit code 2,
no traceback, from `validate` and from `run`."""

from __future__ import annotations

import tomllib

import pytest

import eblvm
from eblvm_core.errors import ConfigError
from tests.support import RECIPES, SMALL_RECIPE, one_line_error


def error_lines(result) -> list[str]:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert all(line.startswith("error: ") for line in lines), result.output
    return lines


def commands(path, tmp_path):
    return (["validate", path], ["run", path, "--out", tmp_path / "runs"])


# ---- -o errors name the -o value -------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("run.stepz=3", "error: -o run.stepz=3: [run] stepz: unknown key (did you mean 'steps'?); valid keys: "),
        ("model.n_hidden=3.5", "error: -o model.n_hidden=3.5: [model] n_hidden: must be int, got float 3.5"),
        ("optim.model.lr=-1", "error: -o optim.model.lr=-1: [optim.model] lr: must be > 0"),
        ("modle.n_hidden=3", "error: -o modle.n_hidden=3: [modle]: unknown section (did you mean 'model'?)"),
        ("steps=3", "error: -o steps=3: must look like section.key=value (or ~section.key to drop a key)"),
        ("~model.kind", "error: -o ~model.kind: [model] kind: missing; choose one of: "),
        ("eval.0.split=val", "error: -o eval.0.split=val: [eval.0] split: "),  # found when the parts are built
    ],
)
def test_an_override_error_names_the_override(cli, write_recipe, tmp_path, override, expected):
    path = write_recipe()
    for command in commands(path, tmp_path):
        line = one_line_error(cli([*command, "-o", "run.log_every=5", "-o", override]))
        assert line.startswith(expected), line
        assert str(path) not in line, line
    assert not (tmp_path / "runs").exists()


def test_a_bad_key_of_the_file_still_names_the_file(cli, write_recipe, tmp_path):
    path = write_recipe(SMALL_RECIPE.replace("n_hidden = 4", "n_hiden = 4"))
    for command in commands(path, tmp_path):
        line = one_line_error(cli([*command, "-o", "run.steps=3"]))
        assert line.startswith(f"error: {path}: [model] n_hiden: unknown key (did you mean 'n_hidden'?)"), line


def test_a_refused_resume_names_the_override(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    assert cli(["run", write_recipe(), "--out", out, "-o", "run.steps=10"]).exit_code == 0
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    line = one_line_error(cli(["run", "--resume", run_dir, "-o", "run.steps=20", "-o", "model.n_hidden=8"]))
    assert line.startswith("error: -o model.n_hidden=8: [model] n_hidden: cannot change when resuming"), line
    line = one_line_error(cli(["run", "--resume", run_dir, "-o", "run.stepz=20"]))
    assert line.startswith("error: -o run.stepz=20: [run] stepz: unknown key"), line


def test_an_override_of_a_comparison_names_the_override(cli, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[[method]]\nname = "DSM"\nrecipe = "{RECIPES / "grbm_dsm.toml"}"\n')
    for command in (["validate", spec], ["compare", spec, "--out", tmp_path / "results"]):
        line = one_line_error(cli([*command, "-o", "run.stepz=3"]))
        assert line.startswith("error: -o run.stepz=3: [run] stepz: unknown key (did you mean 'steps'?)"), line


def test_python_overrides_are_named_as_the_command_line_names_them(tmp_path):
    with pytest.raises(ConfigError, match=r"^-o run\.stepz=3: \[run\] stepz: unknown key"):
        eblvm.train(tomllib.loads(SMALL_RECIPE), overrides={"run.stepz": 3}, out=tmp_path, echo=None)


# ---- every bad key at once -------------------------------------------------------------------------


def test_every_bad_key_of_a_recipe_is_reported_in_one_go(cli, write_recipe, tmp_path):
    text = (
        SMALL_RECIPE.replace("steps = 30", "stepz = 30\nbatch_size = 0")
        .replace("batch_size = 50\n", "")
        .replace("n_hidden = 4", "n_hiden = 4")
        .replace("sigma = 0.1", "sigma = -0.1")
        .replace('kind = "exact-loglik"', 'kind = "exact-loglik"\nbogus = 1')
    )
    path = write_recipe(text)
    for command in commands(path, tmp_path):
        lines = error_lines(cli(command))
        assert [line.split(": ")[2] for line in lines] == [
            "[run] stepz",
            "[run] batch_size",
            "[model] n_hiden",
            "[objective] sigma",
            "[eval.0] bogus",
        ], lines
        assert all(line.startswith(f"error: {path}: [") for line in lines), lines
        assert "did you mean 'steps'" in lines[0] and "must be > 0" in lines[1] and "must be > 0" in lines[3]
    assert not (tmp_path / "runs").exists()


def test_bad_keys_of_the_file_and_of_the_overrides_are_reported_together(cli, write_recipe):
    path = write_recipe(SMALL_RECIPE.replace("n_hidden = 4", "n_hiden = 4"))
    lines = error_lines(cli(["validate", path, "-o", "run.stepz=3", "-o", "optim.model.lr=0"]))
    assert len(lines) == 3, lines
    assert any(line.startswith(f"error: {path}: [model] n_hiden: unknown key") for line in lines), lines
    assert any(line.startswith("error: -o run.stepz=3: [run] stepz: unknown key") for line in lines), lines
    assert any(line.startswith("error: -o optim.model.lr=0: [optim.model] lr: must be > 0") for line in lines), lines


def test_several_errors_from_python_are_one_config_error_listing_each(tmp_path):
    bad = tomllib.loads(SMALL_RECIPE)
    bad["run"]["steps"] = 0
    bad["model"]["n_hiden"] = 4
    with pytest.raises(ConfigError) as caught:
        eblvm.train(bad, out=tmp_path, echo=None)
    assert [(e.section, e.key) for e in caught.value.errors] == [("run", "steps"), ("model", "n_hiden")]
    assert str(caught.value).splitlines() == [str(e) for e in caught.value.errors]
    assert str(caught.value).startswith("<recipe dict>: [run] steps: must be > 0")


def test_an_unknown_section_is_not_also_reported_missing(cli, write_recipe):
    """[objectiv] for [objective]: one line, the unknown section with its hint."""
    line = one_line_error(cli(["validate", write_recipe(SMALL_RECIPE.replace("[objective]", "[objectiv]"))]))
    assert "[objectiv]: unknown section (did you mean 'objective'?)" in line
    lines = error_lines(cli(["validate", write_recipe("[run]\nsteps = 3\n")]))
    assert len(lines) == 1 and "[data]: required section is missing (so are [model]" in lines[0], lines
