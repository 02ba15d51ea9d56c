"""Each kind of recipe error gives one line naming file, section and key, and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import SMALL_RECIPE


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.strip().splitlines() if l.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    return lines[0]


CASES = [
    # (description, replace-this, with-this, fragments the message must contain)
    ("unknown section", "[objective]", "[objectiv]", ["[objectiv]", "unknown section", "did you mean 'objective'"]),
    ("unknown kind", 'kind = "dsm"', 'kind = "dms"', ["[objective] kind", "unknown objective 'dms'", "did you mean 'dsm'"]),
    ("unknown key", "n_hidden = 4", "n_hiden = 4", ["[model] n_hiden", "unknown key", "did you mean 'n_hidden'"]),
    ("wrong type", "steps = 30", 'steps = "thirty"', ["[run] steps", "must be int"]),
    ("float for int", "steps = 30", "steps = 30.5", ["[run] steps", "must be int"]),
    ("out of range", "sigma = 0.1", "sigma = -0.1", ["[objective] sigma", "must be > 0"]),
    ("bad choice", "seed = 7", 'seed = 7\ndevice = "gpu"', ["[run] device", "must be one of"]),
    ("missing kind", 'kind = "grbm"', "", ["[model] kind", "missing"]),
    ("missing section", '[estimator]\nkind = "exact-score"', "", ["[estimator]", "required section is missing"]),
    ("eval item", '[[eval]]\nkind = "exact-loglik"', '[[eval]]\nkind = "exact-loglik"\nbogus = 1', ["[eval.0] bogus", "unknown key"]),
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


def test_missing_file_and_bad_toml(cli, write_recipe, tmp_path):
    line = one_line_error(cli(["validate", tmp_path / "nope.toml"]))
    assert "nope.toml" in line and "not found" in line
    bad = write_recipe("[run\nsteps = 1")
    line = one_line_error(cli(["validate", bad]))
    assert str(bad) in line and "invalid TOML" in line


@pytest.mark.parametrize(
    "override,fragments",
    [
        ("model.n_hidden=3.5", ["[model] n_hidden", "must be int"]),
        ("modle.n_hidden=3", ["[modle]", "did you mean 'model'"]),
        ("steps=3", ["must look like section.key=value"]),
        ("optim.model.lr=-1", ["[optim.model] lr", "must be > 0"]),
        ("eval.3.kind=x", ["eval.3", "no item 3"]),
    ],
)
def test_override_errors(cli, write_recipe, override, fragments):
    path = write_recipe()
    line = one_line_error(cli(["validate", path, "-o", override]))
    for fragment in fragments:
        assert fragment in line, line


def test_overrides_apply_typed_values(write_recipe):
    from eblvm_core.recipe import load_recipe

    recipe = load_recipe(write_recipe(), ["model.n_hidden=6", "optim.model.lr=2e-3", 'run.name="x"', "eval.0.split=train"])
    assert recipe.parts["model"].config.n_hidden == 6
    assert recipe.optim["model"].config.lr == 2e-3
    assert recipe.run.name == "x"
    assert recipe.evals[0].config.split == "train"


def test_build_time_error_is_one_line(cli, write_recipe, tmp_path):
    """A combination only the component can judge (too many hidden units to enumerate)."""
    path = write_recipe()
    line = one_line_error(cli(["run", path, "--out", tmp_path, "-o", "model.n_hidden=40"]))
    assert str(path) in line and "[eval.0]" in line


def test_real_process_exit_code_and_no_traceback(write_recipe):
    path = write_recipe(SMALL_RECIPE.replace("batch_size = 50", "batch_size = 0"))
    proc = subprocess.run([sys.executable, "-m", "eblvm_core.cli", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "[run] batch_size" in proc.stderr and "must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
