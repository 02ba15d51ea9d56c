"""The training loop: batches, estimator steps under the run's precision, schedules, EMA,
logging, evaluation, model selection, early stopping, checkpoints (last.pt and those kept every
[run] keep_every steps), the NaN guard and a stop asked by a signal, the same for every role;
under torchrun the same loop on every rank, rank 0 alone writing and evaluating. What a checkpoint holds is ``state.RunState``; a run directory's life (new or
resumed, lock, signals, provenance) is ``session``."""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.build import Built
from eblvm_core.errors import ConfigError, Interrupted, TrainingDiverged
from eblvm_core.graphs import WARMUP_STEPS, GraphedStep, graph_refusal, scheduled_rates
from eblvm_core.launch import resume_command
from eblvm_core.optim import device_rate, optimizer_params, take_mean_grad_norm
from eblvm_core.recipe import Recipe
from eblvm_core.rundir import append_metrics
from eblvm_core.state import RunState, call_evaluators

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def step_precision(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    """The context a training step runs in under ``[run] precision``: autocast to bf16 or fp16,
    or nothing for fp32. Autocast's cache of weight casts is off: a step that updates parameters
    in place and runs them again (the K lower-level steps of BiSM and VaGES, BiDVL's second
    level after its first) would otherwise reuse the casts made before the update, since the
    cache lives until the outermost autocast region ends; a CUDA graph needs the cache off too."""
    dtype = AUTOCAST.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


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


class Trainer(RunState):
    """Trains ``built`` by ``recipe`` in ``run_dir``, printing through ``echo`` (rank 0 alone logs,
    evaluates and writes checkpoints)."""

    def __init__(self, recipe: Recipe, built: Built, run_dir: Path, echo: Callable[[str], None] = print):
        super().__init__(recipe, built, run_dir)
        self.echo = echo
        self.stop_signal: str | None = None  # set by SIGINT/SIGTERM: checkpoint and stop after this step
        self.bar: Any = None  # the tqdm progress bar while fit() shows one (on a terminal)
        self.stopped_early: str | None = None  # why fit() ended before [run] steps (early stopping)
        self.stalled_roles: set[str] = set()  # roles whose gradient was 0 over a log interval (said once)

    # ---- logging and evaluation -----------------------------------------------------------
    def record(self, scalars: dict[str, float], images: dict[str, Tensor] | None = None) -> None:
        if self.rank:
            return
        append_metrics(self.run_dir, self.step, scalars)
        for logger in self.built.loggers:
            logger.log_scalars(self.step, scalars)
            if images:
                logger.log_images(self.step, images)

    def evaluate(self) -> dict[str, float]:
        """Run every evaluator (on EMA weights where enabled, the networks in eval mode) without
        disturbing the training: after each one, the RNG and the networks' modes and buffers are
        put back. On rank 0 alone, with collectives off (the other ranks return {} and wait for
        it at their next collective)."""
        if self.rank:
            return {}
        start = time.perf_counter()
        with self.ema_weights(), distributed.local():
            result = call_evaluators(
                self.parts, self.built.evaluators, lambda line: self.say(f"step {self.step}: {line}"), keep_rng=True
            )
        scalars, images = result.scalars, result.images
        if scalars or images:
            self.record(scalars, images)
        if scalars and self.step < self.recipe.run.steps:  # the final evaluation is printed by the caller
            values = "  ".join(f"{k.removeprefix('eval/')} {v:.5g}" for k, v in scalars.items())
            self.say(f"eval step {self.step}: {values}  ({time.perf_counter() - start:.1f} s)")
        bad = {k: v for k, v in scalars.items() if not math.isfinite(v)}
        if bad:
            key, value = next(iter(bad.items()))
            raise self._diverged(f"evaluation gave {key} = {value}: the model has degenerated")
        self.select(scalars)
        return scalars

    def select(self, scalars: dict[str, float]) -> None:
        """Model selection: save best.pt (atomically) when [run] select_metric improves on the best
        so far (strictly); otherwise count one more evaluation without improvement (``stale``,
        which [run] patience bounds)."""
        run = self.recipe.run
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
        improved = self.best is None or (value > self.best if run.select_mode == "max" else value < self.best)
        if math.isfinite(value) and improved:
            self.best, self.best_step, self.stale = value, self.step, 0
            ckpt.save_atomic(ckpt.seal(self.state()), ckpt.best_checkpoint(self.run_dir))
        else:
            self.stale += 1

    def early_stop(self) -> str | None:
        """After an evaluation: why the run stops early (a line for the console), or None. Every
        rank calls it and gets rank 0's answer (a collective under torchrun)."""
        run = self.recipe.run
        if run.patience is None or not distributed.any_rank(self.out_of_patience()):
            return None
        if self.rank:
            return "stopped early on rank 0"
        best = f"{self.best:.6g}" + (f" (step {self.best_step})" if self.best_step is not None else "")
        return (
            f"stopped early at step {self.step}/{run.steps}: {run.select_metric} has not improved on {best} "
            f"in {self.stale} evaluations ([run] patience = {run.patience})"
        )

    def say(self, line: str) -> None:
        """Echo a line (and write it to run.log) without breaking the progress bar."""
        if self.bar is None:
            self.echo(line)
            return
        with self.bar.external_write_mode():
            self.echo(line)

    # ---- the NaN guard -------------------------------------------------------------------
    def _diverged(self, what: str, step: int | None = None) -> TrainingDiverged:
        """The error for a divergence at ``step`` (default: the last one taken), saying which checkpoint is kept."""
        if self.last_saved is None:
            kept = "no checkpoint was written before it"
        elif self.last_saved[0] == self.step:
            kept = f"the checkpoint {self.last_saved[1]} holds this step's parameters"
        else:
            kept = f"last good checkpoint: {self.last_saved[1]} (step {self.last_saved[0]})"
        return TrainingDiverged(f"step {self.step if step is None else step}: {what}; run stopped, {kept}")

    def nonfinite_parameter(self) -> str | None:
        """The name of a NaN or infinite trained parameter (any role) or network buffer, else None."""
        for role, opt in self.optimizers.items():
            params = optimizer_params(opt)
            finite = (
                torch.stack([torch.isfinite(p).all() for p in params]) if params else torch.ones(0, dtype=torch.bool)
            )
            if not bool(finite.all()):
                return f"parameter {self.param_names[role][int((~finite).nonzero()[0])]} (role '{role}')"
        for section, net in self.parts.networks().items():
            for name, buffer in net.named_buffers():
                if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all()):
                    return f"buffer {section}.{name}"
        return None

    def check_parameters(self) -> None:
        """Stop when a parameter of any role (or a network buffer) is NaN or infinite."""
        bad = self.nonfinite_parameter()
        if bad is not None:
            raise self._diverged(f"{bad} is not finite")

    def _step_failed(self, exc: Exception) -> TrainingDiverged | None:
        """A step that raised on non-finite values (a NaN probability in a sampler) or with a
        non-finite parameter is a divergence; anything else is a bug (None: re-raise it)."""
        bad = self.nonfinite_parameter()
        message = " ".join(str(exc).split()).split(" (Could this error message be improved?")[0]
        if bad is None and not NON_FINITE.search(message):
            return None
        cause = f"{bad} is not finite" if bad else "a value became non-finite"
        return self._diverged(f"the step failed: {cause} ({type(exc).__name__}: {message[:200]})", self.step + 1)

    # ---- the loop ----------------------------------------------------------------------
    def training_step(self) -> Callable[[Tensor], dict[str, Any]]:
        """The estimator's step; on a GPU wrapped to be replayed from a CUDA graph where it can
        be ([run] cuda_graph), saying in the log which and why."""
        run, device = self.recipe.run, self.parts.device
        if device.type != "cuda":
            return self.estimator.step
        if run.cudnn_benchmark:
            self.say("cuDNN: convolution algorithms chosen by timing ([run] cudnn_benchmark)")
        refusal = graph_refusal(self.estimator, self.built.schedules, device, self.world, run.precision, run.cuda_graph)
        if refusal is not None:
            self.say(f"CUDA graph: not used: {refusal}")
            return self.estimator.step
        rates = scheduled_rates(self.optimizers, self.built.schedules)
        line = f"CUDA graph: the training step is captured after {WARMUP_STEPS} eager steps and replayed"
        if rates is not None:
            roles = ", ".join(role for role, s in self.built.schedules.items() if not s.constant)
            line += f"; the scheduled rates ({roles}) are read from device tensors, updated before each replay"
        self.say(line)
        return GraphedStep(self.estimator.step, self.optimizers, self.say, rates)

    def set_learning_rates(self) -> None:
        """Each role's rate for this step from its schedule. On a CUDA device a scheduled rate is
        rounded to float32 (``optim.device_rate``), the value a replayed step reads from its rate
        tensor, so that graph-replayed and eager runs step alike; on the CPU it is the float itself."""
        run = self.recipe.run
        rounded = self.parts.device.type == "cuda"
        for role, opt in self.optimizers.items():
            schedule = self.built.schedules.get(role)
            if schedule is None or not hasattr(opt, "base_lrs"):
                continue
            for group, base in zip(opt.param_groups, opt.base_lrs):
                lr = schedule.lr(base, self.step, run.steps, self.batches.steps_per_epoch)
                group["lr"] = device_rate(lr) if rounded and not schedule.constant else lr

    def _stop_if_asked(self, sync_step: bool, saved: bool) -> None:
        """After a step: on SIGINT/SIGTERM write a checkpoint (unless this step did) and stop.
        With several processes the ranks agree at logging and checkpoint steps."""
        stop = self.stop_signal is not None
        if self.world > 1:
            stop = sync_step and distributed.any_rank(stop)
        if not stop:
            return
        if not saved:
            self.save()
        raise Interrupted(
            f"{self.stop_signal or 'a signal on another rank'} at step {self.step}/{self.recipe.run.steps}: "
            f"checkpoint {ckpt.last_checkpoint(self.run_dir)} written; "
            f"resume with: {resume_command(self.run_dir, self.world)}"
        )

    def fit(self) -> dict[str, float]:
        """Train to [run] steps, then evaluate; returns the final evaluation. Log steps record the
        mean metrics, learning rates, gradient norms and ``speed/steps_per_s`` (training steps per
        second since the last log step, evaluations and checkpoints excluded) and print a line with
        an ETA. checkpoints/last.pt is written every [run] checkpoint_every steps and at the end,
        checkpoints/step-<N>.pt at every multiple N of [run] keep_every (a schedule of its own).

        Early stopping ([run] patience): the evaluation that makes ``patience`` in a row without
        improving on the best select_metric ends the run at its step, as the final evaluation:
        the steps since the last log step are logged, last.pt is written, a line says why, and
        ``stopped_early`` holds it."""
        run = self.recipe.run
        if self.step < run.steps:  # a resumed run that had stopped early: only its final evaluation is left
            self.stopped_early = self.early_stop()
            if self.stopped_early is not None:
                self.say(self.stopped_early)
                return self.evaluate()
        if self.rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=run.steps, initial=self.step, desc=run.name, dynamic_ncols=True, file=sys.stderr)
        sums = StepSums()
        count, tick, paused = 0, time.perf_counter(), 0.0  # paused: seconds of evaluations and checkpoints
        session_start, first_step = tick, self.step
        training_step = self.training_step()
        prefetch = self.parts.device.type == "cuda"  # the next batch on its way while the GPU runs the step

        def check_finite() -> None:
            """Stop on a non-finite loss since the last log step, or a non-finite parameter (every
            rank). Every log step is checked first, so that covers every step since the last check."""
            if distributed.any_rank(not sums.loss_finite()):
                raise self._diverged(f"training loss became non-finite after step {self.step - count}")
            self.check_parameters()

        def log(last: bool) -> None:
            """Record the means of the steps since the last log step and print a line (with an ETA
            unless ``last``)."""
            nonlocal count, tick, paused
            totals = sums.take()
            keys = list(totals)  # means over every rank's shard
            values = distributed.mean_floats([totals[k] / count for k in keys])
            means = {f"train/{k}": v for k, v in zip(keys, values)}
            for role, opt in self.optimizers.items():
                means[f"lr/{role}"] = float(opt.param_groups[0]["lr"])
                grad_norm = take_mean_grad_norm(opt)
                if grad_norm is not None:
                    means[f"train/grad_norm/{role}"] = grad_norm
                    if grad_norm == 0.0 and role not in self.stalled_roles:
                        self.stalled_roles.add(role)
                        self.say(
                            f"warning: every gradient of role '{role}' since the last log step was 0: its parameters "
                            "have stopped training (a saturated output or dead units), and evaluations that use them "
                            "may mean nothing"
                        )
            now = time.perf_counter()
            rate = count / max(now - tick - paused, 1e-9)
            means["speed/steps_per_s"] = rate
            self.record(means)
            if self.bar is None:
                loss_mean = means.get("train/loss", float("nan"))
                line = f"step {self.step}/{run.steps}  loss {loss_mean:.5g}  ({rate:.1f} it/s"
                if not last:  # the ETA counts evaluations and checkpoints too
                    left = (now - session_start) / (self.step - first_step) * (run.steps - self.step)
                    line += f", ETA {duration(left)}"
                self.echo(line + ")")
            count, tick, paused = 0, now, 0.0

        try:
            while self.step < run.steps:
                self.set_learning_rates()
                batch = self.batches.next()
                try:
                    with step_precision(self.parts.device.type, run.precision):
                        metrics = training_step(batch)
                except (RuntimeError, ValueError) as exc:
                    diverged = self._step_failed(exc)
                    if diverged is None:
                        raise
                    raise diverged from None
                if prefetch and self.step + 1 < run.steps:
                    self.batches.prefetch()
                self.update_ema()
                self.step += 1
                loss = metrics.get("loss", 0.0)
                if not isinstance(loss, Tensor) and not math.isfinite(loss) and self.world == 1:
                    raise self._diverged(f"training loss is {loss}")
                sums.add(metrics)  # with several ranks a non-finite number stops them all at the next check
                count += 1
                if self.bar is not None:
                    self.bar.update(1)
                    if not isinstance(loss, Tensor):
                        self.bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
                log_now = self.step % run.log_every == 0 or self.step == run.steps
                save_now = self.step % run.checkpoint_every == 0 or self.step == run.steps
                keep_now = run.keep_every is not None and self.step % run.keep_every == 0
                if log_now or save_now or keep_now:
                    check_finite()
                if log_now:
                    log(last=self.step == run.steps)
                pause = time.perf_counter()
                stopping = None
                if run.eval_every and self.step % run.eval_every == 0 and self.step < run.steps:
                    results = self.evaluate()
                    stopping = self.early_stop()
                    if stopping is not None and not log_now:
                        if not (save_now or keep_now):
                            check_finite()
                        paused += time.perf_counter() - pause
                        pause = time.perf_counter()
                        log(last=True)
                if save_now or keep_now or stopping is not None:
                    self.save(last=save_now or stopping is not None, keep=keep_now)
                paused += time.perf_counter() - pause
                if stopping is not None:  # the evaluation at this step is the final one
                    self.stopped_early = stopping
                    self.say(stopping)
                    return results
                self._stop_if_asked(log_now or save_now, save_now)
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
        results = self.evaluate()
        if run.select_metric is not None:
            self.save()  # last.pt also holds what the final evaluation did to the selection (best, patience)
        return results


def duration(seconds: float) -> str:
    """Seconds as '42s', '3m05s' or '2h07m'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
