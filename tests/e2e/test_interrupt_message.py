"""A deliberate Ctrl-C is an interruption, not an error: `eblvm run` prints `interrupted: SIGINT at
step N/M: checkpoint ... written; resume with: ...` (no `error:` line), run.log says the same, and
the exit code stays 130. In-process: the session's own signal handler receives a real SIGINT
raised from inside a training step; a second Ctrl-C (KeyboardInterrupt) is printed alike."""

from __future__ import annotations

import signal

import pytest
import typer

from eblvm_core import checkpoint as ckpt
from tests.support import only_run_dir, poison_at


def lines(output: str) -> list[str]:
    return [line for line in output.strip().splitlines() if line.strip()]


def ctrl_c(_built, _metrics) -> None:
    signal.raise_signal(signal.SIGINT)  # to this process: the session's handler asks the trainer to stop


def test_a_ctrl_c_is_printed_as_an_interruption_with_how_to_resume(cli, write_recipe, tmp_path, monkeypatch):
    poison_at(monkeypatch, 12, ctrl_c)
    result = cli(["run", write_recipe(), "--out", tmp_path / "runs"])
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output
    assert not [line for line in lines(result.output) if line.startswith("error")], result.output
    run_dir = only_run_dir(tmp_path / "runs")
    last = lines(result.output)[-1]
    checkpoint = ckpt.last_checkpoint(run_dir)
    assert last == (
        f"interrupted: SIGINT at step 12/30: checkpoint {checkpoint} written; resume with: eblvm run --resume {run_dir}"
    ), last
    assert ckpt.read_checkpoint(checkpoint)["step"] == 12
    log = (run_dir / "run.log").read_text()
    assert last in log and "error" not in log


def test_a_second_ctrl_c_is_printed_as_an_interruption_too(cli, write_recipe, tmp_path, monkeypatch):
    def second_ctrl_c(_built, _metrics) -> None:
        raise KeyboardInterrupt

    poison_at(monkeypatch, 5, second_ctrl_c)
    result = cli(["run", write_recipe(), "--out", tmp_path / "runs"])
    assert result.exit_code == 130, result.output
    (line,) = [line for line in lines(result.output) if "resume with" in line]
    assert line.startswith("interrupted: ") and "error" not in result.output, result.output
    assert f"resume with: eblvm run --resume {only_run_dir(tmp_path / 'runs')}" in line


def test_guarded_prints_an_interruption_and_exits_130(capsys):
    from eblvm_core.cli_support import guarded
    from eblvm_core.errors import Interrupted

    def interrupted() -> None:
        raise Interrupted("SIGTERM at step 3/9: checkpoint c.pt written; resume with: eblvm run --resume r")

    def ctrl_c_before_training() -> None:
        raise KeyboardInterrupt

    for work, expected in [
        (interrupted, "interrupted: SIGTERM at step 3/9: checkpoint c.pt written; resume with: eblvm run --resume r"),
        (ctrl_c_before_training, "interrupted: Ctrl-C"),
    ]:
        with pytest.raises(typer.Exit) as stop:
            guarded(work)
        assert stop.value.exit_code == 130
        err = capsys.readouterr().err
        assert lines(err) == [expected], err
