"""recipe/validation.py: each section checked against its registry entry. Each kind of recipe error
gives one line naming file, section and key, and exit code 2; every bad key of a recipe is
reported at once, one line each, from `validate` and from `run`."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

import eblvm
from eblvm_core.errors import ConfigError
from tests.support import SMALL_RECIPE, error_lines, one_line_error


def commands(path, tmp_path):
    return (["validate", path], ["run", path, "--out", tmp_path / "runs"])


# ---- one line naming file, section and key -------------------------------------------------------

CASES = [
    # (description, replace-this, with-this, fragments the message must contain)
    ("unknown section", "[objective]", "[objectiv]", ["[objectiv]", "unknown section", "did you mean 'objective'"]),
    (
        "unknown kind",
        'kind = "dsm"',
        'kind = "dms"',
        ["[objective] kind", "unknown objective 'dms'", "did you mean 'dsm'"],
    ),
    ("unknown key", "n_hidden = 4", "n_hiden = 4", ["[model] n_hiden", "unknown key", "did you mean 'n_hidden'"]),
    ("wrong type", "steps = 30", 'steps = "thirty"', ["[run] steps", "must be int"]),
    ("float for int", "steps = 30", "steps = 30.5", ["[run] steps", "must be int"]),
    ("out of range", "sigma = 0.1", "sigma = -0.1", ["[objective] sigma", "must be > 0"]),
    ("bad choice", "seed = 7", 'seed = 7\nprecision = "fp8"', ["[run] precision", "must be one of"]),
    ("bad device", "seed = 7", 'seed = 7\ndevice = "gpu"', ["[run] device", "must be auto, cpu, cuda, cuda:N or mps"]),
    ("missing kind", 'kind = "grbm"', "", ["[model] kind", "missing"]),
    ("missing section", '[estimator]\nkind = "exact-score"', "", ["[estimator]", "required section is missing"]),
    (
        "eval item",
        '[[eval]]\nkind = "exact-loglik"',
        '[[eval]]\nkind = "exact-loglik"\nbogus = 1',
        ["[eval.0] bogus", "unknown key"],
    ),
]


@pytest.mark.parametrize("name,old,new,fragments", CASES, ids=[c[0] for c in CASES])
def test_validate_errors_name_file_section_key(cli, write_recipe, name, old, new, fragments):
    assert old in SMALL_RECIPE
    path = write_recipe(SMALL_RECIPE.replace(old, new))
    line = one_line_error(cli(["validate", path]))
    assert str(path) in line
    for fragment in fragments:
        assert fragment in line, line


def test_run_reports_the_same_errors(cli, write_recipe, tmp_path):
    path = write_recipe(SMALL_RECIPE.replace("n_hidden = 4", "n_hiden = 4"))
    line = one_line_error(cli(["run", path, "--out", tmp_path / "runs"]))
    assert "[model] n_hiden" in line
    assert not (tmp_path / "runs").exists(), "nothing may run before the recipe validates"


@pytest.mark.slow
def test_real_process_exit_code_and_no_traceback(write_recipe):
    path = write_recipe(SMALL_RECIPE.replace("batch_size = 50", "batch_size = 0"))
    proc = subprocess.run(
        [sys.executable, "-m", "eblvm_core.cli", "validate", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "[run] batch_size" in proc.stderr and "must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_recipe_data_with_include_is_refused_by_name():
    """Includes are relative to a file: data given as a dict cannot hold one."""
    from eblvm_core.recipe import validate

    with pytest.raises(ConfigError, match=r"<data>: include: is resolved when a recipe file is read"):
        validate({"include": ["base.toml"]}, "<data>")


# ---- every bad key at once -----------------------------------------------------------------------


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


# ---- validate on its own --------------------------------------------------------------------------


def test_a_recipe_without_log_gets_the_default_logger_and_log_empty_gets_none():
    from eblvm_core.recipe import DEFAULT_LOGGER, validate

    data = tomllib.loads(SMALL_RECIPE)
    assert [s.kind for s in validate(data, "r.toml").logs] == [DEFAULT_LOGGER]
    assert validate({**data, "log": []}, "r.toml").logs == []


def test_a_nul_byte_anywhere_is_refused_naming_its_section_and_key():
    from eblvm_core.recipe import validate

    data = tomllib.loads(SMALL_RECIPE)
    data["eval"][0]["split"] = "te\x00st"
    with pytest.raises(ConfigError, match=r"^r.toml: \[eval.0\] split: must not contain a NUL byte"):
        validate(data, "r.toml")
    data = tomllib.loads(SMALL_RECIPE)
    data["model"]["n_\x00hidden"] = 4
    with pytest.raises(ConfigError, match=r"^r.toml: \[model\] 'n_\\x00hidden': a key must not contain a NUL byte"):
        validate(data, "r.toml")


def test_sections_of_the_wrong_shape_are_reported_with_the_rest():
    from eblvm_core.recipe import validate

    data = tomllib.loads(SMALL_RECIPE)
    data.update(run=3, optim=[1], eval={"kind": "x"}, model={"n_hidden": 4})
    with pytest.raises(ConfigError) as refused:
        validate(data, "r.toml")
    lines = [str(e).removeprefix("r.toml: ") for e in refused.value.errors]
    assert len(lines) == 4 and lines[1].startswith("[model] kind: missing; choose one of: ") and "grbm" in lines[1]
    assert lines[:1] + lines[2:] == [
        "[run]: must be a table",
        "[optim]: must hold tables such as [optim.model]",
        "[eval]: must be an array of tables: write [[eval]]",
    ]
