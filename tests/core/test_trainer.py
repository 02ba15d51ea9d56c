"""trainer.py: the loop. What each step is due for (``Due``), ``Trainer.step`` alone, a stop asked by
a signal or by ``after_evaluation``, evaluations along the way leaving the training as it was,
and early stopping on [run] select_metric with [run] patience, resumed or not.

This module is also a test plugin (``EBLVM_PLUGIN_MODULES=tests.core.test_trainer``): the
evaluator ``scripted`` reports a value chosen by the test for each training step, so a test knows
exactly when select_metric stops improving.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eblvm_core import checkpoint as ckpt
from eblvm_core import plugins
from eblvm_core.config import option, positive
from eblvm_core.contracts import EvalResult, Parts
from eblvm_core.hookspecs import hookimpl
from tests.support import RECIPES, SMALL_RECIPE, metrics_rows, networks, only_run_dir, same_tensors, scalars

# ---- the test plugin -----------------------------------------------------------------------------


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


# ---- evaluations along the way -------------------------------------------------------------------


@pytest.mark.slow
def test_evaluating_along_the_way_leaves_the_training_as_it_was(tmp_path):
    """digits_bidvl's energy is spectrally normalised and its encoder and generator hold batch norm:
    ood-auroc (the energy) and reconstruction (the encoder and the generator, also in train mode)
    every 5 steps must leave the same networks, buffers included, to the bit, as no evaluation."""
    import tomllib

    import eblvm

    data = tomllib.loads((RECIPES / "digits_bidvl.toml").read_text())
    data["run"].update(steps=15, checkpoint_every=15, eval_every=5, threads=1)
    for section in ("model", "posterior", "generator"):
        data[section]["base"] = 8
    data["eval"] = [{"kind": "ood-auroc", "n": 100}, {"kind": "reconstruction", "n": 100, "batch_size": 50}]
    along = eblvm.train(data, out=tmp_path / "along", echo=None).run_dir
    data["eval"] = []
    without = eblvm.train(data, out=tmp_path / "without", echo=None).run_dir

    records = [json.loads(line) for line in (along / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/ood-auroc/uniform_auroc" in r] == [5, 10, 15]
    a, b = (ckpt.load(d / "checkpoints" / "last.pt")["networks"] for d in (along, without))
    assert a.keys() == b.keys() == {"model", "posterior", "generator"}
    for section in a:
        assert a[section].keys() == b[section].keys()
        for key in a[section]:
            assert torch.equal(a[section][key], b[section][key]), f"{section}.{key}"


# ---- early stopping ------------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "tests.core.test_trainer")
    monkeypatch.setattr(plugins, "_loaded", None)  # the real registry comes back after the test
    loaded = plugins.load(force=True)
    assert "scripted" in loaded["evaluators"].names(), loaded.failed


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
    logged = metrics_rows(run_dir)
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


@pytest.mark.slow
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


def test_a_run_killed_after_it_stopped_early_does_its_final_evaluation_alone_on_resume(
    cli, write_recipe, tmp_path, scripted
):
    """Stopped early at 50 and killed before its session recorded the end (run.json still says
    running): the resumed session trains no step, says why it stops, and its final evaluation is
    step 50's, recorded as a stop."""
    out = tmp_path / "runs"
    assert cli(["run", write_recipe(PATIENT), "--out", out]).exit_code == 0  # stops at 50
    run_dir = only_run_dir(out)
    provenance = json.loads((run_dir / "run.json").read_text())
    provenance["sessions"][-1]["status"] = "running"
    (run_dir / "run.json").write_text(json.dumps(provenance))
    before = metrics_rows(run_dir)
    result = cli(["run", "--resume", run_dir])
    assert result.exit_code == 0, result.output
    assert (
        "stopped early at step 50/100: eval/scripted/metric has not improved on 3 (step 30) in 2 evaluations "
        "([run] patience = 2)"
    ) in result.output
    assert scalars(result.output)["scripted/metric"] == 2.9 and "nothing to do" not in result.output
    assert ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))["step"] == 50
    final = [row for row in before if row["step"] == 50 and "eval/scripted/metric" in row]
    assert len(final) == 1  # written again, once, last; no training row added
    assert metrics_rows(run_dir) == [row for row in before if row not in final] + final
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [(s["status"], s["to_step"]) for s in sessions][-1] == ("stopped early", 50)


