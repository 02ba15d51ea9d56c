"""From Python, ``echo`` receives every line ``eblvm run`` prints, through one code path: the step
lines, the final evaluation and ``done: <run_dir>``; the note that a run's name folder stands for
its latest run goes through ``echo`` too (``eblvm.Run``, ``eblvm.load``), and ``echo=None``
silences it."""

from __future__ import annotations

import re
from pathlib import Path

import eblvm
from tests.support import only_run_dir


def shape(lines: list[str], run_dir: Path) -> list[str]:
    """The lines with the run directory and the timings (steps per second, ETA) blanked out."""
    out = []
    for line in lines:
        line = line.replace(str(run_dir), "RUN_DIR")
        out.append(re.sub(r"\(\d+(\.\d+)? it/s(, ETA \w+)?\)", "(SPEED)", line))
    return out


def test_echo_receives_every_line_the_command_line_prints(cli, write_recipe, tmp_path):
    recipe = write_recipe()
    result = cli(["run", recipe, "--out", tmp_path / "cli"])
    assert result.exit_code == 0, result.output
    printed = [line for line in result.output.splitlines() if line.strip()]

    lines: list[str] = []
    run = eblvm.train(recipe, out=tmp_path / "api", echo=lines.append)
    assert lines[-1] == f"done: {run.run_dir}"
    final = [f"{key.removeprefix('eval/')}: {value:.6g}" for key, value in run.metrics.items()]
    assert final and lines[-1 - len(final) : -1] == final
    assert shape(lines, run.run_dir) == shape(printed, only_run_dir(tmp_path / "cli"))


def test_the_latest_run_note_goes_through_echo_and_echo_none_silences_it(write_recipe, tmp_path, capsys):
    run = eblvm.train(write_recipe(), out=tmp_path / "runs", echo=None)
    name_folder = run.run_dir.parent
    assert capsys.readouterr() == ("", "")

    lines: list[str] = []
    assert eblvm.Run(name_folder, echo=lines.append).run_dir == run.run_dir
    assert lines == [f"{name_folder}: a run name's folder; using its one run: {run.run_dir}"]
    assert capsys.readouterr() == ("", "")

    assert eblvm.Run(name_folder, echo=None).run_dir == run.run_dir
    loaded = eblvm.load(name_folder, echo=None)
    assert loaded.run_dir == run.run_dir
    assert capsys.readouterr() == ("", "")

    lines.clear()
    eblvm.load(name_folder, echo=lines.append)
    assert lines == [f"{name_folder}: a run name's folder; using its one run: {run.run_dir}"]
    assert capsys.readouterr() == ("", "")
