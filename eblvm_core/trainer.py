"""The training loop. ``Trainer.fit`` reads top to bottom: set the rates, take a step, then at
fixed points call small named parts: ``Progress`` (metric sums, the log line with its speed and
ETA, the progress bar, the warning for a stalled role), ``Guard`` (the NaN guard: a non-finite
loss, parameter or evaluation stops the run with its last good checkpoint), ``Evaluation``
(evaluators on averaged weights, model selection into best.pt, early stopping), the checkpoint
schedule and a stop asked by a signal. The trainer holds the ``state.RunState`` it trains and the
``context.RunContext`` it writes to; under torchrun the same loop runs on every rank, rank 0
alone writing and evaluating."""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.context import RunContext
from eblvm_core.errors import ConfigError, Interrupted, TrainingDiverged
from eblvm_core.graphs import WARMUP_STEPS, GraphedStep, graph_refusal, scheduled_rates
from eblvm_core.launch import resume_command
from eblvm_core.recipe import Recipe
from eblvm_core.roles import averaged
from eblvm_core.state import RunState, call_evaluators

Step = Callable[[Tensor], dict[str, Any]]
NON_FINITE = re.compile(r"\bnan\b|\binf\b|p_in|finite", re.IGNORECASE)  # what a step fails with on NaN/Inf


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


class Guard:
    """The NaN guard: a non-finite loss, trained parameter, network buffer or evaluation stops the
    run (``TrainingDiverged``, exit 3) saying which checkpoint holds the last good parameters."""

    def __init__(self, state: RunState):
        self.state = state

    def diverged(self, what: str, step: int | None = None) -> TrainingDiverged:
        """The error for a divergence at ``step`` (default: the last one taken)."""
        last_saved, now = self.state.last_saved, self.state.step
        if last_saved is None:
            kept = "no checkpoint was written before it"
        elif last_saved[0] == now:
            kept = f"the checkpoint {last_saved[1]} holds this step's parameters"
        else:
            kept = f"last good checkpoint: {last_saved[1]} (step {last_saved[0]})"
        return TrainingDiverged(f"step {now if step is None else step}: {what}; run stopped, {kept}")

    def nonfinite_parameter(self) -> str | None:
        """The name of a NaN or infinite trained parameter (any role) or network buffer, else None."""
        for name, role in self.state.roles.items():
            params = role.params
            finite = (
                torch.stack([torch.isfinite(p).all() for p in params]) if params else torch.ones(0, dtype=torch.bool)
            )
            if not bool(finite.all()):
                return f"parameter {self.state.param_names[name][int((~finite).nonzero()[0])]} (role '{name}')"
        for section, net in self.state.parts.networks().items():
            for key, buffer in net.named_buffers():
                if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all()):
                    return f"buffer {section}.{key}"
        return None

    def check(self, sums: StepSums, since: int) -> None:
        """Stop on a non-finite loss since step ``since`` (the last check), or a non-finite
        parameter; on every rank (a collective under torchrun)."""
        if distributed.any_rank(not sums.loss_finite()):
            raise self.diverged(f"training loss became non-finite after step {since}")
        bad = self.nonfinite_parameter()
        if bad is not None:
            raise self.diverged(f"{bad} is not finite")

    def check_number(self, loss: Any) -> None:
        """A loss given as a number is checked at once (one process; several ranks agree at ``check``)."""
        if not isinstance(loss, Tensor) and not math.isfinite(loss) and self.state.world == 1:
            raise self.diverged(f"training loss is {loss}")

    def check_evaluation(self, scalars: dict[str, float]) -> None:
        bad = {k: v for k, v in scalars.items() if not math.isfinite(v)}
        if bad:
            key, value = next(iter(bad.items()))
            raise self.diverged(f"evaluation gave {key} = {value}: the model has degenerated")

    def step_failed(self, exc: Exception) -> TrainingDiverged | None:
        """A step that raised on non-finite values (a NaN probability in a sampler) or with a
        non-finite parameter is a divergence; anything else is a bug (None: re-raise it)."""
        bad = self.nonfinite_parameter()
        message = " ".join(str(exc).split()).split(" (Could this error message be improved?")[0]
        if bad is None and not NON_FINITE.search(message):
            return None
        cause = f"{bad} is not finite" if bad else "a value became non-finite"
        return self.diverged(f"the step failed: {cause} ({type(exc).__name__}: {message[:200]})", self.state.step + 1)


