"""The training loop. ``Trainer.fit`` reads top to bottom: take a step (``step``: the rates, the
batch, the precision, the estimator's step as the plan runs it, the averages), decide once what
the step is due for (``Due``), and do each of it once through small named parts: the NaN guard
(``Guard``), the log (``Progress``: metric sums, the line with its speed and ETA, the progress
bar), the evaluation (``Evaluation``: evaluators on averaged weights, model selection, early
stopping), the checkpoints, and a stop asked by a signal or by whoever watches the evaluations
(``after_evaluation``, e.g. a search's pruner). The trainer holds the ``state.RunState`` it trains
and the ``records.Records`` it writes to; under torchrun the same loop runs on every rank, rank 0
alone writing and evaluating."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.errors import Interrupted
from eblvm_core.evaluation import AfterEvaluation, Evaluation, Stop
from eblvm_core.graphs import WARMUP_STEPS, GraphedStep, scheduled_rates
from eblvm_core.guard import Guard
from eblvm_core.processes import resume_command
from eblvm_core.progress import Progress
from eblvm_core.recipe import Recipe, RunConfig
from eblvm_core.records import Records
from eblvm_core.state import RunState

EstimatorStep = Callable[[Tensor], dict[str, Any]]


@attrs.frozen
class Due:
    """What the step just taken is due for: the NaN guard's check (before a log or a checkpoint),
    a log record, an evaluation (not at the end: the final one follows the loop), last.pt, a kept
    checkpoint; ``end`` marks [run] steps."""

    check: bool
    log: bool
    evaluate: bool
    save: bool
    keep: bool
    end: bool

    @classmethod
    def at(cls, step: int, run: RunConfig) -> Due:
        end = step == run.steps
        log = step % run.log_every == 0 or end
        save = step % run.checkpoint_every == 0 or end
        keep = run.keep_every is not None and step % run.keep_every == 0
        evaluate = bool(run.eval_every) and step % run.eval_every == 0 and not end
        return cls(log or save or keep, log, evaluate, save, keep, end)


class Trainer:
    """Trains ``state`` by ``recipe``, writing to ``records`` (default: nowhere, for ``step``
    alone). ``stop_signal`` (set by SIGINT/SIGTERM) makes the loop write a checkpoint and stop
    after the step; ``stopped`` says why a run ended before [run] steps after an evaluation: early
    stopping, or ``after_evaluation``'s answer.

    ``estimator_step`` is the estimator's step made already (a compiled one: ``compiled``); by
    default the estimator's own, replayed from a CUDA graph where the plan says so.

    ``after_evaluation(step, scalars)``, when given, is called on rank 0 after each evaluation
    during training (not the final one); a ``Stop`` it returns ends the run there as early stopping
    does: that evaluation is the final one, last.pt is written at its step, the line is printed and
    run.json records the status. Every rank gets rank 0's answer."""

    def __init__(
        self,
        recipe: Recipe,
        state: RunState,
        records: Records | None = None,
        after_evaluation: AfterEvaluation | None = None,
        estimator_step: EstimatorStep | None = None,
    ):
        self.recipe, self.state = recipe, state
        self.records = records or Records(None)
        self.after_evaluation = after_evaluation
        self.stop_signal: str | None = None
        self.stopped: Stop | None = None
        self.progress = Progress(state, self.records, recipe.run.steps)
        self.guard = Guard(state)
        self.evaluation = Evaluation(recipe, state, self.records, self.progress.say, self.guard)
        self.estimator_step = estimator_step

    def fit(self) -> dict[str, float]:
        """Train to [run] steps, then evaluate; returns the final evaluation. An evaluation that
        exhausts [run] patience, or after which ``after_evaluation`` says stop, is the final one:
        the steps since the last log step are logged, last.pt is written at its step, and a line
        says why (``stopped``)."""
        run, state, progress = self.recipe.run, self.state, self.progress
        if state.step < run.steps and (stop := self.evaluation.early_stop()) is not None:
            # a resumed run that had stopped early: only its final evaluation is left
            self._stop(stop)
            return self.evaluation()
        with progress.shown(run.name):
            while state.step < run.steps:
                self.step()
                due = Due.at(state.step, run)
                self._check_and_log(due.check, due.log, last=due.end)
                stop, results = None, {}
                if due.evaluate:
                    with progress.pause():
                        results = self.evaluation()
                    stop = self._asked_to_stop(results)
                    if stop is not None and not due.log:  # the evaluation ends the run: log the steps since
                        self._check_and_log(not due.check, True, last=True)
                if due.save or due.keep or stop is not None:
                    with progress.pause():
                        state.save(self._run_dir(), last=due.save or stop is not None, keep=due.keep)
                if stop is not None:
                    self._stop(stop)
                    return results
                self._stop_if_asked(sync=due.log or due.save, saved=due.save)
        results = self.evaluation()
        state.save(self._run_dir())  # last.pt also holds what the final evaluation did: its step, the selection
        return results

    def step(self) -> dict[str, Any]:
        """One training step as ``fit`` takes it: each role's rate for this step, the next batch,
        the estimator's step in the plan's precision (on a GPU replayed from a CUDA graph where the
        plan says so, saying in the log which and why), the roles' averages, the step count, and the
        metrics counted for the log (a loss given as a number checked at once). Returns the metrics."""
        state, plan = self.state, self.state.built.plan
        if self.estimator_step is None:
            self.estimator_step = self._graphed_or_eager()
        device_rates = plan.device.type == "cuda"
        for role in state.roles.values():
            role.set_lr(state.step, self.recipe.run.steps, state.batches.steps_per_epoch, device_rates)
        batch = state.batches.next()
        try:
            with plan.precision.autocast():
                metrics = self.estimator_step(batch)
        except (RuntimeError, ValueError) as exc:
            diverged = self.guard.step_failed(exc)
            if diverged is None:
                raise
            raise diverged from None
        if device_rates and state.step + 1 < self.recipe.run.steps:
            state.batches.prefetch()  # the next batch on its way while the GPU runs the step
        for role in state.roles.values():
            role.update_average()
        state.step += 1
        self.guard.check_number(metrics.get("loss", 0.0))
        self.progress.add(metrics)  # with several ranks a non-finite number stops them all at the next check
        return metrics

    def _graphed_or_eager(self) -> EstimatorStep:
        """The estimator's step, wrapped to be replayed from a CUDA graph where the plan says it is."""
        plan, state, say = self.state.built.plan, self.state, self.progress.say
        if plan.device.type != "cuda":
            return state.estimator.step
        for line in plan.lines():
            say(line)
        if plan.cuda_graph is not None:
            return state.estimator.step
        rates = scheduled_rates(state.roles)
        line = f"CUDA graph: the training step is captured after {WARMUP_STEPS} eager steps and replayed"
        if rates is not None:
            scheduled = ", ".join(name for name, role in state.roles.items() if role.scheduled)
            line += f"; the scheduled rates ({scheduled}) are read from device tensors, updated before each replay"
        say(line)
        return GraphedStep(state.estimator.step, state.roles, say, rates)

    def _check_and_log(self, check: bool, log: bool, last: bool) -> None:
        """The NaN guard over the steps since the last log (``check``), then their log record (``log``)."""
        if check:
            self.guard.check(self.progress.sums, since=self.state.step - self.progress.sums.steps)
        if log:
            self.progress.log(last=last)

    def _asked_to_stop(self, results: dict[str, float]) -> Stop | None:
        """After an evaluation during training: early stopping's verdict, else ``after_evaluation``'s
        (rank 0's, given to every rank)."""
        stop = self.evaluation.early_stop()
        if stop is not None or self.after_evaluation is None:
            return stop
        stop = self.after_evaluation(self.state.step, results) if self.state.rank == 0 else None
        return distributed.broadcast_object(stop) if self.state.world > 1 else stop

    def _stop(self, stop: Stop) -> None:
        self.stopped = stop
        self.progress.say(stop.why)

    def stop_if_asked(self) -> None:
        """Before the first step: with a stop asked (on any rank, agreed on with several processes),
        write a checkpoint and stop as ``fit`` would after a step."""
        self._stop_if_asked(sync=True, saved=False)

    def _stop_if_asked(self, sync: bool, saved: bool) -> None:
        """After a step: on SIGINT/SIGTERM write a checkpoint (unless this step did) and stop.
        With several processes the ranks agree at logging and checkpoint steps (``sync``)."""
        state = self.state
        stop = self.stop_signal is not None
        if state.world > 1:
            stop = sync and distributed.any_rank(stop)
        if not stop:
            return
        run_dir = self._run_dir()
        if not saved:
            state.save(run_dir)
        raise Interrupted(
            f"{self.stop_signal or 'a signal on another rank'} at step {state.step}/{self.recipe.run.steps}: "
            f"checkpoint {ckpt.last_checkpoint(run_dir)} written; "
            f"resume with: {resume_command(run_dir, state.world)}"
        )

    def _run_dir(self) -> Path:
        """The run directory checkpoints go to: ``fit`` writes them, so it needs records with one
        (``step`` alone does not)."""
        if self.records.run_dir is None:
            raise ValueError("Trainer.fit writes checkpoints: give it Records with a run directory")
        return self.records.run_dir
