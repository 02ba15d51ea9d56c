"""Where ``eblvm compare`` and ``eblvm search`` write is checked before any work, as ``eblvm run
--out`` is: a results folder named by a file, under a file or in a place that cannot be written,
and a search's SQLite study in a folder that is a file (or a study file that is a folder), are one
line naming the path, exit 1, never a traceback; nothing runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.plugins.experiments.test_search import NO_OPTUNA, write_spec
from tests.support import RECIPES

NOT_A_FOLDER = "a file is in the way of the folder"


def one_line_write_error(result) -> str:
    """The one line a path that cannot be written gets: exit code 1, no traceback, "error: ..."."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def unwritable(tmp_path: Path) -> Path:
    """A folder nobody here may write into: read-only, or, where the user may write anyway (root),
    a folder of /proc."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return folder
    if not Path("/proc/self").is_dir():
        pytest.skip("no folder here is unwritable: running as root without /proc")
    return Path("/proc/eblvm-test")


@pytest.fixture
def compare_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[compare]\nseeds = 1\n\n[[method]]\nname = "DSM"\nrecipe = "{RECIPES / "grbm_dsm.toml"}"\n')
    return spec


def test_compare_out_that_is_a_file_or_under_one_is_one_line(cli, tmp_path, compare_spec):
    file = tmp_path / "results.txt"
    file.write_text("notes")
    line = one_line_write_error(cli(["compare", compare_spec, "--out", file, "--steps", "1"]))
    assert line == f"error: {file}: cannot write the comparison's results: {NOT_A_FOLDER}", line
    line = one_line_write_error(cli(["compare", compare_spec, "--out", file / "results", "--steps", "1"]))
    assert line == f"error: {file}: cannot write the comparison's results: {NOT_A_FOLDER}", line
    assert file.read_text() == "notes"


def test_compare_out_in_a_place_that_cannot_be_written_is_one_line(cli, tmp_path, compare_spec):
    place = unwritable(tmp_path) / "results"
    line = one_line_write_error(cli(["compare", compare_spec, "--out", place, "--steps", "1"]))
    assert line.startswith(f"error: {place.parent}") and ": cannot write the comparison's results: " in line, line


def test_search_out_that_is_a_file_is_one_line(cli, tmp_path):
    pytest.importorskip("optuna", reason=NO_OPTUNA)
    file = tmp_path / "results.txt"
    file.write_text("notes")
    line = one_line_write_error(cli(["search", write_spec(tmp_path), "--out", file]))
    assert line == f"error: {file}: cannot write the search's results: {NOT_A_FOLDER}", line


def test_a_sqlite_storage_that_cannot_be_written_is_one_line_naming_it(cli, tmp_path):
    """The study's file in a folder that is a file, and a study file that is a folder."""
    pytest.importorskip("optuna", reason=NO_OPTUNA)
    spec, out, file = write_spec(tmp_path), tmp_path / "res", tmp_path / "taken"
    file.write_text("")
    line = one_line_write_error(cli(["search", spec, "--out", out, "--storage", f"sqlite:///{file}/study.db"]))
    assert line == f"error: {file}: cannot write the search's study database: {NOT_A_FOLDER}", line
    folder = tmp_path / "study.db"
    folder.mkdir()
    line = one_line_write_error(cli(["search", spec, "--out", out, "--storage", f"sqlite:///{folder}"]))
    assert line == f"error: {folder}: cannot write the search's study database: it is a folder, not a file", line
    assert not (out / "runs").exists()  # no trial ran
