"""SM, SSM and DSM on a Gaussian model with known score s(x) = −A(x − μ), and the exact-score estimator."""

from __future__ import annotations

import math

import pytest
import torch
from eblvm_grbm.model import GRBM
from eblvm_score import DSM, SM, SSM, ExactScore
from eblvm_score.estimators import build_exact_score
from torch import Tensor, nn

from eblvm_core.contracts import DataSplits, EnergyModel, Parts
from eblvm_core.errors import ConfigError
from eblvm_core.registry import NoConfig

D = 4


class Gaussian(nn.Module):
    """Score field of N(μ, A⁻¹) with A = MMᵀ + I symmetric positive definite."""

    def __init__(self, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.mu = nn.Parameter(torch.randn(D, generator=gen, dtype=torch.float64))
        self.M = nn.Parameter(0.5 * torch.randn(D, D, generator=gen, dtype=torch.float64))

    @property
    def A(self) -> Tensor:
        return self.M @ self.M.T + torch.eye(D, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return -(x - self.mu) @ self.A  # A symmetric: rows are (A(x − μ))ᵀ


def points(n: int = 64, seed: int = 1) -> Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def half_sq(model: Gaussian, x: Tensor) -> Tensor:
    return 0.5 * (model(x) ** 2).sum(-1)


def test_sm_equals_closed_form():
    model, x = Gaussian(), points()
    expected = half_sq(model, x) - torch.trace(model.A)
    torch.testing.assert_close(SM().loss(model, x, None), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("projection", ["rademacher", "gaussian"])
def test_ssm_averages_to_sm(projection):
    """uᵀ∇(uᵀs) = −uᵀAu; its mean is −tr A; over K slices × B samples the error is ~ sd/√(KB)."""
    model, x = Gaussian(), points(n=200)
    A = model.A.detach()
    if projection == "gaussian":
        var = 2 * torch.trace(A @ A)  # Var uᵀAu for u ~ N(0, I)
    else:
        var = 2 * ((A**2).sum() - (torch.diagonal(A) ** 2).sum())  # 4 Σ_{i<j} A_ij² for ±1 entries
    torch.manual_seed(0)
    k = 50
    jac_term = SSM(n_slices=k, projection=projection).loss(model, x, None) - half_sq(model, x)
    tolerance = 5 * math.sqrt(float(var) / (k * len(x)))
    assert float(jac_term.detach().mean()) == pytest.approx(-float(torch.trace(A)), abs=tolerance)


@pytest.mark.parametrize("projection, variance", [("rademacher", "rademacher"), ("gaussian", "gaussian")])
def test_ssm_single_slice_variance_matches_theory(projection, variance):
    """With one slice per sample, the spread of −uᵀAu across samples has the known variance."""
    model, x = Gaussian(), points(n=4000)
    A = model.A.detach()
    if variance == "gaussian":
        var = 2 * torch.trace(A @ A)
    else:
        var = 2 * ((A**2).sum() - (torch.diagonal(A) ** 2).sum())
    torch.manual_seed(1)
    jac_term = SSM(n_slices=1, projection=projection).loss(model, x, None) - half_sq(model, x)
    # the sample variance of n draws is within a few √(2/n)-relative errors (kurtosis aside)
    assert float(jac_term.detach().var()) == pytest.approx(float(var), rel=0.15)


def test_rademacher_slices_are_exact_for_a_diagonal_hessian():
    """For diagonal A, uᵀAu = tr A for every ±1 vector u: SSM equals SM sample by sample."""
    x = points()
    scale = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    score = lambda y: -y * scale  # noqa: E731
    ssm = SSM(n_slices=3, projection="rademacher").loss(score, x, None)
    torch.testing.assert_close(ssm, SM().loss(score, x, None), rtol=0, atol=1e-12)


def test_ssm_slices_have_identity_second_moment():
    like = torch.zeros(20000, 3, dtype=torch.float64)
    for projection in ("rademacher", "gaussian"):
        u = SSM(n_slices=1, projection=projection).slices(like)[0]
        torch.testing.assert_close(u.T @ u / len(u), torch.eye(3, dtype=torch.float64), rtol=0, atol=0.05)
    assert set(SSM(projection="rademacher").slices(like).unique().tolist()) == {-1.0, 1.0}


def test_dsm_equals_closed_form_for_given_noise():
    model, v = Gaussian(), points()
    dsm = DSM(sigma=0.3)
    torch.manual_seed(2)
    x_noisy, eps = dsm.points(v)
    torch.testing.assert_close(x_noisy - v, 0.3 * eps, rtol=0, atol=1e-14)
    A, mu = model.A, model.mu
    target = -(x_noisy - v) / 0.3**2
    expected = 0.5 * ((-(x_noisy - mu) @ A - target) ** 2).sum(-1)
    torch.testing.assert_close(dsm.loss(model, x_noisy, eps), expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(dsm.loss_at(x_noisy, model(x_noisy), eps), expected, rtol=0, atol=1e-10)
    assert DSM.value_only and not SM.value_only and not SSM.value_only


def finite_difference(fn, param: nn.Parameter, h: float = 1e-6) -> Tensor:
    grad = torch.zeros_like(param)
    with torch.no_grad():
        for idx in range(param.numel()):
            flat = param.view(-1)
            old = float(flat[idx])
            flat[idx] = old + h
            up = float(fn())
            flat[idx] = old - h
            down = float(fn())
            flat[idx] = old
            grad.view(-1)[idx] = (up - down) / (2 * h)
    return grad


@pytest.mark.parametrize("name", ["sm", "ssm-rademacher", "ssm-gaussian", "dsm"])
def test_objective_gradients_match_finite_differences(name):
    model, v = Gaussian(), points(n=16)
    objective = {
        "sm": SM(),
        "ssm-rademacher": SSM(n_slices=2, projection="rademacher"),
        "ssm-gaussian": SSM(n_slices=2, projection="gaussian"),
        "dsm": DSM(sigma=0.2),
    }[name]

    def mean_loss() -> Tensor:
        torch.manual_seed(3)  # the same slices / noise at every evaluation
        x, context = objective.points(v)
        with torch.enable_grad():
            return objective.loss(model, x, context).mean()

    grads = torch.autograd.grad(mean_loss(), [model.mu, model.M])
    for param, grad in zip([model.mu, model.M], grads):
        torch.testing.assert_close(grad, finite_difference(mean_loss, param), rtol=1e-6, atol=1e-6)


# ---- the exact-score estimator -------------------------------------------------------------


def grbm_parts(objective) -> Parts:
    torch.manual_seed(0)
    data = DataSplits(train=torch.rand(256, 2, dtype=torch.float64), test=torch.rand(64, 2, dtype=torch.float64))
    model = GRBM(2, 3).double()
    return Parts(dtype=torch.float64, data=data, model=model, objective=objective)


@pytest.mark.parametrize("objective", [SM(), SSM(), DSM(sigma=0.1)], ids=["sm", "ssm", "dsm"])
def test_exact_score_estimator_steps_and_reports(objective):
    parts = grbm_parts(objective)
    estimator = build_exact_score(NoConfig(), parts)
    before = {k: p.detach().clone() for k, p in parts.model.named_parameters()}
    metrics = estimator.step(parts.data.train[:32])
    assert set(metrics) == {"loss"} and math.isfinite(float(metrics["loss"]))
    assert set(parts.roles) == {"model"} and parts.roles["model"] is estimator.model_role
    assert parts.roles["model"].take_mean_grad_norm() > 0  # one update, with a nonzero gradient
    assert all(not torch.equal(before[k], p) for k, p in parts.model.named_parameters())


def test_exact_score_estimator_lowers_the_sm_loss():
    parts = grbm_parts(SM())
    parts.optimizer_factories["model"] = lambda params: torch.optim.Adam(params, lr=1e-2)
    estimator = build_exact_score(NoConfig(), parts)
    losses = [estimator.step(parts.data.train[:64])["loss"] for _ in range(40)]
    assert sum(losses[-5:]) < sum(losses[:5])


def test_exact_score_estimator_skips_frozen_parameters():
    parts = grbm_parts(SM())
    parts.model = GRBM(2, 3, learn_sigma=False).double()
    estimator = build_exact_score(NoConfig(), parts)
    estimator.step(parts.data.train[:16])
    assert float(parts.model.log_sigma) == 0.0


class NoFreeEnergy(EnergyModel):
    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        return (v**2).sum(-1) + (h**2).sum(-1)


def test_exact_score_estimator_refusals():
    parts = grbm_parts(SM())
    parts.model = NoFreeEnergy()
    with pytest.raises(ConfigError, match="free energy") as info:
        build_exact_score(NoConfig(), parts)
    assert (info.value.section, info.value.key) == ("estimator", "kind")
    parts = grbm_parts(None)
    with pytest.raises(ConfigError, match=r"\[objective\]"):
        build_exact_score(NoConfig(), parts)
    assert isinstance(build_exact_score(NoConfig(), grbm_parts(DSM())), ExactScore)
