"""Each kind of recipe error gives one line naming file, section and key, and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.support import BISM, RECIPES, SMALL_RECIPE


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    return lines[0]


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

    recipe = load_recipe(
        write_recipe(), ["model.n_hidden=6", "optim.model.lr=2e-3", 'run.name="x"', "eval.0.split=train"]
    )
    assert recipe.parts["model"].config.n_hidden == 6
    assert recipe.optim["model"].optimizer.config.lr == 2e-3
    assert recipe.run.name == "x"
    assert recipe.evals[0].config.split == "train"


def test_build_time_error_is_one_line(cli, write_recipe, tmp_path):
    """A combination only the component can judge (too many hidden units to enumerate)."""
    path = write_recipe()
    line = one_line_error(cli(["run", path, "--out", tmp_path, "-o", "model.n_hidden=40"]))
    assert str(path) in line and "[eval.0]" in line


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


# ---- validate is a dry run: what run rejects before its first step, validate rejects -------------


DRY_CASES = [
    (
        "misspelt role",
        BISM,
        "[optim.posterior]",
        "[optim.posteror]",
        ["[optim.posteror]", "unknown role (did you mean 'posterior'?)"],
    ),
    (
        "missing role",
        BISM,
        '[optim.posterior]\nkind = "adam"',
        "",
        ["[optim.posterior] kind", "missing", "trains role 'posterior'"],
    ),
    ("fisher on bernoulli", BISM, 'kind = "kl"', 'kind = "fisher"', ["[divergence] kind", "needs a continuous latent"]),
    (
        "no such split",
        SMALL_RECIPE,
        'kind = "exact-loglik"',
        'kind = "exact-loglik"\nsplit = "val"',
        ["[eval.0] split", "no 'val' split"],
    ),
    (
        "unknown select_metric",
        SMALL_RECIPE,
        "seed = 7",
        'seed = 7\nselect_metric = "eval/exact-loglik/val_loglik"',
        [
            "[run] select_metric",
            "no evaluator reports 'eval/exact-loglik/val_loglik' (did you mean 'eval/exact-loglik/test_loglik'?)",
        ],
    ),
    (
        "absent cuda device",
        SMALL_RECIPE,
        "seed = 7",
        'seed = 7\ndevice = "cuda:7"',
        ["[run] device", "cuda:7 requested"],
    ),
]


@pytest.mark.parametrize("name, base, old, new, fragments", DRY_CASES, ids=[c[0] for c in DRY_CASES])
def test_validate_rejects_what_run_would_reject_before_its_first_step(
    cli, write_recipe, tmp_path, name, base, old, new, fragments
):
    if name == "absent cuda device" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert old in base
    path = write_recipe(base.replace(old, new))
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        assert str(path) in line
        for fragment in fragments:
            assert fragment in line, line
    assert not (tmp_path / "runs").exists(), "a rejected run leaves no run directory"


@pytest.mark.slow
def test_validate_accepts_every_bundled_recipe_and_comparison_spec(cli):
    root = RECIPES
    files = sorted(root.glob("*.toml")) + sorted((root / "compare").glob("*.toml"))
    result = cli(["validate", *files])
    assert result.exit_code == 0, result.output
    assert result.output.count("ok: ") == len(files)
    # Frey face recipes are checked with stand-in images when the file is absent, and say so
    assert "checked with stand-in images" in result.output


def test_validate_check_data_requires_the_files(cli):
    recipe = RECIPES / "freyface_dsm.toml"
    result = cli(["validate", recipe, "-o", "data.root=/nonexistent", "--check-data"])
    assert result.exit_code == 2 and "/nonexistent/frey_rawface.mat" in result.output
