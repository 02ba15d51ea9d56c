"""What a training session writes to its run directory, in one place: the resolved recipe
(recipe.toml), its session in run.json, run.log (every console line), metrics.jsonl and the
loggers (each step's scalars and images). Under torchrun rank 0 alone writes: on the other ranks
a ``Records`` writes nothing and its console is quiet."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from eblvm_core.build import build_loggers
from eblvm_core.contracts import Logger
from eblvm_core.errors import EblvmError, FileSystemError, Interrupted
from eblvm_core.plan import Plan
from eblvm_core.recipe import Recipe
from eblvm_core.rundir import Provenance, RunLog, append_metrics, clean_metrics, hyperparameters, write_recipe


def quiet(_line: str) -> None:
    """A console that prints nothing (ranks > 0, ``echo=None``)."""


def cannot_write(exc: OSError, where: Path, after: str = "") -> FileSystemError:
    """The one-line error of a file system that refused a write (exit 1)."""
    return FileSystemError(f"{exc.filename or where}: cannot write: {exc.strerror or exc}{after}")


class Records:
    """The records of one session on ``run_dir``: ``echo`` prints a line and appends it to run.log;
    ``record`` writes a step's scalars to metrics.jsonl and every logger, and its images to the
    loggers. ``open`` starts the session's records, ``close`` ends them with the session's status.
    With ``writes`` false (ranks > 0; no run directory) it writes nothing and echoes nothing."""

    def __init__(self, run_dir: Path | None, console: Callable[[str], None] = quiet, writes: bool = True):
        self.run_dir, self.writes = run_dir, writes and run_dir is not None
        self.log = RunLog(run_dir, console) if writes and run_dir is not None else None
        self.echo: Callable[[str], None] = self.log if self.log is not None else quiet
        self.loggers: list[Logger] = []
        self.provenance = Provenance(run_dir) if writes and run_dir is not None else None
        self.started = False  # the session is in run.json

    def open(
        self,
        recipe: Recipe,
        plan: Plan,
        step: int,
        threads: int,
        resumed: bool,
        command: str | None,
        launched_by: Mapping[str, Any] | None,
        final_pending: bool,
        training_step: str | None = None,
    ) -> None:
        """Write recipe.toml; on a resume drop what the stopped session recorded after its
        checkpoint at ``step`` (and the final evaluation when ``final_pending``: it runs again),
        from metrics.jsonl and the loggers; open the session in run.json; make the loggers. A new
        run that cannot start this way leaves nothing behind; an OSError is a FileSystemError."""
        run_dir, provenance, log = self.run_dir, self.provenance, self.log
        if run_dir is None or provenance is None or log is None:
            return
        try:
            write_recipe(recipe, run_dir)
            moved = provenance.move_damaged_aside()
            if moved is not None:
                self.echo(
                    f"warning: {provenance.path} could not be read ({provenance.damaged}): moved aside to "
                    f"{moved}, with the sessions it recorded; a new run.json starts here"
                )
            if resumed:
                clean_metrics(run_dir, step, final_pending)
            provenance.start(str(plan.device), plan.world, step, threads, command, launched_by, training_step)
            self.started = True
            for name, why in provenance.data["sessions"][-1]["plugins_failed"].items():
                log.write(f"eblvm: plugin '{name}' failed to load and was skipped: {why}")  # said at load
            self.loggers = build_loggers(recipe, run_dir)
            if resumed:
                for logger in self.loggers:
                    logger.resume(step)
        except BaseException as exc:
            if not resumed:
                shutil.rmtree(run_dir, ignore_errors=True)  # a run that could not start leaves nothing
                with contextlib.suppress(OSError):
                    run_dir.parent.rmdir()  # nor an empty <out>/<name>/
                self.started = False
            if isinstance(exc, OSError):
                raise cannot_write(exc, run_dir) from None
            raise

    def record(self, step: int, scalars: dict[str, float], images: dict[str, Tensor] | None = None) -> None:
        if not self.writes or self.run_dir is None:
            return
        append_metrics(self.run_dir, step, scalars)
        for logger in self.loggers:
            logger.log_scalars(step, scalars)
            if images:
                logger.log_images(step, images)

    def finish(self, recipe: Recipe, results: dict[str, float]) -> None:
        """The final evaluation's lines (also in run.log) and the hyper-parameters with it."""
        for key, value in results.items():
            self.echo(f"{key.removeprefix('eval/')}: {value:.6g}")
        for logger in self.loggers:
            logger.log_hparams(hyperparameters(recipe), results)

    def failed(self, exc: BaseException) -> None:
        """An eblvm error's line in run.log (what the CLI prints of it)."""
        if self.writes and self.run_dir is not None and isinstance(exc, EblvmError):
            label = "interrupted" if isinstance(exc, Interrupted) else "error"
            with contextlib.suppress(OSError):
                RunLog(self.run_dir, quiet).write(f"{label}: {exc}")

    def close(self, status: str, step: int) -> None:
        """Close the loggers and end the session in run.json with ``status`` at ``step``."""
        for logger in self.loggers:
            with contextlib.suppress(Exception):
                logger.close()
        if self.started and self.provenance is not None:
            with contextlib.suppress(OSError):
                self.provenance.end(status, step)
