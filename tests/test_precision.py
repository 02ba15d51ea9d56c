"""Reduced precision: a small conv energy's DSM loss and gradient under bf16 autocast agree with
fp32 within 2% (measured: about 0.2% and 0.5%), which is why the exact-score estimator allows bf16
with value-only objectives; objectives that differentiate the score again refuse it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eblvm_core.contracts import EnergyModel, exact_score
from eblvm_core.errors import ConfigError
from eblvm_core.testing import make

TOLERANCE = 0.02


class ConvEnergy(EnergyModel):
    """A fully visible conv energy on 1×8×8 images; its free energy is the energy itself."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 1),
        )
        with torch.no_grad():
            self.net[-1].weight.mul_(300)  # scores as large as DSM's target ε/σ, so the loss depends on the model

    def energy(self, v, h=None):
        return self.net(v).squeeze(-1)

    def free_energy(self, v):
        return self.energy(v)


def loss_and_gradient(model, objective, x, context, bf16: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = objective.loss(lambda y: exact_score(model, y), x, context).mean()
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), torch.cat(
        [(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)]
    )


def relative(a, b) -> float:
    return float(((a - b).norm() / b.norm()).detach())


def test_bf16_dsm_loss_and_gradient_agree_with_fp32():
    torch.manual_seed(0)
    model, objective = ConvEnergy(), make("objectives", "dsm", sigma=0.1)
    v = torch.rand(64, 1, 8, 8)
    x, context = objective.points(v)
    loss32, grad32 = loss_and_gradient(model, objective, x, context, bf16=False)
    loss16, grad16 = loss_and_gradient(model, objective, x, context, bf16=True)
    target = 0.5 * ((context / 0.1) ** 2).flatten(1).sum(1).mean()  # the part of the loss the model does not touch
    assert abs(float(loss16 - loss32)) < TOLERANCE * abs(float(loss32 - target))
    assert relative(grad16, grad32) < TOLERANCE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        score16 = exact_score(model, x)
    assert relative(score16, exact_score(model, x)) < TOLERANCE
    # the comparison can fail: a bf16 cast of the input alone moves the score by more than the tolerance allows
    assert (
        relative(exact_score(model, x.bfloat16().float() + 0.05 * torch.randn_like(x)), exact_score(model, x))
        > TOLERANCE
    )


RECIPE = """
[run]
precision = "bf16"

[data]
kind = "checkerboard"
n_train = 200
n_test = 50

[model]
kind = "grbm"

[objective]
kind = "{objective}"

[estimator]
kind = "exact-score"

[optim.model]
kind = "adam"
"""


def test_exact_score_allows_bf16_with_dsm_and_refuses_it_with_ssm(cli, write_recipe):
    assert cli(["validate", write_recipe(RECIPE.format(objective="dsm"))]).exit_code == 0
    result = cli(["validate", write_recipe(RECIPE.format(objective="ssm"))])
    assert result.exit_code == 2
    assert "[run] precision: estimator 'exact-score' supports fp32, not bf16" in result.output


def test_estimators_refuse_precisions_they_do_not_declare(write_recipe):
    from eblvm_core.build import dry_run

    text = RECIPE.format(objective="dsm").replace('"bf16"', '"fp16"')
    with pytest.raises(ConfigError, match="supports fp32, bf16, not fp16"):
        dry_run(write_recipe(text))
