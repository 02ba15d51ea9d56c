"""Checkpoints kept every [run] keep_every steps and evaluated with ``eval --checkpoint step:N``,
a run's name folder standing for its latest run, evaluations logged to TensorBoard, and early
stopping on [run] select_metric with [run] patience, resumed or not.

This module is also a test plugin (``EBLVM_PLUGIN_MODULES=tests.e2e.test_checkpoints``): the
evaluator ``scripted`` reports a value chosen by the test for each training step, so a test knows
exactly when select_metric stops improving.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core import plugins
from eblvm_core.config import option, positive
from eblvm_core.contracts import EvalResult, Parts
from eblvm_core.hookspecs import hookimpl
from tests.support import SMALL_RECIPE

# ---- the test plugin -------------------------------------------------------------------------


@attrs.frozen
class ScriptedConfig:
    values: list[float] = option([0.0], "the value reported at steps every, 2 every, ... (the last one after)")
    every: int = option(10, "steps between two values", positive)


def training_step(parts: Parts) -> int:
    """The number of steps the model's Adam has taken: the training step, restored on resume."""
    state = parts.roles["model"].optimizer.state
    return int(next(iter(state.values()))["step"]) if state else 0


def build_scripted(cfg: ScriptedConfig, parts: Parts):
    """Reports `metric`: values[step // every - 1] at the model's training step."""

    def evaluate(parts: Parts) -> EvalResult:
        index = min(training_step(parts) // cfg.every, len(cfg.values)) - 1
        return EvalResult(scalars={"metric": cfg.values[max(index, 0)]})

    return evaluate


@hookimpl
def register_evaluators(register):
    register("scripted", build_scripted, ScriptedConfig)


# ---- helpers ---------------------------------------------------------------------------------


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def only_run_dir(out: Path) -> Path:
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    return run_dir


def scalars(output: str) -> dict[str, float]:
    found = {}
    for line in output.splitlines():
        key, _, value = line.partition(": ")
        try:
            found[key] = float(value)
        except ValueError:
            continue
    return found


def networks(path: Path) -> dict[str, torch.Tensor]:
    return ckpt.load(path)["networks"]["model"]


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


KEEP = SMALL_RECIPE.replace("steps = 30", "steps = 40").replace(
    "checkpoint_every = 10", "checkpoint_every = 30\neval_every = 20\nkeep_every = 20"
)


# ---- kept checkpoints ------------------------------------------------------------------------


def test_kept_checkpoints_hold_their_step_and_evaluate_as_training_did(cli, write_recipe, tmp_path):
    """keep_every = 20 with checkpoint_every = 30: step-20.pt and step-40.pt (a schedule of their
    own), sealed like last.pt; step-20.pt holds the parameters of a run stopped at 20, and
    `eval --checkpoint step:20` gives exactly the evaluation the training wrote at step 20."""
    out = tmp_path / "runs"
    assert cli(["run", write_recipe(KEEP), "--out", out]).exit_code == 0
    run_dir = only_run_dir(out)
    assert ckpt.kept_steps(run_dir) == [20, 40]
    kept = ckpt.read_checkpoint(ckpt.kept_checkpoint(run_dir, 20))  # verifies the checksum
    assert kept["step"] == 20 and "checksum" in kept
    assert ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))["step"] == 40

    short = tmp_path / "short"
    assert cli(["run", write_recipe(KEEP), "--out", short, "-o", "run.steps=20"]).exit_code == 0
    assert same_tensors(
        networks(ckpt.kept_checkpoint(run_dir, 20)), networks(ckpt.last_checkpoint(only_run_dir(short)))
    )
    assert not same_tensors(networks(ckpt.kept_checkpoint(run_dir, 20)), networks(ckpt.last_checkpoint(run_dir)))

    result = cli(["eval", run_dir, "--checkpoint", "step:20"])
    assert result.exit_code == 0, result.output
    trained = next(r for r in rows(run_dir) if r["step"] == 20 and "eval/exact-loglik/test_loglik" in r)
    appended = rows(run_dir)[-1]
    assert appended["checkpoint"] == "step:20" and appended["step"] == 20
    assert appended["eval/exact-loglik/test_loglik"] == trained["eval/exact-loglik/test_loglik"]
    printed = scalars(result.output)["exact-loglik/test_loglik"]
    assert f"{printed:.6g}" == f"{trained['eval/exact-loglik/test_loglik']:.6g}"
    assert "step 20 (step:20)" in result.output


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


