"""What the console and the loggers see of training: the step metrics summed where they are
(``StepSums``), and ``Progress``, which turns them into log records and lines with a speed and an
ETA, shows a progress bar on a terminal, and warns once when a role stops getting gradients."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from eblvm_core import distributed
from eblvm_core.records import Records
from eblvm_core.state import RunState


class Progress:
    """What the console and the loggers see of training: the sums of the step metrics, the log
    record (their means, each role's rate and mean gradient norm, ``speed/steps_per_s``: steps per
    second since the last log step, evaluations and checkpoints excluded), the log line with an ETA,
    a tqdm bar on a terminal (rank 0), and a warning, once per role, when a role's gradient was 0
    over a log interval."""

    def __init__(self, state: RunState, records: Records, total_steps: int):
        self.state, self.records, self.total = state, records, total_steps
        self.sums = state.sums
        self.bar: Any = None
        self.stalled: set[str] = set()
        self.timed, self.tick, self.paused = 0, time.perf_counter(), 0.0  # steps timed since the last log, this session
        self.session_start, self.first_step = self.tick, state.step

    def say(self, line: str) -> None:
        """Echo a line (and write it to run.log) without breaking the progress bar."""
        if self.bar is None:
            self.records.echo(line)
            return
        with self.bar.external_write_mode():
            self.records.echo(line)

    @contextlib.contextmanager
    def shown(self, name: str) -> Iterator[None]:
        """Within the block a progress bar stands for the log lines (rank 0, on a terminal)."""
        if self.records.writes and sys.stderr.isatty():
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
        self.timed += 1
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
        steps = self.sums.steps
        totals = self.sums.take()
        keys = list(totals)
        values = distributed.mean_floats([totals[k] / steps for k in keys])
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
        rate = self.timed / max(now - self.tick - self.paused, 1e-9)
        means["speed/steps_per_s"] = rate
        step = self.state.step
        self.records.record(step, means)
        if self.bar is None:
            line = f"step {step}/{self.total}  loss {means.get('train/loss', float('nan')):.5g}  ({rate:.1f} it/s"
            if not last:  # the ETA counts evaluations and checkpoints too
                left = (now - self.session_start) / (step - self.first_step) * (self.total - step)
                line += f", ETA {duration(left)}"
            self.records.echo(line + ")")
        self.timed, self.tick, self.paused = 0, now, 0.0


def duration(seconds: float) -> str:
    """Seconds as '42s', '3m05s' or '2h07m'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
