"""End-to-end runs through the CLI: the run directory, metrics and TensorBoard of `eblvm run`, its
console, and a run killed (kill -9) and resumed to the bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from tests.support import SMALL_RECIPE, kill_run_when, only_run_dir

WITH_PLOT = SMALL_RECIPE + '\n[[eval]]\nkind = "density-plot"\ngrid = 40\n'


def test_short_run_writes_run_directory(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(WITH_PLOT), "--out", out, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "exact-loglik/test_loglik:" in result.output
    run_dir = only_run_dir(out)
    assert run_dir.parent.name == "small"

    # the resolved recipe holds the seed and every default
    from eblvm_core.recipe import load_recipe

    resolved = load_recipe(run_dir / "recipe.toml")
    assert resolved.run.seed == 7 and resolved.run.device == "cpu"
    assert resolved.optim["model"].optimizer.config.beta2 == 0.999

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [10, 20, 30]
    final = [r for r in records if "eval/exact-loglik/test_loglik" in r]
    assert final and final[-1]["step"] == 30 and final[-1]["eval/density-plot/grid_mass"] > 0

    state = ckpt.load(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 30 and set(state["roles"]) == {"model"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0}).Reload()
    tags = events.Tags()
    assert {"train/loss", "train/grad_norm/model", "lr/model", "eval/exact-loglik/test_loglik"} <= set(tags["scalars"])
    assert [s.step for s in events.Scalars("train/loss")] == [10, 20, 30]
    assert [s.step for s in events.Scalars("speed/steps_per_s")] == [10, 20, 30]
    assert "eval/density-plot/density" in tags["images"]

    # the HPARAMS dashboard: the resolved recipe's hyper-parameters, the final metrics by tag
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = events.PluginTagToContent("hparams")
    data = {tag: plugin_data_pb2.HParamsPluginData.FromString(raw) for tag, raw in content.items()}
    (experiment,) = [d.experiment for d in data.values() if d.HasField("experiment")]
    assert {m.name.tag for m in experiment.metric_infos} == set(final[-1]) - {"step"}
    (start,) = [d.session_start_info for d in data.values() if d.HasField("session_start_info")]
    hparams = start.hparams
    assert hparams["model.n_hidden"].number_value == 4 and hparams["run.seed"].number_value == 7
    assert hparams["estimator.kind"].string_value == "exact-score"
    assert not any(key.startswith(("eval.", "log.")) for key in hparams)


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load(run_dir / "checkpoints" / "last.pt")["networks"]["model"]


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(write_recipe, tmp_path):
    from tests.support import session_run as run

    recipe = write_recipe(
        SMALL_RECIPE.replace("steps = 30", "steps = 1500").replace("checkpoint_every = 10", "checkpoint_every = 50")
    )
    quiet = lambda _msg: None  # noqa: E731
    full_dir, _ = run(recipe, out=tmp_path / "full", echo=quiet)

    out = tmp_path / "killed"
    kill_run_when(recipe, out, ready=lambda _checkpoint: True)
    killed_dir = only_run_dir(out)
    killed_at = ckpt.load(killed_dir / "checkpoints" / "last.pt")["step"]
    assert killed_at < 1500, "the run finished before it could be killed; the test proves nothing"

    run(None, resume=killed_dir, echo=quiet)
    a, b = params(full_dir), params(killed_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # metrics of the resumed part are appended, not rewritten
    steps = [json.loads(line)["step"] for line in (killed_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 1500


def test_the_console_shows_evaluations_as_they_run(cli, write_recipe, tmp_path):
    """Each evaluation before the end prints its results; a long one announces itself first; log
    lines before the last carry an ETA; a tiny model on a CPU gets one thread."""
    text = SMALL_RECIPE.replace("checkpoint_every = 10", "checkpoint_every = 10\neval_every = 20")
    text += '\n[[eval]]\nkind = "ais-loglik"\nn_chains = 30\nn_reverse_chains = 20\nn_temps = 40\n'
    result = cli(["run", write_recipe(text), "--out", tmp_path / "runs", "--device", "cpu", "-o", "run.threads=0"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "1 CPU thread)" in lines[0]
    assert "step 20: ais-loglik: AIS: 30 chains × 40 temperatures forward, 20 chains back…" in lines
    assert sum("ais-loglik: AIS: 30 chains" in line for line in lines) == 2  # at step 20 and at the end
    (evaluated,) = [line for line in lines if line.startswith("eval step 20: ")]
    row = next(r for r in metrics(only_run_dir(tmp_path / "runs")) if r["step"] == 20 and "eval/ais-loglik/log_z" in r)
    assert f"exact-loglik/test_loglik {row['eval/exact-loglik/test_loglik']:.5g}" in evaluated
    assert f"ais-loglik/log_z {row['eval/ais-loglik/log_z']:.5g}" in evaluated
    steps = [line for line in lines if line.startswith("step ") and "loss" in line]
    assert [("ETA " in line) for line in steps] == [True, True, False]  # not on the last
    assert json.loads((only_run_dir(tmp_path / "runs") / "run.json").read_text())["sessions"][0]["threads"] == 1


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
