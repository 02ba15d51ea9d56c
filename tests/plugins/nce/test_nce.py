"""NCE and VNCE: the loss and its gradient against closed forms, VNCE = NCE at the exact
posterior, the noise, and consistency on a Gaussian."""

from __future__ import annotations

import math

import pytest
import torch
from eblvm_grbm.model import GRBM
from eblvm_nce.estimators import NCEConfig, VNCEConfig, build_nce, build_vnce, make_noise, nce_loss
from torch import Tensor, nn

from eblvm_core.contracts import DataSplits, EnergyModel, Parts
from eblvm_core.errors import ConfigError


class GaussianModel(EnergyModel):
    """Fully visible N(μ, s²I) as an energy model: F(v) = ‖v − μ‖²/(2s²), log Z = d log(s√(2π))."""

    def __init__(self, d: int):
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(d, dtype=torch.float64))
        self.log_s = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def free_energy(self, v: Tensor) -> Tensor:
        return ((v - self.mu) ** 2).sum(-1) / (2 * self.log_s.exp() ** 2)

    def log_z(self) -> Tensor:
        return self.mu.shape[0] * (self.log_s + 0.5 * math.log(2 * math.pi))


def gaussian_parts(d: int = 2, n: int = 400, seed: int = 0, lr: float = 1e-2) -> Parts:
    g = torch.Generator().manual_seed(seed)
    data = DataSplits(
        train=torch.randn(n, d, generator=g, dtype=torch.float64), test=torch.randn(10, d, dtype=torch.float64)
    )
    return Parts(
        dtype=torch.float64,
        data=data,
        model=GaussianModel(d),
        optimizer_factories={"model": lambda params: torch.optim.Adam(params, lr=lr)},
    )


def loss_on(estimator, x: Tensor, y: Tensor, nu: float) -> Tensor:
    """The estimator's NCE loss on given data x and noise draws y."""
    return nce_loss(
        estimator.data_term(x),
        estimator.noise.log_prob(x),
        estimator.log_unnormalised(y, True) - estimator.log_z,
        estimator.noise.log_prob(y),
        nu,
    )


