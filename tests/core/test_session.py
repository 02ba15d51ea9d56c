"""session.py: a run's life (``run``: prepare, fit, close). A new run's seed; recipes given as data
or as a ``Recipe``; the resume checks (a run directory to resume, what an override may change,
nothing written on a refusal, a finished run, resuming to the bit); the lock and stale temporary
checkpoints; ``Signals`` and a second Ctrl-C; a full disk; the CPU's numerics while it trains."""

from __future__ import annotations

import errno
import json
import os
import signal
import tomllib
from types import SimpleNamespace

import pytest
import torch

import eblvm
from eblvm_core import checkpoint as ckpt
from tests.support import SMALL_RECIPE, assert_same_parameters, one_line, only_run_dir, poison_at, snapshot

QUIET = lambda _line: None  # noqa: E731
quiet = None  # eblvm.train(echo=None): nothing printed


# ---- a new run -----------------------------------------------------------------------------------


def test_seed_is_chosen_and_written_back(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(SMALL_RECIPE.replace("seed = 7\n", "")), "--out", out, "-o", "run.steps=2"])
    assert result.exit_code == 0, result.output
    from eblvm_core.recipe import load_recipe

    assert isinstance(load_recipe(only_run_dir(out) / "recipe.toml").run.seed, int)


def test_a_recipe_object_and_its_overrides(tmp_path):
    recipe = eblvm.load_recipe(tomllib.loads(SMALL_RECIPE), {"run.steps": 12, "run.log_every": 4})
    assert recipe.run.steps == 12 and recipe.path == "<recipe dict>"
    a = eblvm.train(recipe, out=tmp_path / "a", echo=quiet)
    b = eblvm.train(recipe.to_dict(), overrides=["run.steps=12"], out=tmp_path / "b", echo=quiet)
    assert_same_parameters(a.run_dir, b.run_dir)
    assert [r["step"] for r in a.history() if "train/loss" in r] == [4, 8, 12]
    assert a.checkpoints() == ["last"]


# ---- resume: what may change, and nothing written on refusal -------------------------------------


def test_resume_needs_a_run_directory(cli, tmp_path):
    result = cli(["run", "--resume", tmp_path])
    assert (
        result.exit_code == 2
        and f"{tmp_path}: cannot resume: not a run directory: it has no recipe.toml" in result.output
    )
    result = cli(["run", "--resume", tmp_path / "gone"])
    assert result.exit_code == 2 and f"{tmp_path / 'gone'}: cannot resume: no such directory" in result.output


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.n_hidden=8", "[model] n_hidden: cannot change when resuming (the run has 4, the override gives 8)"),
        ("optim.model.lr=0.5", "[optim.model] lr: cannot change when resuming"),
        ("objective.sigma=0.2", "[objective] sigma: cannot change when resuming"),
        ("run.seed=8", "[run] seed: cannot change when resuming"),
        ("run.name=other", "[run] name: cannot change when resuming"),
        ("run.steps=0", "[run] steps: must be > 0"),
        ("run.steps=20", "[run] steps: 20 is below the checkpoint's step 30"),
        ("model.n_hiden=8", "[model] n_hiden: unknown key"),
    ],
)
def test_a_refused_resume_leaves_the_run_directory_unchanged(cli, run_copy, override, fragment):
    before = snapshot(run_copy)
    line = one_line(cli(["run", "--resume", run_copy, "-o", override]))
    assert line.startswith(f"error: -o {override}: ") and fragment in line, line
    assert snapshot(run_copy) == before
    # and the run still resumes and evaluates as before
    assert cli(["eval", run_copy]).exit_code == 0


