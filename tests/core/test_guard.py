"""guard.py: the NaN guard. A non-finite loss (a number or a tensor), trained parameter, evaluation
or a step that fails on one stops the run (exit 3), naming the checkpoint that holds the last good
parameters, which the run keeps."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core.errors import TrainingDiverged
from eblvm_core.guard import Guard
from eblvm_core.state import StepSums
from tests.support import SMALL_RECIPE, one_line, only_run_dir, poison_at

# ---- runs that diverge ---------------------------------------------------------------------------


def nan_sigma(built, metrics) -> None:
    with torch.no_grad():
        built.parts.model.log_sigma.fill_(float("nan"))


def test_nan_loss_stops_cleanly_and_keeps_last_good_checkpoint(cli, write_recipe, tmp_path, monkeypatch):
    import eblvm_core.session as session_module

    real_build = session_module.build

    def build_with_nan(*args, **kwargs):
        built = real_build(*args, **kwargs)
        estimator, real_step, count = built.parts.estimator, built.parts.estimator.step, [0]

        def step(batch):
            count[0] += 1
            metrics = real_step(batch)
            if count[0] == 25:
                with torch.no_grad():
                    built.parts.model.W.fill_(float("nan"))
                metrics["loss"] = float("nan")
            return metrics

        estimator.step = step
        return built

    monkeypatch.setattr(session_module, "build", build_with_nan)
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(), "--out", out])
    assert result.exit_code == 3
    assert "step 25: training loss is nan" in result.output
    assert "last good checkpoint" in result.output and "(step 20; never evaluated)" in result.output
    state = ckpt.load(only_run_dir(out) / "checkpoints" / "last.pt")
    assert state["step"] == 20
    assert all(torch.isfinite(t).all() for t in state["networks"]["model"].values())


def test_a_non_finite_parameter_stops_the_run_with_a_finite_loss(cli, write_recipe, tmp_path, monkeypatch):
    poison_at(monkeypatch, 30, nan_sigma)  # after step 30's loss: only the parameter is not finite
    out = tmp_path / "runs"
    line = one_line(cli(["run", write_recipe(), "--out", out]), code=3)
    assert "step 30: parameter model.log_sigma (role 'model') is not finite" in line, line
    run_dir = only_run_dir(out)
    assert f"last good checkpoint: {ckpt.last_checkpoint(run_dir)} (step 20; never evaluated)" in line, line
    state = ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))
    assert state["step"] == 20 and all(torch.isfinite(t).all() for t in state["networks"]["model"].values())


def test_after_a_resume_the_message_names_the_checkpoint_resumed_from(cli, run_copy, monkeypatch):
    poison_at(monkeypatch, 5, nan_sigma)
    line = one_line(cli(["run", "--resume", run_copy, "-o", "run.steps=60", "-o", "run.checkpoint_every=100"]), code=3)
    assert f"last good checkpoint: {ckpt.last_checkpoint(run_copy)} (step 30; its evaluation was finite)" in line, line


def test_a_degenerate_model_whose_evaluation_is_nan_stops_with_exit_3(cli, write_recipe, tmp_path):
    """DSM with SGD at a large rate: the parameters stay finite (log σ runs away) but the exact
    log-likelihood is NaN; metrics.jsonl stays valid JSON (null and a flag)."""
    overrides = ["optim.model.kind=sgd", "optim.model.lr=2.0", "run.steps=100", "objective.sigma=0.05"]
    out = tmp_path / "runs"
    line = one_line(cli(["run", write_recipe(), "--out", out, *[a for o in overrides for a in ("-o", o)]]), code=3)
    assert "step 100: evaluation gave eval/exact-loglik/test_loglik = nan" in line, line
    run_dir = only_run_dir(out)

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in metrics.jsonl")

    rows = [json.loads(r, parse_constant=refuse) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = rows[-1]
    assert final["eval/exact-loglik/test_loglik"] is None and final["nonfinite"] == {
        "eval/exact-loglik/test_loglik": "nan",
        "eval/exact-loglik/test_loglik_stderr": "nan",
    }
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["status"] == "diverged"


CD = SMALL_RECIPE.replace('[objective]\nkind = "dsm"\nsigma = 0.1\n', "").replace('"exact-score"', '"cd"')


@pytest.mark.parametrize("lr", [50.0, 200.0])
def test_a_sampler_failing_on_a_nan_probability_is_a_divergence(cli, write_recipe, tmp_path, lr):
    overrides = ["-o", "optim.model.kind=sgd", "-o", f"optim.model.lr={lr}", "-o", "run.steps=100"]
    line = one_line(cli(["run", write_recipe(CD), "--out", tmp_path / "runs", *overrides]), code=3)
    assert "the step failed" in line and "p_in" in line and "run stopped" in line, line


# ---- Guard, on a state of its own ---------------------------------------------------------------


def guarded_state(step: int = 12, last_saved=None, world: int = 1, evaluated_step=None):
    """What the guard reads of a RunState: one role over a Linear network (which has a buffer too)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    net.register_buffer("running", torch.zeros(3))
    role = SimpleNamespace(params=[net.weight, net.bias])
    return SimpleNamespace(
        step=step,
        last_saved=last_saved,
        evaluated_step=evaluated_step,
        world=world,
        roles={"model": role},
        param_names={"model": ["model.weight", "model.bias"]},
        parts=SimpleNamespace(networks=lambda: {"model": net}),
        net=net,
    )


