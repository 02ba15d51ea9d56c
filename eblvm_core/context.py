"""A training session's context, made once before training starts and handed to what needs it:
where it runs (device, this process's rank among ``world``, CPU threads) and what it writes to
(the run directory, the loggers, the console). Under torchrun ranks > 0 have no loggers and a
quiet console: rank 0 alone writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from torch import Tensor

from eblvm_core.contracts import Logger
from eblvm_core.rundir import append_metrics


def quiet(_line: str) -> None:
    """A console that prints nothing (ranks > 0, ``echo=None``)."""


@attrs.frozen
class RunContext:
    """``echo`` prints a line to the console and run.log (rank 0); ``record`` writes a step's
    scalars to metrics.jsonl and every logger, and its images to the loggers (rank 0)."""

    run_dir: Path
    device: torch.device
    threads: int
    echo: Callable[[str], None] = quiet
    loggers: tuple[Logger, ...] = ()
    rank: int = 0
    world: int = 1

    def record(self, step: int, scalars: dict[str, float], images: dict[str, Tensor] | None = None) -> None:
        if self.rank:
            return
        append_metrics(self.run_dir, step, scalars)
        for logger in self.loggers:
            logger.log_scalars(step, scalars)
            if images:
                logger.log_images(step, images)