def test_resume_may_change_steps_intervals_and_evaluators(cli, run_copy):
    result = cli(
        ["run", "--resume", run_copy, "-o", "run.steps=40", "-o", "run.log_every=5", "-o", "eval.0.split=train"]
    )
    assert result.exit_code == 0, result.output
    assert f"resuming {run_copy} at step 30" in result.output and "exact-loglik/train_loglik" in result.output
    from eblvm_core.recipe import load_recipe

    resolved = load_recipe(run_copy / "recipe.toml")
    assert resolved.run.steps == 40 and resolved.run.log_every == 5 and resolved.evals[0].config.split == "train"
    assert ckpt.read_checkpoint(ckpt.last_checkpoint(run_copy))["step"] == 40


def test_a_finished_run_resumed_does_nothing_and_says_so(cli, run_copy):
    before = snapshot(run_copy)
    result = cli(["run", "--resume", run_copy])
    assert result.exit_code == 0 and "finished at step 30: nothing to do" in result.output, result.output
    assert snapshot(run_copy) == before


def test_train_resumes_a_run_as_the_command_line_does(tmp_path):
    data = tomllib.loads(SMALL_RECIPE)
    full = eblvm.train(data, out=tmp_path / "full", echo=quiet)
    part = eblvm.train(data, overrides={"run.steps": 20}, out=tmp_path / "part", echo=quiet)
    lines: list[str] = []
    resumed = eblvm.train(resume=part.run_dir.parent, overrides={"run.steps": 30}, echo=lines.append)
    assert resumed.run_dir == part.run_dir
    assert any("a run name's folder; using its one run" in line for line in lines)
    assert any(line == f"resuming {part.run_dir} at step 20" for line in lines)
    assert_same_parameters(full.run_dir, resumed.run_dir)
    assert resumed.metrics == full.metrics
    again = eblvm.train(resume=part.run_dir, overrides={"run.steps": 30}, echo=quiet)
    assert again.metrics == full.metrics  # finished: nothing trained, the final evaluation read back


# ---- the lock and stale temporaries --------------------------------------------------------------


def test_a_finished_run_leaves_no_lock(cli, write_recipe, tmp_path):
    assert cli(["run", write_recipe(), "--out", tmp_path / "runs"]).exit_code == 0
    run_dir = only_run_dir(tmp_path / "runs")
    assert (run_dir / "checkpoints" / "last.pt").exists() and not (run_dir / ".lock").exists()


def test_a_kill_during_a_checkpoint_write_leaves_no_temporary_after_the_next_start(cli, run_copy):
    stale = run_copy / "checkpoints" / ".last.pt.x1y2z3.tmp"
    stale.write_bytes(b"")
    assert cli(["run", "--resume", run_copy, "-o", "run.steps=40"]).exit_code == 0
    assert not stale.exists() and sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["last.pt"]


# ---- a second Ctrl-C, a full disk, the CPU's numerics --------------------------------------------


def test_a_second_ctrl_c_before_the_first_checkpoint_gives_advice_that_works(cli, write_recipe, tmp_path, monkeypatch):
    """A second Ctrl-C aborts training inside a step (KeyboardInterrupt) before any checkpoint was
    written; the command the message gives starts the run again from step 0 in its directory and
    ends bit-identical to an uninterrupted run, with one training row per logged step."""

    def second_ctrl_c(built, metrics) -> None:
        raise KeyboardInterrupt

    poison_at(monkeypatch, 15, second_ctrl_c)
    options = ["-o", "run.checkpoint_every=30"]
    line = one_line(cli(["run", write_recipe(), "--out", tmp_path / "runs", *options]), code=130, label="interrupted")
    run_dir = only_run_dir(tmp_path / "runs")
    assert line.startswith("interrupted: Ctrl-C at step 14, stopped at once; resume with: "), line
    assert "no checkpoint had been written, so it starts again from step 0" in line, line
    assert not (run_dir / "checkpoints" / "last.pt").exists() and not (run_dir / ".lock").exists()
    advice = line.split("resume with: ")[1].split(" (")[0]
    assert advice == f"eblvm run --resume {run_dir}"

    monkeypatch.undo()
    result = cli(advice.split()[1:])
    assert result.exit_code == 0, result.output
    assert f"resuming {run_dir} at step 0" in result.output
    assert cli(["run", write_recipe(), "--out", tmp_path / "full", *options]).exit_code == 0
    a, b = (ckpt.load(ckpt.last_checkpoint(d))["networks"]["model"] for d in (only_run_dir(tmp_path / "full"), run_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [10, 20, 30]
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [(s["status"], s["from_step"]) for s in sessions] == [("interrupted", 0), ("finished", 0)]


def test_a_full_disk_keeps_the_last_checkpoint(cli, write_recipe, tmp_path, monkeypatch):
    real_save, calls = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "runs"
    line = one_line(cli(["run", write_recipe(), "--out", out]), code=1)
    run_dir = only_run_dir(out)
    assert "No space left on device" in line and f"{ckpt.last_checkpoint(run_dir)} holds step 10" in line, line
    assert ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))["step"] == 10
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.pt"]


