"""What the console and the loggers see of training: the step metrics summed where they are
(``StepSums``), and ``Progress``, which turns them into log records and lines with a speed and an
ETA, shows a progress bar on a terminal, and warns once when a role stops getting gradients."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from eblvm_core import distributed
from eblvm_core.context import RunContext
from eblvm_core.state import RunState


class StepSums:
    """The sums of the step metrics since the last log step, kept where the metrics are.

    Tensor metrics are added into 0-d float32 tensors on their device, all of them by one
    ``_foreach_add_`` a step (no host synchronisation, no new tensors); number metrics into Python
    floats. Folded into the same addition, a sentinel adds 0·loss for a tensor ``loss``: it stays 0
    while every loss is finite and turns NaN at the first non-finite one (a finite loss, however
    large, cannot overflow it). The sums are read from the device in one transfer, at log steps and
    at the NaN guard's checks only.
    """

    SENTINEL = "\0loss-is-finite"

    def __init__(self):
        self.order: dict[str, None] = {}  # metric names since the last take, in the order they first came
        self.tensors: dict[str, Tensor] = {}  # every tensor metric's accumulator (kept, zeroed, across takes)
        self.numbers: dict[str, float] = {}
        self.nonfinite_number = False  # a loss given as a number was not finite
        self._plan: tuple[tuple[str, ...], list[Tensor]] = ((), [])  # the last step's keys and accumulators

    def add(self, metrics: dict[str, Any]) -> None:
        keys, values = [], []
        for k, v in metrics.items():
            self.order.setdefault(k)
            if isinstance(v, Tensor):
                keys.append(k)
                values.append(v if v.dim() == 0 else v.reshape(()))
            else:
                self.numbers[k] = self.numbers.get(k, 0.0) + float(v)
        loss = metrics.get("loss")
        if loss is not None and not isinstance(loss, Tensor) and not math.isfinite(loss):
            self.nonfinite_number = True
        if not keys:
            return
        plan_keys, accumulators = self._plan
        with torch.no_grad():
            if isinstance(loss, Tensor):
                keys.append(self.SENTINEL)
                values.append(loss.reshape(()) * 0)
            if tuple(keys) != plan_keys:
                for k, v in zip(keys, values):
                    if k not in self.tensors:
                        self.tensors[k] = torch.zeros((), dtype=torch.float32, device=v.device)
                accumulators = [self.tensors[k] for k in keys]
                self._plan = (tuple(keys), accumulators)
            torch._foreach_add_(accumulators, [v if v.dtype == torch.float32 else v.float() for v in values])

    def loss_finite(self) -> bool:
        """Whether every loss since the last ``take`` was finite (reads the sentinel: a synchronisation)."""
        sentinel = self.tensors.get(self.SENTINEL)
        return not self.nonfinite_number and (sentinel is None or float(sentinel) == 0.0)

    def take(self) -> dict[str, float]:
        """The sums by metric name (one transfer from the device), then every sum back to 0, in place."""
        names = [k for k in self.tensors if k != self.SENTINEL]
        tensors = [self.tensors[k] for k in names]
        try:
            read = torch.stack(tensors).tolist() if tensors else []
        except RuntimeError:  # sums on several devices
            read = [float(t) for t in tensors]
        sums = dict(zip(names, read))
        for k, v in self.numbers.items():
            sums[k] = sums.get(k, 0.0) + v
        if self.tensors:
            torch._foreach_zero_(list(self.tensors.values()))
        taken = {k: sums[k] for k in self.order}  # the metrics given since the last take
        self.order, self.numbers, self.nonfinite_number, self._plan = {}, {}, False, ((), [])
        return taken


class Progress:
    """What the console and the loggers see of training: the sums of the step metrics, the log
    record (their means, each role's rate and mean gradient norm, ``speed/steps_per_s``: steps per
    second since the last log step, evaluations and checkpoints excluded), the log line with an ETA,
    a tqdm bar on a terminal (rank 0), and a warning, once per role, when a role's gradient was 0
    over a log interval."""

    def __init__(self, state: RunState, context: RunContext, total_steps: int):
        self.state, self.context, self.total = state, context, total_steps
        self.sums = StepSums()
        self.bar: Any = None
        self.stalled: set[str] = set()
        self.count, self.tick, self.paused = 0, time.perf_counter(), 0.0
        self.session_start, self.first_step = self.tick, state.step

    def say(self, line: str) -> None:
        """Echo a line (and write it to run.log) without breaking the progress bar."""
        if self.bar is None:
            self.context.echo(line)
            return
        with self.bar.external_write_mode():
            self.context.echo(line)

    @contextlib.contextmanager
    def shown(self, name: str) -> Iterator[None]:
        """Within the block a progress bar stands for the log lines (rank 0, on a terminal)."""
        if self.context.rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.state.step, desc=name, dynamic_ncols=True, file=sys.stderr)
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    def add(self, metrics: dict[str, Any]) -> None:
        """Count one step's metrics (after the step is taken)."""
        self.sums.add(metrics)
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
            loss = metrics.get("loss", 0.0)
            if not isinstance(loss, Tensor):
                self.bar.set_postfix(loss=f"{loss:.4g}", refresh=False)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Time spent in the block (evaluations, checkpoints) does not count in the speed."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - start

    def log(self, last: bool) -> None:
        """Record the means of the steps since the last log step and print a line (with an ETA
        unless ``last``). Every rank calls it: the means are over every rank's shard."""
        totals = self.sums.take()
        keys = list(totals)
        values = distributed.mean_floats([totals[k] / self.count for k in keys])
        means = {f"train/{k}": v for k, v in zip(keys, values)}
        for name, role in self.state.roles.items():
            means[f"lr/{name}"] = role.lr
            grad_norm = role.take_mean_grad_norm()
            if grad_norm is not None:
                means[f"train/grad_norm/{name}"] = grad_norm
                if grad_norm == 0.0 and name not in self.stalled:
                    self.stalled.add(name)
                    self.say(
                        f"warning: every gradient of role '{name}' since the last log step was 0: its parameters "
                        "have stopped training (a saturated output or dead units), and evaluations that use them "
                        "may mean nothing"
                    )
        now = time.perf_counter()
        rate = self.count / max(now - self.tick - self.paused, 1e-9)
        means["speed/steps_per_s"] = rate
        step = self.state.step
        self.context.record(step, means)
        if self.bar is None:
            line = f"step {step}/{self.total}  loss {means.get('train/loss', float('nan')):.5g}  ({rate:.1f} it/s"
            if not last:  # the ETA counts evaluations and checkpoints too
                left = (now - self.session_start) / (step - self.first_step) * (self.total - step)
                line += f", ETA {duration(left)}"
            self.context.echo(line + ")")
        self.count, self.tick, self.paused = 0, now, 0.0


def duration(seconds: float) -> str:
    """Seconds as '42s', '3m05s' or '2h07m'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
