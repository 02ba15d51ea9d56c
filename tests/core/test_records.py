"""records.py: what a session writes to its run directory (recipe.toml, run.json, run.log,
metrics.jsonl, the loggers), nothing left by a run that cannot start, and on resume nothing
recorded twice."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import tomli_w
import torch

from eblvm_core.errors import ConfigError, EblvmError, FileSystemError, Interrupted
from eblvm_core.records import Records
from tests.support import SMALL_RECIPE, one_line

# ---- sessions ------------------------------------------------------------------------------------


def test_a_run_that_cannot_start_leaves_no_run_directory(cli, write_recipe, tmp_path, monkeypatch):
    import eblvm_core.records as records_module
    from eblvm_core.errors import ConfigError

    def broken(recipe, run_dir):
        raise ConfigError("log.0", "kind", "cannot open the log")

    monkeypatch.setattr(records_module, "build_loggers", broken)
    out = tmp_path / "runs"
    line = one_line(cli(["run", write_recipe(), "--out", out]))
    assert "[log.0] kind: cannot open the log" in line
    assert not out.exists() or not any(out.rglob("*")), list(out.rglob("*"))


def test_the_run_directory_records_provenance_and_the_console_log(cli, run_copy):
    assert cli(["run", "--resume", run_copy, "-o", "run.steps=40"]).exit_code == 0
    sessions = json.loads((run_copy / "run.json").read_text())["sessions"]
    assert [s["status"] for s in sessions] == ["finished", "finished"]
    assert [(s["from_step"], s["to_step"]) for s in sessions] == [(0, 30), (30, 40)]
    import eblvm_core

    for s in sessions:
        assert s["eblvm"] == eblvm_core.__version__ and s["torch"] == torch.__version__ and s["device"] == "cpu"
        assert s["started"] <= s["ended"] and s["command"] and s["cwd"]
        assert s["git"] is None or len(s["git"]["commit"]) == 40
    log = (run_copy / "run.log").read_text()
    assert "run directory:" in log and f"resuming {run_copy} at step 30" in log
    assert "step 40/40" in log and "exact-loglik/test_loglik:" in log


@pytest.mark.slow
def test_a_resumed_run_does_not_show_tensorboard_twice_what_it_logs_again(tmp_path):
    """A run killed after its last checkpoint logged steps that the resumed run logs again;
    TensorBoard must show each step once (the resumed writer purges what followed the checkpoint)."""

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.support import session_run as run

    recipe = tmp_path / "small.toml"
    recipe.write_text(SMALL_RECIPE)
    quiet = lambda _: None  # noqa: E731
    run_dir, _ = run(recipe, ["run.steps=20", "run.log_every=5"], out=tmp_path / "runs", echo=quiet)
    at_20 = tmp_path / "at_20.pt"
    shutil.copy(run_dir / "checkpoints" / "last.pt", at_20)
    time.sleep(1.1)  # event files are ordered by their names, which hold the second they were opened
    run(None, ["run.steps=30"], resume=run_dir, echo=quiet)
    shutil.copy(at_20, run_dir / "checkpoints" / "last.pt")  # as if killed after logging 25 and 30
    time.sleep(1.1)
    run(None, ["run.steps=30"], resume=run_dir, echo=quiet)
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [s.step for s in events.Scalars("train/loss")] == [5, 10, 15, 20, 25, 30]
    assert [s.step for s in events.Scalars("eval/exact-loglik/test_loglik")] == [20, 30]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [5, 10, 15, 20, 25, 30]


# ---- Records on its own ------------------------------------------------------------------------


PLAN = SimpleNamespace(device="cpu", world=1)  # what ``open`` reads of a plan


def small_recipe():
    import tomllib

    import eblvm

    return eblvm.load_recipe(tomllib.loads(SMALL_RECIPE))


def session_of(records, recipe, step=0, resumed=False, final_pending=False):
    records.open(recipe, PLAN, step, 1, resumed, "the test", None, final_pending)


def test_records_that_do_not_write_write_nothing_and_say_nothing(tmp_path):
    """``writes=False`` (ranks > 0): a whole session of records leaves the run directory empty and
    the console silent; without a run directory nothing is written either."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    said = []
    records = Records(run_dir, said.append, writes=False)
    assert not records.writes and records.provenance is None
    session_of(records, small_recipe())
    records.echo("a line")
    records.record(10, {"train/loss": 1.0}, {"eval/x/img": torch.zeros(3, 2, 2)})
    records.finish(small_recipe(), {"eval/x/y": 1.0})
    records.failed(EblvmError("no"))
    records.close("finished", 10)
    assert said == [] and list(run_dir.iterdir()) == []
    nowhere = Records(None, said.append)
    assert not nowhere.writes
    nowhere.echo("a line")
    nowhere.record(1, {"a": 1.0})
    assert said == []


