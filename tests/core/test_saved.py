"""saved.py: work on a saved run. Which checkpoint (``resolve_checkpoint``: last, best, step:N),
``load_run`` and ``LoadedRun`` (evaluate, sample, the sampler ``pick_sampler`` chooses) and
``record`` (metrics.jsonl, the run's loggers at the checkpoint's step)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import attrs
import pytest
import torch

import eblvm
from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import EvalResult
from eblvm_core.errors import ConfigError, EblvmError
from eblvm_core.saved import load_run, pick_sampler, record, resolve_checkpoint, sample_run, samples_image
from tests.support import SMALL_RECIPE, metrics_rows, only_run_dir, scalars, train_small

quiet = None  # echo=None: nothing printed

KEEP = SMALL_RECIPE.replace("steps = 30", "steps = 40").replace(
    "checkpoint_every = 10", "checkpoint_every = 30\neval_every = 20\nkeep_every = 20"
)


# ---- which checkpoint ----------------------------------------------------------------------------


def test_a_missing_kept_checkpoint_names_those_kept(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    assert cli(["run", write_recipe(KEEP), "--out", out]).exit_code == 0
    run_dir = only_run_dir(out)
    result = cli(["eval", run_dir, "--checkpoint", "step:30"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert f"no checkpoint step:30 in {run_dir}: kept: step:20, step:40" in result.output
    result = cli(["eval", run_dir, "--checkpoint", "step:x"])
    assert result.exit_code == 2 and "step:N takes a step number" in result.output
    assert cli(["run", write_recipe(SMALL_RECIPE), "--out", tmp_path / "none"]).exit_code == 0
    result = cli(["eval", only_run_dir(tmp_path / "none"), "--checkpoint", "step:10"])
    assert result.exit_code == 2 and "none is kept ([run] keep_every = N" in result.output


# ---- recording an evaluation ---------------------------------------------------------------------


def test_eval_results_reach_the_runs_tensorboard_at_the_checkpoints_step(cli, write_recipe, tmp_path):
    """An evaluator the training did not run, on step:20, shows in the run's TensorBoard at step 20
    with the printed value and its image; what the training logged stays, none of it purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "runs"
    assert cli(["run", write_recipe(KEEP), "--out", out]).exit_code == 0
    run_dir = only_run_dir(out)
    result = cli(["eval", run_dir, "--checkpoint", "step:20", "-e", "score-loss", "-e", "density-plot"])
    assert result.exit_code == 0, result.output
    assert "and its [[log]] (tensorboard)" in result.output
    printed = scalars(result.output)["score-loss/test_score_loss"]
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    (point,) = events.Scalars("eval/score-loss/test_score_loss")
    assert point.step == 20 and f"{point.value:.6g}" == f"{printed:.6g}"
    assert [i.step for i in events.Images("eval/density-plot/density")] == [20]
    assert [s.step for s in events.Scalars("train/loss")] == [10, 20, 30, 40]
    assert [s.step for s in events.Scalars("eval/exact-loglik/test_loglik")] == [20, 40]


def test_record_does_what_eblvm_eval_does(tmp_path):
    run = eblvm.train(tomllib.loads(SMALL_RECIPE), out=tmp_path / "runs", echo=quiet)
    before = len(run.history())
    run.evaluate(echo=quiet)
    assert len(run.history()) == before, "evaluate() alone writes nothing"
    result = run.evaluate(record=True, echo=quiet)
    row = run.history()[-1]
    assert row["checkpoint"] == "last" and row["step"] == 30
    assert {k: v for k, v in row.items() if k.startswith("eval/")} == result.scalars
    assert eblvm.Run(run.run_dir).metrics == run.metrics, "rows of eblvm eval are not the final evaluation"


# ---- on a run trained once ------------------------------------------------------------------------


def test_which_checkpoint_last_best_step_or_a_path(trained, tmp_path):
    assert resolve_checkpoint(trained, "last") == ckpt.last_checkpoint(trained)
    with pytest.raises(
        EblvmError, match=r"best.pt \(best.pt exists only when the recipe's \[run\] sets select_metric\)"
    ):
        resolve_checkpoint(trained, "best")
    with pytest.raises(EblvmError, match=r"no checkpoint step:10 in .*: none is kept"):
        resolve_checkpoint(trained, "step:10")
    with pytest.raises(EblvmError, match=r"step:N takes a step number, e.g. step:5000"):
        resolve_checkpoint(trained, "step:-1")
    copy = shutil.copy(ckpt.last_checkpoint(trained), tmp_path / "elsewhere.pt")
    assert resolve_checkpoint(trained, str(copy)) == Path(copy)
    with pytest.raises(EblvmError, match=f"no checkpoint {tmp_path / 'gone.pt'}$"):
        resolve_checkpoint(trained, str(tmp_path / "gone.pt"))
    kept = ckpt.kept_checkpoint(tmp_path, 20)
    kept.parent.mkdir()
    kept.write_bytes(b"")
    assert resolve_checkpoint(tmp_path, "step:20") == kept


