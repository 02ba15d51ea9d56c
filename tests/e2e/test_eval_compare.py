"""Commands on finished runs (``eblvm eval``, ``eblvm sample``), best-checkpoint selection,
resume of the baselines' estimator state, and ``eblvm compare`` end to end."""

from __future__ import annotations

import datetime
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import DataSplits
from tests.support import RECIPES

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
    assert Image.open(path).size[0] > 256 and torch.load(tmp_path / "s.pt").shape == (50, 2)
    assert cli(["sample", tiny_run, "-n", "5", "--checkpoint", "best"]).exit_code == 0
    assert (tiny_run / "samples.png").is_file() and (tiny_run / "samples.pt").is_file()
    result = cli(["sample", tiny_run, "--out", tmp_path / "s.npy"])
    assert result.exit_code == 2 and "name an image file" in result.output


FREY_GRID = """
log = []

[run]
name = "frey"
seed = 0
steps = 4
batch_size = 10

[data]
kind = "freyface"
root = "ROOT"
n_train = 20
n_val = 10
n_test = 10

[model]
kind = "grbm"
n_hidden = 3
init_sigma = 0.3
init_weight_std = 0.5

[objective]
kind = "dsm"
sigma = 0.3

[estimator]
kind = "exact-score"

[optim.model]
kind = "adam"
lr = 1e-3

[[eval]]
kind = "sample-grid"
n = 4
sampler_options = { final_mean = true, burn_in = 5 }
"""


def test_sample_uses_the_recipes_sampler_settings_and_saves_the_raw_samples(cli, write_recipe, tmp_path):
    """With the sample-grid's final_mean = true every sample is a mean of p(v|h), b + σ²Wh for one of
    the 2^3 hidden states, as in TensorBoard; -o final_mean=false gives noisy draws instead. The raw
    samples (.pt, .npy) are the image's, (n, 1, 28, 20), and equal for one seed."""
    import itertools

    import numpy as np

    from tests.plugins.images.test_images import frey_images, write_frey

    write_frey(tmp_path / "frey", frey_images(40))
    out = tmp_path / "runs"
    recipe = write_recipe(FREY_GRID.replace("ROOT", str(tmp_path / "frey")))
    assert cli(["run", recipe, "--out", out, "--device", "cpu"]).exit_code == 0
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    result = cli(["sample", run_dir, "-n", "6", "--out", tmp_path / "a.png"])
    assert result.exit_code == 0 and "[eval.0] sample-grid" in result.output, result.output
    samples = torch.load(tmp_path / "a.pt")
    assert samples.shape == (6, 1, 28, 20) and (tmp_path / "a.png").is_file()
    model = ckpt.load(run_dir / "checkpoints" / "last.pt")["networks"]["model"]
    sigma = model["log_sigma"].exp()
    states = torch.tensor(list(itertools.product([0.0, 1.0], repeat=3)))  # (8, 3)
    means = model["b"] + sigma**2 * states @ model["W"].T  # (8, 560): E[v|h] with the plain coupling
    distance = torch.cdist(samples.reshape(6, 560).double(), means.double()).min(1).values
    assert distance.max() < 1e-4

    result = cli(
        [
            "sample",
            run_dir,
            "-n",
            "6",
            "--out",
            tmp_path / "b.png",
            "--raw",
            "npy",
            "-o",
            "eval.0.sampler_options.final_mean=false",
        ]
    )
    assert result.exit_code == 0, result.output
    noisy = torch.from_numpy(np.load(tmp_path / "b.npy"))
    assert noisy.shape == (6, 1, 28, 20)
    assert torch.cdist(noisy.reshape(6, 560).double(), means.double()).min(1).values.min() > 0.3 * math.sqrt(560) / 2

    again = cli(["sample", run_dir, "-n", "6", "--out", tmp_path / "c.png", "--raw", "npy"])
    assert again.exit_code == 0 and torch.equal(torch.from_numpy(np.load(tmp_path / "c.npy")), samples)
    refused = cli(["sample", run_dir, "-o", "model.n_hidden=5"])
    assert refused.exit_code == 2 and "[model] n_hidden" in refused.output and "cannot change" in refused.output