# ---- a run's name folder ---------------------------------------------------------------------


def test_a_name_folder_stands_for_its_latest_run_and_says_so(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    for steps in (10, 20):
        assert cli(["run", write_recipe(), "--out", out, "-o", f"run.steps={steps}"]).exit_code == 0
    name = out / "small"
    first, second = sorted(name.iterdir())
    assert ckpt.load(ckpt.last_checkpoint(second))["step"] == 20
    result = cli(["eval", name])
    assert result.exit_code == 0, result.output
    assert f"{name}: a run name's folder; using the latest of its 2 runs: {second}" in result.output
    assert "step 20 (last)" in result.output

    # names sort by their start and suffix, not as text; a folder without recipe.toml is no run
    shutil.copytree(first, name / "20990101-000000-10")
    shutil.copytree(second, name / "20990101-000000-9")
    (name / "zzz").mkdir()
    result = cli(["eval", name])
    assert result.exit_code == 0, result.output
    assert f"using the latest of its 4 runs: {name / '20990101-000000-10'}" in result.output
    assert "step 10 (last)" in result.output

    result = cli(["run", "--resume", name, "-o", "run.steps=30"])
    assert result.exit_code == 0, result.output
    assert f"using the latest of its 4 runs: {name / '20990101-000000-10'}" in result.output
    assert ckpt.load(ckpt.last_checkpoint(name / "20990101-000000-10"))["step"] == 30


def test_a_missing_path_and_a_folder_that_is_not_a_run_say_different_things(cli, tmp_path):
    missing = cli(["eval", tmp_path / "gone"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "sub").mkdir()
    empty = cli(["eval", tmp_path / "empty"])
    (tmp_path / "file").write_text("x")
    a_file = cli(["eval", tmp_path / "file"])
    for result in (missing, empty, a_file):
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert missing.output.strip() == f"error: {tmp_path / 'gone'}: no such directory"
    assert empty.output.strip() == (
        f"error: {tmp_path / 'empty'}: not a run directory: it has no recipe.toml, "
        "and no run directory inside it has one either"
    )
    assert a_file.output.strip() == f"error: {tmp_path / 'file'}: not a run directory: a file, not a folder"
    resumed = cli(["run", "--resume", tmp_path / "gone"])
    assert resumed.exit_code == 2 and f"{tmp_path / 'gone'}: cannot resume: no such directory" in resumed.output


# ---- early stopping --------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "tests.e2e.test_checkpoints")
    monkeypatch.setattr(plugins, "_loaded", None)  # the real registry comes back after the test
    loaded = plugins.load(force=True)
    assert "scripted" in loaded["evaluators"].names(), loaded.failed


# the evaluations at 10, 20, ..., 100: best 3 at step 30; 40 ties it (no improvement), 60 beats it
VALUES = [1.0, 2.0, 3.0, 3.0, 2.9, 3.5, 1.0, 1.0, 1.0, 1.0]
PATIENT = (
    SMALL_RECIPE.replace("steps = 30", "steps = 100")
    .replace(
        "checkpoint_every = 10",
        'checkpoint_every = 100\nlog_every = 20\neval_every = 10\nselect_metric = "eval/scripted/metric"\npatience = 2',
    )
    .replace("log_every = 10\n", "")
    + f'\n[[eval]]\nkind = "scripted"\nvalues = {VALUES}\n'
)


def test_early_stopping_ends_the_run_at_the_patience_th_evaluation_without_improvement(
    cli, write_recipe, tmp_path, scripted
):
    """patience = 2: best at 30, no improvement at 40 (a tie) and 50: the run stops at 50 with that
    evaluation as its final one, logs the steps since 40, writes last.pt at 50 and says why."""
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(PATIENT), "--out", out])
    assert result.exit_code == 0, result.output
    run_dir = only_run_dir(out)
    assert (
        "stopped early at step 50/100: eval/scripted/metric has not improved on 3 (step 30) in 2 evaluations "
        "([run] patience = 2)"
    ) in result.output
    assert scalars(result.output)["scripted/metric"] == 2.9  # the final evaluation is step 50's
    state = ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))
    assert state["step"] == 50 and state["stale"] == 2 and state["best"] == 3.0 and state["best_step"] == 30
    assert ckpt.load(ckpt.best_checkpoint(run_dir))["step"] == 30
    logged = rows(run_dir)
    assert [r["step"] for r in logged if "train/loss" in r] == [20, 40, 50]
    assert [r["step"] for r in logged if "eval/scripted/metric" in r] == [10, 20, 30, 40, 50]
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [(s["status"], s["to_step"]) for s in sessions] == [("stopped early", 50)]

    again = cli(["run", "--resume", run_dir])
    assert again.exit_code == 0 and "stopped early at step 50: 2 evaluations without improvement" in again.output
    assert "nothing to do" in again.output and ckpt.load(ckpt.last_checkpoint(run_dir))["step"] == 50


