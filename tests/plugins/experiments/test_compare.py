"""``eblvm compare`` end to end: methods over seeds in parallel processes, a killed comparison
resumed without rerunning finished runs, a run stopped on a NaN left out of the table, best
checkpoints re-evaluated by [[final_eval]], spec errors naming the file, the curve plot's axis,
and --seed-offset."""

from __future__ import annotations

import datetime
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image

from eblvm_core import checkpoint as ckpt
from tests.support import RECIPES, session_run


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_spec(folder: Path, body: str) -> Path:
    path = folder / "spec.toml"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.slow
def test_compare_runs_methods_over_seeds_in_parallel(cli, tmp_path):
    """2 methods × 2 seeds in 2 processes, 12 steps each (--steps): table, figure, curves, images."""
    spec = write_spec(
        tmp_path,
        f"""
        [compare]
        name = "mini"
        metrics = ["eval/exact-loglik/test_loglik", "eval/ais-loglik/test_loglik"]
        curve = "eval/exact-loglik/test_loglik"
        image = "density-plot"
        overrides = ["run.eval_every=4", "run.log_every=4", "data.n_train=500", "data.n_test=200"]

        [[method]]
        name = "CD"
        recipe = "{RECIPES / "grbm_cd.toml"}"

        [[method]]
        name = "PCD"
        recipe = "{RECIPES / "grbm_pcd.toml"}"
        overrides = ["estimator.n_chains=20"]

        [[eval]]
        kind = "score-loss"

        [[final_eval]]
        kind = "exact-loglik"

        [[final_eval]]
        kind = "ais-loglik"
        n_chains = 50
        n_temps = 50
        """,
    )
    out = tmp_path / "results"
    result = cli(["compare", spec, "--seeds", "2", "--jobs", "2", "--steps", "12", "--out", out, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "results.json").read_text())
    runs = summary["runs"]
    assert sorted((r["method"], r["seed"]) for r in runs) == [("CD", 0), ("CD", 1), ("PCD", 0), ("PCD", 1)]
    for r in runs:
        run_dir = Path(r["run_dir"])
        assert ckpt.load(run_dir / "checkpoints" / "last.pt")["step"] == 12
        curve = [
            x["step"] for x in records(run_dir) if "eval/score-loss/test_score_loss" in x and "checkpoint" not in x
        ]
        assert curve == [4, 8, 12]  # the spec's [[eval]] was added and --steps applied
        assert (
            abs(r["final"]["eval/ais-loglik/test_loglik"] - r["final"]["eval/exact-loglik/test_loglik"])
            <= 4 * r["final"]["eval/ais-loglik/test_loglik_stderr"]
        )
    for method in ("CD", "PCD"):
        values = [r["final"]["eval/exact-loglik/test_loglik"] for r in runs if r["method"] == method]
        mean, std = sum(values) / 2, abs(values[0] - values[1]) / math.sqrt(2)
        row = next(line for line in (out / "table.md").read_text().splitlines() if line.startswith(f"| {method} |"))
        assert f"{mean:.4g} ± {std:.2g}" in row
    assert {p.name for p in (out / "images").iterdir()} == {"CD.png", "PCD.png"}
    width, height = Image.open(out / "figure.png").size
    assert width >= 2 * 600 and height > 300 + 440  # the two density plots side by side above the curve plot
    assert (out / "recipes" / "CD.toml").is_file() and len(list((out / "logs").iterdir())) == 4


