"""eblvm_core.files: a damaged file read, or an output path that cannot be written, is one error naming the path."""

from __future__ import annotations

import gzip
import os

import pytest

from eblvm_core.errors import DataError, FileSystemError
from eblvm_core.files import output_file, output_folder, reading


def test_a_truncated_gzip_read_is_a_data_error_naming_the_file_and_key(tmp_path):
    path = tmp_path / "x.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(os.urandom(4096))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError) as caught, reading(path, "archive", fix="fetch it again"):
        with gzip.open(path, "rb") as fh:
            fh.read()
    assert str(caught.value).startswith(f"{path}: cannot read the archive: ")
    assert str(caught.value).endswith("; fetch it again") and caught.value.key == "root"


def test_an_error_that_is_no_read_fault_passes_through(tmp_path):
    with pytest.raises(ZeroDivisionError), reading(tmp_path / "f"):
        1 / 0  # noqa: B018


def test_output_folder_names_the_file_in_the_way_even_below_it(tmp_path):
    (tmp_path / "afile").write_text("")
    for target in (tmp_path / "afile", tmp_path / "afile" / "deeper" / "still"):
        with pytest.raises(FileSystemError, match="a file is in the way") as caught:
            output_folder(target, "results")
        assert str(caught.value).startswith(f"{tmp_path / 'afile'}: cannot write the results")


def test_output_folder_makes_missing_folders_and_leaves_no_probe(tmp_path):
    made = output_folder(tmp_path / "a" / "b", "results")
    assert made.is_dir() and list(made.iterdir()) == []


def test_output_file_refuses_a_folder(tmp_path):
    with pytest.raises(FileSystemError, match="it is a folder, not a file"):
        output_file(tmp_path, "figure")
    assert output_file(tmp_path / "new" / "f.png", "figure").parent.is_dir()