class Evaluation:
    """The evaluators on the roles' averaged weights (networks in eval mode, the RNG and the
    networks' modes and buffers put back after each), their record and line, model selection
    (best.pt when [run] select_metric improves strictly) and early stopping ([run] patience).
    Rank 0 alone evaluates, with collectives off; the other ranks get {}."""

    def __init__(self, recipe: Recipe, state: RunState, context: RunContext, say: Callable[[str], None], guard: Guard):
        self.recipe, self.state, self.context, self.say, self.guard = recipe, state, context, say, guard

    def __call__(self) -> dict[str, float]:
        state = self.state
        if state.rank:
            return {}
        start = time.perf_counter()
        with averaged(state.roles.values()), distributed.local():
            result = call_evaluators(
                state.parts, state.built.evaluators, lambda line: self.say(f"step {state.step}: {line}"), keep_rng=True
            )
        scalars = result.scalars
        if scalars or result.images:
            self.context.record(state.step, scalars, result.images)
        if scalars and state.step < self.recipe.run.steps:  # the final evaluation is printed by the caller
            values = "  ".join(f"{k.removeprefix('eval/')} {v:.5g}" for k, v in scalars.items())
            self.say(f"eval step {state.step}: {values}  ({time.perf_counter() - start:.1f} s)")
        self.guard.check_evaluation(scalars)
        self.select(scalars)
        return scalars

    def select(self, scalars: dict[str, float]) -> None:
        """Save best.pt when select_metric improves on the best so far (strictly); otherwise count
        one more evaluation without improvement (``stale``, which [run] patience bounds)."""
        run, state = self.recipe.run, self.state
        if run.select_metric is None:
            return
        if run.select_metric not in scalars:
            reported = ", ".join(sorted(scalars)) or "nothing"
            raise ConfigError(
                "run",
                "select_metric",
                f"no evaluator reports '{run.select_metric}'; reported: {reported}",
                file=self.recipe.path,
            )
        value = scalars[run.select_metric]
        improved = state.best is None or (value > state.best if run.select_mode == "max" else value < state.best)
        if math.isfinite(value) and improved:
            state.best, state.best_step, state.stale = value, state.step, 0
            state.save_best(self.context.run_dir)
        else:
            state.stale += 1

    def early_stop(self) -> str | None:
        """After an evaluation: why the run stops early (a line for the console), or None. Every
        rank calls it and gets rank 0's answer (a collective under torchrun)."""
        run, state = self.recipe.run, self.state
        if run.patience is None or not distributed.any_rank(state.out_of_patience()):
            return None
        if state.rank:
            return "stopped early on rank 0"
        best = f"{state.best:.6g}" + (f" (step {state.best_step})" if state.best_step is not None else "")
        return (
            f"stopped early at step {state.step}/{run.steps}: {run.select_metric} has not improved on {best} "
            f"in {state.stale} evaluations ([run] patience = {run.patience})"
        )