def test_a_cpu_run_flushes_subnormal_floats_while_it_trains_and_only_then(write_recipe, tmp_path, monkeypatch):
    """Inside a CPU run a subnormal float32 (1e-39) multiplies to 0, so the relaxed samples'
    subnormals cost no slow path; before and after the run, also one that fails, it is itself."""
    from tests.support import session_run as train

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush subnormal floats")
    tiny = torch.tensor(1e-39)
    seen: list[float] = []
    poison_at(monkeypatch, 3, lambda built, metrics: seen.append((tiny * 1.0).item()))
    assert (tiny * 1.0).item() > 0
    train(write_recipe(), ["run.steps=5"], "cpu", tmp_path / "runs", echo=lambda _: None)
    assert seen == [0.0] and (tiny * 1.0).item() > 0

    def fail(built, metrics):
        raise RuntimeError("a step that fails")

    poison_at(monkeypatch, 2, fail)
    with pytest.raises(RuntimeError, match="a step that fails"):
        train(write_recipe(), ["run.steps=5"], "cpu", tmp_path / "failed", echo=lambda _: None)
    assert (tiny * 1.0).item() > 0


# ---- Signals ----------------------------------------------------------------------------------------


def answer(policy, signum: int) -> str | None:
    """What ``policy`` does with ``signum`` as the signal calls it: "abort" when it raises
    KeyboardInterrupt (kept from pytest, which would stop), else None."""
    try:
        policy(signum, None)
    except KeyboardInterrupt:
        return "abort"
    return None


def test_before_training_ctrl_c_interrupts_and_another_signal_goes_to_the_handler_before_the_session():
    from eblvm_core.session import Signals

    policy = Signals()
    assert answer(policy, signal.SIGINT) == "abort"
    called = []
    policy.previous = {signal.SIGTERM: lambda signum, frame: called.append(signum)}  # e.g. a cluster job's
    assert answer(policy, signal.SIGTERM) is None and called == [signal.SIGTERM]


def test_while_training_the_first_signal_asks_for_a_stop_and_a_second_ctrl_c_aborts():
    from eblvm_core.session import Signals

    for first in (signal.SIGINT, signal.SIGTERM):
        policy, trainer = Signals(), SimpleNamespace(stop_signal=None)
        policy.watch(trainer)
        assert answer(policy, first) is None and trainer.stop_signal == signal.Signals(first).name
        if first == signal.SIGTERM:  # another SIGTERM: still a stop asked, not an abort
            assert answer(policy, signal.SIGTERM) is None and trainer.stop_signal == "SIGTERM"
        assert answer(policy, signal.SIGINT) == "abort"


def test_before_training_under_several_processes_the_first_signal_waits_for_the_trainer():
    """A rank must not leave its set-up alone (the others would wait at a collective): the first
    signal is kept and handed to the trainer, on which the ranks agree; a second Ctrl-C aborts."""
    from eblvm_core.session import Signals

    for first in (signal.SIGINT, signal.SIGTERM):
        policy, trainer = Signals(several=True), SimpleNamespace(stop_signal=None)
        assert answer(policy, first) is None and policy.pending == signal.Signals(first).name
        assert answer(policy, signal.SIGINT) == "abort"
        policy.watch(trainer)
        assert trainer.stop_signal == signal.Signals(first).name
    policy, trainer = Signals(several=True), SimpleNamespace(stop_signal=None)
    policy.watch(trainer)  # nothing was asked: nothing to hand on
    assert trainer.stop_signal is None


