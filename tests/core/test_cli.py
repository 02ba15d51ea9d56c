"""cli.py and cli_support.py: the commands' own arguments refused in one line before anything runs
(a recipe or --resume, --device, --raw, a launcher's options or --wait without it, an unknown
option), --nproc-per-node's checks before it starts a process, a degenerate model's evaluation and
samples refused with exit 3, and ``guarded``'s lines and exit codes on rank 0 and on other ranks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import typer

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import Draw
from eblvm_core.errors import EblvmError, Interrupted, TrainingDiverged
from eblvm_core.launching import Launcher
from tests.support import one_line_error, snapshot

# ---- arguments refused before anything runs -------------------------------------------------------


def test_run_takes_a_recipe_or_resume_and_not_both(cli, write_recipe, tmp_path):
    recipe = write_recipe()
    for args in (["run"], ["run", recipe, "--resume", tmp_path, "--out", tmp_path / "runs"]):
        assert one_line_error(cli(args)) == "error: give a recipe file or --resume RUN_DIR (one of them)"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["run", "eval", "sample"])
def test_a_device_no_run_could_use_is_refused_before_anything_is_read(cli, write_recipe, tmp_path, command):
    """Refused before the recipe or the run is read: a run directory that does not exist is not reported."""
    args = [write_recipe(), "--out", tmp_path / "runs"] if command == "run" else [tmp_path / "nowhere"]
    line = one_line_error(cli([command, *args, "--device", "tpu"]))
    assert line == "error: --device must be auto, cpu, cuda, cuda:N or mps, got 'tpu'"
    assert not (tmp_path / "runs").exists()


def test_sample_refuses_a_raw_format_it_does_not_write(cli, tmp_path):
    assert one_line_error(cli(["sample", tmp_path, "--raw", "csv"])) == "error: --raw must be pt or npy, got 'csv'"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--wait"], "error: --wait is for a cluster job: add --launcher slurm"),
        (["--partition", "debug"], "error: --partition is an option of a cluster job: add --launcher slurm"),
        (["--bogus"], "error: no such option: --bogus"),
        (["--bogus=1"], "error: no such option: --bogus"),
        (["stray"], "error: no such option: stray"),
    ],
)
def test_a_local_run_refuses_what_only_a_launcher_takes_naming_the_launcher(
    cli, write_recipe, tmp_path, args, expected
):
    """A launcher's option (or --wait) names the launcher that takes it; anything else is unknown."""
    assert one_line_error(cli(["run", write_recipe(), "--out", tmp_path / "runs", *args])) == expected
    assert not (tmp_path / "runs").exists()


def test_wait_without_any_registered_launcher_says_none_is(cli, write_recipe, monkeypatch):
    import eblvm_core.cli as cli_module

    monkeypatch.setattr(cli_module, "_launchers", dict)
    line = one_line_error(cli(["run", write_recipe(), "--wait"]))
    assert line == "error: --wait is for a run a launcher starts elsewhere, and no plugin registers a launcher"


class Cluster(Launcher):
    runs_as = "a job on the cluster"


def test_what_a_launchers_runs_are_comes_from_the_class_its_factory_returns():
    """``Launcher.runs_as`` of the returned class; the base class's words when the annotation is not
    a Launcher or does not resolve."""
    from types import SimpleNamespace

    from eblvm_core.cli import _runs_as

    def cluster(config, parts=None) -> Cluster:
        return Cluster()

    def unresolved(config, parts=None):
        return None

    unresolved.__annotations__ = {"return": "NoSuchLauncher"}  # a name get_type_hints cannot resolve

    def other(config, parts=None) -> int:
        return 0

    assert _runs_as(SimpleNamespace(factory=cluster)) == "a job on the cluster"
    assert _runs_as(SimpleNamespace(factory=unresolved)) == Launcher.runs_as == "a job elsewhere"
    assert _runs_as(SimpleNamespace(factory=other)) == "a job elsewhere"


# ---- --nproc-per-node: checked before a process starts ----------------------------------------------


@pytest.fixture
def launched(monkeypatch):
    """The requests ``eblvm run --nproc-per-node N`` would start N processes for (none starts)."""
    import eblvm_core.cli as cli_module

    requests = []
    monkeypatch.setattr(cli_module, "_launch", lambda nproc, request: requests.append((nproc, request)) or 0)
    return requests


def test_nproc_per_node_resumes_the_run_a_name_folder_names(cli, run_copy, tmp_path, launched):
    """A run's name folder is resolved here, to its latest run (said on stderr), so that the N
    processes and the resume command name the run itself."""
    names = tmp_path / "runs" / "small"
    names.mkdir(parents=True)
    latest = Path(shutil.move(run_copy, names / run_copy.name))
    result = cli(["run", "--resume", names, "--nproc-per-node", "2", "-o", "run.steps=40"])
    assert result.exit_code == 0, result.output
    ((nproc, request),) = launched
    assert nproc == 2 and request.resume == latest and request.overrides == ("run.steps=40",)
    assert result.output == f"{names}: a run name's folder; using its one run: {latest}\n"


