"""Commands on finished runs (``eblvm eval``, ``eblvm sample``), best-checkpoint selection,
resume of the baselines' estimator state, and ``eblvm compare`` end to end."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import DataSplits

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

TINY_CD = """
log = []

[run]
name = "tiny"
seed = 3
steps = 30
batch_size = 50
log_every = 10
eval_every = 10
checkpoint_every = 10
select_metric = "eval/exact-loglik/test_loglik"

[data]
kind = "checkerboard"
n_train = 1000
n_test = 300

[model]
kind = "grbm"
n_hidden = 3

[estimator]
kind = "cd"
k = 1

[optim.model]
kind = "adam"
lr = 3e-2

[[eval]]
kind = "exact-loglik"

[[eval]]
kind = "ais-loglik"
n_chains = 200
n_temps = 200
"""


def scalars(output: str) -> dict[str, float]:
    """'name: value' lines of a command's output."""
    found = {}
    for line in output.splitlines():
        key, sep, value = line.partition(": ")
        try:
            found[key] = float(value)
        except ValueError:
            continue
    return found


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def tiny_run(cli, write_recipe, tmp_path) -> Path:
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(TINY_CD), "--out", out, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    return run_dir


def test_best_checkpoint_holds_the_best_validation_value(cli, tiny_run):
    evals = [r["eval/exact-loglik/test_loglik"] for r in records(tiny_run) if "eval/exact-loglik/test_loglik" in r]
    assert len(evals) == 3  # steps 10, 20 and the final evaluation at 30
    best = ckpt.load(tiny_run / "checkpoints" / "best.pt")
    assert best["best"] == max(evals) and best["step"] == 10 * (evals.index(max(evals)) + 1)

    result = cli(["eval", tiny_run, "--checkpoint", "best", "-e", "exact-loglik"])
    assert result.exit_code == 0, result.output
    assert scalars(result.output)["exact-loglik/test_loglik"] == pytest.approx(max(evals), rel=1e-5)
    last = records(tiny_run)[-1]
    assert last["checkpoint"] == "best" and last["step"] == best["step"]


def test_eval_reruns_the_recipes_evaluators_on_the_last_checkpoint(cli, tiny_run):
    final = [r for r in records(tiny_run) if r["step"] == 30 and "eval/exact-loglik/test_loglik" in r][-1]
    result = cli(["eval", tiny_run, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    out = scalars(result.output)
    assert out["exact-loglik/test_loglik"] == pytest.approx(final["eval/exact-loglik/test_loglik"], rel=1e-5)
    assert out["ais-loglik/test_loglik"] == pytest.approx(final["eval/ais-loglik/test_loglik"], rel=1e-5)  # seeded
    assert (
        abs(out["ais-loglik/test_loglik"] - out["exact-loglik/test_loglik"]) <= 4 * out["ais-loglik/test_loglik_stderr"]
    )
    appended = records(tiny_run)[-1]
    assert appended["checkpoint"] == "last" and appended["step"] == 30
    assert set(appended) >= {"eval/exact-loglik/test_loglik", "eval/ais-loglik/log_z"}

    named = cli(["eval", tiny_run, "-e", "score-loss", "-e", "density-plot"])
    assert named.exit_code == 0, named.output
    assert "score-loss/test_score_loss" in scalars(named.output) and "exact-loglik/test_loglik" not in named.output
    assert (tiny_run / "eval" / "density-plot-density-step30.png").is_file()


def test_sample_writes_an_image(cli, tiny_run, tmp_path):
    path = tmp_path / "s.png"
    result = cli(["sample", tiny_run, "-n", "50", "--out", path, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert Image.open(path).size == (256, 256)
    assert cli(["sample", tiny_run, "-n", "5", "--checkpoint", "best"]).exit_code == 0
    assert (tiny_run / "samples.png").is_file()


def test_command_errors_are_one_line(cli, tiny_run, tmp_path):
    result = cli(["eval", tmp_path])
    assert result.exit_code == 2 and "has no recipe.toml" in result.output
    result = cli(["eval", tiny_run, "--checkpoint", tmp_path / "nope.pt"])
    assert result.exit_code == 2 and "no checkpoint" in result.output
    result = cli(["eval", tiny_run, "-e", "ais-logik"])
    assert result.exit_code == 2 and "did you mean 'ais-loglik'" in result.output
    result = cli(["sample", tiny_run, "--sampler", "nope"])
    assert result.exit_code == 2 and "unknown sampler" in result.output


def test_select_metric_must_be_reported(cli, write_recipe, tmp_path):
    text = TINY_CD.replace('"eval/exact-loglik/test_loglik"', '"eval/exact-loglik/val_loglik"')
    result = cli(["run", write_recipe(text), "--out", tmp_path / "runs", "-o", "run.steps=10"])
    assert result.exit_code == 2
    assert "select_metric" in result.output and "no evaluator reports 'eval/exact-loglik/val_loglik'" in result.output


def test_samples_image_layouts():
    from eblvm_core.evaluate import samples_image, scatter_image

    image = scatter_image(torch.tensor([[0.9, 0.9]]), ((0.0, 1.0), (0.0, 1.0)), size=100)
    dark = (image[0] < 0.5).nonzero()
    assert len(dark) == 9 and dark[:, 0].max() < 15 and dark[:, 1].min() > 85  # top right: y points up
    faces = DataSplits(train=torch.rand(10, 1, 28, 20), test=torch.rand(2, 1, 28, 20))
    grid = samples_image(torch.rand(16, 1, 28, 20), faces)
    assert grid.shape == (3, 4 * 28 + 5 * 2, 4 * 20 + 5 * 2) and 0 <= grid.min() and grid.max() <= 1


@pytest.mark.parametrize("estimator", ['kind = "pcd"\nn_chains = 30', 'kind = "nce"', 'kind = "vnce"\ninner_steps = 2'])
def test_resume_restores_the_estimator_state(write_recipe, tmp_path, estimator):
    """PCD's chains, NCE's log-normaliser and VNCE's posterior and optimizers round-trip:
    10 + 10 resumed steps equal 20 uninterrupted ones."""
    from eblvm_core.trainer import run

    extra = (
        '\n[posterior]\nkind = "bernoulli"\n\n[divergence]\nkind = "kl"\n\n[optim.posterior]\nkind = "adam"\n'
        if "vnce" in estimator
        else ""
    )
    text = TINY_CD.replace('kind = "cd"\nk = 1', estimator).replace("[optim.model]", extra + "\n[optim.model]")
    recipe = write_recipe(
        text.replace('select_metric = "eval/exact-loglik/test_loglik"\n', "").replace(
            '[[eval]]\nkind = "ais-loglik"\nn_chains = 200\nn_temps = 200\n', ""
        )
    )
    quiet = lambda _msg: None  # noqa: E731
    full, _ = run(recipe, ["run.steps=20"], out=tmp_path / "full", echo=quiet)
    part, _ = run(recipe, ["run.steps=10"], out=tmp_path / "part", echo=quiet)
    run(None, ["run.steps=20"], resume=part, echo=quiet)
    a, b = ckpt.load(full / "checkpoints" / "last.pt"), ckpt.load(part / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 20
    for section, values in [*a["networks"].items(), ("estimator", a["estimator"])]:
        for key in values:
            compared = b["estimator"] if section == "estimator" else b["networks"][section]
            assert torch.equal(values[key], compared[key]), (section, key)
    assert set(a["networks"]) == ({"model", "posterior"} if "vnce" in estimator else {"model"})


# ---- compare ---------------------------------------------------------------------------------


def write_spec(folder: Path, body: str) -> Path:
    path = folder / "spec.toml"
    path.write_text(textwrap.dedent(body))
    return path


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
    assert width >= 640 and height > 360  # the density row above the curve plot
    assert (out / "recipes" / "CD.toml").is_file() and len(list((out / "logs").iterdir())) == 4


def test_freyface_comparison_selects_best_checkpoints_on_a_stand_in_file(cli, tmp_path):
    """The real freyface spec (two of its methods, a small AIS) on a tiny stand-in .mat file:
    validation-selected best.pt, re-evaluated by the [[final_eval]] evaluators, sample images."""
    import tomli_w

    from eblvm_core.recipe import read
    from tests.test_images import frey_images, write_frey

    spec = read(RECIPES / "compare" / "freyface.toml")
    spec["method"] = [m for m in spec["method"] if m["name"] in ("DSM", "BiDSM N=1")]
    for method in spec["method"]:
        method["recipe"] = str(RECIPES / "compare" / method["recipe"])
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
    assert Image.open(out / "images" / "DSM.png").size == (8 * 20 + 9 * 2, 8 * 28 + 9 * 2)  # 64 faces
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


@pytest.mark.parametrize("name", ["grbm_cd", "grbm_pcd", "grbm_nce", "grbm_vnce"])
def test_baseline_recipes_validate(name):
    from eblvm_core.recipe import load_recipe

    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert recipe.run.steps == load_recipe(RECIPES / "grbm_dsm.toml").run.steps


@pytest.mark.parametrize("spec", sorted(p.name for p in (RECIPES / "compare").glob("*.toml")))
def test_comparison_specs_validate(spec):
    from eblvm_core.compare import load_spec

    loaded = load_spec(RECIPES / "compare" / spec)
    assert len(loaded.methods) >= 2