def test_once_training_has_ended_signals_are_ignored_while_the_session_shuts_down():
    from eblvm_core.session import Signals

    policy, trainer = Signals(), SimpleNamespace(stop_signal=None)
    policy.watch(trainer)
    policy.done()
    assert [answer(policy, s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGINT)] == [None, None, None]
    assert trainer.stop_signal is None


def test_the_session_policy_holds_its_signals_within_the_block_only():
    import threading

    from eblvm_core.session import stop_on_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    with stop_on_signals([signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM]) as policy:
        assert signal.getsignal(signal.SIGTERM) is policy and signal.getsignal(signal.SIGUSR1) is policy
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert list(policy.previous) == [signal.SIGTERM, signal.SIGUSR1]
    assert {sig: signal.getsignal(sig) for sig in before} == before
    seen = []

    def elsewhere():
        with stop_on_signals() as policy:
            seen.append((policy.previous, signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [({}, before[signal.SIGTERM])], "outside the main thread signals are left alone"


# ---- recipes as data, a run's attendants ------------------------------------------------------------


def test_resolve_recipe_takes_a_path_data_or_a_recipe(write_recipe):
    from eblvm_core.recipe import Recipe
    from eblvm_core.session import DICT_RECIPE, resolve_recipe

    path = write_recipe()
    from_file = resolve_recipe(path, ["run.steps=3"])
    data = tomllib.loads(SMALL_RECIPE)
    from_data = resolve_recipe(data, ["run.steps=3"])
    assert data == tomllib.loads(SMALL_RECIPE), "the caller's data is left as it was"
    assert from_file.path == str(path) and from_data.path == DICT_RECIPE
    assert from_file.to_dict() == from_data.to_dict() and from_data.run.steps == 3
    assert resolve_recipe(from_data) is from_data
    again = resolve_recipe(from_data, ["run.steps=4"])
    assert isinstance(again, Recipe) and again.run.steps == 4 and again.path == DICT_RECIPE
    assert again.overrides == ("run.steps=4",)
    silent = resolve_recipe(data, ["~log.0"])  # no [[log]] is the default logger: dropped, none
    assert silent.logs == []
    assert resolve_recipe(silent, ["run.steps=5"]).logs == [], "an empty [[log]] stays empty under overrides"
    with pytest.raises(TypeError, match="a recipe is a path, a dict or a Recipe, not int"):
        resolve_recipe(3)


def test_a_session_records_who_launched_it_and_how_after_evaluation_ended_it(write_recipe, tmp_path):
    """``launched_by`` goes into the session's run.json entry; a Stop from ``after_evaluation``
    ends the run at that evaluation, with its status in run.json and its line in the console."""
    from eblvm_core.evaluation import Stop
    from tests.support import session_run

    said, asked = [], []

    def prune(step, scalars):
        asked.append(step)
        return Stop("pruned", "pruned by the test") if step == 20 else None

    run_dir, results = session_run(
        write_recipe(),
        ["run.eval_every=10"],
        out=tmp_path / "runs",
        echo=said.append,
        launched_by={"kind": "slurm", "job_id": "812_3"},
        after_evaluation=prune,
    )
    assert asked == [10, 20] and "pruned by the test" in said and said[-1] == f"done: {run_dir}"
    assert "eval/exact-loglik/test_loglik" in results
    (session,) = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert session["launcher"] == {"kind": "slurm", "job_id": "812_3"}
    assert (session["status"], session["to_step"]) == ("pruned", 20)
    assert ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))["step"] == 20