def test_nce_loss_is_the_logistic_loss_written_with_density_ratios():
    """−log σ(G) = log(1 + ν p_n/p_m) on data and −log σ(−G) = log(1 + p_m/(ν p_n)) on noise."""
    g = torch.Generator().manual_seed(1)
    lm_x, ln_x, lm_y, ln_y = (torch.randn(n, generator=g, dtype=torch.float64) for n in (7, 7, 21, 21))
    nu = 3.0
    expected = torch.log1p(nu * (ln_x - lm_x).exp()).mean() + nu * torch.log1p((lm_y - ln_y).exp() / nu).mean()
    torch.testing.assert_close(nce_loss(lm_x, ln_x, lm_y, ln_y, nu), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("nu", [1.0, 4.0])
def test_nce_at_model_equal_to_noise_has_closed_form_loss_and_gradient(nu):
    """Model = noise = N(0, I) and c = log Z: G ≡ −log ν, so L = log(1+ν) + ν log((1+ν)/ν),
    ∂L/∂c = 0 and ∂L/∂μ = ν/(1+ν) (mean_y y − mean_x x) exactly, for any draws."""
    parts = gaussian_parts()
    estimator = build_nce(NCEConfig(nu=nu, noise="fixed", init_log_z=math.log(2 * math.pi)), parts)
    x = parts.data.train[:50]
    y = torch.randn(int(50 * nu), 2, dtype=torch.float64)
    loss = loss_on(estimator, x, y, nu)
    assert float(loss.detach()) == pytest.approx(math.log1p(nu) + nu * math.log((1 + nu) / nu), abs=1e-12)
    d_mu, d_c = torch.autograd.grad(loss, [parts.model.mu, estimator.log_z])
    assert float(d_c) == pytest.approx(0.0, abs=1e-12)
    torch.testing.assert_close(d_mu, nu / (1 + nu) * (y.mean(0) - x.mean(0)), rtol=0, atol=1e-12)


def test_nce_gradient_matches_the_analytic_logistic_gradient():
    """∂L/∂θ = −mean_x (1 − σ(G)) ∂G + ν mean_y σ(G) ∂G, with ∂G/∂μ = −∂F/∂μ and ∂G/∂c = −1."""
    parts = gaussian_parts()
    model = parts.model
    with torch.no_grad():
        model.mu.copy_(torch.tensor([0.4, -0.3]))
        model.log_s.fill_(0.2)
    estimator = build_nce(NCEConfig(nu=2.0, noise="fitted", init_log_z=1.3), parts)
    x, y = parts.data.train[:40], estimator.noise.sample(80)
    loss = loss_on(estimator, x, y, 2.0)
    d_mu, d_c = torch.autograd.grad(loss, [model.mu, estimator.log_z])
    with torch.no_grad():
        s2 = model.log_s.exp() ** 2

        def G(u: Tensor) -> Tensor:
            return -model.free_energy(u) - estimator.log_z - estimator.noise.log_prob(u) - math.log(2.0)

        dG_dmu = lambda u: (u - model.mu) / s2  # noqa: E731
        wx, wy = 1 - torch.sigmoid(G(x)), torch.sigmoid(G(y))
        expected_mu = -(wx[:, None] * dG_dmu(x)).mean(0) + 2.0 * (wy[:, None] * dG_dmu(y)).mean(0)
        expected_c = wx.mean() - 2.0 * wy.mean()
    torch.testing.assert_close(d_mu, expected_mu, rtol=0, atol=1e-12)
    assert float(d_c) == pytest.approx(float(expected_c), abs=1e-12)


def test_fitted_noise_has_the_data_moments_and_fixed_noise_its_settings():
    parts = gaussian_parts(n=1000)
    train = parts.data.train
    fitted = make_noise(NCEConfig(noise_cov="full"), parts.data)
    torch.testing.assert_close(fitted.dist.mean, train.mean(0))
    torch.testing.assert_close(fitted.dist.covariance_matrix, torch.cov(train.T), rtol=1e-4, atol=1e-5)
    diag = make_noise(NCEConfig(noise_cov="diagonal", noise_scale=2.0), parts.data)
    torch.testing.assert_close(diag.dist.covariance_matrix, torch.diag(4 * train.var(0)))
    fixed = make_noise(NCEConfig(noise="fixed", noise_mean=1.0, noise_std=3.0), parts.data)
    torch.testing.assert_close(
        fixed.log_prob(torch.ones(1, 2, dtype=torch.float64)),
        torch.tensor([-2 * math.log(3.0 * math.sqrt(2 * math.pi))], dtype=torch.float64),
    )


def test_initial_log_normaliser_is_estimated_from_the_noise():
    parts = gaussian_parts()
    with torch.no_grad():
        parts.model.log_s.fill_(-0.5)
    estimator = build_nce(NCEConfig(init_samples=20000), parts)
    assert float(estimator.log_z.detach()) == pytest.approx(float(parts.model.log_z().detach()), abs=0.05)


def test_nce_recovers_a_gaussian_and_its_normaliser():
    """Consistency: on N((1, −1), 0.5²I) data the model and c = log Z are learned."""
    torch.manual_seed(2)
    parts = gaussian_parts(n=4000, lr=0.03)
    with torch.no_grad():
        parts.data.train.mul_(0.5).add_(torch.tensor([1.0, -1.0], dtype=torch.float64))
    estimator = build_nce(NCEConfig(nu=2.0, init_log_z=0.0), parts)
    for i in range(400):
        metrics = estimator.step(parts.data.train[(i * 200) % 4000 :][:200])
    model = parts.model
    assert torch.allclose(model.mu.detach(), torch.tensor([1.0, -1.0], dtype=torch.float64), atol=0.1)
    assert float(model.log_s.detach().exp()) == pytest.approx(0.5, abs=0.05)
    assert metrics["log_z"] == pytest.approx(float(model.log_z().detach()), abs=0.1)


def test_nce_state_holds_the_log_normaliser():
    parts = gaussian_parts()
    a = build_nce(NCEConfig(init_log_z=0.7), parts)
    b = build_nce(NCEConfig(init_log_z=-2.0), parts)
    b.load_state_dict(a.state_dict())
    assert float(b.log_z.detach()) == 0.7


# ---- VNCE ------------------------------------------------------------------------------------


def grbm_parts(seed: int = 0) -> Parts:
    from eblvm_divergences import KLConfig, build_kl
    from eblvm_posteriors import BernoulliConfig, build_bernoulli

    torch.manual_seed(seed)
    model = GRBM(2, 3, init_sigma=0.7, init_weight_std=0.8).double()
    with torch.no_grad():
        model.b.normal_(0.0, 0.5)
        model.c.normal_(0.0, 0.5)
    data = DataSplits(train=torch.rand(300, 2, dtype=torch.float64), test=torch.rand(10, 2, dtype=torch.float64))
    parts = Parts(dtype=torch.float64, data=data, model=model)
    parts.posterior = build_bernoulli(BernoulliConfig(), parts).double()
    parts.divergence = build_kl(KLConfig(), parts)
    return parts


def set_exact_posterior(model: GRBM, posterior: nn.Module) -> None:
    """Linear logits c + Wᵀv/σ: q(h|v) = p(h|v)."""
    (linear,) = posterior.net
    with torch.no_grad():
        linear.weight.copy_(model.coupling_weight().T)
        linear.bias.copy_(model.c)


def test_vnce_loss_equals_nce_loss_at_the_exact_posterior():
    """p̃(v,h)/p(h|v) = exp(−F(v)) for every h, so both VNCE bounds are exact there."""
    parts = grbm_parts()
    set_exact_posterior(parts.model, parts.posterior)
    nce = build_nce(NCEConfig(nu=2.0, init_log_z=1.0), parts)
    vnce = build_vnce(VNCEConfig(nu=2.0, init_log_z=1.0, n_importance=3, n_data_samples=4), parts)
    x, y = parts.data.train[:50], nce.noise.sample(100)
    torch.testing.assert_close(loss_on(vnce, x, y, 2.0), loss_on(nce, x, y, 2.0), rtol=0, atol=1e-12)


def test_vnce_data_term_is_a_lower_bound_away_from_the_exact_posterior():
    """With a wrong q the Jensen bound on E log σ(G(x)) is strictly lower (higher loss)."""
    parts = grbm_parts(seed=1)
    nce = build_nce(NCEConfig(init_log_z=1.0), parts)
    vnce = build_vnce(VNCEConfig(init_log_z=1.0, n_data_samples=2000), parts)  # q: the untrained linear net
    x = parts.data.train[:30]
    noise_x = nce.noise.log_prob(x)
    exact = torch.nn.functional.logsigmoid(nce.data_term(x) - noise_x)
    with torch.no_grad():
        bound = torch.nn.functional.logsigmoid(vnce.data_term(x) - noise_x).mean(0)
    assert (bound < exact.detach()).all()


def test_vnce_step_trains_the_posterior_and_the_model():
    parts = grbm_parts(seed=2)
    estimator = build_vnce(VNCEConfig(inner_steps=3), parts)
    q_before = [p.detach().clone() for p in parts.posterior.parameters()]
    w_before = parts.model.W.detach().clone()
    metrics = estimator.step(parts.data.train[:100])
    assert set(metrics) == {"loss", "log_z", "lower_level"}
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert not torch.equal(parts.model.W, w_before)
    assert all(not torch.equal(a, b) for a, b in zip(parts.posterior.parameters(), q_before))
    assert set(parts.roles) == {"model", "posterior"}


def test_refusals_name_the_estimator_section():
    parts = grbm_parts()
    for missing in ("posterior", "divergence"):
        broken = Parts(
            dtype=parts.dtype,
            data=parts.data,
            model=parts.model,
            posterior=parts.posterior,
            divergence=parts.divergence,
        )
        setattr(broken, missing, None)
        with pytest.raises(ConfigError, match=f"needs a \\[{missing}\\]"):
            build_vnce(VNCEConfig(), broken)
    with pytest.raises(ConfigError, match="no latent"):
        build_vnce(VNCEConfig(), gaussian_parts())

    class NoFree(EnergyModel):
        pass

    with pytest.raises(ConfigError, match="free energy"):
        build_nce(NCEConfig(), Parts(data=parts.data, model=NoFree()))


def test_at_the_exact_posterior_the_vnce_gradient_is_the_nce_gradient():
    """With q = p(h|v) every log-weight is −F, so VNCE's θ- and c-gradients average (over h ~ q)
    to NCE's on the same data and noise draws: within Monte-Carlo error, and not at a wrong q."""
    parts = grbm_parts()
    set_exact_posterior(parts.model, parts.posterior)
    nce = build_nce(NCEConfig(nu=2.0, init_log_z=1.0), parts)
    vnce = build_vnce(VNCEConfig(nu=2.0, init_log_z=1.0, n_importance=2000, n_data_samples=2000), parts)
    params = [*parts.model.parameters()]
    torch.manual_seed(4)
    x, y = parts.data.train[:40], nce.noise.sample(80)

    def gradient(estimator) -> Tensor:
        grads = torch.autograd.grad(loss_on(estimator, x, y, 2.0), [*params, estimator.log_z])
        return torch.cat([g.flatten() for g in grads])

    exact, variational = gradient(nce), gradient(vnce)
    assert float((variational - exact).norm() / exact.norm()) < 0.05
    with torch.no_grad():
        parts.posterior.net[0].bias.add_(1.5)  # q away from p(h|v): the bound's gradient moves off
    assert float((gradient(vnce) - exact).norm() / exact.norm()) > 0.2


def exact_kl(model: GRBM, posterior: nn.Module, v: Tensor) -> float:
    """Mean over v of KL(q(h|v) ‖ p(h|v)) for factorised Bernoulli q and the GRBM's exact posterior."""
    with torch.no_grad():
        q, p = posterior.mean(v), torch.sigmoid(model.hidden_logits(v))
        return float((q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()).sum(-1).mean())


def test_vnce_steps_bring_the_posterior_to_the_exact_one():
    """The posterior role descends the lower level: from a wrong q, VNCE's steps shrink the exact
    KL(q ‖ p(h|v)) (in closed form) severalfold while the model barely moves."""
    parts = grbm_parts(seed=2)
    parts.optimizer_factories = {
        "model": lambda p: torch.optim.SGD(p, lr=1e-6),
        "posterior": lambda p: torch.optim.Adam(p, lr=0.05),
    }
    estimator = build_vnce(VNCEConfig(inner_steps=5), parts)
    with torch.no_grad():
        parts.posterior.net[0].bias.add_(1.0)
    v = parts.data.train
    before = exact_kl(parts.model, parts.posterior, v)
    torch.manual_seed(5)
    for i in range(20):
        estimator.step(v[(i * 50) % 300 :][:50])
    after = exact_kl(parts.model, parts.posterior, v)
    assert before > 0.1 and after < before / 4, (before, after)
