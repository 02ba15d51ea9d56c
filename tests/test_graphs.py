"""When a run's training step may be replayed from a CUDA graph, and the gradient-norm log that a
replayed step keeps. The replay itself needs a GPU (tests/test_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eblvm_core.build import build
from eblvm_core.checkpoint import seed_everything
from eblvm_core.graphs import graph_refusal
from eblvm_core.optim import apply_update, take_mean_grad_norm
from eblvm_core.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CUDA = torch.device("cuda")  # only named: graph_refusal decides without touching a device


def refusal(recipe: str, overrides: list[str] = (), device=CUDA, world=1, precision="fp32") -> str | None:
    seed_everything(0)
    built = build(load_recipe(RECIPES / recipe, list(overrides)), torch.device("cpu"))
    return graph_refusal(built.parts.estimator, built.schedules, device, world, precision)


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("grbm_bissm.toml", []),
        ("grbm_bidsm.toml", []),
        ("grbm_bidsm.toml", ['estimator.unroll="adam"']),
        ("grbm_ssm.toml", []),
        ("grbm_dsm.toml", []),
        ("grbm_ssm.toml", ['optim.model.kind="sgd"', "optim.model.momentum=0.9"]),
    ],
)
def test_the_score_matching_steps_of_the_checkerboard_recipes_may_be_captured(recipe, overrides):
    assert refusal(recipe, overrides) is None


@pytest.mark.parametrize(
    "recipe, overrides, where, expected",
    [
        ("grbm_bissm.toml", [], {"device": torch.device("cpu")}, "not a CUDA device"),
        ("grbm_bissm.toml", [], {"world": 2}, "several processes"),
        ("grbm_dsm.toml", [], {"precision": "bf16"}, "precision bf16"),
        ("grbm_bism_implicit.toml", [], {}, "BiSMImplicit) does not declare"),
        ("grbm_cd.toml", [], {}, "does not declare"),
        ("grbm_bissm.toml", ['optim.model.schedule.kind="cosine"'], {}, "role 'model' follows a schedule"),
    ],
)
def test_a_step_that_cannot_be_captured_is_refused_with_the_reason(recipe, overrides, where, expected):
    assert expected in (refusal(recipe, overrides, **where) or "")


def test_an_unfused_adam_is_refused():
    seed_everything(0)
    built = build(load_recipe(RECIPES / "grbm_bissm.toml"), torch.device("cpu"))
    estimator = built.parts.estimator
    assert graph_refusal(estimator, built.schedules, CUDA, 1, "fp32") is None
    estimator.optimizers["posterior"].param_groups[0]["fused"] = False
    assert "Adam of role 'posterior' is not the fused one" in graph_refusal(estimator, built.schedules, CUDA, 1, "fp32")


def test_the_logged_gradient_norm_is_the_mean_since_the_last_log_kept_in_one_tensor():
    p = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([p], lr=0.1)
    apply_update(optimizer, (torch.tensor([3.0, 4.0, 0.0]) * p).sum())  # gradient norm 5
    apply_update(optimizer, (torch.tensor([0.0, 0.0, 1.0]) * p).sum())  # gradient norm 1
    stats = optimizer.grad_norm_stats
    assert take_mean_grad_norm(optimizer) == pytest.approx(3.0)
    assert take_mean_grad_norm(optimizer) is None
    apply_update(optimizer, (torch.tensor([0.0, 2.0, 0.0]) * p).sum())
    assert take_mean_grad_norm(optimizer) == pytest.approx(2.0)
    assert optimizer.grad_norm_stats is stats  # reset in place: a captured step keeps adding to it