@pytest.mark.parametrize(
    "last_saved, kept",
    [
        (None, "no checkpoint was written before it"),
        ((12, Path("r/checkpoints/last.pt")), "the checkpoint r/checkpoints/last.pt holds this step's parameters"),
        ((10, Path("r/checkpoints/last.pt")), "last good checkpoint: r/checkpoints/last.pt (step 10; never evaluated)"),
    ],
)
def test_a_divergence_names_the_checkpoint_that_holds_the_last_good_parameters(last_saved, kept):
    """...and says whether that checkpoint was evaluated: a finite parameter may still be a model
    that has degenerated, which only an evaluation shows."""
    error = Guard(guarded_state(step=12, last_saved=last_saved)).diverged("training loss is nan")
    assert isinstance(error, TrainingDiverged) and error.exit_code == 3
    assert str(error) == f"step 12: training loss is nan; run stopped, {kept}"
    assert str(Guard(guarded_state(step=12)).diverged("x", step=13)).startswith("step 13: x;")
    saved = (10, Path("r/checkpoints/last.pt"))
    evaluated = str(Guard(guarded_state(last_saved=saved, evaluated_step=10)).diverged("x"))
    assert evaluated.endswith("(step 10; its evaluation was finite)")
    earlier = str(Guard(guarded_state(last_saved=saved, evaluated_step=5)).diverged("x"))
    assert earlier.endswith("(step 10; not evaluated: the last evaluation, finite, was at step 5)")


def test_the_first_non_finite_parameter_is_named_with_its_role_then_a_buffer():
    state = guarded_state()
    guard = Guard(state)
    assert guard.nonfinite_parameter() is None
    with torch.no_grad():
        state.net.running[1] = float("inf")
    assert guard.nonfinite_parameter() == "buffer model.running"
    with torch.no_grad():
        state.net.bias.fill_(float("nan"))
    assert guard.nonfinite_parameter() == "parameter model.bias (role 'model')"


def test_check_stops_on_a_non_finite_loss_since_the_last_check_or_a_non_finite_parameter():
    state = guarded_state(step=20, last_saved=(10, Path("last.pt")))
    guard, sums = Guard(state), StepSums()
    sums.add({"loss": torch.tensor(1.0)})
    guard.check(sums, since=10)  # all well
    sums.add({"loss": torch.tensor(float("nan"))})
    with pytest.raises(TrainingDiverged, match=r"^step 20: training loss became non-finite after step 10; run stopped"):
        guard.check(sums, since=10)
    sums.take()
    with torch.no_grad():
        state.net.weight[0, 1] = float("nan")
    with pytest.raises(
        TrainingDiverged, match=r"parameter model.weight \(role 'model'\) is not finite.*\(step 10; never evaluated\)"
    ):
        guard.check(sums, since=10)


def test_a_number_loss_is_checked_at_once_on_one_process_only():
    guard = Guard(guarded_state(step=5))
    guard.check_number(1.5)
    guard.check_number(torch.tensor(float("nan")))  # a tensor waits for the next check (no synchronisation)
    with pytest.raises(TrainingDiverged, match=r"^step 5: training loss is inf;"):
        guard.check_number(float("inf"))
    Guard(guarded_state(world=2)).check_number(float("nan"))  # several ranks agree at the next check


def test_an_evaluation_is_checked_naming_its_first_non_finite_value():
    guard = Guard(guarded_state(step=30))
    guard.check_evaluation({"eval/a/x": 1.0})
    with pytest.raises(TrainingDiverged, match=r"evaluation gave eval/a/y = nan: the model has degenerated"):
        guard.check_evaluation({"eval/a/x": 1.0, "eval/a/y": float("nan"), "eval/a/z": float("inf")})


def test_a_failed_step_is_a_divergence_only_when_something_is_not_finite():
    state = guarded_state(step=7)
    guard = Guard(state)
    assert guard.step_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # a bug: re-raised
    sampled = guard.step_failed(RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"))
    assert str(sampled).startswith("step 8: the step failed: a value became non-finite (RuntimeError: probability")
    with torch.no_grad():
        state.net.weight.fill_(float("nan"))
    failed = guard.step_failed(ValueError("Expected parameter loc to satisfy the constraint Real()"))
    assert str(failed).startswith("step 8: the step failed: parameter model.weight (role 'model') is not finite")