@pytest.mark.slow
def test_a_killed_comparison_resumes_without_rerunning_finished_runs(tmp_path, monkeypatch):
    """The first comparison finishes CD, gets DSM to step 10 of 20 and is killed. Run again, it
    reuses CD's recorded result without training it, continues DSM from its checkpoint to the
    same parameters and numbers as an uninterrupted run, and tabulates the curve at given steps."""
    from eblvm_experiments import compare as comparison

    spec = write_spec(
        tmp_path,
        f"""
        [compare]
        name = "resumable"
        seeds = 1
        metrics = ["eval/exact-loglik/test_loglik"]
        curve = "eval/exact-loglik/test_loglik"
        table_steps = [10, 20]
        overrides = ["run.eval_every=10", "run.checkpoint_every=10", "data.n_train=500", "data.n_test=200"]

        [[method]]
        name = "CD"
        recipe = "{RECIPES / "grbm_cd.toml"}"

        [[method]]
        name = "DSM"
        recipe = "{RECIPES / "grbm_dsm.toml"}"
        """,
    )
    out = tmp_path / "results"
    real_run_one, trained = comparison.run_one, []

    def killed_at_dsm_step_10(task):
        trained.append(task["method"])
        if task["method"] == "DSM":
            session_run(task["recipe"], [*task["overrides"], "run.steps=10"], "cpu", task["out"], echo=lambda _: None)
            raise KeyboardInterrupt
        return real_run_one(task)

    monkeypatch.setattr(comparison, "run_one", killed_at_dsm_step_10)
    with pytest.raises(KeyboardInterrupt):
        comparison.compare(spec, steps=20, out=out, device="cpu", echo=lambda _: None)
    assert trained == ["CD", "DSM"] and not (out / "results.json").exists()
    (dsm_dir,) = (out / "runs" / "DSM-seed0").iterdir()
    provenance = json.loads((dsm_dir / "run.json").read_text())
    first = provenance["sessions"][0]  # said to have taken 1,000 s longer: the time column must count it
    first["started"] = (
        datetime.datetime.fromisoformat(first["started"]) - datetime.timedelta(seconds=1000)
    ).isoformat()
    (dsm_dir / "run.json").write_text(json.dumps(provenance))

    def counted(task):
        trained.append(task["method"])
        return real_run_one(task)

    monkeypatch.setattr(comparison, "run_one", counted)
    lines: list[str] = []
    comparison.compare(spec, steps=20, out=out, device="cpu", echo=lines.append)
    assert trained == ["CD", "DSM", "DSM"], trained  # CD was not trained again
    assert any("CD seed 0: done earlier" in line for line in lines) and any("continuing" in line for line in lines)
    runs = {r["method"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert [len(list((out / "runs" / name).iterdir())) for name in ("CD-seed0", "DSM-seed0")] == [1, 1]
    resumed = ckpt.load(Path(runs["DSM"]["run_dir"]) / "checkpoints" / "last.pt")
    assert resumed["step"] == 20
    assert 1000 <= runs["DSM"]["seconds"] < 1000 + 300 and runs["CD"]["seconds"] < 300  # both sessions' time

    straight_dir, straight = session_run(
        out / "recipes" / "DSM.toml", ["run.seed=0", "run.name=straight"], "cpu", tmp_path / "x", echo=lambda _: None
    )
    uninterrupted = ckpt.load(straight_dir / "checkpoints" / "last.pt")
    for key, value in uninterrupted["networks"]["model"].items():
        assert torch.equal(resumed["networks"]["model"][key], value), key
    loglik = "eval/exact-loglik/test_loglik"
    assert runs["DSM"]["final"][loglik] == straight[loglik]
    row = next(line for line in (out / "table.md").read_text().splitlines() if line.startswith("| DSM |"))
    at_10 = dict(comparison.learning_curve(straight_dir, loglik))[10]
    assert row.split(" | ")[2:4] == [f"{at_10:.4g}", f"{straight[loglik]:.4g}"], row

    trained.clear()  # a third time: nothing left to train
    comparison.compare(spec, steps=20, out=out, device="cpu", echo=lambda _: None)
    assert trained == []

    # killed after CD finished but before its record was written: CD is "continued" (nothing to
    # train, and said so) and tabulated from its final evaluation
    (out / "done" / "CD-seed0.json").unlink()
    lines.clear()
    comparison.compare(spec, steps=20, out=out, device="cpu", echo=lines.append)
    assert any("CD seed 0: finished earlier, tabulated" in line for line in lines), lines
    assert not any("continuing" in line for line in lines), lines
    again = {r["method"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert trained == ["CD"] and again["CD"]["final"][loglik] == runs["CD"]["final"][loglik]
    assert len(list((out / "runs" / "CD-seed0").iterdir())) == 1

    # --only trains the methods it names and keeps the others' rows: from their records, or, a
    # record lost, from their finished run directories, tabulated without training
    for lost in (False, True):
        if lost:
            (out / "done" / "CD-seed0.json").unlink()
        trained.clear()
        comparison.compare(spec, steps=20, out=out, device="cpu", echo=lambda _: None, only=["DSM"])
        assert trained == (["CD"] if lost else [])  # DSM's record stands, so it is not trained either
        table = (out / "table.md").read_text()
        row = next(line for line in table.splitlines() if line.startswith("| CD |"))
        assert "not run" not in table and f"{runs['CD']['final'][loglik]:.4g}" in row, table
    (cd_dir,) = (out / "runs" / "CD-seed0").iterdir()
    assert len(json.loads((cd_dir / "run.json").read_text())["sessions"]) == 1  # never trained again


@pytest.mark.slow
def test_a_run_stopped_on_a_nan_leaves_the_others_to_finish_and_the_comparison_exits_3(cli, tmp_path):
    """DSM under SGD at rate 2 reaches a NaN log-likelihood at its first evaluation (step 20); in two
    processes, CD's two seeds still train and are tabulated, the stopped runs are named in table.md
    (their row reads "stopped") and in one closing error line, and nothing is recorded for them."""
    spec = write_spec(
        tmp_path,
        f"""
        [compare]
        name = "one_diverges"
        metrics = ["eval/exact-loglik/test_loglik"]
        overrides = ["run.eval_every=20", "run.checkpoint_every=20", "data.n_train=500", "data.n_test=200"]

        [[method]]
        name = "DSM at rate 2"
        recipe = "{RECIPES / "grbm_dsm.toml"}"
        overrides = ["optim.model.kind=\\"sgd\\"", "optim.model.lr=2.0"]

        [[method]]
        name = "CD"
        recipe = "{RECIPES / "grbm_cd.toml"}"
        """,
    )
    out = tmp_path / "results"
    result = cli(["compare", spec, "--seeds", "2", "--jobs", "2", "--steps", "20", "--out", out, "--device", "cpu"])
    assert result.exit_code == 3 and "Traceback" not in result.output, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("error: ")]
    head = f"error: 2 of 4 runs stopped on a NaN or an infinity and are left out of {out / 'table.md'}: "
    assert error.startswith(head), error
    assert sorted(error.removeprefix(head).split(", ")) == ["DSM at rate 2 seed 0", "DSM at rate 2 seed 1"], error
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted((r["method"], r["seed"]) for r in runs) == [("CD", 0), ("CD", 1)]
    assert sorted(p.name for p in (out / "done").iterdir()) == ["CD-seed0.json", "CD-seed1.json"]
    table = (out / "table.md").read_text()
    cd_row = next(line for line in table.splitlines() if line.startswith("| CD |"))
    values = [r["final"]["eval/exact-loglik/test_loglik"] for r in runs]
    assert f"{sum(values) / 2:.4g} ± {abs(values[0] - values[1]) / math.sqrt(2):.2g} | 2 |" in cd_row, table
    assert "| DSM at rate 2 | stopped | 0 | n/a |" in table, table
    for seed in (0, 1):
        assert f"- DSM at rate 2 seed {seed}: step 20: evaluation gave eval/exact-loglik/test_loglik = nan" in table


@pytest.mark.slow
def test_freyface_comparison_selects_best_checkpoints_on_a_stand_in_file(cli, tmp_path):
    """The real freyface spec (two of its methods, a small AIS) on a tiny stand-in .mat file:
    validation-selected best.pt, re-evaluated by the [[final_eval]] evaluators, sample images."""
    import tomli_w

    from eblvm_core.recipe import read
    from tests.plugins.images.test_images import frey_images, write_frey

    spec = read(RECIPES / "compare" / "freyface.toml")
    spec["method"] = [m for m in spec["method"] if m["name"] in ("DSM", "BiDSM N=1")]  # eblvm:NAME recipes
    spec["final_eval"][0].update(n_chains=20, n_temps=20)
    path = tmp_path / "frey.toml"
    path.write_text(tomli_w.dumps(spec))
    write_frey(tmp_path / "frey", frey_images(40))
    tiny = [
        f"data.root={tmp_path / 'frey'}",
        "data.n_train=20",
        "data.n_val=10",
        "data.n_test=10",
        "model.n_hidden=8",
        "run.eval_every=2",
        "sampler.burn_in=5",
        "run.batch_size=10",
    ]
    out = tmp_path / "results"
    result = cli(["compare", path, "--steps", "6", "--out", out, *[a for o in tiny for a in ("-o", o)]])
    assert result.exit_code == 0, result.output
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ["DSM", "BiDSM N=1"]
    for r in runs:
        run_dir = Path(r["run_dir"])
        vals = [
            (x["step"], x["eval/score-loss/val_score_loss"])
            for x in records(run_dir)
            if "eval/score-loss/val_score_loss" in x and "checkpoint" not in x
        ]
        assert [s for s, _ in vals] == [2, 4, 6]  # only the spec's [[eval]] ran during training
        best_step = min(vals, key=lambda sv: sv[1])[0]
        assert ckpt.load(run_dir / "checkpoints" / "best.pt")["step"] == best_step
        ais_keys = ["test_loglik", "test_loglik_stderr", "test_loglik_reverse", "log_z", "log_z_stderr", "log_z_ess"]
        ais_keys += ["log_z_reverse", "log_z_reverse_stderr", "log_z_reverse_ess", "log_z_gap"]
        assert set(r["final"]) == {f"eval/ais-loglik/{k}" for k in ais_keys} | {
            "eval/score-loss/test_score_loss",
            "eval/score-loss/test_score_loss_stderr",
        }
        assert records(run_dir)[-1]["checkpoint"] == "best" and records(run_dir)[-1]["step"] == best_step
    # 64 faces, 8 to a row, each pixel 4 × 4 so that a 20-pixel-wide face is 80 pixels wide
    assert Image.open(out / "images" / "DSM.png").size == (4 * (8 * 20 + 9 * 2), 4 * (8 * 28 + 9 * 2))
    assert (out / "figure.png").is_file() and "| BiDSM N=1 |" in (out / "table.md").read_text()


def test_compare_spec_errors_name_the_file(cli, tmp_path):
    spec = write_spec(
        tmp_path,
        f"""
        [compare]
        metric = ["x"]

        [[method]]
        name = "CD"
        recipe = "{RECIPES / "grbm_cd.toml"}"
        """,
    )
    result = cli(["compare", spec])
    assert result.exit_code == 2 and str(spec) in result.output and "did you mean 'metrics'" in result.output
    spec = write_spec(
        tmp_path,
        f"""
        [[method]]
        name = "CD"
        recipe = "{RECIPES / "grbm_cd.toml"}"
        overrides = ["estimator.kk=2"]
        """,
    )
    result = cli(["compare", spec])
    assert result.exit_code == 2 and "grbm_cd.toml" in result.output and "[estimator] kk" in result.output


def test_a_copied_spec_finds_its_recipes_relative_to_itself(cli, tmp_path, monkeypatch):
    """The bundled checkerboard spec, copied with the recipes and naming them by relative path,
    finds the copies beside it from any working directory (the repository's root included); a
    recipe missing there is one line naming the spec, the method and the place looked at."""
    import re
    import shutil

    from eblvm_experiments.spec import load_spec

    recipes = Path(shutil.copytree(RECIPES, tmp_path / "recipes"))
    copy = recipes / "compare" / "checkerboard.toml"
    copy.write_text(re.sub(r'"eblvm:(\w+)"', r'"../\1.toml"', copy.read_text()))
    (recipes / "grbm_dsm.toml").write_text(
        (RECIPES / "grbm_dsm.toml").read_text().replace("steps = 20000", "steps = 7")
    )
    for folder in (RECIPES.parent, tmp_path):
        monkeypatch.chdir(folder)
        spec = load_spec(copy)
        assert spec.recipe_paths["DSM"] == recipes / "grbm_dsm.toml" and len(spec.methods) == 12
        assert spec.recipes["DSM"]["run"]["steps"] == 7
    assert cli(["validate", copy]).exit_code == 0
    (recipes / "grbm_ssm.toml").unlink()
    result = cli(["compare", copy, "--steps", "1"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    line = result.output.strip()
    assert f"{copy}: [method.1] recipe: no recipe file '../grbm_ssm.toml': {copy.parent / '../grbm_ssm.toml'}" in line


def test_curve_axis_fits_the_data_and_marks_clipping():
    """A short run entirely below curve_range keeps its later half in view (not flattened onto the
    clip value); earlier excursions are clipped and drawn as triangles; no range fits everything."""
    from eblvm_experiments.compare import curve_axis
    from eblvm_experiments.figures import comparison

    from eblvm.tools import render

    curves = {"short": [(1, -3.0), (2, -1.5), (3, -1.2), (4, -1.1)], "long": [(1, -0.9), (2, 0.1), (3, 0.2), (4, 0.3)]}
    lo, hi = curve_axis(curves, [-0.6, 0.7])
    assert -1.5 < lo < -1.2 and 0.3 < hi < 0.7  # the later half (-1.2, -1.1) in view, -3 and -1.5 clipped
    lo, hi = curve_axis(curves, None)
    assert -3.5 < lo < -3.0 and 0.3 < hi < 0.5  # the whole range and a 5% margin
    # most curves end inside the range: one that diverged is clipped rather than squashing them
    many = {
        **curves,
        "also": [(1, -0.5), (2, 0.0), (3, 0.25), (4, 0.32)],
        "diverged": [(1, -1.0), (2, -5.0), (3, -9.0), (4, -10.0)],
    }
    many["short"] = curves["long"]
    lo, hi = curve_axis(many, [-0.6, 0.7])
    assert -0.7 < lo <= -0.6 and 0.3 < hi < 0.4
    # drawn: tab:blue is the first method's colour, the short run's
    fig = comparison([], curves, "eval/x", curve_axis(curves, [-0.6, 0.7]))
    (ax,) = fig.axes
    image = render(fig)
    left, bottom, right, top = ax.get_window_extent().extents
    bottom, top = image.shape[1] - bottom, image.shape[1] - top  # rows from the top of the image
    blue = ((image * 255 - torch.tensor([31, 119, 180])[:, None, None]).abs().max(0).values < 10).nonzero()
    rows = blue[blue[:, 1] < right][:, 0]  # the plot area, not the legend
    assert rows.max() - rows.min() > 30  # the short run is not a flat line (that spans 2-4 pixels)
    assert (rows > bottom + 1).sum() > 4  # clipped points: triangles reaching below the frame's bottom edge
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["short", "long"]
    assert "clipped (triangles on the edge): 2 below the axis" in ax.get_title()

    fig = comparison([], curves, "eval/x", curve_axis(curves, None))
    plain = render(fig)
    bottom = plain.shape[1] - fig.axes[0].get_window_extent().y0
    blue = ((plain * 255 - torch.tensor([31, 119, 180])[:, None, None]).abs().max(0).values < 10).nonzero()
    assert not (blue[blue[:, 1] < right][:, 0] > bottom + 1).any()  # nothing clipped without a range
    assert "clipped" not in fig.axes[0].get_title()


@pytest.mark.parametrize("spec", sorted(p.name for p in (RECIPES / "compare").glob("*.toml")))
def test_comparison_specs_validate(spec, monkeypatch):
    from eblvm_experiments.spec import load_spec

    monkeypatch.chdir(RECIPES.parent)

    loaded = load_spec(RECIPES / "compare" / spec)
    assert len(loaded.methods) >= 2


@pytest.mark.slow
def test_seed_offset_trains_the_named_seeds(cli, tmp_path):
    """--seed-offset 3 --seeds 1 trains seed 3 only, and its model is the one `run` trains with
    run.seed=3 (and not seed 0's)."""
    spec = write_spec(
        tmp_path,
        f"""
        [compare]
        name = "offset"
        seeds = 1
        metrics = ["eval/exact-loglik/test_loglik"]
        overrides = ["data.n_train=300", "data.n_test=100"]

        [[method]]
        name = "DSM"
        recipe = "{RECIPES / "grbm_dsm.toml"}"
        """,
    )
    out = tmp_path / "results"
    result = cli(["compare", spec, "--seed-offset", "3", "--steps", "6", "--out", out, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (record,) = json.loads((out / "results.json").read_text())["runs"]
    assert record["seed"] == 3 and Path(record["run_dir"]).parent.name == "DSM-seed3"
    compared = ckpt.load(Path(record["run_dir"]) / "checkpoints" / "last.pt")["networks"]["model"]
    for seed, same in ((3, True), (0, False)):
        run_dir, _ = session_run(
            out / "recipes" / "DSM.toml", [f"run.seed={seed}", "run.steps=6"], "cpu", tmp_path / f"s{seed}", echo=print
        )
        direct = ckpt.load(run_dir / "checkpoints" / "last.pt")["networks"]["model"]
        assert all(torch.equal(compared[k], direct[k]) for k in direct) == same, seed
