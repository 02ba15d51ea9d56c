"""Commands on finished runs (``eblvm eval``, ``eblvm sample``), best-checkpoint selection,
resume of the baselines' estimator state; ``eblvm compare`` is tested with its plugin
(tests/plugins/experiments)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import DataSplits
from tests.support import RECIPES, scalars, session_run

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


@pytest.mark.slow
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
    from eblvm_core.plot import BOUNDS_COLOUR, POINT_COLOUR
    from eblvm_core.saved import samples_image

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
    full, _ = session_run(recipe, ["run.steps=20"], out=tmp_path / "full", echo=quiet)
    part, _ = session_run(recipe, ["run.steps=10"], out=tmp_path / "part", echo=quiet)
    session_run(None, ["run.steps=20"], resume=part, echo=quiet)
    a, b = ckpt.load(full / "checkpoints" / "last.pt"), ckpt.load(part / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 20
    for section, values in [*a["networks"].items(), ("estimator", a["estimator"])]:
        for key in values:
            compared = b["estimator"] if section == "estimator" else b["networks"][section]
            assert torch.equal(values[key], compared[key]), (section, key)
    assert set(a["networks"]) == ({"model", "posterior"} if "vnce" in estimator else {"model"})


@pytest.mark.parametrize("name", ["grbm_cd", "grbm_pcd", "grbm_nce", "grbm_vnce"])
def test_baseline_recipes_validate(name):
    from eblvm_core.recipe import load_recipe

    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert recipe.run.steps == load_recipe(RECIPES / "grbm_dsm.toml").run.steps
