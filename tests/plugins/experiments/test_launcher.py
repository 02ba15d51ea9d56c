"""``--launcher``: runs and comparisons as submitit jobs. submitit's local executor runs the Slurm
path's jobs as processes here (``--launcher submitit-local``): a two-method comparison end to
end, a job told to stop (SIGTERM, or the USR2 Slurm sends before a time limit) is requeued and
ends bit for bit as an uninterrupted run, on one rank and on two; the Slurm path writes the
sbatch script a spec asks for (a stand-in sbatch takes it, nothing is submitted); bad [launcher]
tables and missing pieces get one line."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from tests.support import SMALL_RECIPE, one_line_error, session_run
from tests.support.forked import STDOUT, Forked, read_logs, torch_log_lines, torchrun_ranks

NO_SUBMITIT = "eblvm's 'slurm' extra (submitit) is not installed: pip install -e '.[slurm]'"
LONG = SMALL_RECIPE.replace("steps = 30", "steps = 400").replace("checkpoint_every = 10", "checkpoint_every = 50")
quiet = lambda _line: None  # noqa: E731


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load(run_dir / "checkpoints" / "last.pt")["networks"]["model"]


def assert_same(a: Path, b: Path) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key


def sessions(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "run.json").read_text())["sessions"]


def wait_for(find, timeout: float = 300.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = find()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError("timed out")


def spec_text(recipe: Path, launcher: str = "time = 10") -> str:
    return f"""
[compare]
name = "two"
seeds = 1
metrics = ["eval/exact-loglik/test_loglik"]

[[method]]
name = "A"
recipe = "{recipe}"

[[method]]
name = "B"
recipe = "{recipe}"
overrides = ["optim.model.lr=3e-3"]

