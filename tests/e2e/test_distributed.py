"""Data parallelism on torch.distributed: two CPU processes (gloo) against one process fed the
union of their batches; a kill -9 and Ctrl-Cs under two processes, each resumed to end level with
one uninterrupted run; a NaN on one rank; and the helpers without a process group.

The multi-process tests launch `python -m eblvm` twice with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, ...) or through `eblvm run --nproc-per-node 2` (torchrun itself), with
the test plugin ``tests.support.fixed_noise`` loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import tomli_w
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.roles import TrainingRole
from tests.support import ROOT, SMALL_RECIPE, only_run_dir
from tests.support.forked import Forked, read_logs, torch_log_lines, torchrun_ranks

pytestmark = pytest.mark.slow  # every test here starts processes (torchrun ranks, pip installs)

T = TypeVar("T")
TIMEOUT = 180  # seconds for any one launch; a few on a free machine


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    path = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {
        **env,
        "PYTHONPATH": path,
        "EBLVM_PLUGIN_MODULES": "tests.support.fixed_noise",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",  # a rank that aborts (SIGABRT) prints where each thread was
        **extra,
    }


def write_recipe(path: Path, base: str | dict, run: dict, **sections) -> Path:
    """``base`` (a recipe of recipes/ by name, or a dict) with [run] keys and whole sections replaced."""
    recipe = tomllib.loads((ROOT / "recipes" / f"{base}.toml").read_text()) if isinstance(base, str) else base
    recipe["run"].update({"device": "cpu", "threads": 1, **run})
    recipe.update(sections)
    path.write_text(tomli_w.dumps(recipe))
    return path


def launch(args: list, logs: Path) -> list[Forked]:
    """Two ranks of `python -m eblvm run ARGS` as torchrun starts them, forked (``torchrun_ranks``), in
    this module's environment; output in ``logs``.rank0 and .rank1."""
    return torchrun_ranks(args, logs, environment(), cwd=ROOT)


def wait(procs: list[Forked], logs: Path) -> list[int]:
    """Exit codes of ``procs``; kills them all if one is still running after TIMEOUT seconds."""
    deadline = time.time() + TIMEOUT
    try:
        return [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"timed out: {read_logs(logs)}") from None


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def layout(run_dir: Path) -> list[str]:
    """The files of a run directory, TensorBoard event files by folder only."""
    names = (p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
    return sorted("tensorboard/<events>" if n.startswith("tensorboard/events.") else n for n in names)


# ---- without a process group: identities, and the buckets -------------------------------------


def test_helpers_are_identities_without_a_process_group():
    grads = [torch.randn(3), torch.randn(2, 2)]
    assert not distributed.active() and distributed.rank() == 0 and distributed.world_size() == 1
    assert all(a is b for a, b in zip(distributed.mean_over_ranks(grads), grads))
    assert distributed.mean_floats([1.5, -2.0]) == [1.5, -2.0]
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    assert distributed.broadcast_object("x") == "x"
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    norm = TrainingRole("model", torch.optim.SGD([p], lr=0.5)).update((p**2).sum())
    assert torch.equal(p.detach(), torch.tensor([0.0, 0.0])) and float(norm) == pytest.approx(20**0.5)


def test_a_resnets_gradients_travel_in_a_few_buckets():
    from torchvision.models import resnet18

    with torch.device("meta"):
        params = list(resnet18().parameters())  # 11.7 M float32 values, 62 tensors
    buckets = distributed.buckets(params)
    assert [p for b in buckets for p in b] == params
    assert len(buckets) == 2
    assert all(sum(p.numel() * 4 for p in b) <= distributed.BUCKET_BYTES for b in buckets if len(b) > 1)
    mixed = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    assert [len(b) for b in distributed.buckets(mixed)] == [1, 1, 1]


# ---- two processes against one fed the union of their batches ----------------------------------


def parameters_by_step(run_dir: Path) -> dict[int, torch.Tensor]:
    """{step: every parameter entry, as float64 (K,)} from the `parameters` evaluator's records."""
    out = {}
    for row in records(run_dir):
        keys = sorted(k for k in row if k.startswith("eval/parameters/"))
        if keys:
            assert row["step"] not in out, "a step evaluated twice: a rank other than 0 recorded"
            out[row["step"]] = torch.tensor([row[k] for k in keys], dtype=torch.float64)
    return out


POINT_NOISE_POSTERIOR = {"posterior": {"kind": "bernoulli-point-noise", "temperature": 0.1}}
RECIPES = {
    # BiSSM: K = 5 real posterior steps and N = 5 unrolled ones per step, two roles
    "grbm_bissm": POINT_NOISE_POSTERIOR,
    # BiSSM by the implicit function theorem: a Neumann solve on averaged Hessian-vector products
    "grbm_bism_implicit": POINT_NOISE_POSTERIOR,
    # exact-score SSM: one role
    "grbm_ssm": {},
    # BiSSM with the exact KL and one Gauss-Newton unrolled step: the Fisher blocks averaged over the ranks
    "grbm_bissm, Gauss-Newton": {
        **POINT_NOISE_POSTERIOR,
        "divergence": {"kind": "kl", "exact": True},
        "estimator": {
            "kind": "bism-unrolled",
            "inner_steps": 5,
            "unroll_steps": 1,
            "unroll": "natural",
            "inner_lr": 1.0,
        },
    },
}


@pytest.fixture
def fixed_noise_plugin(monkeypatch):
    """The test plugin ``tests.support.fixed_noise`` loaded in this process too (the plugin set put back after)."""
    from eblvm_core import plugins

    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "tests.support.fixed_noise")
    monkeypatch.setattr(plugins, "_loaded", None)


