"""The catalog plugin's commands: ``eblvm recipes`` (list, copy) and ``eblvm runs``; and the core's
``eblvm --version`` and ``eblvm plugins --kind / NAME``."""

from __future__ import annotations

import json
import tomllib

from eblvm_catalog.commands import description

from eblvm_core import __version__
from eblvm_core.recipe.library import names
from tests.support import RECIPES, SMALL_RECIPE, one_line_error


def test_recipes_lists_every_bundled_file_with_its_first_comment(cli):
    result = cli(["recipes"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == list(names())
    row = next(line for line in lines if line.startswith("grbm_bissm "))
    assert row.split(None, 1)[1] == description(RECIPES / "grbm_bissm.toml")
    assert description(RECIPES / "grbm_bissm.toml").startswith("GRBM (4 hidden units) on the 2x2 checkerboard by BiSSM")
    assert all(len(line.split(None, 1)) == 2 for line in lines)  # every bundled file says what it is


def test_description_is_the_first_comment_paragraph_without_the_name(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("# mine: a first line\n# and a second\n#\n# not this\n[run]\n")
    assert description(path) == "a first line and a second"
    path.write_text("# " + "word " * 40 + "\n")
    assert len(description(path)) <= 100 and description(path).endswith("word…")
    path.write_text("[run]\n# late\n")
    assert description(path) == ""


def test_recipes_copy_writes_an_editable_copy_that_runs_from_anywhere(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli(["recipes", "copy", "compare/checkerboard"])
    assert result.exit_code == 0 and "eblvm compare checkerboard.toml" in result.output
    assert (tmp_path / "checkerboard.toml").read_text() == (RECIPES / "compare" / "checkerboard.toml").read_text()
    assert cli(["validate", "checkerboard.toml"]).exit_code == 0  # its methods are eblvm:NAME
    (tmp_path / "mine").mkdir()
    assert cli(["recipes", "copy", "eblvm:grbm_bissm", "mine"]).exit_code == 0
    assert tomllib.loads((tmp_path / "mine" / "grbm_bissm.toml").read_text())["run"]["name"] == "grbm_bissm"
    (tmp_path / "mine" / "grbm_bissm.toml").write_text("# edited\n")
    line = one_line_error(cli(["recipes", "copy", "grbm_bissm", "mine"]))
    assert line == "error: mine/grbm_bissm.toml exists: give another DEST, or --force to replace it"
    assert (tmp_path / "mine" / "grbm_bissm.toml").read_text() == "# edited\n"  # left as it was
    assert cli(["recipes", "copy", "grbm_bissm", "mine", "--force"]).exit_code == 0
    assert (tmp_path / "mine" / "grbm_bissm.toml").read_text() == (RECIPES / "grbm_bissm.toml").read_text()
    line = one_line_error(cli(["recipes", "copy", "grbm_bisssm"]))
    assert line.startswith("error: eblvm:grbm_bisssm: no bundled recipe (did you mean 'grbm_bissm'?)")
    assert one_line_error(cli(["recipes", "paste", "x"])) == "error: usage: eblvm recipes [copy NAME [DEST]]"


def test_runs_lists_each_run_with_its_status_steps_metric_and_device(cli, tmp_path, write_recipe):
    recipe = write_recipe(SMALL_RECIPE)
    assert cli(["run", recipe, "--out", tmp_path / "runs"]).exit_code == 0
    (run_dir,) = (tmp_path / "runs").glob("*/*/")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_eval = [row for row in rows if any(k.startswith("eval/") for k in row)][-1]
    selected = tomllib.loads((run_dir / "recipe.toml").read_text())["run"].get("select_metric")
    key = selected or next(k for k in last_eval if k.startswith("eval/"))
    broken = tmp_path / "runs" / "broken" / "20260101-000000"
    broken.mkdir(parents=True)
    (broken / "run.json").write_text("{half")
    listed = tmp_path / "runs" / "listed" / "20260101-000000"
    listed.mkdir(parents=True)
    (listed / "run.json").write_text("[1, 2]")  # JSON, but not a run's
    result = cli(["runs", tmp_path / "runs"])
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    assert header.split() == ["RUN", "STARTED", "STATUS", "STEPS", "LAST", "EVALUATION", "DEVICE"]
    ours = next(line for line in lines if line.startswith(str(run_dir.relative_to(tmp_path / "runs"))))
    steps = rows[-1]["step"]
    assert ours.split()[2:] == ["finished", f"{steps}/{steps}", f"{key[5:]}={last_eval[key]:.6g}", "cpu"]
    for name in ("broken", "listed"):
        assert any(line.startswith(f"{name}/20260101-000000") and "unreadable run.json" in line for line in lines)
    assert one_line_error(cli(["runs", tmp_path / "none"])).startswith(f"error: {tmp_path / 'none'}: no such folder")


def test_version_prints_the_one_version():
    from typer.testing import CliRunner

    from eblvm_core.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"eblvm {__version__}\n"


def test_plugins_shows_one_kind_or_one_component_alone(cli):
    everything = cli(["plugins"]).output
    estimators = cli(["plugins", "--kind", "estimator"])
    assert estimators.exit_code == 0
    heads = [line for line in estimators.output.splitlines() if not line.startswith(" ")]
    assert heads and all(line.startswith("estimator ") for line in heads)
    assert cli(["plugins", "--kind", "estimators"]).output == estimators.output
    assert len(heads) == sum(line.startswith("  estimator ") for line in everything.splitlines())
    grbm = cli(["plugins", "grbm"]).output.splitlines()
    assert grbm[0].startswith("model grbm: ") and grbm[0].endswith("(plugin grbm)")
    assert "    n_hidden: int = 4  number of Bernoulli hidden units m" in grbm
    assert one_line_error(cli(["plugins", "grbmm"])) == "error: no component 'grbmm' (did you mean 'grbm'?)"
    assert one_line_error(cli(["plugins", "--kind", "estimatr"])).startswith(
        "error: --kind: no kind 'estimatr' (did you mean 'estimators'?)"
    )