class Trainer:
    """Trains ``state`` by ``recipe`` in ``context``. ``stop_signal`` (set by SIGINT/SIGTERM) makes
    the loop write a checkpoint and stop after the step; ``stopped_early`` says why a run ended
    before [run] steps (early stopping)."""

    def __init__(self, recipe: Recipe, state: RunState, context: RunContext):
        self.recipe, self.state, self.context = recipe, state, context
        self.stop_signal: str | None = None
        self.stopped_early: str | None = None
        self.progress = Progress(state, context, recipe.run.steps)
        self.guard = Guard(state)
        self.evaluate = Evaluation(recipe, state, context, self.progress.say, self.guard)

    def fit(self) -> dict[str, float]:
        """Train to [run] steps, then evaluate; returns the final evaluation. A log step records
        the metrics' means (``Progress``), a checkpoint step writes checkpoints/last.pt (also at the
        end), a keep step checkpoints/step-<N>.pt; before either the NaN guard checks every step
        since the last check. An evaluation that exhausts [run] patience is the final one: the
        steps since the last log step are logged, last.pt is written at its step, and a line says
        why (``stopped_early``)."""
        run, state, progress = self.recipe.run, self.state, self.progress
        if state.step < run.steps and (stopping := self.evaluate.early_stop()) is not None:
            self._stop_early(stopping)  # a resumed run that had stopped early: only its final evaluation is left
            return self.evaluate()
        step = self.training_step()
        prefetch = state.parts.device.type == "cuda"  # the next batch on its way while the GPU runs the step
        with progress.shown(run.name):
            while state.step < run.steps:
                self._take(step, prefetch)
                at_end = state.step == run.steps
                log_now = state.step % run.log_every == 0 or at_end
                save_now = state.step % run.checkpoint_every == 0 or at_end
                keep_now = run.keep_every is not None and state.step % run.keep_every == 0
                if log_now or save_now or keep_now:
                    self.guard.check(progress.sums, since=state.step - progress.count)
                if log_now:
                    progress.log(last=at_end)
                stopping = None
                if run.eval_every and state.step % run.eval_every == 0 and not at_end:
                    with progress.pause():
                        results = self.evaluate()
                    stopping = self.evaluate.early_stop()
                    if stopping is not None and not log_now:  # the evaluation ends the run: log the steps since
                        if not (save_now or keep_now):
                            self.guard.check(progress.sums, since=state.step - progress.count)
                        progress.log(last=True)
                if save_now or keep_now or stopping is not None:
                    with progress.pause():
                        state.save(self.context.run_dir, last=save_now or stopping is not None, keep=keep_now)
                if stopping is not None:
                    self._stop_early(stopping)
                    return results
                self._stop_if_asked(sync=log_now or save_now, saved=save_now)
        results = self.evaluate()
        if run.select_metric is not None:
            state.save(self.context.run_dir)  # last.pt also holds what the final evaluation did to the selection
        return results

    def _take(self, step: Step, prefetch: bool) -> None:
        """One training step at this step's learning rates and precision; the roles' averages
        follow, the step count goes up, and the metrics are counted (a number loss checked)."""
        state = self.state
        device_rates = state.parts.device.type == "cuda"
        for role in state.roles.values():
            role.set_lr(state.step, self.recipe.run.steps, state.batches.steps_per_epoch, device_rates)
        batch = state.batches.next()
        try:
            with state.built.precision.autocast():
                metrics = step(batch)
        except (RuntimeError, ValueError) as exc:
            diverged = self.guard.step_failed(exc)
            if diverged is None:
                raise
            raise diverged from None
        if prefetch and state.step + 1 < self.recipe.run.steps:
            state.batches.prefetch()
        for role in state.roles.values():
            role.update_average()
        state.step += 1
        self.guard.check_number(metrics.get("loss", 0.0))
        self.progress.add(metrics)  # with several ranks a non-finite number stops them all at the next check

    def _stop_early(self, why: str) -> None:
        self.stopped_early = why
        self.progress.say(why)

    def training_step(self) -> Step:
        """The estimator's step; on a GPU wrapped to be replayed from a CUDA graph where it can
        be ([run] cuda_graph), saying in the log which and why."""
        run, state, say = self.recipe.run, self.state, self.progress.say
        estimator, device = state.estimator, state.parts.device
        if device.type != "cuda":
            return estimator.step
        if run.cudnn_benchmark:
            say("cuDNN: convolution algorithms chosen by timing ([run] cudnn_benchmark)")
        refusal = graph_refusal(
            estimator.graph_safe, state.roles, device, state.world, state.built.precision, run.cuda_graph
        )
        if refusal is not None:
            say(f"CUDA graph: not used: {refusal}")
            return estimator.step
        rates = scheduled_rates(state.roles)
        line = f"CUDA graph: the training step is captured after {WARMUP_STEPS} eager steps and replayed"
        if rates is not None:
            scheduled = ", ".join(name for name, role in state.roles.items() if role.scheduled)
            line += f"; the scheduled rates ({scheduled}) are read from device tensors, updated before each replay"
        say(line)
        return GraphedStep(estimator.step, state.roles, say, rates)

    def _stop_if_asked(self, sync: bool, saved: bool) -> None:
        """After a step: on SIGINT/SIGTERM write a checkpoint (unless this step did) and stop.
        With several processes the ranks agree at logging and checkpoint steps (``sync``)."""
        state = self.state
        stop = self.stop_signal is not None
        if state.world > 1:
            stop = sync and distributed.any_rank(stop)
        if not stop:
            return
        if not saved:
            state.save(self.context.run_dir)
        raise Interrupted(
            f"{self.stop_signal or 'a signal on another rank'} at step {state.step}/{self.recipe.run.steps}: "
            f"checkpoint {ckpt.last_checkpoint(self.context.run_dir)} written; "
            f"resume with: {resume_command(self.context.run_dir, state.world)}"
        )


def duration(seconds: float) -> str:
    """Seconds as '42s', '3m05s' or '2h07m'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