def test_nproc_per_node_refuses_a_missing_run_before_starting_processes(cli, tmp_path, launched):
    line = one_line_error(cli(["run", "--resume", tmp_path / "nowhere", "--nproc-per-node", "2"]))
    assert line == f"error: {tmp_path / 'nowhere'}: cannot resume: no such directory" and not launched


def test_nproc_per_node_under_torchrun_is_refused(cli, write_recipe, tmp_path, monkeypatch):
    """A process torchrun started (WORLD_SIZE set) must not start N more of its own."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = one_line_error(cli(["run", write_recipe(), "--nproc-per-node", "2", "--out", tmp_path / "runs"]))
    assert line == "error: --nproc-per-node: this process was launched by torchrun already"
    assert not (tmp_path / "runs").exists()


# ---- a degenerate model: exit 3 ----------------------------------------------------------------------


def nan_checkpoint(run_dir: Path, where: Path) -> Path:
    """The run's last checkpoint with the model's visible bias b set to NaN, sealed as a valid checkpoint."""
    state = ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))
    model = dict(state["networks"]["model"])
    model["b"] = torch.full_like(model["b"], float("nan"))
    state["networks"] = {**state["networks"], "model": model}
    ckpt.save_atomic(ckpt.seal(state), where)
    return where


def test_eval_of_a_degenerate_model_exits_3_naming_the_value(cli, run_copy, tmp_path):
    path = nan_checkpoint(run_copy, tmp_path / "nan.pt")
    result = cli(["eval", run_copy, "--checkpoint", path])
    assert result.exit_code == 3 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {run_copy} step 30 ({path}): evaluation gave eval/exact-loglik/test_loglik = nan: "
        "the model has degenerated"
    ]


def test_non_finite_samples_exit_3_and_nothing_is_written(cli, run_copy, monkeypatch):
    """Samples with a NaN are refused before the image, the raw samples or the diagnostics are written."""
    import eblvm_core.saved as saved

    def nan_draws(run, n, sampler=None):
        samples = torch.zeros(n, 2)
        samples[1, 0] = float("nan")
        return Draw(samples, {"acceptance": 1.0}), torch.zeros(3, 4, 4), "gibbs (defaults)"

    monkeypatch.setattr(saved, "sample_run", nan_draws)
    before = snapshot(run_copy)
    result = cli(["sample", run_copy, "-n", "4"])
    assert result.exit_code == 3 and "Traceback" not in result.output, result.output
    assert result.output.strip() == (
        f"error: {run_copy} step 30 (last): the sampler gibbs (defaults) drew non-finite samples: "
        "the model has degenerated; nothing was written"
    )
    assert snapshot(run_copy) == before


# ---- guarded: a line and an exit code, per rank --------------------------------------------------------


def guarded_exit(fn, capsys) -> tuple[int, str]:
    """(exit code, stderr) of ``guarded(fn)``."""
    from eblvm_core.cli_support import guarded

    with pytest.raises(typer.Exit) as exc:
        guarded(fn)
    return exc.value.exit_code, capsys.readouterr().err


def raising(exc: BaseException):
    def fn() -> None:
        raise exc

    return fn


@pytest.mark.parametrize(
    "exc, code, rank0",
    [
        (Interrupted("SIGTERM at step 7/20"), 130, "interrupted: SIGTERM at step 7/20\n"),
        (TrainingDiverged("loss is nan at step 3"), 3, "error: loss is nan at step 3\n"),
        (KeyboardInterrupt(), 130, "interrupted: Ctrl-C\n"),
        (EblvmError("r.toml: [run] steps: must be positive"), 2, "error: r.toml: [run] steps: must be positive\n"),
    ],
)
def test_guarded_prints_on_rank_0_alone_a_stop_every_rank_reaches(monkeypatch, capsys, exc, code, rank0):
    """A stop every rank reaches together (a signal, a divergence) is printed by rank 0 alone, with
    the same exit code on every rank; a rank's own error is printed with its rank."""
    monkeypatch.delenv("RANK", raising=False)
    assert guarded_exit(raising(exc), capsys) == (code, rank0)
    monkeypatch.setenv("RANK", "1")
    own = "error: rank 1: r.toml: [run] steps: must be positive\n" if type(exc) is EblvmError else ""
    assert guarded_exit(raising(exc), capsys) == (code, own)


def test_guarded_shows_an_end_of_input_as_the_fault_it_is():
    """click would print a bare "Aborted!" for an EOFError; guarded raises it as a RuntimeError that says what ended."""
    from eblvm_core.cli_support import guarded

    with pytest.raises(RuntimeError, match="^unexpected end of input: stdin closed$"):
        guarded(raising(EOFError("stdin closed")))
