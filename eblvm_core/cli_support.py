"""What every eblvm command shares (the CLI's own and those plugins register): a failure printed
as one line per error with its exit code, the guard that turns eblvm's errors into those lines,
and the check of a --device option."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NoReturn

import typer

from eblvm_core.errors import EblvmError, Interrupted, TrainingDiverged


def fail(message: str, code: int = 2, label: str = "error") -> NoReturn:
    """Print ``message`` on stderr, each of its lines as ``label: line`` (several errors found
    together are one line each), and exit with ``code``."""
    for line in message.splitlines() or [""]:
        typer.echo(f"{label}: {line}", err=True)
    raise typer.Exit(code)


def guarded(fn: Callable[[], None]) -> None:
    """Run ``fn``; user-facing errors become one line on stderr (``error: ...``, one line per
    error when several were found together) and their exit code (2: a wrong recipe, override or
    file; 3: diverged; 1: the file system refused). A deliberate stop is no error: Ctrl-C or
    SIGTERM prints ``interrupted: ...`` (how to resume) and exits with 130. Under several
    processes a stop every rank reaches together (a signal, a divergence) is printed by rank 0
    alone; another rank's own error is printed with its rank."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        fn()
    except Interrupted as exc:
        if rank:
            raise typer.Exit(exc.exit_code) from None
        fail(str(exc), code=exc.exit_code, label="interrupted")
    except TrainingDiverged as exc:
        if rank:
            raise typer.Exit(exc.exit_code) from None
        fail(str(exc), code=exc.exit_code)
    except EblvmError as exc:
        fail("\n".join(f"rank {rank}: {line}" for line in str(exc).splitlines()) if rank else str(exc), exc.exit_code)
    except EOFError as exc:  # click would print a bare "Aborted!" for it: show the fault instead
        raise RuntimeError(f"unexpected end of input: {exc}") from exc
    except KeyboardInterrupt:
        if rank:
            raise typer.Exit(130) from None
        fail("Ctrl-C", code=130, label="interrupted")


def check_device(device: str | None) -> None:
    """Refuse a --device that no run could use, in one line (exit 2)."""
    import re

    if device is not None and not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", device):
        fail(f"--device must be auto, cpu, cuda, cuda:N or mps, got '{device}'")