[launcher]
{launcher}
"""


# ---- submitit's local executor: the Slurm path's jobs as processes here --------------------------


@pytest.mark.slow
def test_a_comparison_runs_as_submitit_jobs_end_to_end(cli, write_recipe, tmp_path):
    pytest.importorskip("submitit", reason=NO_SUBMITIT)
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(write_recipe()))
    out = tmp_path / "res"
    args = ["compare", spec, "--launcher", "submitit-local", "--out", out, "--device", "cpu"]
    result = cli(args)
    assert result.exit_code == 0, result.output
    jobs = json.loads((out / "jobs.json").read_text())
    assert sorted(jobs) == ["A-seed0", "B-seed0"]
    for method in ("A", "B"):  # each watched to its end
        job = jobs[f"{method}-seed0"]["job_id"]
        assert f"{method} seed 0: running (job {job})" in result.output
        assert f"{method} seed 0: finished (job {job})" in result.output
        (run_dir,) = (out / "runs" / f"{method}-seed0").iterdir()
        (session,) = sessions(run_dir)
        assert session["launcher"] == {"kind": "submitit-local", "job_id": job}
        assert session["status"] == "finished"
        assert "submitit" not in session["command"]  # the command that submitted it, not the job's wrapper
        assert (out / "done" / f"{method}-seed0.json").is_file()  # written by the job itself
    rows = [
        line
        for line in (out / "table.md").read_text().splitlines()
        if line.startswith("| A ") or line.startswith("| B ")
    ]
    assert len(rows) == 2 and "not run" not in "".join(rows)

    # the job trained what the same run trains here, to the bit
    (job_dir,) = (out / "runs" / "A-seed0").iterdir()
    here, _ = session_run(
        out / "recipes" / "A.toml", ["run.seed=0", "run.name=A-seed0"], "cpu", tmp_path / "here", echo=quiet
    )
    assert_same(job_dir, here)

    again = cli(args)  # finished runs are picked up, nothing is submitted
    assert again.exit_code == 0, again.output
    assert again.output.count("done earlier, not rerun") == 2 and "submitted" not in again.output
    assert json.loads((out / "jobs.json").read_text()) == jobs


@pytest.mark.slow
def test_a_job_told_to_stop_checkpoints_is_requeued_and_ends_as_an_uninterrupted_run(write_recipe, tmp_path):
    """USR2 (Slurm's warning before the time limit) to the job's training process: it finishes
    its step, writes its checkpoint, and submitit requeues the job, which resumes the same run
    directory; the run ends with an uninterrupted run's parameters. SIGTERM (preemption) is sent
    to the two-rank job below."""
    signum = signal.SIGUSR2
    pytest.importorskip("submitit", reason=NO_SUBMITIT)
    recipe = write_recipe(LONG)
    full, _ = session_run(recipe, device="cpu", out=tmp_path / "full", echo=quiet)
    out = tmp_path / "job"
    args = ["run", recipe, "--launcher", "submitit-local", "--wait", "--device", "cpu", "--out", out]
    proc = Forked(args, stderr=STDOUT)
    checkpoint = wait_for(lambda: next(out.glob("small/*/checkpoints/last.pt"), None))
    run_dir = checkpoint.parent.parent
    pid = int((run_dir / ".lock").read_text().split()[1])  # the job's training process
    os.kill(pid, signum)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    assert len(sessions(run_dir)) == 2, f"{sessions(run_dir)}\n{output}"
    first, second = sessions(run_dir)
    assert first["status"] == "interrupted" and second["status"] == "finished", output
    assert 0 < first["to_step"] < 400, "the job finished before the signal; the test proves nothing"
    assert second["from_step"] == first["to_step"]
    assert first["launcher"] == second["launcher"]  # the same job, requeued
    assert f"done: {run_dir}" in output
    assert_same(run_dir, full)


@pytest.mark.slow
def test_a_two_rank_job_stopped_mid_run_ends_as_an_uninterrupted_two_process_run(write_recipe, tmp_path):
    """A job whose two tasks are a run's ranks (rank and world from the job's environment), all
    told to stop, as Slurm signals every task: the ranks agree to checkpoint, the job is requeued
    and the run ends with the parameters two ranks give uninterrupted; no rank warns that the
    rendezvous store's host (rank 0, submitit giving no agent store) left before it."""
    pytest.importorskip("submitit", reason=NO_SUBMITIT)
    recipe = write_recipe(LONG.replace("seed = 7", "seed = 7\nthreads = 1"))
    reference_logs = tmp_path / "reference"  # two ranks as torchrun starts them, uninterrupted
    reference = torchrun_ranks([recipe, "--device", "cpu"], reference_logs, dict(os.environ), cwd=tmp_path)
    assert [rank.wait(timeout=300) for rank in reference] == [0, 0], read_logs(reference_logs)
    (full,) = (tmp_path / "runs" / "small").iterdir()
    out = tmp_path / "job"
    args = ["run", recipe, "--launcher", "submitit-local", "--nproc-per-node", "2", "--wait", "--device", "cpu"]
    proc = Forked([*args, "--out", out], stderr=STDOUT)
    checkpoint = wait_for(lambda: next(out.glob("small/*/checkpoints/last.pt"), None))
    run_dir = checkpoint.parent.parent
    controller = int(sessions(run_dir)[0]["launcher"]["job_id"])  # submitit's local job: it signals every task
    os.kill(controller, signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    job_logs = "".join(p.read_text() for p in sorted((out / "slurm").glob("*_log.*")))
    assert len(sessions(run_dir)) == 2, f"{sessions(run_dir)}\n{output}\n{job_logs}"
    first, second = sessions(run_dir)
    assert (first["status"], second["status"]) == ("interrupted", "finished"), output
    assert first["processes"] == second["processes"] == 2
    assert 0 < first["to_step"] < 400, "the job finished before the signal; the test proves nothing"
    assert_same(run_dir, full)
    output = job_logs + read_logs(reference_logs)
    assert not torch_log_lines(output), output  # e.g. a rank asking the store after rank 0, its host, exited


@pytest.mark.slow
def test_watching_jobs_says_which_failed_and_why(tmp_path):
    """Each job's state as it changes, and a failed job's last error line with its log."""
    pytest.importorskip("submitit", reason=NO_SUBMITIT)
    import functools
    import operator

    from eblvm_experiments.launcher import SlurmConfig, executor, submit, watch

    ex = executor("submitit-local", SlurmConfig(time=5), tmp_path / "jobs", "probe")
    handles = submit(ex, [functools.partial(operator.add, 1, 2), functools.partial(operator.truediv, 1, 0)])
    lines, ended = [], {}
    watch(dict(zip("ab", handles)), str, lines.append, lambda key, *outcome: ended.update({key: outcome}), 0.2)
    assert ended["a"] == (3, None)
    result, error = ended["b"]
    assert result is None and error.startswith("ZeroDivisionError: division by zero (log: ")
    assert f"  b: failed (job {handles[1].job_id})" in lines and f"  a: finished (job {handles[0].job_id})" in lines
    assert lines[-1] == "jobs: 0 queued, 0 running, 1 finished, 1 failed"


# ---- the Slurm path, up to sbatch ----------------------------------------------------------------

FAKE_SBATCH = """#!/bin/sh
cp "$1" "$EBLVM_TEST_SBATCH_COPY"
echo "Submitted batch job 4242"
"""

LAUNCHER = """partition = "gpu"
time = "1:30:00"
gpus = 4
cpus = 8
mem = "64G"
array_parallelism = 2
signal_delay = 300
setup = ["module load cuda/12"]
sbatch = { account = "proj", qos = "high", exclusive = true }"""


def test_the_slurm_path_writes_the_sbatch_script_a_spec_asks_for(write_recipe, tmp_path, monkeypatch):
    """A comparison of three runs with a [launcher] table (and --partition over it) goes to sbatch
    as one job array; submitit's script holds every resource asked for, and each array task's
    pickle is the run it trains. A stand-in sbatch takes the script; nothing is submitted."""
    submitit = pytest.importorskip("submitit", reason=NO_SUBMITIT)
    import eblvm_experiments.launcher as launcher
    from eblvm_experiments.compare import compare

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", "#!/bin/sh\nexit 1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "submitted.sh"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("EBLVM_TEST_SBATCH_COPY", str(script))
    watched = {}
    monkeypatch.setattr(launcher, "watch", lambda handles, *args: watched.update(handles))  # nothing runs

    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'[compare]\nname = "two"\nseeds = 3\n\n[[method]]\nname = "A"\nrecipe = "{write_recipe()}"\n'
        f"\n[launcher]\n{LAUNCHER}\n"
    )
    out = tmp_path / "res"
    compare(spec, out=out, echo=quiet, launcher="slurm", slurm={"partition": "debug"})

    lines = set(script.read_text().splitlines())
    expected = {
        "#SBATCH --partition=debug",  # the command line's, over the table's "gpu"
        "#SBATCH --time=90",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=4",  # one process per GPU
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=64G",
        "#SBATCH --array=0-2%2",  # three runs, two at a time
        "#SBATCH --signal=USR2@300",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --exclusive",
        "#SBATCH --job-name=two",
        "module load cuda/12",
    }
    assert expected <= lines, sorted(expected - lines)
    assert not any(line.startswith("#SBATCH --partition=gpu") for line in lines)
    assert any("srun" in line and "submitit.core._submit" in line for line in lines)

    jobs = json.loads((out / "jobs.json").read_text())
    assert {name: record["job_id"] for name, record in jobs.items()} == {
        "A-seed0": "4242_0",
        "A-seed1": "4242_1",
        "A-seed2": "4242_2",
    }
    folder = Path(jobs["A-seed0"]["folder"])
    for index in range(3):
        delayed = submitit.helpers.DelayedSubmission.load(folder / f"4242_{index}_submitted.pkl")
        assert delayed.function.task["name"] == f"A-seed{index}"
        assert delayed.function.task["overrides"] == [f"run.seed={index}", f"run.name=A-seed{index}"]
    assert sorted(job.job_id for job in watched.values()) == ["4242_0", "4242_1", "4242_2"]


