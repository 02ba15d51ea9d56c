"""The one process ``eblvm run --nproc-per-node W`` starts (``python -m eblvm_core.rank_server
RUN_ARGS``): it imports torch and a run's modules once (``eblvm_core.worker_imports``), forks the
W ranks from itself, each then running ``python -m eblvm run RUN_ARGS`` as a fresh process would,
and waits for them (``processes.wait_all``), exiting with their exit code.

A rank forked this way starts without importing torch again (about 4 CPU-seconds a rank). The
server's environment is rank 0's from ``processes.worker_environment`` (what torch reads as it
loads, such as ``OMP_NUM_THREADS``, is the same for every rank); each rank sets its own rank
variables, and rank 0 alone keeps the store's socket. Once the ranks exist, SIGINT and SIGTERM
sent to the server reach each rank once.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import types

from eblvm_core.processes import RANK_VARIABLES, wait_all
from eblvm_core.rundir import STORE_FD

FORWARDED = (signal.SIGINT, signal.SIGTERM)


class ForkedRank:
    """A forked child, polled and signalled as ``subprocess.Popen`` is (``wait_all``'s view)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (-S when killed by signal S), or None while it runs."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_ranks(ranks: list[ForkedRank]) -> int | None:
    """Import torch once, then fork ``WORLD_SIZE`` ranks into ``ranks``. Returns the rank's number in
    a forked rank (its environment, signals and store socket set up), None in the server, which
    from then on passes SIGINT and SIGTERM on to every rank. A Ctrl-C before the ranks exist
    stops the server as it stops ``eblvm run`` (exit 130); SIGTERM then ends it (143)."""
    interrupted: list[int] = []

    def interrupt(signum: int, _frame: types.FrameType | None) -> None:
        interrupted.append(signum)  # kept even where an import's own bare ``except`` swallows the exception
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        import eblvm_core.worker_imports  # noqa: F401 - torch and a run's modules, loaded once for every rank

        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # until every rank exists: then each gets every signal
    if interrupted:
        print("interrupted: Ctrl-C", file=sys.stderr)
        os._exit(130)

    def forward(signum: int, _frame: types.FrameType | None) -> None:
        for rank in ranks:
            rank.send_signal(signum)

    store_fd = int(os.environ.pop(STORE_FD))
    for signum in FORWARDED:
        signal.signal(signum, forward)
    for rank in range(int(os.environ["WORLD_SIZE"])):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            os.environ.update(dict.fromkeys(RANK_VARIABLES, str(rank)))
            if rank == 0:
                os.environ[STORE_FD] = str(store_fd)
            else:
                os.close(store_fd)
            return rank
        ranks.append(ForkedRank(pid))
    os.close(store_fd)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    return None


if __name__ == "__main__":
    forked: list[ForkedRank] = []
    if fork_ranks(forked) is None:
        code = wait_all(forked)
        sys.stdout.flush()
        os._exit(code)  # without torch's teardown: the server has nothing left to write
    sys.argv[1:] = ["run", *sys.argv[1:]]
    runpy.run_module("eblvm", run_name="__main__", alter_sys=True)  # exits with the rank's code