def test_a_loaded_run_holds_the_checkpoints_networks_in_eval_mode(trained):
    said = []
    run = load_run(trained.parent, echo=said.append)
    assert said == [f"{trained.parent}: a run name's folder; using its one run: {trained}"]
    assert run.run_dir == trained and run.step == 30 and run.checkpoint == "last" and run.seed == 0
    saved = ckpt.load(ckpt.last_checkpoint(trained))["networks"]["model"]
    assert run.model is run.parts.model and not run.model.training and run.posterior is None
    assert all(torch.equal(value, saved[key]) for key, value in run.model.state_dict().items())
    assert run.recipe.run.select_metric is None and run.recipe.run.patience is None


def test_a_loaded_run_may_not_change_what_was_trained(trained):
    with pytest.raises(ConfigError, match=r"\[model\] n_hidden: cannot change when evaluating a trained run"):
        load_run(trained, overrides=["model.n_hidden=8"])
    run = load_run(trained, overrides=["sampler.kind=gibbs", "sampler.burn_in=5", "eval.0.split=train"])
    assert pick_sampler(run)[1] == "gibbs ([sampler])" and run.parts.sampler.cfg.burn_in == 5  # [sampler] may change
    assert list(run.evaluate(echo=None).scalars) == [
        "eval/exact-loglik/train_loglik",
        "eval/exact-loglik/train_loglik_stderr",
    ]


def test_evaluations_and_samples_repeat_for_a_seed(trained):
    run = load_run(trained, overrides=["sampler.kind=gibbs", "sampler.burn_in=3"])
    first = run.evaluate(echo=None)
    assert run.evaluate(echo=None).scalars == first.scalars
    samples = run.sample(6)
    assert samples.shape == (6, 2) and torch.equal(run.sample(6), samples)
    assert torch.equal(run.sample(6, seed=0), samples) and not torch.equal(run.sample(6, seed=1), samples)
    again, image, source = sample_run(run, 6)
    assert torch.equal(again.samples, samples) and source == "gibbs ([sampler])" and image.shape[0] == 3


def test_the_sampler_comes_from_the_recipe_an_evaluator_or_the_models_default(trained):
    """[sampler] first; else the first [[eval]] that samples (its sampler and sampler_options);
    else the sampler registered as the default for the model kind, with its defaults."""
    from eblvm_core.plugins import load
    from eblvm_core.recipe import Section

    run = load_run(trained)
    sampler, source = pick_sampler(run)
    assert source == "gibbs (defaults)" and sampler.cfg.burn_in == 1000
    entry = load()["evaluators"].get("sample-grid")
    grid = entry.config(sampler="gibbs", sampler_options={"burn_in": 7})
    run.recipe = attrs.evolve(run.recipe, evals=[*run.recipe.evals, Section("eval.1", entry, grid)])
    sampler, source = pick_sampler(run)
    assert source == "gibbs ([eval.1] sample-grid)" and sampler.cfg.burn_in == 7
    assert pick_sampler(run, "gibbs")[1] == "gibbs ([eval.1] sample-grid)"
    with pytest.raises(ConfigError, match="--sampler"):
        pick_sampler(run, "nope")


def test_record_appends_the_scalars_and_writes_the_images(trained, tmp_path):
    run_dir = Path(shutil.copytree(trained, tmp_path / "run"))
    run = load_run(run_dir)
    result = EvalResult(scalars={"eval/x/y": 1.5}, images={"eval/x/grid": torch.rand(3, 8, 8)})
    paths = record(run, result, log=False)
    assert paths == [run_dir / "eval" / "x-grid-step30.png"] and paths[0].stat().st_size > 0
    assert metrics_rows(run_dir)[-1] == {"step": 30, "checkpoint": "last", "eval/x/y": 1.5}


def test_samples_are_shown_as_a_scatter_or_a_grid_of_images():
    points = samples_image(torch.randn(20, 2), None)
    assert points.dim() == 3 and points.shape[0] == 3
    images = samples_image(torch.rand(4, 16), None, scale=1)  # four 4x4 images, two by two, 2 pixels apart
    assert images.shape[0] == 3 and images.min() >= 0 and images.max() <= 1
    assert images.shape[1:] == (2 + 2 * (4 + 2), 2 + 2 * (4 + 2))


def test_a_role_with_a_parameter_average_is_loaded_with_the_average_in_place(tmp_path):
    text = SMALL_RECIPE.replace('[optim.model]\nkind = "adam"', '[optim.model]\nkind = "adam"\nema = 0.9')
    run_dir = train_small(tmp_path, text)
    saved = ckpt.load(ckpt.last_checkpoint(run_dir))
    average, trained = saved["roles"]["model"]["ema"], saved["networks"]["model"]
    run = load_run(run_dir)
    loaded = list(run.model.parameters())
    assert len(loaded) == len(average) and all(torch.equal(p, a) for p, a in zip(loaded, average))
    assert not all(torch.equal(p, trained[name]) for name, p in run.model.named_parameters())


def test_a_name_folder_is_said_on_stderr_unless_told_otherwise(trained, capsys):
    run = load_run(trained.parent)
    assert run.run_dir == trained
    assert capsys.readouterr().err == f"{trained.parent}: a run name's folder; using its one run: {trained}\n"


