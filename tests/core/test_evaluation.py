"""``evaluation.evaluate`` (evaluators on a run's parts), the ``Evaluator`` contract it reads, and
``Stop``. The loop's ``Evaluation`` (model selection, early stopping) runs in real runs:
tests/e2e/test_run.py and tests/core/test_trainer.py."""

from __future__ import annotations

import torch

from eblvm_core.contracts import EvalResult, Evaluator, Parts, evaluator, reporting
from eblvm_core.evaluation import Stop, evaluate


def draw(_parts: Parts) -> EvalResult:
    return EvalResult(scalars={"u": float(torch.rand(()))})


def test_evaluate_keys_results_announces_and_keeps_the_callers_random_stream_when_asked():
    lines: list[str] = []
    announced = evaluator(draw, announce="one uniform draw")
    torch.manual_seed(0)
    before = torch.get_rng_state()
    kept = evaluate(Parts(), [("draw", announced)], lines.append, keep_rng=True)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is where it was
    moved = evaluate(Parts(), [("draw", announced)], lines.append)
    assert not torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(0)
    assert kept.scalars == moved.scalars == {"eval/draw/u": float(torch.rand(()))}
    assert lines == ["draw: one uniform draw"] * 2


def test_a_plain_function_evaluates_too_and_announces_nothing():
    lines: list[str] = []
    assert set(evaluate(Parts(), [("draw", draw)], lines.append).scalars) == {"eval/draw/u"}
    assert lines == []


def test_reporting_declares_the_keys_on_an_evaluator():
    declared = reporting(["u", "u_stderr"])(draw)
    assert isinstance(declared, Evaluator) and declared.reports == ("u", "u_stderr") and declared.announce is None
    assert set(declared(Parts()).scalars) == {"u"}
    assert Evaluator.reports is None and Evaluator.announce is None  # what a subclass declares unless it says more


def test_a_stop_says_its_status_and_why():
    stop = Stop("pruned", "pruned at step 100")
    assert (stop.status, stop.why) == ("pruned", "pruned at step 100")
