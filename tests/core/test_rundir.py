"""rundir.py: a run directory's creation (never two in the same second, a read-only --out), its
lock, and a path given by the user (a run's name folder standing for its latest run, a missing
path, a folder that is not a run)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from eblvm_core import checkpoint as ckpt
from eblvm_core.errors import ConfigError
from eblvm_core.rundir import (
    Provenance,
    RunLock,
    clean_metrics,
    find_run_dir,
    hyperparameters,
    json_row,
    new_run_dir,
)
from tests.support import one_line

# ---- a run's name folder, a missing path ---------------------------------------------------------


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


# ---- the lock ------------------------------------------------------------------------------------


def test_the_lock_is_exclusive_and_released_without_a_trace(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(Exception, match="in use by pid"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / ".lock").exists()
    RunLock(tmp_path).acquire().release()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_won_on_a_just_deleted_file_is_taken_again_on_the_file_at_the_path(tmp_path, monkeypatch):
    """B opens the lock file, A releases (deleting it), B's flock then succeeds on the deleted file,
    which a third process cannot see: B must notice and lock the file at the path instead."""
    import eblvm_core.rundir as rundir

    first = RunLock(tmp_path).acquire()
    early = open(tmp_path / ".lock", "a+")  # noqa: SIM115 - handed to acquire below
    first.release()
    handles = [early]
    monkeypatch.setattr(rundir, "open", lambda *a, **k: handles.pop() if handles else open(*a, **k), raising=False)
    second = RunLock(tmp_path).acquire()
    assert not handles and early.closed, "the early handle was not tried, or was kept"
    assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()
    with pytest.raises(Exception, match="in use by pid"):
        RunLock(tmp_path).acquire()
    second.release()


# ---- creating a run directory --------------------------------------------------------------------


def test_a_read_only_out_is_one_line_and_exit_1(cli, write_recipe, tmp_path, monkeypatch):
    """A read-only file system refuses every mkdir (EROFS), also for root; simulated under --out."""
    out = tmp_path / "ro"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if str(self).startswith(str(out)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    line = one_line(cli(["run", write_recipe(), "--out", out]), code=1)
    assert line == f"error: {out / 'small'}: cannot create the run directory: Read-only file system", line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_folder_for_real(cli, write_recipe, tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        line = one_line(cli(["run", write_recipe(), "--out", out]), code=1)
        assert "cannot create the run directory: Permission denied" in line
    finally:
        out.chmod(0o700)


@pytest.mark.slow
def test_runs_started_in_the_same_second_never_collide(tmp_path):
    barrier, made, errors = threading.Barrier(8), [], []

    def make() -> None:
        barrier.wait()
        try:
            made.append(new_run_dir(tmp_path, "same"))
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(made)) == 8 and all((p / "checkpoints").is_dir() for p in made)


# ---- find_run_dir, new_run_dir --------------------------------------------------------------------


def a_run(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "recipe.toml").write_text("")
    return path


def test_find_run_dir_picks_the_latest_run_by_its_start_and_suffix(tmp_path):
    """Run directories sort by the start in their names, then the suffix as a number (-10 after -2);
    those named otherwise come before them; folders without recipe.toml and files are no runs."""
    name = tmp_path / "small"
    for run in ("20240101-000000", "20240101-000000-2", "20240101-000000-10", "20231231-235959-99", "zz-notes"):
        a_run(name / run)
    (name / "20990101-000000").mkdir()  # no recipe.toml: not a run
    (name / "20990101-000001").write_text("a file")
    found, note = find_run_dir(name, "cannot resume")
    assert found == name / "20240101-000000-10"
    assert note == f"{name}: a run name's folder; using the latest of its 5 runs: {found}"
    assert find_run_dir(found) == (found, None), "a run directory is taken as it is"
    (one,) = [a_run(tmp_path / "one" / "20200101-000000")]
    assert find_run_dir(tmp_path / "one") == (one, f"{tmp_path / 'one'}: a run name's folder; using its one run: {one}")


def test_find_run_dir_names_what_it_was_doing(tmp_path):
    with pytest.raises(ConfigError) as missing:
        find_run_dir(tmp_path / "gone", "cannot resume")
    assert str(missing.value) == f"{tmp_path / 'gone'}: cannot resume: no such directory"
    with pytest.raises(ConfigError, match=r"^[^:]+: not a run directory: it has no recipe.toml"):
        find_run_dir(tmp_path)


def test_new_run_dir_claims_the_next_suffix_when_a_second_is_taken(tmp_path, monkeypatch):
    import eblvm_core.rundir as rundir

    monkeypatch.setattr(rundir.time, "strftime", lambda _format: "20240101-120000")
    made = [new_run_dir(tmp_path / "out", "small") for _ in range(3)]
    assert [p.name for p in made] == ["20240101-120000", "20240101-120000-1", "20240101-120000-2"]
    assert all(p.parent == tmp_path / "out" / "small" and (p / "checkpoints").is_dir() for p in made)
    for path in made:
        (path / "recipe.toml").write_text("")
    assert find_run_dir(tmp_path / "out" / "small")[0] == made[-1]


# ---- metrics.jsonl ---------------------------------------------------------------------------------


def test_a_metrics_row_is_valid_json_with_non_finite_values_listed():
    row = json_row(5, {"a": 1.5, "b": float("nan"), "c": float("-inf"), "d": 2}, checkpoint="last")
    assert json.loads(row) == {
        "step": 5,
        "checkpoint": "last",
        "a": 1.5,
        "b": None,
        "c": None,
        "d": 2,
        "nonfinite": {"b": "nan", "c": "-inf"},
    }
    assert "nonfinite" not in json.loads(json_row(1, {"a": 0.0}))


def test_clean_metrics_drops_what_runs_again_and_keeps_eval_rows(tmp_path):
    rows = [
        {"step": 10, "train/loss": 1.0},
        {"step": 20, "train/loss": 2.0},
        {"step": 20, "eval/x/y": 0.5},
        {"step": 30, "train/loss": 3.0},
        {"step": 30, "eval/x/y": 0.6, "checkpoint": "last"},  # eblvm eval's: stays
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 40, "train/lo'  # a line cut by a kill
    (tmp_path / "metrics.jsonl").write_text(text)
    clean_metrics(tmp_path, 20, final_pending=False)
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        rows[0],
        rows[1],
        rows[2],
        rows[4],
    ]
    clean_metrics(tmp_path, 20, final_pending=True)  # the final evaluation at 20 runs again
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        rows[0],
        rows[1],
        rows[4],
    ]
    clean_metrics(tmp_path / "nowhere", 0, False)  # no metrics yet: nothing to do


# ---- run.json ---------------------------------------------------------------------------------------


def test_provenance_opens_and_ends_sessions_and_sums_their_time(tmp_path):
    provenance = Provenance(tmp_path)
    assert provenance.status is None and not provenance.finished and provenance.seconds == 0.0
    provenance.start("cpu", 1, 0, 1, command="eblvm.train(...)", launcher={"kind": "slurm", "job_id": "1"})
    again = Provenance(tmp_path)
    (session,) = again.data["sessions"]
    assert session["status"] == "running" and session["command"] == "eblvm.train(...)"
    assert session["launcher"] == {"kind": "slurm", "job_id": "1"} and session["from_step"] == 0
    again.end("stopped early", 50)
    assert Provenance(tmp_path).finished and Provenance(tmp_path).data["sessions"][0]["to_step"] == 50
    again.data["sessions"][0].update(started="2024-01-01T00:00:00+00:00", ended="2024-01-01T00:01:30+00:00")
    again.data["sessions"].append({"started": "2024-01-01T01:00:00+00:00", "ended": None, "status": "killed"})
    assert again.seconds == 90.0 and again.status == "killed" and not again.finished
    (tmp_path / "run.json").write_text("{ damaged")
    assert Provenance(tmp_path).data == {"sessions": []}


def test_hyperparameters_flatten_the_recipe_but_its_evaluators_and_loggers():
    import tomllib

    import eblvm
    from tests.support import SMALL_RECIPE

    flat = hyperparameters(eblvm.load_recipe(tomllib.loads(SMALL_RECIPE)))
    assert flat["run.seed"] == 7 and flat["model.n_hidden"] == 4 and flat["optim.model.lr"] == 0.01
    assert flat["optim.model.schedule.kind"] == "constant"
    assert not any(key.startswith(("eval", "log")) for key in flat)
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())
    assert hyperparameters({"a": {"b": [1, 2], "c": None}, "eval": [{"kind": "x"}]}) == {"a.b": "[1, 2]"}