@pytest.mark.slow
def test_eval_options_address_the_named_evaluators(cli, tiny_run):
    """-e replaces the recipe's [[eval]] list, so eval.0 is the first -e: AIS with 7 chains has an
    effective sample size of at most 7 (the default 2,000 chains would give far more)."""
    result = cli(["eval", tiny_run, "-e", "ais-loglik", "-e", "exact-loglik", "-o", "eval.0.n_chains=7"])
    assert result.exit_code == 0, result.output
    out = scalars(result.output)
    assert 1 <= out["ais-loglik/log_z_ess"] <= 7 and "exact-loglik/test_loglik" in out
    assert "AIS: 7 chains × 2,000 temperatures" in result.output  # announced before it starts
    result = cli(["eval", tiny_run, "-e", "exact-loglik", "-o", "eval.0.n_chains=7"])
    assert result.exit_code == 2 and "[eval.0] n_chains" in result.output  # exact-loglik has no n_chains
    assert len(result.output.strip().splitlines()) == 1


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
    """2-D samples: a scatter with y upwards and a far point drawn in red on the view's right edge,
    beyond the bounds' red box; images: a grid upscaled until each image is 64 pixels wide."""
    from eblvm_core.evaluate import samples_image
    from eblvm_core.plot import BOUNDS_COLOUR, POINT_COLOUR

    def dots(image: Tensor, colour: tuple[int, ...]) -> Tensor:
        return ((image - torch.tensor(colour)[:, None, None] / 255).abs().max(0).values < 0.02).nonzero()

    box = ((0.0, 1.0), (0.0, 1.0))
    image = samples_image(
        torch.tensor([[0.9, 0.9], [0.1, 0.1], [40.0, 0.5]]),
        DataSplits(train=torch.rand(5, 2), test=torch.rand(5, 2), bounds=box),
    )
    assert image.shape[0] == 3 and 0 <= image.min() and image.max() <= 1
    inside = dots(image, POINT_COLOUR)
    inside = inside[inside[:, 0] < image.shape[1] - 60]  # the plot, not the legend's marker below it
    top_right = inside[inside[:, 1] > inside[:, 1].float().mean()]
    bottom_left = inside[inside[:, 1] < inside[:, 1].float().mean()]
    assert len(top_right) >= 9 and len(bottom_left) >= 9  # two dots: the far point is not among them ...
    assert top_right[:, 0].max() < bottom_left[:, 0].min()  # y points up
    red = dots(image, BOUNDS_COLOUR)
    red = red[red[:, 0] < image.shape[1] - 60]
    far = red[red[:, 1] == red[:, 1].max()]  # ... it is red, at the right edge, right of the bounds' red box
    assert red[:, 1].max() > top_right[:, 1].max() + 50 and len(far) < 10
    assert top_right[:, 0].max() < far[:, 0].float().mean() < bottom_left[:, 0].min()  # at y = 0.5
    faces = DataSplits(train=torch.rand(10, 1, 28, 20), test=torch.rand(2, 1, 28, 20))
    grid = samples_image(torch.rand(16, 1, 28, 20), faces)
    assert grid.shape == (3, 4 * (4 * 28 + 5 * 2), 4 * (4 * 20 + 5 * 2)) and 0 <= grid.min() and grid.max() <= 1
    assert samples_image(torch.rand(16, 1, 28, 20), faces, scale=1).shape == (3, 4 * 28 + 5 * 2, 4 * 20 + 5 * 2)


