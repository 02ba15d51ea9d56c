"""``eblvm run --nproc-per-node N``: N training processes on this machine, started and watched by
the ``eblvm`` process itself (torchrun's environment without its agent).

The parent binds the rendezvous store's socket (a free port, so two launches never race for a
port) and hands it to rank 0, which serves the store on it: the parent itself never imports torch.
It starts one process in a process group of its own (``eblvm_core.rank_server``), which imports
torch once and forks the N ranks, each running ``python -m eblvm run ...``. The parent forwards
SIGINT and SIGTERM to it, which passes them on: a terminal's Ctrl-C reaches each rank exactly once,
through the parent, and the ranks agree to write a checkpoint and stop (exit 130). A second
Ctrl-C stops every rank at once and says how to resume. The parent prints nothing else and
exits with the ranks' exit code. torchrun itself (several machines) still works: the ranks then
read its environment the same way.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from eblvm_core.rundir import COMMAND, LOCK, RUN_DIR_FILE, STORE_FD, Provenance

GRACE_SECONDS = 10.0  # once one rank has failed, how long the others may take to stop on their own
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "ROLE_RANK")  # the environment's rank, on one machine


def worker_environment(
    rank: int, world: int, port: int, threads: int, run_dir_file: str, store_fd: int | None = None
) -> dict[str, str]:
    """The environment of rank ``rank``: what torchrun sets for one machine, every rank a client of
    the store on ``port`` (``TORCHELASTIC_USE_AGENT_STORE``) that rank 0 serves on the socket
    ``store_fd`` (``STORE_FD``), the CPU threads per process unless OMP_NUM_THREADS is set, and
    the command line as typed."""
    env = dict(os.environ)
    env.update(dict.fromkeys(RANK_VARIABLES, str(rank)))
    env.update(
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    env.pop(STORE_FD, None)
    if store_fd is not None:
        env[STORE_FD] = str(store_fd)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env[COMMAND] = shlex.join(sys.argv)
    env[RUN_DIR_FILE] = run_dir_file
    return env


def threads_per_process(world: int) -> int:
    """The machine's cores shared among ``world`` processes (at least one each)."""
    return max(1, (os.cpu_count() or 1) // world)


def resume_command(run_dir: Path, world: int) -> str:
    """The command that continues the run in ``run_dir`` as it was launched: with
    ``--nproc-per-node`` when eblvm started its ``world`` processes (under torchrun: launch the
    same command again with torchrun)."""
    command = f"eblvm run --resume {run_dir}"
    if world == 1:
        return command
    if RUN_DIR_FILE in os.environ:
        return f"{command} --nproc-per-node {world}"
    return f"torchrun --nproc-per-node {world} -m eblvm run --resume {run_dir}"


def run_processes(world: int, run_args: Sequence[str], resume: Path | None) -> int:
    """Train with ``world`` processes of ``python -m eblvm run RUN_ARGS``; returns the exit code
    to leave with (the ranks' code; 130 after a second Ctrl-C)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=max(128, world))
    port, fd = listener.getsockname()[1], listener.fileno()
    with tempfile.TemporaryDirectory(prefix="eblvm-launch-") as tmp:
        run_dir_file = str(Path(tmp) / "run_dir")
        threads = threads_per_process(world)
        with listener:  # the rank server, then rank 0, holds the socket; ranks that connect first wait in its backlog
            server = subprocess.Popen(
                [sys.executable, "-m", "eblvm_core.rank_server", *run_args],
                env=worker_environment(0, world, port, threads, run_dir_file, fd),
                pass_fds=(fd,),
                process_group=0,
            )
        signals: list[int] = []

        def forward(signum: int, _frame: Any) -> None:
            signals.append(signum)
            if signum == signal.SIGINT and signals.count(signal.SIGINT) > 1:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)  # the server and every rank it forked
                return
            if server.poll() is None:
                server.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = wait_all([server])
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutting down: a further Ctrl-C changes nothing
        if signals.count(signal.SIGINT) > 1:
            where = resume or _read(run_dir_file)
            if where:  # the ranks could not tidy up themselves
                Provenance(where).end("killed", None)
                (Path(where) / LOCK).unlink(missing_ok=True)
            advice = (
                f"resume with: eblvm run --resume {where} --nproc-per-node {world} "
                "(from its last checkpoint, or from step 0 if none had been written)"
                if where
                else "no run directory was made yet: run the same command again"
            )
            print(f"interrupted: stopped at once by a second Ctrl-C; {advice}", file=sys.stderr)
            return 130
        return code


class Process(Protocol):
    """What ``wait_all`` needs of a process: ``subprocess.Popen``'s poll and kill."""

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...


def wait_all(procs: Sequence[Process]) -> int:
    """Wait for every process; returns the exit code of the first that failed (a process killed
    by signal S counts as 128 + S), or 0. When one fails while others still run (a rank that died
    without reaching a collective), the others get GRACE_SECONDS to stop on their own and are then
    killed, so the launch never hangs on a lost peer."""
    first_failure: int | None = None
    failed_at = 0.0
    while True:
        codes = [p.poll() for p in procs]
        for code in codes:
            if code and first_failure is None:
                first_failure, failed_at = (128 - code if code < 0 else code), time.monotonic()
        if all(code is not None for code in codes):
            return first_failure or 0
        if first_failure is not None and time.monotonic() - failed_at > GRACE_SECONDS:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None