def test_evaluators_given_by_table_need_a_kind_and_their_errors_name_the_runs_recipe(trained):
    """A table without a kind lists the evaluators there are; an option the evaluator refuses is
    the one-line error of the run's recipe.toml, at the table's place (``eval.<i>``)."""
    run = load_run(trained)
    with pytest.raises(ConfigError) as missing:
        run.evaluate([{"split": "test"}], echo=None)
    assert str(missing.value).startswith("[eval.0] kind: missing; choose one of: ais-loglik, density-plot, ")
    assert "exact-loglik" in str(missing.value).split(": ")[-1].split(", ")
    recipe = trained / "recipe.toml"
    with pytest.raises(ConfigError) as refused:
        run.evaluate(["exact-loglik", {"kind": "exact-loglik", "split": "val"}], echo=None)
    assert str(refused.value) == f"{recipe}: [eval.1] split: the dataset has no 'val' split"
    with pytest.raises(ConfigError) as unknown:
        run.evaluate([{"kind": "score-loss", "bogus": 1}], echo=None)
    assert str(unknown.value).startswith(f"{recipe}: [eval.0] bogus: unknown key; valid keys: split, ")


def test_a_sampler_that_refuses_the_model_names_the_runs_recipe(trained):
    run = load_run(trained)
    with pytest.raises(ConfigError) as refused:
        run.sample(4, sampler="annealed-langevin")
    assert str(refused.value).startswith(f"{trained / 'recipe.toml'}: [sampler] mode: via-q sampling needs ")


def test_a_model_without_a_default_sampler_needs_one_named(trained):
    """No [sampler], no sampling [[eval]], and no sampler registered as the default for the model
    kind: the error says what to add and lists the samplers; naming one works."""
    from eblvm_core.plugins import load
    from eblvm_core.recipe import Section

    run = load_run(trained)
    other = Section("model", load()["models"].get("bidvl-energy"), None)
    run.recipe = attrs.evolve(run.recipe, parts={**run.recipe.parts, "model": other})
    with pytest.raises(EblvmError) as none:
        pick_sampler(run)
    registered = ", ".join(load()["samplers"].names())
    assert str(none.value) == (
        "no sampler for model 'bidvl-energy': add a [sampler] section to the recipe or pass --sampler "
        f"(registered: {registered})"
    )
    assert pick_sampler(run, "gibbs")[1] == "gibbs (defaults)"


def test_the_sample_image_is_the_image_eblvm_sample_saves(cli, trained, tmp_path):
    """``LoadedRun.sample_image`` for a seed, as 8-bit pixels, is the PNG ``eblvm sample`` writes for
    that seed: a scatter of the 2-D samples with the data's bounds drawn as a red box."""
    import numpy as np
    from PIL import Image

    from eblvm_core.plot import BOUNDS_COLOUR

    out = tmp_path / "s.png"
    result = cli(
        [
            "sample",
            trained,
            "-n",
            "16",
            "--seed",
            "3",
            "--out",
            out,
            "-o",
            "sampler.kind=gibbs",
            "-o",
            "sampler.burn_in=5",
        ]
    )
    assert result.exit_code == 0, result.output
    run = load_run(trained, overrides=["sampler.kind=gibbs", "sampler.burn_in=5"], seed=3)
    image = run.sample_image(16)
    saved = torch.from_numpy(np.array(Image.open(out).convert("RGB"))).permute(2, 0, 1)
    assert torch.equal(image.mul(255).add(0.5).clamp(0, 255).to(torch.uint8), saved)
    red = torch.tensor(BOUNDS_COLOUR, dtype=torch.float32)[:, None, None] / 255
    assert (image - red).abs().amax(0).lt(1e-6).sum() > 100  # the bounds' box
    bare = samples_image(run.sample(16), None)
    assert (bare - red).abs().amax(0).lt(1e-6).sum() == 0  # no data, no bounds, no point beyond the view


def test_samples_of_a_stored_shape_are_shown_in_it():
    """Data whose examples are (H, W) arrays (not (C, H, W) images) are shown in that shape, each
    value mapped by the training data's range to [0, 1]."""
    from eblvm_core.contracts import DataSplits

    train = torch.linspace(-1.0, 3.0, 10 * 24).reshape(10, 4, 6)  # the training data's range: [-1, 3]
    data = DataSplits(train=train, test=train[:2])
    assert data.image_shape is None and data.shape == (4, 6)
    samples = torch.stack([torch.full((4, 6), value) for value in (-1.0, 1.0, 3.0, 5.0)])
    image = samples_image(samples, data, scale=1)
    assert image.shape == (3, 2 + 2 * (4 + 2), 2 + 2 * (6 + 2))  # two by two, 2 white pixels around each
    tiles = [image[:, 2 + r * 6 : 6 + r * 6, 2 + c * 8 : 8 + c * 8] for r in range(2) for c in range(2)]
    assert [float(t.unique()) for t in tiles] == [0.0, 0.5, 1.0, 1.0]  # -1, 1, 3 and 5 clamped