def test_fit_needs_records_with_a_run_directory(tmp_path, monkeypatch):
    """``step`` alone writes nowhere; ``fit`` writes checkpoints, so a trainer without a run
    directory says so at its first checkpoint instead of failing inside the save."""
    from eblvm_core.trainer import Trainer
    from tests.support import small_state

    monkeypatch.chdir(tmp_path)
    recipe, state = small_state(overrides=["run.steps=2", "run.checkpoint_every=1"])
    trainer = Trainer(recipe, state)
    with pytest.raises(ValueError, match="^Trainer.fit writes checkpoints: give it Records with a run directory$"):
        trainer.fit()
    assert state.step == 1 and list(tmp_path.iterdir()) == []


# ---- what a step is due for ---------------------------------------------------------------------


def due_at(run, field: str) -> list[int]:
    """The steps 1..[run] steps at which ``Due.at`` says ``field``."""
    from eblvm_core.trainer import Due

    return [step for step in range(1, run.steps + 1) if getattr(Due.at(step, run), field)]


def test_each_interval_is_due_on_its_own_schedule_and_the_last_step_ends_the_run():
    """log_every, checkpoint_every, keep_every and eval_every each on their own schedule: a log and
    last.pt also at the last step, a kept checkpoint only where keep_every falls, an evaluation
    never at the last step (the final one follows the loop), the guard's check before every log or
    checkpoint."""
    from eblvm_core.recipe import RunConfig

    run = RunConfig(steps=25, log_every=10, checkpoint_every=15, keep_every=20, eval_every=5)
    assert due_at(run, "log") == [10, 20, 25]
    assert due_at(run, "save") == [15, 25]
    assert due_at(run, "keep") == [20]
    assert due_at(run, "evaluate") == [5, 10, 15, 20]
    assert due_at(run, "check") == [10, 15, 20, 25]
    assert due_at(run, "end") == [25]
    quiet = RunConfig(steps=20, log_every=10, checkpoint_every=10, keep_every=None, eval_every=0)
    assert due_at(quiet, "evaluate") == [] and due_at(quiet, "keep") == []
    assert due_at(quiet, "log") == due_at(quiet, "save") == due_at(quiet, "check") == [10, 20]


def test_the_guard_checks_before_whatever_is_logged_or_written_and_never_evaluates_the_end():
    """Over many schedules: the check is due exactly when a log or a checkpoint is; the last step is
    logged and checkpointed, not evaluated; before it each interval falls on its multiples."""
    import itertools

    from eblvm_core.recipe import RunConfig
    from eblvm_core.trainer import Due

    for steps, log_every, checkpoint_every, keep_every, eval_every in itertools.product(
        [1, 7, 12, 30], [1, 4, 5], [3, 6, 50], [None, 4], [0, 3, 12]
    ):
        run = RunConfig(
            steps=steps,
            log_every=log_every,
            checkpoint_every=checkpoint_every,
            keep_every=keep_every,
            eval_every=eval_every,
        )
        for step in range(1, steps + 1):
            due, where = Due.at(step, run), (run, step)
            assert due.check == (due.log or due.save or due.keep), where
            assert due.end == (step == steps), where
            assert due.keep == (keep_every is not None and step % keep_every == 0), where
            if due.end:  # the last step is logged and checkpointed; its evaluation is the final one
                assert due.log and due.save and not due.evaluate, where
            else:
                assert due.log == (step % log_every == 0) and due.save == (step % checkpoint_every == 0), where
                assert due.evaluate == (eval_every > 0 and step % eval_every == 0), where


# ---- Trainer.step and Trainer.fit ---------------------------------------------------------------


def test_a_step_alone_trains_once_and_writes_nowhere(tmp_path, monkeypatch):
    from eblvm_core.trainer import Trainer
    from tests.support import small_state

    monkeypatch.chdir(tmp_path)
    recipe, state = small_state()
    trainer = Trainer(recipe, state)  # records: none
    before = {k: v.clone() for k, v in state.parts.model.state_dict().items()}
    metrics = trainer.step()
    assert state.step == 1 and "loss" in metrics and trainer.progress.sums.steps == 1
    after = state.parts.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the step changed no parameter"
    trainer.step()
    assert state.step == 2 and list(tmp_path.iterdir()) == []