# The case whose ranks `eblvm run --nproc-per-node 2` starts; the others' ranks are started as torchrun
# starts them (``launch``: forked, so they skip a fresh interpreter's import of torch).
LAUNCHED_BY_EBLVM = "grbm_bissm"


@pytest.mark.parametrize("name", list(RECIPES))
def test_two_processes_equal_one_process_fed_the_union_of_their_batches(name, tmp_path, fixed_noise_plugin):
    """4 steps in float64 with the random draws a function of each data point (tests/support/fixed_noise.py):
    the parameters after every step equal those of one process to 1e-14 (the gap is 1e-17 or
    less), the gradient norms of every role to 1e-12 relative; rank 0 alone wrote the run
    directory; each rank kept its own random stream. Launched by `eblvm run --nproc-per-node 2`
    (``LAUNCHED_BY_EBLVM``), one process of the launch imported torch: not the launching one (rank 0
    serves the rendezvous store), nor the ranks, forked from it. Torch logs nothing, however the
    ranks were started: the rank that holds the store leaves last."""
    steps = 4
    recipe = write_recipe(
        tmp_path / "recipe.toml",
        name.split(",")[0],
        {"steps": steps, "dtype": "float64", "log_every": 1, "eval_every": 1, "checkpoint_every": steps},
        data={"kind": "checkerboard", "n_train": 1000, "n_test": 100},
        objective={"kind": "ssm-point-noise"},
        eval=[{"kind": "parameters"}],
        **RECIPES[name],
    )

    from tests.support import session_run as run  # the one process: this one, while the two train

    if name == LAUNCHED_BY_EBLVM:
        command = [sys.executable, "-m", "eblvm", "run", recipe, "--nproc-per-node", "2", "--out", tmp_path / "two"]
        every_import = environment(PYTHONPROFILEIMPORTTIME="1")  # each process lists what it imports
        two = subprocess.Popen(command, cwd=ROOT, env=every_import, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        run(recipe, out=tmp_path / "one", echo=lambda _line: None)
        lines = two.communicate(timeout=TIMEOUT)[0].decode().splitlines()
        imported = [line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")]
        output = "\n".join(line for line in lines if not line.startswith("import time:"))
        assert two.returncode == 0, output
        assert "2 processes" in output
        assert "eblvm_core.processes" in imported and "eblvm_core.worker_imports" in imported
        assert imported.count("torch") == 1, "torch was imported by the launching process or by every rank"
    else:
        logs = tmp_path / "two.log"
        ranks = launch([recipe, "--out", tmp_path / "two"], logs)
        run(recipe, out=tmp_path / "one", echo=lambda _line: None)
        assert wait(ranks, logs) == [0, 0], read_logs(logs)
        output = read_logs(logs)
    assert output.count("done: ") == 1, output  # rank 0's
    assert not torch_log_lines(output), output  # e.g. a rank asking the store after its host exited

    one_dir, two_dir = only_run_dir(tmp_path / "one"), only_run_dir(tmp_path / "two")
    expected, got = parameters_by_step(one_dir), parameters_by_step(two_dir)
    assert sorted(expected) == sorted(got) == list(range(1, steps + 1))
    for step in expected:
        gap = float((got[step] - expected[step]).abs().max())
        assert gap <= 1e-14, f"step {step}: parameters differ by up to {gap:.3g}"
    moved = (expected[steps] - expected[1]).abs().max()
    assert moved > 1e-3, "the parameters hardly move: the comparison would prove nothing"

    # Adam's early steps hardly depend on the gradient's size: compare the gradients' norms too
    train = [[r for r in records(d) if "train/loss" in r] for d in (one_dir, two_dir)]
    assert len(train[0]) == len(train[1]) == steps
    for key in [k for k in train[0][0] if k.startswith("train/grad_norm/")]:
        norms = [[r[key] for r in rows] for rows in train]
        assert norms[1] == pytest.approx(norms[0], rel=1e-12), key
    # the trainer sums tensor metrics in float32: the logged mean over ranks equals to float32's precision
    losses = [[r["train/loss"] for r in rows] for rows in train]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)

    assert (
        layout(two_dir)
        == layout(one_dir)
        == sorted(
            [
                "checkpoints/last.pt",
                "metrics.jsonl",
                "recipe.toml",
                "run.json",
                "run.log",
                "tensorboard/<events>",
            ]
        )
    )
    assert [sorted(r) for r in records(two_dir)] == [sorted(r) for r in records(one_dir)]
    state = ckpt.load(two_dir / "checkpoints" / "last.pt")
    rngs = [rank["rng"]["torch"] for rank in state["ranks"]]
    assert len(rngs) == 2 and torch.equal(rngs[0], state["rng"]["torch"]) and not torch.equal(rngs[0], rngs[1])


# ---- a NaN ---------------------------------------------------------------------------------------


def test_a_nan_on_one_rank_stops_every_rank(tmp_path):
    recipe = tomllib.loads(SMALL_RECIPE)
    recipe["estimator"] = {"kind": "exact-score-nan-on-rank1", "at_step": 3}
    recipe = write_recipe(tmp_path / "nan.toml", recipe, {"checkpoint_every": 2})
    logs = tmp_path / "nan"
    assert wait(launch([recipe, "--out", tmp_path / "runs"], logs), logs) == [3, 3], read_logs(logs)
    assert "step 4: training loss became non-finite" in logs.with_name("nan.rank0").read_text()
    assert ckpt.load(only_run_dir(tmp_path / "runs") / "checkpoints" / "last.pt")["step"] == 2


# ---- interrupted and resumed: kill -9, and Ctrl-C under `eblvm run --nproc-per-node 2` -----------


def start_launch(args: list, out: Path) -> subprocess.Popen:
    """`eblvm run --nproc-per-node 2 ARGS` in a session of its own, as a terminal runs a foreground
    command: a Ctrl-C is a SIGINT to that process group (the parent alone: the process that forks
    its ranks has a group of its own)."""
    command = [sys.executable, "-m", "eblvm", "run", *map(str, args), "--nproc-per-node", "2"]
    log = open(out, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=log, stderr=log, start_new_session=True)


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def wait_for_step(run_root: Path, step: int, proc: subprocess.Popen) -> Path:
    """The run directory once metrics.jsonl holds a training row at ``step`` or later."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and proc.poll() is None:
        for path in run_root.glob("*/*/metrics.jsonl"):
            if any(r.get("step", 0) >= step and "train/loss" in r for r in records(path.parent)):
                return path.parent
        time.sleep(0.05)
    raise AssertionError(f"no training row at step {step}: exit {proc.poll()}")


reads_proc = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the processes' state in /proc")


def processes() -> list[tuple[Path, str, int, int]]:
    """(/proc folder, state, parent pid, process group) of every process (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # a process that ended while we looked
        found.append((stat.parent, state, int(ppid), int(group)))
    return found


def loading_torch(parent: int) -> bool:
    """Whether a child of process ``parent`` has mapped torch's library (it is importing torch)."""
    for folder, _, ppid, _ in processes():
        with contextlib.suppress(OSError):
            if ppid == parent and "libtorch_cpu" in (folder / "maps").read_text():
                return True
    return False


def live_in_group(group: int) -> list[str]:
    """The pids of process group ``group`` still running (not ended, nor ended and unreaped)."""
    return [folder.name for folder, state, _, in_group in processes() if in_group == group and state != "Z"]


@reads_proc
def test_a_ctrl_c_while_torch_loads_stops_the_launch_with_one_line(tmp_path):
    """Ctrl-C while the process that forks the ranks is still importing torch: exit 130 with
    ``interrupted: Ctrl-C`` alone (no traceback), and no run directory."""
    args = [ROOT / "recipes" / "grbm_bissm.toml", "--out", tmp_path / "runs", "-o", "run.steps=50"]  # short if missed
    proc = start_launch(args, tmp_path / "out.log")
    once_running(lambda: loading_torch(proc.pid), proc, tmp_path / "out.log")
    ctrl_c(proc)
    assert proc.wait(timeout=TIMEOUT) == 130
    assert (tmp_path / "out.log").read_text() == "interrupted: Ctrl-C\n"
    assert not (tmp_path / "runs").exists()


def test_a_ctrl_c_during_the_set_up_stops_every_rank_before_the_first_step(tmp_path):
    """Ctrl-C while rank 0 still builds and rank 1 waits for it at a collective: neither rank
    leaves its set-up alone (the other's collective would fail with a traceback); they agree to
    stop before the first step, rank 0 writes a checkpoint at step 0 and says how to resume, and
    the resumed run (its ranks started as torchrun starts them) finishes."""
    marker = tmp_path / "building"
    recipe = tomllib.loads(SMALL_RECIPE)
    recipe["estimator"] = {"kind": "exact-score-slow-build-on-rank0", "marker": str(marker)}
    recipe = write_recipe(tmp_path / "slow.toml", recipe, {})
    proc = start_launch([recipe, "--out", tmp_path / "runs"], tmp_path / "out.log")
    once_running(marker.exists, proc, tmp_path / "out.log")
    ctrl_c(proc)
    assert proc.wait(timeout=TIMEOUT) == 130
    output = (tmp_path / "out.log").read_text()
    assert "Traceback" not in output and not torch_log_lines(output), output
    assert output.splitlines()[-1].startswith("interrupted: SIGINT at step 0/30: checkpoint"), output
    run_dir = only_run_dir(tmp_path / "runs")
    assert networks(run_dir)["step"] == 0
    logs = tmp_path / "resumed"  # the ranks started as torchrun starts them
    assert wait(launch(["--resume", run_dir], logs), logs) == [0, 0], read_logs(logs)
    assert networks(run_dir)["step"] == 30


def once_running(found: Callable[[], T], proc: subprocess.Popen, log: Path) -> T:
    """What ``found()`` gives once it is something, asked every 10 ms while ``proc`` runs (for
    TIMEOUT seconds at most); ``log`` is shown when it ends or times out first."""
    deadline = time.time() + TIMEOUT
    while not (result := found()):
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.01)
    return result


def networks(run_dir: Path) -> dict:
    state = ckpt.load(run_dir / "checkpoints" / "last.pt")
    return {"step": state["step"], "networks": state["networks"], "ranks": state["ranks"]}


def assert_same_run(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for name, tensors in a["networks"].items():
        for key, value in tensors.items():
            assert torch.equal(value, b["networks"][name][key]), f"{name}.{key}"
    for rank_a, rank_b in zip(a["ranks"], b["ranks"], strict=True):
        assert torch.equal(rank_a["rng"]["torch"], rank_b["rng"]["torch"])


STEPS = 300


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """PCD trained by two processes without interruption, for the kill and Ctrl-C tests to end
    level with (started once, in the background, while the first of them interrupts its own run)."""
    tmp = tmp_path_factory.mktemp("reference")
    recipe = write_recipe(
        tmp / "pcd.toml",
        "grbm_pcd",
        {"steps": STEPS, "log_every": 50, "checkpoint_every": 50, "eval_every": 0},
        data={"kind": "checkerboard", "n_train": 2000, "n_test": 200},
        estimator={"kind": "pcd", "k": 1, "n_chains": 50},
        eval=[{"kind": "exact-loglik"}],
    )
    full = start_launch([recipe, "--out", tmp / "full"], tmp / "full.log")
    return {"recipe": recipe, "tmp": tmp, "full": full}


def finished_reference(reference_run) -> dict:
    proc = reference_run["full"]
    assert proc.wait(timeout=TIMEOUT) == 0, (reference_run["tmp"] / "full.log").read_text()
    return networks(only_run_dir(reference_run["tmp"] / "full"))


def test_kill_and_resume_under_two_processes_matches_the_uninterrupted_run(reference_run, tmp_path):
    """PCD: every rank has its own chains and random stream; both are checkpointed by rank 0 and
    restored rank by rank, so the resumed run ends bit-identical to the uninterrupted one (which
    ``eblvm run --nproc-per-node 2`` trained: the ranks here are started as torchrun starts them)."""
    recipe = reference_run["recipe"]
    procs = launch([recipe, "--out", tmp_path / "killed"], tmp_path / "killed")
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if list((tmp_path / "killed").glob("*/*/checkpoints/last.pt")):
            break
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    killed_dir = only_run_dir(tmp_path / "killed")
    killed_at = ckpt.load(killed_dir / "checkpoints" / "last.pt")["step"]
    assert killed_at < STEPS, "the run finished before it could be killed; the test proves nothing"

    logs = tmp_path / "resumed"
    assert wait(launch(["--resume", killed_dir], logs), logs) == [0, 0], read_logs(logs)
    assert f"resuming {killed_dir} at step {killed_at}" in read_logs(logs)

    full, resumed = finished_reference(reference_run), networks(killed_dir)
    assert resumed["step"] == full["step"] == STEPS
    assert_same_run(resumed, full)
    chains = [[rank["estimator"]["chains"] for rank in state["ranks"]] for state in (full, resumed)]
    assert not torch.equal(chains[0][0], chains[0][1]), "the ranks' chains should differ"
    assert all(torch.equal(a, b) for a, b in zip(*chains))


def test_ctrl_c_under_two_processes_stops_cleanly_and_resumes_bit_identical(reference_run, tmp_path):
    """One SIGINT to the launcher's process group: both ranks finish their step, agree at the next
    logging step, write a checkpoint and stop; one line, exit 130, no traceback, no torch warning
    or banner. The resumed run (its ranks started as torchrun starts them) ends where the
    uninterrupted one does, to the bit; run.json records the command as typed and every plugin
    with its version."""
    proc = start_launch([reference_run["recipe"], "--out", tmp_path / "runs"], tmp_path / "out.log")
    run_dir = wait_for_step(tmp_path / "runs", 100, proc)
    ctrl_c(proc)
    assert proc.wait(timeout=TIMEOUT) == 130, (tmp_path / "out.log").read_text()
    output = (tmp_path / "out.log").read_text()
    stopped = [line for line in output.splitlines() if "SIGINT at step" in line]
    assert len(stopped) == 1, output
    assert f"resume with: eblvm run --resume {run_dir} --nproc-per-node 2" in stopped[0]
    for noise in ("Traceback", "Warning", "OMP_NUM_THREADS", "SignalException"):
        assert noise not in output, output
    assert not torch_log_lines(output), output
    at = ckpt.load(run_dir / "checkpoints" / "last.pt")["step"]
    # the row at step 100 is written before the ranks agree at that step, so a signal seen then stops at 100
    assert 100 <= at < STEPS and at % 50 == 0

    session = json.loads((run_dir / "run.json").read_text())["sessions"][0]
    assert session["status"] == "interrupted" and session["to_step"] == at
    assert session["command"].endswith("--nproc-per-node 2") and session["processes"] == 2
    assert session["plugins"]["grbm"]["distribution"] == "eblvm" and session["plugins"]["grbm"]["version"]
    extra = session["plugins"]["tests.support.fixed_noise"]  # loaded by module, installed by no distribution
    assert extra["distribution"] is None and extra["file"].endswith("fixed_noise.py")
    assert not (run_dir / ".lock").exists()

    logs = tmp_path / "resumed"  # the ranks started as torchrun starts them
    assert wait(launch(["--resume", run_dir], logs), logs) == [0, 0], read_logs(logs)
    resumed = read_logs(logs)
    assert f"resuming {run_dir} at step {at}" in resumed
    assert not torch_log_lines(resumed), resumed
    assert_same_run(networks(run_dir), finished_reference(reference_run))


@reads_proc
def test_a_second_ctrl_c_stops_at_once_and_its_advice_resumes_the_run(reference_run, tmp_path):
    """Two SIGINTs between two checkpoints: the launcher kills both ranks at once (the first alone
    stops them at the next logging or checkpoint step, when they agree to) and names the command
    that resumes, last: no rank outlives it to print a line of its own. That command, run as
    printed, starts again from the last checkpoint and ends level with the uninterrupted run."""
    proc = start_launch([reference_run["recipe"], "--out", tmp_path / "runs"], tmp_path / "out.log")
    last = once_running(lambda: list((tmp_path / "runs").glob("*/*/checkpoints/last.pt")), proc, tmp_path / "out.log")
    run_dir = last[0].parent.parent
    (server,) = (int(folder.name) for folder, _, ppid, _ in processes() if ppid == proc.pid)  # leads the ranks' group
    ctrl_c(proc)
    time.sleep(0.05)
    ctrl_c(proc)
    assert proc.wait(timeout=TIMEOUT) == 130
    deadline = time.time() + TIMEOUT
    while live_in_group(server):  # none, unless ranks outlived the launcher: they would then stop on their own
        assert time.time() < deadline
        time.sleep(0.05)
    output = (tmp_path / "out.log").read_text()
    assert "Traceback" not in output, output
    assert output.splitlines()[-1].startswith("interrupted: stopped at once by a second Ctrl-C"), output
    # A rank that finished its own stop before the second Ctrl-C reached the launcher (a loaded
    # machine) has printed its line, with the same advice, before the launcher's.
    errors = [line for line in output.splitlines() if line.startswith("interrupted:")]
    assert errors and all("resume with: " in line for line in errors), output
    line = errors[-1]
    advice = line.split("resume with: ")[1].split(" (")[0]
    assert advice == f"eblvm run --resume {run_dir} --nproc-per-node 2", line
    assert json.loads((run_dir / "run.json").read_text())["sessions"][0]["status"] in ("killed", "interrupted")

    resumed = start_launch(advice.split()[2:-2], tmp_path / "resumed.log")
    assert resumed.wait(timeout=TIMEOUT) == 0, (tmp_path / "resumed.log").read_text()
    assert_same_run(networks(run_dir), finished_reference(reference_run))