def test_a_run_stopped_between_log_steps_logs_on_as_if_it_never_stopped(tmp_path, monkeypatch):
    """SIGINT at step 37 (the log steps are 10, 20, ...): the resumed run's metrics.jsonl, every
    training mean, rate and gradient norm and every evaluation, equals an uninterrupted run's;
    the first mean after the resume covers steps 31-40 of both sessions, as the checkpoint kept
    the partial sums. Only the speed, a wall-clock reading, may differ."""
    from eblvm_core.errors import Interrupted
    from tests.support import BISM, metrics_rows, session_run

    recipe = tmp_path / "bism.toml"
    recipe.write_text(
        BISM.replace("steps = 30", "steps = 60").replace("checkpoint_every = 10", "checkpoint_every = 25")
    )
    options = ["run.eval_every=20", "run.seed=4"]
    straight, _ = session_run(recipe, options, out=tmp_path / "straight", echo=lambda _line: None)

    def interrupt(_built, _metrics):
        signal.raise_signal(signal.SIGINT)

    poison_at(monkeypatch, 37, interrupt)
    with pytest.raises(Interrupted, match="SIGINT at step 37/60"):
        session_run(recipe, options, out=tmp_path / "stopped", echo=lambda _line: None)
    monkeypatch.undo()
    stopped = only_run_dir(tmp_path / "stopped")
    session_run(None, resume=stopped, echo=lambda _line: None)

    def logged(run_dir):
        return [{k: v for k, v in row.items() if k != "speed/steps_per_s"} for row in metrics_rows(run_dir)]

    assert len(logged(straight)) == len(logged(stopped)) > 6
    assert logged(stopped) == logged(straight)


@pytest.mark.parametrize("inside", [False, True])
def test_a_file_fault_mid_run_is_a_read_error_or_a_write_error_by_where_the_file_is(tmp_path, monkeypatch, inside):
    """An OSError while training that names a file outside the run directory is the read error it
    is (a damaged data file: exit 2), saying which checkpoint holds the last good step and how to
    resume; one inside the run directory is its write error (exit 1). Neither says the other."""
    from eblvm_core.data import Batches
    from eblvm_core.errors import DataError, FileSystemError
    from tests.support import session_run

    out = tmp_path / "runs"
    real_next, calls = Batches.next, [0]

    def failing(self):
        calls[0] += 1
        if calls[0] == 15:
            where = only_run_dir(out) / "metrics.jsonl" if inside else tmp_path / "data" / "img_0042.png"
            raise OSError(errno.EIO, "Input/output error", str(where))
        return real_next(self)

    monkeypatch.setattr(Batches, "next", failing)
    recipe = tmp_path / "r.toml"
    recipe.write_text(SMALL_RECIPE)
    with pytest.raises(FileSystemError if inside else DataError) as fault:
        session_run(recipe, out=out, echo=lambda _line: None)
    line = str(fault.value)
    assert "holds step 10" in line and "\n" not in line
    if inside:
        assert "metrics.jsonl: cannot write: Input/output error" in line
    else:
        assert "img_0042.png: cannot read: Input/output error" in line and "cannot write" not in line
        assert f"once it is fixed, resume with: eblvm run --resume {only_run_dir(out)}" in line


def test_what_the_build_warns_of_is_said_once_at_the_start_and_kept_in_run_log(tmp_path):
    """A factory's warning (a relaxed posterior's temperature) is the session's first line after
    the run is opened, before the run directory's line, and run.log keeps it."""
    from tests.support import BISM, session_run

    recipe = tmp_path / "r.toml"
    recipe.write_text(BISM.replace('kind = "bernoulli"', 'kind = "bernoulli"\ntemperature = 0.5', 1))
    said = []
    run_dir, _ = session_run(recipe, ["run.steps=2"], out=tmp_path / "runs", echo=said.append)
    warnings = [line for line in said if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: [posterior] temperature: 0.5 > 0.2: ")
    assert said.index(warnings[0]) == said.index(next(line for line in said if line.startswith("run directory: "))) - 1
    assert warnings[0] in (run_dir / "run.log").read_text().splitlines()
