"""Where reading and writing files becomes one line naming the file: every reader of a data file
(images, idx and gzip, .mat, .npz) reads inside ``reading``, and every command's output path is
checked by ``output_file`` or ``output_folder`` before any work, as a run directory is."""

from __future__ import annotations

import contextlib
import gzip
import pickle
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from eblvm_core.errors import DataError, FileSystemError

# What a damaged or half-written file raises while it is read: the OS, gzip, zlib, pickle, zip and
# tar archives, packed formats (numpy, scipy), and Pillow (its UnidentifiedImageError is an OSError).
READ_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    EOFError,
    zlib.error,
    gzip.BadGzipFile,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
    tarfile.TarError,
    ValueError,
    KeyError,
    IndexError,
)


def reason(exc: BaseException) -> str:
    """A reader's error as a short phrase: its message's first line, else its kind."""
    text = (getattr(exc, "strerror", None) or str(exc)).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


@contextlib.contextmanager
def reading(path: str | Path, what: str = "file", key: str | None = "root", fix: str = "") -> Iterator[None]:
    """Within the block, what a damaged, truncated or unreadable ``path`` raises becomes a
    DataError ``PATH: cannot read the <what>: <reason>`` (with ``fix`` after it), naming ``key``
    of [data] as where it comes from."""
    try:
        yield
    except DataError:
        raise
    except READ_ERRORS as exc:
        after = f"; {fix}" if fix else ""
        raise DataError(f"{path}: cannot read the {what}: {reason(exc)}{after}", key=key) from None


def output_file(path: str | Path, what: str) -> Path:
    """``path`` as a file a command may write: its folder made if absent; a folder given instead
    of a file, or a folder that cannot be made or written, is a FileSystemError naming it."""
    path = Path(path)
    if path.is_dir():
        raise FileSystemError(f"{path}: cannot write the {what}: it is a folder, not a file")
    output_folder(path.parent, what)
    return path


def output_folder(path: str | Path, what: str) -> Path:
    """``path`` as a folder a command writes into: made if absent; a file in its way, or a folder
    that cannot be made or written, is a FileSystemError naming it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".eblvm-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except (FileExistsError, NotADirectoryError):
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise FileSystemError(f"{blocking}: cannot write the {what}: a file is in the way of the folder") from None
    except OSError as exc:
        raise FileSystemError(f"{exc.filename or path}: cannot write the {what}: {reason(exc)}") from None
    return path