@pytest.mark.parametrize("patience, stop", [(3, 90), (4, None)])
def test_the_stop_step_depends_on_the_patience(cli, write_recipe, tmp_path, scripted, patience, stop):
    """patience = 3: 60 improves (3.5), then 70, 80, 90 do not: stop at 90. patience = 4: the run
    reaches step 100 and finishes."""
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(PATIENT), "--out", out, "-o", f"run.patience={patience}"])
    assert result.exit_code == 0, result.output
    run_dir = only_run_dir(out)
    assert ckpt.load(ckpt.last_checkpoint(run_dir))["step"] == (stop or 100)
    status = json.loads((run_dir / "run.json").read_text())["sessions"][-1]["status"]
    assert status == ("stopped early" if stop else "finished")
    assert ("stopped early at step" in result.output) == bool(stop)


def test_a_resumed_run_keeps_counting_evaluations_without_improvement(cli, write_recipe, tmp_path, scripted):
    """patience = 3 in two sessions: 80 steps (its final evaluation at 80 is the second without
    improvement since 60), then resumed to 100: the stop comes at 90 as in one session, with the
    same parameters; and an early-stopped run resumed with a larger patience goes on."""
    full = tmp_path / "full"
    assert cli(["run", write_recipe(PATIENT), "--out", full, "-o", "run.patience=3"]).exit_code == 0
    split = tmp_path / "split"
    first = cli(["run", write_recipe(PATIENT), "--out", split, "-o", "run.patience=3", "-o", "run.steps=80"])
    assert first.exit_code == 0 and "stopped early" not in first.output, first.output
    run_dir = only_run_dir(split)
    assert ckpt.load(ckpt.last_checkpoint(run_dir))["stale"] == 2
    second = cli(["run", "--resume", run_dir, "-o", "run.steps=100"])
    assert second.exit_code == 0, second.output
    assert "stopped early at step 90/100" in second.output
    assert ckpt.load(ckpt.last_checkpoint(run_dir))["step"] == 90
    assert same_tensors(networks(ckpt.last_checkpoint(run_dir)), networks(ckpt.last_checkpoint(only_run_dir(full))))
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [s["status"] for s in sessions] == ["finished", "stopped early"]

    stopped = tmp_path / "stopped"
    assert cli(["run", write_recipe(PATIENT), "--out", stopped]).exit_code == 0  # stops at 50
    go_on = cli(["run", "--resume", only_run_dir(stopped), "-o", "run.patience=3"])
    assert go_on.exit_code == 0 and "stopped early at step 90/100" in go_on.output, go_on.output
    assert same_tensors(
        networks(ckpt.last_checkpoint(only_run_dir(stopped))), networks(ckpt.last_checkpoint(only_run_dir(full)))
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["run.patience=2"], "[run] patience: counts evaluations without improvement of select_metric"),
        (
            ['run.select_metric="eval/exact-loglik/test_loglik"', "run.patience=2"],
            "[run] patience: counts evaluations, but eval_every = 0",
        ),
        (["run.keep_every=0"], "[run] keep_every: must be > 0"),
    ],
)
def test_patience_and_keep_every_are_checked_before_a_run(cli, write_recipe, tmp_path, overrides, message):
    result = cli(["validate", write_recipe(), *[a for o in overrides for a in ("-o", o)]])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
