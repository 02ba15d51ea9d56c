"""What a run directory records besides checkpoints and metrics: the lock that keeps a second
process out, ``run.json`` (provenance) and ``run.log`` (the console output).

``run.json`` holds the eblvm, torch and Python versions, the device, the number of processes and
of CPU threads, the command line, the working directory, the git commit of eblvm's checkout (when
it runs from one), and the start, end and status of the first session and of every resume.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from eblvm_core.errors import EblvmError

LOCK = ".lock"
PROVENANCE = "run.json"
LOG = "run.log"


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``, held while a process trains in the run
    directory; the system releases it when the process ends, even by kill -9. Without ``fcntl``
    (Windows) it locks nothing."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK
        self.handle: Any = None

    def acquire(self) -> RunLock:
        """Take the lock or raise EblvmError naming the process that holds it."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on POSIX
            return self
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise EblvmError(
                f"{self.path.parent}: in use by {holder}; wait for it to end (two processes must not train one run)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self.handle = handle
        return self

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing drops the flock
            self.handle = None


def now() -> str:
    """The local time, ISO 8601 with the UTC offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def git_commit() -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git checkout eblvm runs from, or None (installed, no git)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def session(device: str, world: int, step: int, threads: int) -> dict[str, Any]:
    """Provenance of this process's session on a run, starting at ``step``."""
    import torch

    from eblvm_core import __version__

    return {
        "started": now(),
        "ended": None,
        "status": "running",
        "from_step": step,
        "command": shlex.join(sys.argv),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "eblvm": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": device,
        "processes": world,
        "threads": threads,
        "git": git_commit(),
    }


class Provenance:
    """``run.json``: {"sessions": [...]}, the first the run's start, each later one a resume."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / PROVENANCE
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {"sessions": []}
        if not isinstance(self.data, dict) or not isinstance(self.data.get("sessions"), list):
            self.data = {"sessions": []}

    @property
    def finished(self) -> bool:
        """Whether the last session ended with the run's final evaluation."""
        sessions = self.data["sessions"]
        return bool(sessions) and sessions[-1].get("status") == "finished"

    def start(self, device: str, world: int, step: int, threads: int) -> None:
        """Open a session: device, processes and CPU threads per process, from ``step``."""
        self.data["sessions"].append(session(device, world, step, threads))
        self.write()

    def end(self, status: str, step: int) -> None:
        """Record how the current session ended: finished, diverged, interrupted, failed."""
        if self.data["sessions"]:
            self.data["sessions"][-1].update(ended=now(), status=status, to_step=step)
            self.write()

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


class RunLog:
    """Echo a line and append it to ``<run_dir>/run.log``."""

    def __init__(self, run_dir: str | Path, echo: Any):
        self.path, self.echo = Path(run_dir) / LOG, echo

    def __call__(self, line: str) -> None:
        self.echo(line)
        self.write(line)

    def write(self, line: str) -> None:
        """Append to run.log only (what the CLI prints itself, an error line)."""
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
