"""Around the training core: resume rules, the run lock, checkpoint checksums and corrupt
checkpoints, Ctrl-C and SIGTERM, divergence, the file system, provenance."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core.rundir import RunLock, new_run_dir
from tests.support import RECIPES, SMALL_RECIPE, kill_run_when, poison_at

QUIET = lambda _line: None  # noqa: E731


def only_run_dir(out: Path) -> Path:
    (name_dir,) = list(out.iterdir())
    (run_dir,) = list(name_dir.iterdir())
    return run_dir


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes, but the lock (which records its last holder)."""
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in run_dir.rglob("*")
        if p.is_file() and p.name != ".lock"
    }


def one_line(result, code: int = 2, label: str = "error") -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith(f"{label}: ")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 30-step run of the small recipe (checkpoints at 10, 20, 30)."""
    from eblvm_core.session import run

    folder = tmp_path_factory.mktemp("trained")
    recipe = folder / "r.toml"
    recipe.write_text(SMALL_RECIPE)
    run_dir, _ = run(recipe, out=folder / "runs", echo=QUIET)
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A private copy of the trained run."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


# ---- resume: what may change, and nothing written on refusal -------------------------------------


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


def test_a_checkpoint_from_another_recipe_is_refused(cli, run_copy, tmp_path, write_recipe):
    from eblvm_core.session import run

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


@pytest.mark.slow
def test_records_after_the_last_checkpoint_are_not_duplicated_on_resume(write_recipe, tmp_path):
    """Killed (kill -9) with metrics logged after its last checkpoint, then resumed: every training
    step is logged once, and the final parameters equal an uninterrupted run's."""
    from eblvm_core.session import run

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


def test_a_finished_run_leaves_no_lock(cli, write_recipe, tmp_path):
    assert cli(["run", write_recipe(), "--out", tmp_path / "runs"]).exit_code == 0
    run_dir = only_run_dir(tmp_path / "runs")
    assert (run_dir / "checkpoints" / "last.pt").exists() and not (run_dir / ".lock").exists()


def test_a_kill_during_a_checkpoint_write_leaves_no_temporary_after_the_next_start(cli, run_copy):
    stale = run_copy / "checkpoints" / ".last.pt.x1y2z3.tmp"
    stale.write_bytes(b"")
    assert cli(["run", "--resume", run_copy, "-o", "run.steps=40"]).exit_code == 0
    assert not stale.exists() and sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["last.pt"]


# ---- checkpoints: checksums and corrupt files -----------------------------------------------------


def flip_a_bit_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip the lowest bit of the first byte of ``tensor``'s data inside the checkpoint file."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the tensor's bytes must occur once in the file"
    data[at] ^= 1
    path.write_bytes(bytes(data))


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


def test_the_checksum_covers_every_tensor_byte_and_plain_value():
    state = {"format": 3, "step": 5, "networks": {"m": {"w": torch.arange(6.0).view(2, 3)}}, "best": None}
    digest = ckpt.checksum(state)
    assert ckpt.checksum(ckpt.seal(state)) == digest, "the checksum leaves itself out"
    changed = [
        {**state, "step": 6},
        {**state, "best": 0.0},
        {**state, "networks": {"m": {"w": torch.arange(6.0).view(3, 2)}}},  # same bytes, another shape
        {**state, "networks": {"m": {"w": torch.arange(6.0, dtype=torch.float64).view(2, 3)}}},
        {**state, "networks": {"m": {"w": torch.arange(6.0).view(2, 3).nextafter(torch.tensor(9.0))}}},
    ]
    assert all(ckpt.checksum(other) != digest for other in changed)


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


def start(recipe: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "eblvm_core.cli", "run", str(recipe), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_training(out: Path, proc: subprocess.Popen, step: int = 20) -> None:
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
    from eblvm_core.session import run

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


# ---- divergence ------------------------------------------------------------------------------------


def nan_sigma(built, metrics) -> None:
    with torch.no_grad():
        built.parts.model.log_sigma.fill_(float("nan"))


def test_a_non_finite_parameter_stops_the_run_with_a_finite_loss(cli, write_recipe, tmp_path, monkeypatch):
    poison_at(monkeypatch, 30, nan_sigma)  # after step 30's loss: only the parameter is not finite
    out = tmp_path / "runs"
    line = one_line(cli(["run", write_recipe(), "--out", out]), code=3)
    assert "step 30: parameter model.log_sigma (role 'model') is not finite" in line, line
    run_dir = only_run_dir(out)
    assert f"last good checkpoint: {ckpt.last_checkpoint(run_dir)} (step 20)" in line, line
    state = ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))
    assert state["step"] == 20 and all(torch.isfinite(t).all() for t in state["networks"]["model"].values())


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


def test_after_a_resume_the_message_names_the_checkpoint_resumed_from(cli, run_copy, monkeypatch):
    poison_at(monkeypatch, 5, nan_sigma)
    line = one_line(cli(["run", "--resume", run_copy, "-o", "run.steps=60", "-o", "run.checkpoint_every=100"]), code=3)
    assert f"last good checkpoint: {ckpt.last_checkpoint(run_copy)} (step 30)" in line, line


def test_a_degenerate_model_whose_evaluation_is_nan_stops_with_exit_3(cli, write_recipe, tmp_path):
    """DSM with SGD at a large rate: the parameters stay finite (log σ runs away) but the exact
    log-likelihood is NaN; metrics.jsonl stays valid JSON (null and a flag)."""
    overrides = ["optim.model.kind=sgd", "optim.model.lr=2.0", "run.steps=100", "objective.sigma=0.05"]
    out = tmp_path / "runs"
    line = one_line(cli(["run", write_recipe(), "--out", out, *[a for o in overrides for a in ("-o", o)]]), code=3)
    assert "step 100: evaluation gave eval/exact-loglik/test_loglik = nan" in line, line
    run_dir = only_run_dir(out)

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in metrics.jsonl")

    rows = [json.loads(r, parse_constant=refuse) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = rows[-1]
    assert final["eval/exact-loglik/test_loglik"] is None and final["nonfinite"] == {
        "eval/exact-loglik/test_loglik": "nan",
        "eval/exact-loglik/test_loglik_stderr": "nan",
    }
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["status"] == "diverged"


CD = SMALL_RECIPE.replace('[objective]\nkind = "dsm"\nsigma = 0.1\n', "").replace('"exact-score"', '"cd"')


@pytest.mark.parametrize("lr", [50.0, 200.0])
def test_a_sampler_failing_on_a_nan_probability_is_a_divergence(cli, write_recipe, tmp_path, lr):
    overrides = ["-o", "optim.model.kind=sgd", "-o", f"optim.model.lr={lr}", "-o", "run.steps=100"]
    line = one_line(cli(["run", write_recipe(CD), "--out", tmp_path / "runs", *overrides]), code=3)
    assert "the step failed" in line and "p_in" in line and "run stopped" in line, line


# ---- the file system -------------------------------------------------------------------------------


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


def test_a_run_that_cannot_start_leaves_no_run_directory(cli, write_recipe, tmp_path, monkeypatch):
    import eblvm_core.session as session_module
    from eblvm_core.errors import ConfigError

    def broken(recipe, run_dir):
        raise ConfigError("log.0", "kind", "cannot open the log")

    monkeypatch.setattr(session_module, "build_loggers", broken)
    out = tmp_path / "runs"
    line = one_line(cli(["run", write_recipe(), "--out", out]))
    assert "[log.0] kind: cannot open the log" in line
    assert not out.exists() or not any(out.rglob("*")), list(out.rglob("*"))


# ---- provenance ------------------------------------------------------------------------------------


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