def test_a_cancelled_job_is_told_from_a_preempted_one_by_squeue(tmp_path, monkeypatch):
    """scancel sends SIGTERM as a preemption does; the job asks Slurm before it asks to be requeued."""
    from eblvm_experiments.launcher import cancelled

    squeue = tmp_path / "squeue"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for state, expected in (("CANCELLED", True), ("RUNNING", False), ("PREEMPTED", False)):
        squeue.write_text(f"#!/bin/sh\necho {state}\n")
        squeue.chmod(0o755)
        assert cancelled("slurm", "812_3") is expected, state
    assert cancelled("submitit-local", "812") is False  # no Slurm to ask: requeued as asked
    squeue.unlink()
    assert cancelled("slurm", "812_3") is False  # squeue missing: cannot tell, requeued


# ---- one line for what is wrong -------------------------------------------------------------------

BAD_LAUNCHER = [
    ('time = "soon"', "[launcher] time: must be minutes or HH:MM:SS / D-HH:MM:SS, got 'soon'"),
    ("time = 0", "[launcher] time: must be at least one minute"),
    ("gpu = 1", "[launcher] gpu: unknown key (did you mean 'gpus'?)"),
    ("sbatch = { account = ['a'] }", "[launcher] sbatch.account: must be a string, a number or true"),
    ("cpus = 0", "[launcher] cpus: must be > 0"),
]