def test_a_session_writes_its_recipe_provenance_log_and_metrics(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    said = []
    records = Records(run_dir, said.append)
    recipe = small_recipe()
    session_of(records, recipe)
    assert (run_dir / "recipe.toml").read_text() == tomli_w.dumps(recipe.to_dict())
    assert [s["status"] for s in json.loads((run_dir / "run.json").read_text())["sessions"]] == ["running"]
    assert [type(logger).__name__ for logger in records.loggers] and (run_dir / "tensorboard").is_dir()
    records.echo("step 10/30")
    records.record(10, {"train/loss": 1.0})
    records.finish(recipe, {"eval/exact-loglik/test_loglik": -1.25})
    records.close("finished", 30)
    assert said == ["step 10/30", "exact-loglik/test_loglik: -1.25"]
    assert (run_dir / "run.log").read_text() == "step 10/30\nexact-loglik/test_loglik: -1.25\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 10, "train/loss": 1.0}\n'
    (session,) = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert (session["status"], session["from_step"], session["to_step"], session["command"]) == (
        "finished",
        0,
        30,
        "the test",
    )


def test_a_failure_is_written_to_run_log_as_the_cli_prints_it(tmp_path):
    records = Records(tmp_path)
    records.failed(Interrupted("SIGTERM at step 3/9"))
    records.failed(ConfigError("run", "steps", "must be > 0", file="r.toml"))
    records.failed(ValueError("a bug: its traceback says it"))
    assert (
        tmp_path / "run.log"
    ).read_text() == "interrupted: SIGTERM at step 3/9\nerror: r.toml: [run] steps: must be > 0\n"


def test_a_new_run_that_cannot_open_its_records_leaves_no_directory(tmp_path, monkeypatch):
    import eblvm_core.records as records_module
    from eblvm_core.rundir import new_run_dir

    def broken(recipe, run_dir):
        raise ConfigError("log.0", "kind", "cannot open the log")

    monkeypatch.setattr(records_module, "build_loggers", broken)
    out = tmp_path / "out"
    records = Records(new_run_dir(out, "small"))
    with pytest.raises(ConfigError, match="cannot open the log"):
        session_of(records, small_recipe())
    assert list(out.iterdir()) == [], "neither the run directory nor an empty <out>/<name>/ is left"
    records.close("failed", 0)  # the session never reached run.json
    assert list(out.iterdir()) == []

    other = new_run_dir(out, "small")
    (other.parent / "20000101-000000").mkdir()  # an earlier run of the same name stays
    records = Records(other)
    with pytest.raises(ConfigError):
        session_of(records, small_recipe())
    assert not other.exists() and [p.name for p in (out / "small").iterdir()] == ["20000101-000000"]


def test_a_refused_write_is_a_file_system_error_and_a_resumed_run_keeps_its_directory(tmp_path, monkeypatch):
    import eblvm_core.records as records_module

    def full(recipe, run_dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run_dir / ".recipe.toml.tmp"))

    monkeypatch.setattr(records_module, "write_recipe", full)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 10}\n')
    with pytest.raises(FileSystemError) as refused:
        session_of(Records(run_dir), small_recipe(), step=10, resumed=True)
    assert str(refused.value) == f"{run_dir / '.recipe.toml.tmp'}: cannot write: No space left on device"
    assert refused.value.exit_code == 1
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 10}\n', "a resumed run keeps what it had"


def test_a_resumed_session_drops_what_followed_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": 10, "train/loss": 1.0}, {"step": 20, "train/loss": 2.0}, {"step": 20, "eval/x/y": 3.0}]
    rows += [{"step": 30, "train/loss": 3.0}, {"step": 20, "checkpoint": "last", "eval/x/y": 3.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = Records(run_dir)
    session_of(records, small_recipe(), step=20, resumed=True, final_pending=True)
    records.close("finished", 20)
    kept = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kept == [rows[0], rows[1], rows[4]]
    assert json.loads((run_dir / "run.json").read_text())["sessions"][0]["from_step"] == 20
