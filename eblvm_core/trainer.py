"""The training loop. ``Trainer.fit`` reads top to bottom: set the rates, take a step, then at
fixed points call small named parts: ``Progress`` (metric sums, the log line with its speed and
ETA, the progress bar, the warning for a stalled role), ``Guard`` (the NaN guard: a non-finite
loss, parameter or evaluation stops the run with its last good checkpoint), ``Evaluation``
(evaluators on averaged weights, model selection into best.pt, early stopping), the checkpoint
schedule and a stop asked by a signal or by whoever watches the evaluations (``after_evaluation``,
e.g. a hyperparameter search's pruner). The trainer holds the ``state.RunState`` it trains and the
``context.RunContext`` it writes to; under torchrun the same loop runs on every rank, rank 0
alone writing and evaluating."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import attrs
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.context import RunContext
from eblvm_core.errors import ConfigError, Interrupted
from eblvm_core.graphs import WARMUP_STEPS, GraphedStep, graph_refusal, scheduled_rates
from eblvm_core.guard import Guard
from eblvm_core.launch import resume_command
from eblvm_core.progress import Progress
from eblvm_core.recipe import Recipe
from eblvm_core.roles import averaged
from eblvm_core.state import RunState, call_evaluators

Step = Callable[[Tensor], dict[str, Any]]


@attrs.frozen
class Stop:
    """Why a run ends after an evaluation before [run] steps: the status run.json records for the
    session ("stopped early" for [run] patience; "pruned" for a search's pruner) and the line the
    console and run.log print."""

    status: str
    why: str


AfterEvaluation = Callable[[int, dict[str, float]], "Stop | None"]


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

    def early_stop(self) -> Stop | None:
        """After an evaluation: the Stop ("stopped early", a line for the console) that [run]
        patience asks for, or None. Every rank calls it and gets rank 0's answer (a collective
        under torchrun)."""
        run, state = self.recipe.run, self.state
        if run.patience is None or not distributed.any_rank(state.out_of_patience()):
            return None
        if state.rank:
            return Stop("stopped early", "stopped early on rank 0")
        best = f"{state.best:.6g}" + (f" (step {state.best_step})" if state.best_step is not None else "")
        return Stop(
            "stopped early",
            f"stopped early at step {state.step}/{run.steps}: {run.select_metric} has not improved on {best} "
            f"in {state.stale} evaluations ([run] patience = {run.patience})",
        )


class Trainer:
    """Trains ``state`` by ``recipe`` in ``context``. ``stop_signal`` (set by SIGINT/SIGTERM) makes
    the loop write a checkpoint and stop after the step; ``stopped`` says why a run ended before
    [run] steps after an evaluation: early stopping, or ``after_evaluation``'s answer.

    ``after_evaluation(step, scalars)``, when given, is called on rank 0 after each evaluation
    during training (not the final one); a ``Stop`` it returns ends the run there as early stopping
    does: that evaluation is the final one, last.pt is written at its step, the line is printed and
    run.json records the status. Every rank gets rank 0's answer."""

    def __init__(
        self, recipe: Recipe, state: RunState, context: RunContext, after_evaluation: AfterEvaluation | None = None
    ):
        self.recipe, self.state, self.context = recipe, state, context
        self.after_evaluation = after_evaluation
        self.stop_signal: str | None = None
        self.stopped: Stop | None = None
        self.progress = Progress(state, context, recipe.run.steps)
        self.guard = Guard(state)
        self.evaluate = Evaluation(recipe, state, context, self.progress.say, self.guard)

    def fit(self) -> dict[str, float]:
        """Train to [run] steps, then evaluate; returns the final evaluation. A log step records
        the metrics' means (``Progress``), a checkpoint step writes checkpoints/last.pt (also at the
        end), a keep step checkpoints/step-<N>.pt; before either the NaN guard checks every step
        since the last check. An evaluation that exhausts [run] patience, or after which
        ``after_evaluation`` says stop, is the final one: the steps since the last log step are
        logged, last.pt is written at its step, and a line says why (``stopped``)."""
        run, state, progress = self.recipe.run, self.state, self.progress
        if state.step < run.steps and (stop := self.evaluate.early_stop()) is not None:
            # a resumed run that had stopped early: only its final evaluation is left
            self._stop(stop)
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
                    stopping = self._asked_to_stop(results)
                    if stopping is not None and not log_now:  # the evaluation ends the run: log the steps since
                        if not (save_now or keep_now):
                            self.guard.check(progress.sums, since=state.step - progress.count)
                        progress.log(last=True)
                if save_now or keep_now or stopping is not None:
                    with progress.pause():
                        state.save(self.context.run_dir, last=save_now or stopping is not None, keep=keep_now)
                if stopping is not None:
                    self._stop(stopping)
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

    def _asked_to_stop(self, results: dict[str, float]) -> Stop | None:
        """After an evaluation during training: early stopping's verdict, else ``after_evaluation``'s
        (rank 0's, given to every rank)."""
        stop = self.evaluate.early_stop()
        if stop is not None:
            return stop
        if self.after_evaluation is None:
            return None
        stop = self.after_evaluation(self.state.step, results) if self.state.rank == 0 else None
        return distributed.broadcast_object(stop) if self.state.world > 1 else stop

    def _stop(self, stop: Stop) -> None:
        self.stopped = stop
        self.progress.say(stop.why)

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
