"""Evaluating: ``evaluate`` runs evaluators on a run's parts (during training, and on a saved run);
``Evaluation`` is the loop's part that does so at its evaluation steps, on the roles' averaged
weights, then records the results, checks them and selects the model (best.pt, early stopping);
``Stop`` is why a run ends after an evaluation before [run] steps."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from eblvm_core import distributed
from eblvm_core.contracts import EvalResult, Evaluator, Parts, evaluation_mode
from eblvm_core.errors import ConfigError
from eblvm_core.guard import Guard
from eblvm_core.recipe import Recipe
from eblvm_core.records import Records
from eblvm_core.roles import averaged
from eblvm_core.state import RunState


@attrs.frozen
class Stop:
    """Why a run ends after an evaluation before [run] steps: the status run.json records for the
    session ("stopped early" for [run] patience; "pruned" for a search's pruner) and the line the
    console and run.log print."""

    status: str
    why: str


AfterEvaluation = Callable[[int, dict[str, float]], "Stop | None"]
"""``after_evaluation(step, scalars)``: called after each evaluation during training; a ``Stop`` ends the run."""


def evaluate(
    parts: Parts, evaluators: Iterable[tuple[str, Any]], announce: Callable[[str], None], keep_rng: bool = False
) -> EvalResult:
    """Call each (name, evaluator) on ``parts`` in ``evaluation_mode`` (with ``keep_rng``, also
    inside a fork of the RNG, so the caller's stream goes on as if nothing had run); an
    ``Evaluator``'s ``announce`` line goes to ``announce`` as "<name>: <line>" before it starts.
    Scalars and images keyed ``eval/<name>/<key>``."""
    devices = [parts.device] if parts.device.type == "cuda" else []
    scalars: dict[str, float] = {}
    images: dict[str, torch.Tensor] = {}
    for name, evaluator in evaluators:
        if isinstance(evaluator, Evaluator) and evaluator.announce:
            announce(f"{name}: {evaluator.announce}")
        rng = torch.random.fork_rng(devices=devices) if keep_rng else contextlib.nullcontext()
        with rng, evaluation_mode(parts.networks().values()):
            result = evaluator(parts)
        scalars.update({f"eval/{name}/{k}": float(v) for k, v in result.scalars.items()})
        images.update({f"eval/{name}/{k}": v for k, v in result.images.items()})
    return EvalResult(scalars, images)


class Evaluation:
    """The evaluators on the roles' averaged weights (networks in eval mode, the RNG and the
    networks' modes and buffers put back after each), their record and line, model selection
    (best.pt when [run] select_metric improves strictly) and early stopping ([run] patience).
    Rank 0 alone evaluates, with collectives off; the other ranks get {}."""

    def __init__(self, recipe: Recipe, state: RunState, records: Records, say: Callable[[str], None], guard: Guard):
        self.recipe, self.state, self.records, self.say, self.guard = recipe, state, records, say, guard

    def __call__(self) -> dict[str, float]:
        state = self.state
        if state.rank:
            return {}
        start = time.perf_counter()
        with averaged(state.roles.values()), distributed.local():
            result = evaluate(
                state.parts, state.built.evaluators, lambda line: self.say(f"step {state.step}: {line}"), keep_rng=True
            )
        scalars = result.scalars
        if scalars or result.images:
            self.records.record(state.step, scalars, result.images)
        if scalars and state.step < self.recipe.run.steps:  # the final evaluation is printed by the session
            values = "  ".join(f"{k.removeprefix('eval/')} {v:.5g}" for k, v in scalars.items())
            self.say(f"eval step {state.step}: {values}  ({time.perf_counter() - start:.1f} s)")
        self.guard.check_evaluation(scalars)
        state.evaluated_step = state.step
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
            if self.records.run_dir is not None:  # a trainer without records writes no file
                state.save_best(self.records.run_dir)
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