@pytest.mark.parametrize("estimator", ['kind = "pcd"\nn_chains = 30', 'kind = "nce"', 'kind = "vnce"\ninner_steps = 2'])
def test_resume_restores_the_estimator_state(write_recipe, tmp_path, estimator):
    """PCD's chains, NCE's log-normaliser and VNCE's posterior and optimizers round-trip:
    10 + 10 resumed steps equal 20 uninterrupted ones."""
    from eblvm_core.session import run

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
    from eblvm_core.experiments import compare as comparison
    from eblvm_core.session import run as train

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
            train(task["recipe"], [*task["overrides"], "run.steps=10"], "cpu", task["out"], echo=lambda _: None)
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

    straight_dir, straight = train(
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


def test_a_copied_spec_finds_its_recipes_from_the_working_directory(cli, tmp_path, monkeypatch):
    """The bundled checkerboard spec, copied elsewhere, finds recipes/... from the project's root; a
    recipe beside the spec wins; a recipe found in neither place is one line naming both."""
    import shutil

    from eblvm_core.experiments.compare import load_spec

    root = RECIPES.parent
    copy = tmp_path / "mine" / "spec.toml"
    copy.parent.mkdir()
    shutil.copy(RECIPES / "compare" / "checkerboard.toml", copy)
    monkeypatch.chdir(root)
    spec = load_spec(copy)
    assert spec.recipe_paths["DSM"] == RECIPES / "grbm_dsm.toml" and len(spec.methods) == 12
    assert cli(["validate", copy]).exit_code == 0
    beside = copy.parent / "recipes" / "grbm_dsm.toml"
    beside.parent.mkdir()
    beside.write_text((RECIPES / "grbm_dsm.toml").read_text().replace("steps = 20000", "steps = 7"))
    spec = load_spec(copy)
    assert spec.recipe_paths["DSM"] == beside.resolve() and spec.recipes["DSM"]["run"]["steps"] == 7
    monkeypatch.chdir(tmp_path)
    result = cli(["compare", copy, "--steps", "1"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    line = result.output.strip()
    assert f"{copy}: [method.1] recipe: no recipe file 'recipes/grbm_ssm.toml'" in line
    assert (
        str(copy.parent / "recipes" / "grbm_ssm.toml") in line and str(tmp_path / "recipes" / "grbm_ssm.toml") in line
    )


def test_curve_axis_fits_the_data_and_marks_clipping():
    """A short run entirely below curve_range keeps its later half in view (not flattened onto the
    clip value); earlier excursions are clipped and drawn as triangles; no range fits everything."""
    from eblvm_core.experiments.compare import curve_axis
    from eblvm_core.plot import comparison, render

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


@pytest.mark.parametrize("name", ["grbm_cd", "grbm_pcd", "grbm_nce", "grbm_vnce"])
def test_baseline_recipes_validate(name):
    from eblvm_core.recipe import load_recipe

    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert recipe.run.steps == load_recipe(RECIPES / "grbm_dsm.toml").run.steps


@pytest.mark.parametrize("spec", sorted(p.name for p in (RECIPES / "compare").glob("*.toml")))
def test_comparison_specs_validate(spec, monkeypatch):
    from eblvm_core.experiments.compare import load_spec

    monkeypatch.chdir(RECIPES.parent)  # specs may name recipes from the project's root

    loaded = load_spec(RECIPES / "compare" / spec)
    assert len(loaded.methods) >= 2


def test_seed_offset_trains_the_named_seeds(cli, tmp_path):
    """--seed-offset 3 --seeds 1 trains seed 3 only, and its model is the one `run` trains with
    run.seed=3 (and not seed 0's)."""
    from eblvm_core.session import run as train

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
        run_dir, _ = train(
            out / "recipes" / "DSM.toml", [f"run.seed={seed}", "run.steps=6"], "cpu", tmp_path / f"s{seed}", echo=print
        )
        direct = ckpt.load(run_dir / "checkpoints" / "last.pt")["networks"]["model"]
        assert all(torch.equal(compared[k], direct[k]) for k in direct) == same, seed