def test_a_stop_signal_writes_a_checkpoint_after_the_step_and_stops(tmp_path):
    """SIGTERM during step 7 of 20 (no checkpoint due there): last.pt at step 7, and the error says
    how to resume."""
    from eblvm_core.errors import Interrupted
    from eblvm_core.records import Records
    from eblvm_core.trainer import Trainer
    from tests.support import small_state

    recipe, state = small_state(overrides=["run.steps=20", "run.checkpoint_every=100"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trainer = Trainer(recipe, state, Records(run_dir))
    step = trainer.step

    def signalled_at_7():
        metrics = step()
        if state.step == 7:
            trainer.stop_signal = "SIGTERM"  # what Signals sets
        return metrics

    trainer.step = signalled_at_7
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    last = ckpt.last_checkpoint(run_dir)
    assert (
        str(stopped.value)
        == f"SIGTERM at step 7/20: checkpoint {last} written; resume with: eblvm run --resume {run_dir}"
    )
    assert ckpt.read_checkpoint(last)["step"] == 7 and state.last_saved == (7, last)


def test_after_evaluation_may_end_the_run_at_an_evaluation(tmp_path):
    """A Stop from after_evaluation at step 15 (evaluations every 5, logs every 10): that evaluation
    is the final one, the steps since 10 are logged, last.pt is written at 15 and the line said."""
    from eblvm_core.evaluation import Stop
    from eblvm_core.records import Records
    from eblvm_core.trainer import Trainer
    from tests.support import small_state

    recipe, state = small_state(overrides=["run.eval_every=5", "run.checkpoint_every=100"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    seen, said = [], []

    def after(step, scalars):
        seen.append((step, sorted(scalars)))
        return Stop("pruned", "pruned at step 15 by the test") if step == 15 else None

    trainer = Trainer(recipe, state, Records(run_dir, said.append), after)
    results = trainer.fit()
    keys = ["eval/exact-loglik/test_loglik", "eval/exact-loglik/test_loglik_stderr"]
    assert seen == [(5, keys), (10, keys), (15, keys)]
    assert (
        trainer.stopped == Stop("pruned", "pruned at step 15 by the test") and "pruned at step 15 by the test" in said
    )
    assert state.step == 15 and sorted(results) == keys
    assert ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))["step"] == 15
    assert [r["step"] for r in metrics_rows(run_dir) if "train/loss" in r] == [10, 15]


# ---- properties (hypothesis) ---------------------------------------------------------------------


def multiples(every: int | None, up_to: int) -> list[int]:
    """every, 2 every, ... up to ``up_to`` included (none for 0 or None)."""
    return list(range(every, up_to + 1, every)) if every else []


class Recorded:
    """What ``Trainer.fit`` did, in order: ("log", step), ("evaluate", step), ("save", step, last,
    keep); stands in for the trainer's evaluation (never stopping early) and the state's save."""

    def __init__(self, state):
        self.state, self.done = state, []

    def __call__(self) -> dict[str, float]:
        self.done.append(("evaluate", self.state.step))
        return {}

    def early_stop(self):
        return None

    def save(self, run_dir, last: bool = True, keep: bool = False) -> None:
        self.done.append(("save", self.state.step, last, keep))

    def log(self, last: bool) -> None:
        self.done.append(("log", self.state.step))


@pytest.mark.property
@settings(max_examples=40)
@given(
    steps=st.integers(1, 40),
    log_every=st.integers(1, 45),
    checkpoint_every=st.integers(1, 45),
    eval_every=st.integers(0, 45),
    keep_every=st.one_of(st.none(), st.integers(1, 45)),
)
def test_the_loop_does_each_action_at_exactly_the_steps_its_settings_say(
    steps, log_every, checkpoint_every, eval_every, keep_every
):
    """For any [run] steps and intervals, ``Trainer.fit`` logs at each multiple of log_every and at
    the end; evaluates at each multiple of eval_every before the end and once after the last step;
    writes last.pt at each multiple of checkpoint_every and at the end, a kept checkpoint at each
    multiple of keep_every (with last.pt where both fall), and last.pt once more after the final
    evaluation; each once, in step order."""
    from eblvm_core.records import Records
    from eblvm_core.trainer import Trainer
    from tests.support import small_state

    keep = [] if keep_every is None else [f"run.keep_every={keep_every}"]
    recipe, state = small_state(
        overrides=[
            f"run.steps={steps}",
            f"run.log_every={log_every}",
            f"run.checkpoint_every={checkpoint_every}",
            f"run.eval_every={eval_every}",
            *keep,
        ]
    )
    recorded = Recorded(state)
    records = Records(Path("never-written"), writes=False)  # fit saves to a run directory: here, recorded
    trainer = Trainer(recipe, state, records, estimator_step=lambda batch: {"loss": torch.zeros(())})
    trainer.evaluation, trainer.progress.log, state.save = recorded, recorded.log, recorded.save
    trainer.fit()

    expected = []
    for step in range(1, steps + 1):
        if step in multiples(log_every, steps) or step == steps:
            expected.append(("log", step))
        if step in multiples(eval_every, steps - 1):
            expected.append(("evaluate", step))
        last, kept = step in multiples(checkpoint_every, steps) or step == steps, step in multiples(keep_every, steps)
        if last or kept:
            expected.append(("save", step, last, kept))
    expected += [("evaluate", steps), ("save", steps, True, False)]
    assert recorded.done == expected