@pytest.mark.parametrize("line, expected", BAD_LAUNCHER, ids=[b[0] for b in BAD_LAUNCHER])
def test_a_bad_launcher_table_is_one_line_from_validate(cli, write_recipe, tmp_path, line, expected):
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(write_recipe(), line))
    message = one_line_error(cli(["validate", spec]))
    assert expected in message and str(spec) in message, message


@pytest.mark.parametrize(
    "value, minutes",
    [(90, 90), ("90", 90), ("90:30", 91), ("1:30:00", 90), ("2-0", 2880), ("1-2:3", 1563), ("0-0:1:1", 2)],
)
def test_slurm_time_limits_read_as_minutes(value, minutes):
    from eblvm_experiments.launcher import minutes as read

    assert read(value) == minutes


def test_a_cluster_option_without_a_cluster_launcher_is_refused(cli, write_recipe):
    line = one_line_error(cli(["run", write_recipe(), "--partition", "gpu"]))
    assert "--partition is an option of a cluster job: add --launcher slurm" in line


def test_an_unknown_launcher_and_jobs_on_a_cluster_are_refused(cli, write_recipe, tmp_path):
    line = one_line_error(cli(["run", write_recipe(), "--launcher", "pbs"]))
    assert "--launcher must be local, slurm, submitit-local, got 'pbs'" in line
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(write_recipe()))
    line = one_line_error(cli(["compare", spec, "--launcher", "slurm", "--jobs", "2"]))
    assert "--jobs is for --launcher local" in line


def test_the_launcher_without_the_extra_names_it(cli, write_recipe, monkeypatch):
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit fails as when it is not installed
    line = one_line_error(cli(["run", write_recipe(), "--launcher", "slurm"]))
    assert "--launcher slurm needs submitit, eblvm's 'slurm' extra: pip install" in line and "[slurm]" in line


def test_slurm_without_slurm_says_where_to_run_it(cli, write_recipe, tmp_path, monkeypatch):
    pytest.importorskip("submitit", reason=NO_SUBMITIT)
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun
    line = one_line_error(cli(["run", write_recipe(), "--launcher", "slurm", "--out", tmp_path / "runs"]))
    assert "no Slurm here (srun is not on the PATH)" in line and "--launcher submitit-local" in line
