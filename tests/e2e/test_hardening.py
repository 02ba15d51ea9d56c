"""Around the training core, as real processes and as every command sees it: a run killed (kill -9)
and resumed records nothing twice; a second process on a run directory is refused; SIGINT and
SIGTERM sent to a training process; a checkpoint of another recipe, of before an option existed,
with a flipped bit or corrupt, refused alike by `run --resume`, `eval` and `sample`; errors that
cross a worker process. (The modules' own tests are in tests/core/: test_session.py,
test_guard.py, test_rundir.py, test_checkpoint.py, test_records.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from tests.support import (
    RECIPES,
    SMALL_RECIPE,
    flip_a_bit_of,
    kill_run_when,
    one_line,
    only_run_dir,
    snapshot,
)
from tests.support.forked import Forked

QUIET = lambda _line: None  # noqa: E731


# ---- a checkpoint of another recipe -----------------------------------------------------------------


def test_a_checkpoint_from_another_recipe_is_refused(cli, run_copy, tmp_path, write_recipe):
    from tests.support import session_run as run

    other = write_recipe(SMALL_RECIPE.replace("sigma = 0.1", "sigma = 0.2"), name="o.toml")
    other_dir, _ = run(other, out=tmp_path / "other", echo=QUIET)
    shutil.copy(ckpt.last_checkpoint(other_dir), ckpt.last_checkpoint(run_copy))
    before = snapshot(run_copy)
    for command in (["run", "--resume", run_copy, "-o", "run.steps=40"], ["eval", run_copy], ["sample", run_copy]):
        line = one_line(cli(command))
        assert f"{ckpt.last_checkpoint(run_copy)}: written by another recipe: objective.sigma is 0.2" in line, line
    assert snapshot(run_copy) == before


def test_a_checkpoint_from_before_an_option_existed_loads_while_the_option_keeps_its_default(cli, run_copy):
    """A checkpoint whose recipe lacks an option (written before the option was added) resumes,
    evaluates and samples while the option is at its default here (Adam's beta1, 0.9); one that
    lacks an option this recipe sets otherwise (lr 1e-2, default 1e-3) is still refused."""
    path = ckpt.last_checkpoint(run_copy)
    state = ckpt.read_checkpoint(path)
    del state["recipe"]["optim"]["model"]["beta1"]
    ckpt.save_atomic(ckpt.seal(state), path)
    for command in (["eval", run_copy], ["sample", run_copy, "--out", run_copy / "s.png"]):
        result = cli(command)
        assert result.exit_code == 0, result.output
    result = cli(["run", "--resume", run_copy, "-o", "run.steps=40"])
    assert result.exit_code == 0 and f"resuming {run_copy} at step 30" in result.output, result.output
    state = ckpt.read_checkpoint(path)
    del state["recipe"]["optim"]["model"]["lr"]
    ckpt.save_atomic(ckpt.seal(state), path)
    line = one_line(cli(["eval", run_copy]))
    assert f"{path}: written by another recipe: optim.model.lr is None there and 0.01" in line, line


# ---- a killed run, a second process ------------------------------------------------------------------


@pytest.mark.slow
def test_records_after_the_last_checkpoint_are_not_duplicated_on_resume(write_recipe, tmp_path):
    """Killed (kill -9) with metrics logged after its last checkpoint, then resumed: every training
    step is logged once, and the final parameters equal an uninterrupted run's."""
    from tests.support import session_run as run

    recipe = write_recipe(
        SMALL_RECIPE.replace("steps = 30", "steps = 1500").replace("checkpoint_every = 10", "checkpoint_every = 200")
    )
    out = tmp_path / "killed"

    def logged_past(checkpoint: Path) -> bool:
        """Metrics logged at least 30 steps past the checkpoint's step."""
        rows = (checkpoint.parents[1] / "metrics.jsonl").read_text().splitlines()
        return bool(rows) and json.loads(rows[-1])["step"] >= ckpt.load(checkpoint)["step"] + 30

    kill_run_when(recipe, out, ready=logged_past)
    killed = only_run_dir(out)
    at = ckpt.load(ckpt.last_checkpoint(killed))["step"]
    logged = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines() if line]
    assert at < 1500 and logged[-1] > at, "no records after the last checkpoint: the test proves nothing"

    run(None, resume=killed, echo=QUIET)
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(10, 1501, 10))
    full, _ = run(recipe, out=tmp_path / "full", echo=QUIET)
    a, b = (ckpt.load(ckpt.last_checkpoint(d))["networks"]["model"] for d in (full, killed))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_second_process_on_a_run_directory_is_refused(cli, run_copy):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from eblvm_core.rundir import RunLock; lock = RunLock({str(run_copy)!r}).acquire(); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        lock = run_copy / ".lock"  # made by the holder: a finished run leaves none
        while not (lock.exists() and f"pid {holder.pid}" in lock.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        before = snapshot(run_copy)
        line = one_line(cli(["run", "--resume", run_copy, "-o", "run.steps=40"]))
        assert f"{run_copy}: in use by pid {holder.pid}" in line, line
        assert snapshot(run_copy) == before
    finally:
        holder.communicate("\n", timeout=60)
    assert cli(["run", "--resume", run_copy, "-o", "run.steps=40"]).exit_code == 0


# ---- checkpoints: checksums and corrupt files -----------------------------------------------------


def test_checkpoints_carry_a_checksum_that_catches_a_flipped_bit(cli, run_copy):
    path = ckpt.last_checkpoint(run_copy)
    state = ckpt.read_checkpoint(path)
    assert state["format"] == ckpt.CHECKPOINT_FORMAT and state["checksum"] == ckpt.checksum(state)
    W = state["networks"]["model"]["W"]
    flip_a_bit_of(path, W)
    flipped = ckpt.load(path)["networks"]["model"]["W"]
    assert not torch.equal(flipped, W), "the flip must reach W, or the test proves nothing"
    for command in (["eval", run_copy], ["sample", run_copy], ["run", "--resume", run_copy, "-o", "run.steps=40"]):
        line = one_line(cli(command))
        assert f"{path}: checksum mismatch" in line, line


def corrupt(kind: str, path: Path, tmp_path: Path) -> str:
    """Damage the checkpoint at ``path`` in one of the ways a user may meet; returns what the error must say."""
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
        return "truncated or damaged"
    if kind == "zero-byte":
        path.write_bytes(b"")
        return "empty file (0 bytes)"
    if kind == "garbage":
        path.write_bytes(bytes((i * 97 + 13) % 256 for i in range(4096)))
        return "not an eblvm checkpoint"
    if kind == "tensor-only":
        torch.save(torch.ones(3), path)
        return "not an eblvm checkpoint: it holds a bare Tensor"
    if kind == "no format":
        torch.save({"networks": {}}, path)
        return "a dict without 'format'"
    if kind == "wrong shape":
        state = ckpt.read_checkpoint(path)
        state["networks"]["model"]["W"] = torch.zeros(2, 8)
        ckpt.save_atomic(ckpt.seal(state), path)
        return "does not fit this run's parts: Error(s) in loading state_dict for GRBM: size mismatch for W"
    if kind == "pickle payload":
        marker = tmp_path / "pwned"

        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        torch.save({"format": 3, "x": Payload()}, path)
        return "holds a pickled Python object (posix.system); refused"
    raise AssertionError(kind)


KINDS = ["truncated", "zero-byte", "garbage", "tensor-only", "no format", "wrong shape", "pickle payload"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_checkpoint_is_one_line_for_resume_eval_and_sample(cli, run_copy, tmp_path, kind):
    path = ckpt.last_checkpoint(run_copy)
    fragment = corrupt(kind, path, tmp_path)
    before = snapshot(run_copy)
    for command in (["run", "--resume", run_copy, "-o", "run.steps=40"], ["eval", run_copy], ["sample", run_copy]):
        line = one_line(cli(command))
        assert line.startswith(f"error: {path}: ") and fragment in line, line
        assert "weights_only" not in line
    assert snapshot(run_copy) == before
    assert not (tmp_path / "pwned").exists(), "a pickle payload must never run"


# ---- Ctrl-C and SIGTERM --------------------------------------------------------------------------


def start(recipe: Path, out: Path) -> Forked:
    return Forked(["run", recipe, "--out", out])


def wait_for_training(out: Path, proc: Forked, step: int = 20) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        rows = list(out.glob("*/*/metrics.jsonl"))
        if rows and rows[0].read_text().count("train/loss") * 10 >= step:
            return
        time.sleep(0.01)
    raise AssertionError("training did not start")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_writes_a_checkpoint_says_how_to_resume_and_exits_130(write_recipe, tmp_path, signum):
    """The interrupted run, resumed, ends with the parameters of an uninterrupted run, bit for bit."""
    from tests.support import session_run as run

    recipe = write_recipe(
        SMALL_RECIPE.replace("steps = 30", "steps = 1500").replace("checkpoint_every = 10", "checkpoint_every = 100000")
    )
    out = tmp_path / "stopped"
    proc = start(recipe, out)
    wait_for_training(out, proc)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout + stderr
    run_dir = only_run_dir(out)
    state = ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))
    assert 0 < state["step"] < 1500, "the signal came too late; the test proves nothing"
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"interrupted: {signal.Signals(signum).name} at step {state['step']}/1500"), stderr
    assert f"resume with: eblvm run --resume {run_dir}" in stderr and "Traceback" not in stderr
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["status"] == "interrupted"
    if signum != signal.SIGINT:
        return
    run(None, resume=run_dir, echo=QUIET)
    full, _ = run(recipe, out=tmp_path / "full", echo=QUIET)
    a, b = (ckpt.load(ckpt.last_checkpoint(d))["networks"]["model"] for d in (full, run_dir))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- errors across processes ------------------------------------------------------------------------


