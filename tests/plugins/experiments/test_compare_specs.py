"""Comparison specs: every path in a spec is relative to the spec file (one rule, so the bundled
specs work from any folder); a recipe that is not there is one line naming the spec, the
[method.N] and the key, with a hint when the path would work from the working directory; every
key spec.py accepts is documented with its default in docs/compare.md, which `eblvm compare
--help` names; and `image` defaults to the first density-plot or sample-grid evaluator of the
methods' recipes, so a comparison figure shows each method's image."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import attrs
import pytest
from eblvm_experiments.spec import SECTIONS, CompareConfig, MethodConfig, load_spec
from PIL import Image

from tests.support import RECIPES, ROOT, SMALL_RECIPE, one_line_error

SPECS = sorted(p.name for p in (RECIPES / "compare").glob("*.toml"))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ---- paths relative to the spec -------------------------------------------------------------------


@pytest.mark.parametrize("name", SPECS)
def test_every_bundled_spec_validates_from_another_folder(cli, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    spec = RECIPES / "compare" / name
    result = cli(["validate", spec])
    assert result.exit_code == 0, result.output
    assert f"ok: {spec}" in result.output


def test_a_recipe_missing_beside_the_spec_is_one_line_with_a_hint(cli, tmp_path, monkeypatch):
    """A spec in tmp/mine naming recipes/grbm_dsm.toml: from the repository's root that path would
    exist relative to the working directory, which the line says; the spec's own folder is what
    counts, and a recipe put there is found from any folder."""
    spec = write(
        tmp_path / "mine" / "spec.toml",
        """
        [[method]]
        name = "DSM"
        recipe = "recipes/grbm_dsm.toml"
        """,
    )
    monkeypatch.chdir(ROOT)
    for command in (["validate", spec], ["compare", spec, "--out", tmp_path / "results"]):
        line = one_line_error(cli(command))
        assert line.startswith(f"error: {spec}: [method.0] recipe: no recipe file 'recipes/grbm_dsm.toml': "), line
        assert str(tmp_path / "mine" / "recipes" / "grbm_dsm.toml") in line, line
        assert "relative to the spec file" in line and f"{ROOT / 'recipes' / 'grbm_dsm.toml'} exists" in line, line
        assert f"write recipe = '{ROOT / 'recipes' / 'grbm_dsm.toml'}'" in line, line
    monkeypatch.chdir(tmp_path)
    line = one_line_error(cli(["validate", spec]))
    assert "no recipe file 'recipes/grbm_dsm.toml'" in line and "exists" not in line, line
    write(tmp_path / "mine" / "recipes" / "grbm_dsm.toml", (RECIPES / "grbm_dsm.toml").read_text())
    assert load_spec(spec).recipe_paths["DSM"] == (tmp_path / "mine" / "recipes" / "grbm_dsm.toml").resolve()


# ---- every key documented --------------------------------------------------------------------------


def spec_keys() -> dict[str, list[str]]:
    """Every key spec.py accepts, by the heading of docs/compare.md that documents it."""
    return {
        "## `[compare]`": [f.name for f in attrs.fields(CompareConfig)],
        "## `[[method]]`": [f.name for f in attrs.fields(MethodConfig)],
        "## Sections": list(SECTIONS),
        "## `[sweep]`": ["values", "label"],
    }


def test_every_spec_key_is_documented_with_its_default():
    doc = (ROOT / "docs" / "compare.md").read_text()
    parts = {part.splitlines()[0]: part for part in ("\n" + doc).split("\n## ")[1:]}
    for heading, keys in spec_keys().items():
        part = parts.get(heading.removeprefix("## "))
        assert part is not None, f"docs/compare.md has no section {heading}"
        rows = {line.split("|")[1].strip().strip("`[]"): line for line in part.splitlines() if line.startswith("| `")}
        for key in keys:
            assert key in rows, f"docs/compare.md, {heading}: no row for {key}"
            assert rows[key].count("|") == 4 and rows[key].split("|")[2].strip(), f"{key}: no default: {rows[key]}"


def test_compare_help_points_to_the_reference_and_lists_the_keys(cli):
    result = cli(["compare", "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "docs/compare.md" in text
    for key in spec_keys()["## `[compare]`"] + spec_keys()["## `[[method]]`"]:
        assert key in text, key


# ---- image defaults to the methods' first density or sample-grid evaluator ----------------------------


RECIPE = SMALL_RECIPE.replace("steps = 30", "steps = 4").replace("log_every = 10", "log_every = 2")


def spec_with(tmp_path: Path, compare: str = "", evals: str = "") -> Path:
    recipe = write(tmp_path / "r.toml", RECIPE + evals)
    return write(
        tmp_path / "spec.toml",
        f"""
        [compare]
        name = "pictures"
        seeds = 1
        {compare}

        [[method]]
        name = "DSM"
        recipe = "{recipe.name}"
        """,
    )


PLOT = '\n[[eval]]\nkind = "density-plot"\ngrid = 20\n'


@pytest.mark.parametrize(
    "compare, evals, image",
    [
        ("", PLOT, "density-plot"),
        ("", '\n[[eval]]\nkind = "sample-grid"\nn = 4\n' + PLOT, "sample-grid"),
        ('image = ""', PLOT, ""),  # none, said so
        ('image = "samples"', PLOT, "samples"),
        ("", "", ""),  # no evaluator draws an image
    ],
)
def test_image_defaults_to_the_first_density_or_sample_grid_evaluator(tmp_path, compare, evals, image):
    assert load_spec(spec_with(tmp_path, compare, evals)).compare.image == image


def test_a_comparison_without_image_shows_each_methods_density(cli, tmp_path):
    out = tmp_path / "results"
    result = cli(["compare", spec_with(tmp_path, evals=PLOT), "--out", out, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert (out / "images" / "DSM.png").is_file()
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["image"] and Path(run["image"]).is_file()
    assert Image.open(out / "figure.png").size[1] > Image.open(out / "images" / "DSM.png").size[1]


# ---- [compare] metrics are what an evaluator reports ------------------------------------------------


def error_lines(result) -> list[str]:
    """The lines of a CLI error found together: exit code 2, no traceback, each "error: ..."."""
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert all(line.startswith("error: ") for line in lines), result.output
    return lines


REPORTED = "eval/exact-loglik/test_loglik, eval/exact-loglik/test_loglik_stderr"


def test_a_metric_no_evaluator_reports_is_one_line_each_from_validate_and_compare(cli, tmp_path):
    """As a search spec's metric: each bad one named, with the nearest key; the good one passes."""
    spec = spec_with(
        tmp_path, 'metrics = ["eval/exact-loglik/test_logl", "eval/exact-loglik/test_loglik", "eval/fid/fid"]'
    )
    expected = [
        f"error: {spec}: [compare] metrics: no evaluator of the methods' recipes reports "
        f"'eval/exact-loglik/test_logl' (did you mean 'eval/exact-loglik/test_loglik'?); reported: {REPORTED}",
        f"error: {spec}: [compare] metrics: no evaluator of the methods' recipes reports 'eval/fid/fid'; "
        f"reported: {REPORTED}",
    ]
    assert error_lines(cli(["validate", spec])) == expected
    assert error_lines(cli(["compare", spec, "--out", tmp_path / "results"])) == expected
    assert not (tmp_path / "results").exists()  # refused before any work
    assert cli(["validate", spec_with(tmp_path, 'metrics = ["eval/exact-loglik/test_loglik"]')]).exit_code == 0


def test_with_final_evals_the_metrics_are_what_they_report(cli, tmp_path):
    """[[final_eval]] evaluators replace the recipes' own for the table: their keys count alone."""
    final = '\n[[final_eval]]\nkind = "ais-loglik"\nn_chains = 10\nn_temps = 10\n'
    good = spec_with(tmp_path, 'metrics = ["eval/ais-loglik/test_loglik"]')
    write(good, good.read_text() + final)
    assert cli(["validate", good]).exit_code == 0
    bad = spec_with(tmp_path, 'metrics = ["eval/exact-loglik/test_loglik"]')
    write(bad, bad.read_text() + final)
    (line,) = error_lines(cli(["validate", bad]))
    assert line.startswith(
        f"error: {bad}: [compare] metrics: no [[final_eval]] evaluator reports 'eval/exact-loglik/test_loglik' "
        "(did you mean 'eval/ais-loglik/test_loglik'?); reported: eval/ais-loglik/"
    ), line
