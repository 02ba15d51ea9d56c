"""``python -m eblvm ARGS`` as a process forked from a server that loaded torch and a run's modules
once: multiprocessing's fork server preloading ``eblvm_core.worker_imports``, the server ``eblvm
compare``'s and ``eblvm search``'s worker pools share in this test process. A fresh interpreter
spends about 5 CPU-seconds importing torch and ``torch._dynamo`` before the command begins.

For the tests whose subject is what a command does once it runs (a signal, kill -9 and resume, two
commands at once), not how a process starts: import hygiene, start-up time and a command's output
before torch loads are tested with fresh interpreters (``subprocess``). The child gets its own
arguments, environment and working folder, SIGINT and SIGTERM as a fresh interpreter has them, and
its stdout and stderr in files (the same one where asked). ``Forked`` is polled, signalled, waited
for and read as ``subprocess.Popen`` with ``text=True`` is.
"""

from __future__ import annotations

import faulthandler
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from eblvm_core.rank_server import ForkedRank
from eblvm_core.startup import worker_context

STDOUT = subprocess.STDOUT  # stderr=STDOUT: both streams in one file, as Popen merges them


def _run_eblvm(args: list[str], cwd: str, environment: dict[str, str], stdout: str, stderr: str) -> None:
    """In the forked child: ``python -m eblvm ARGS`` with this working folder, environment and output files."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    if environment.get("PYTHONFAULTHANDLER"):  # read as an interpreter starts
        faulthandler.enable()
    sys.argv = [sys.argv[0], *args]
    runpy.run_module("eblvm", run_name="__main__", alter_sys=True)  # exits with the command's code


class Forked(ForkedRank):
    """``python -m eblvm ARGS`` forked from the fork server (see the module's note): signalled as the
    rank server's ranks are, its exit code read from the fork server (it is not this process's child)."""

    def __init__(
        self,
        args: Sequence[object],
        *,
        cwd: Path | str | None = None,
        env: dict[str, str] | None = None,
        stderr: int | None = None,
        log: Path | None = None,
    ) -> None:
        """``stderr=STDOUT``: both streams in one file; ``log``: that file (both streams), else files
        in a temporary folder removed with this object."""
        self._folder = tempfile.TemporaryDirectory(prefix="forked-")
        folder = Path(self._folder.name)
        self._out = log or folder / "stdout"
        self._err = self._out if stderr == STDOUT or log else folder / "stderr"
        for path in {self._out, self._err}:
            path.write_bytes(b"")
        environment = dict(os.environ if env is None else env)
        self._process = worker_context().Process(
            target=_run_eblvm,
            args=([str(a) for a in args], str(cwd or os.getcwd()), environment, str(self._out), str(self._err)),
        )
        self._process.start()
        super().__init__(self._process.pid)

    def poll(self) -> int | None:
        """The exit code (-S when killed by signal S), or None while it runs."""
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"forked eblvm {self.pid}", timeout or 0.0)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """(stdout, stderr) once the process has ended; stderr None where it went to stdout."""
        self.wait(timeout)
        return self._out.read_text(), None if self._err == self._out else self._err.read_text()


_ports: set[int] = set()


def free_port() -> int:
    """A free TCP port, never the same twice in this process (launches may overlap)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports:
            _ports.add(port)
            return port


def torchrun_ranks(
    args: Sequence[object], logs: Path, env: dict[str, str], cwd: Path | str | None = None
) -> list[Forked]:
    """Two ranks of ``python -m eblvm run ARGS``, forked, in ``env`` with what torchrun adds (RANK,
    WORLD_SIZE, MASTER_ADDR, ...; rank 0 hosts the rendezvous store, as without torchrun's agent);
    rank r's output in the file ``logs`` named with ``.rank{r}`` appended."""
    port = str(free_port())
    return [
        Forked(
            ["run", *args],
            cwd=cwd,
            env={
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            log=logs.with_name(f"{logs.name}.rank{rank}"),
        )
        for rank in range(2)
    ]


def read_logs(logs: Path) -> str:
    """The ranks' output of ``torchrun_ranks(..., logs, ...)``, rank 0's first."""
    return "\n".join(p.read_text() for p in sorted(logs.parent.glob(f"{logs.name}.rank*")))


def torch_log_lines(output: str) -> list[str]:
    """The warnings and errors torch's C++ code logged (``[W1207 09:45:23.449 TCPStore.cpp:125] ...``)."""
    return re.findall(r"^\[[WE]\d{4} .*$", output, flags=re.MULTILINE)