@pytest.mark.slow
def test_errors_survive_pickling_so_a_worker_process_error_prints_as_one_line(cli, tmp_path):
    """Every user-facing error crosses a process boundary intact (str, exit code, fields); under
    ``compare --jobs 2`` a run that fails in a worker ends in the same one line as without workers."""
    import pickle

    from eblvm_core import errors

    made = [
        errors.ConfigError("data", "root", "not found", file="r.toml"),
        errors.DataError("no such folder", key="root"),
        errors.CheckpointError("last.pt", "checksum mismatch"),
        errors.TrainingDiverged("loss is nan"),
        errors.Interrupted("stopped"),
        errors.FileSystemError("read-only"),
    ]
    for error in made:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error) and copy.__dict__ == error.__dict__
        assert copy.exit_code == error.exit_code
    spec = tmp_path / "spec.toml"
    recipe = RECIPES / "freyface_dsm.toml"
    spec.write_text(f'[compare]\nname = "x"\nmetrics = []\n\n[[method]]\nname = "DSM"\nrecipe = "{recipe}"\n')
    args = [
        "compare",
        spec,
        "--seeds",
        "2",
        "--jobs",
        "2",
        "--steps",
        "2",
        "--out",
        tmp_path / "out",
        "--device",
        "cpu",
    ]
    result = cli([*args, "-o", f'data.root="{tmp_path / "missing"}"'])
    assert result.exit_code == 2 and "missing" in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2, result.output
