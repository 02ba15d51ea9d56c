"""A training session's context, made once before training starts and handed to what needs it:
where it runs (device, this process's rank among ``world``, CPU threads) and what it writes to
(the run directory, the loggers, the console). Under torchrun ranks > 0 have no loggers and a
quiet console: rank 0 alone writes. Also the choices about where and how a run computes: the
device a recipe asks for (``pick_device``), the CPU threads (``set_threads``), and the numerics
in force while it trains (``subnormals_flushed``, ``cudnn_autotuned``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import torch
from torch import Tensor

from eblvm_core.contracts import Logger, Parts
from eblvm_core.errors import ConfigError
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


def pick_device(choice: str) -> torch.device:
    """The torch device of ``[run] device``; a ConfigError when it is not available here.
    "auto" gives CUDA when there is one (``build`` then keeps small models whose step will not be
    graph-replayed on the CPU: ``auto_on_cpu``)."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("run", "device", f"{choice} requested but no CUDA device is available")
        index = int(choice.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                "run", "device", f"{choice} requested but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    if choice == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("run", "device", "mps requested but it is not available")
    return torch.device(choice)


SMALL_MODEL = 10_000  # parameters below which one CPU thread is fastest (docs/benchmarks.md)


def set_threads(threads: int, device: torch.device, parts: Parts) -> int:
    """Set torch's CPU threads and return the number in use: ``threads`` when > 0 ([run] threads);
    for 0, one thread on a CPU when the networks hold fewer than SMALL_MODEL parameters (a tiny
    model's steps are many tiny operations, which a second thread only slows: 3-10x on 2 busy
    cores, to the same bits; docs/benchmarks.md), else the current setting."""
    if threads == 0 and device.type == "cpu":
        size = sum(p.numel() for net in parts.networks().values() for p in net.parameters())
        threads = 1 if size < SMALL_MODEL else 0
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@contextmanager
def subnormals_flushed(device: torch.device) -> Iterator[None]:
    """On a CPU, treat subnormal floats (|x| < 1.2e-38 in float32, 2.2e-308 in float64) as zero
    inside the block, then put torch's default (off) back. A relaxed Bernoulli sample at T = 0.1
    and the unrolled gradients through it are full of them, and x86 CPUs compute with subnormals
    many times slower: BiDSM (K = 1, N = 5) on Frey face took 284 ms per step late in training,
    71 ms flushed (docs/benchmarks.md). Only numbers below the smallest normal one (and their
    products) change: 2,000 steps of the main job end with the same bits."""
    flushed = device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flushed:
            torch.set_flush_denormal(False)


@contextmanager
def cudnn_autotuned(device: torch.device, enabled: bool) -> Iterator[None]:
    """On a CUDA device with ``enabled`` ([run] cudnn_benchmark), let cuDNN pick convolution
    algorithms by timing them inside the block, then put the previous setting back."""
    previous = torch.backends.cudnn.benchmark
    if enabled and device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous
