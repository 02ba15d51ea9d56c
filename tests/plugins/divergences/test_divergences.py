"""Lower-level divergences: minimal at the exact posterior, finite gradients, refusals."""

from __future__ import annotations

import tomllib

import pytest
import torch
from eblvm_divergences import KL, Fisher, PosteriorFisherConfig, build_posterior_fisher
from eblvm_grbm.model import GRBM
from eblvm_posteriors import BernoulliPosterior

from eblvm.testing import linear_gaussian_parts
from eblvm_core.build import build as build_parts
from eblvm_core.contracts import DataSplits, Parts
from eblvm_core.errors import ConfigError
from eblvm_core.recipe import validate


def perturbed(posterior: torch.nn.Module, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in posterior.parameters():
            p += scale * torch.randn(p.shape, generator=g, dtype=p.dtype)


def gaussian_kl(posterior, model, v) -> torch.Tensor:
    """Closed-form KL(q(h|v) ‖ p(h|v)) for diagonal Gaussians, per sample."""
    mu_q, log_sq = posterior.params(v)
    mu_p, log_sp = model.posterior_mean(v), -0.5 * model.log_d
    var_q, var_p = (2 * log_sq).exp(), (2 * log_sp).exp()
    return (log_sp - log_sq + (var_q + (mu_q - mu_p) ** 2) / (2 * var_p) - 0.5).sum(-1)


@pytest.mark.parametrize("divergence", [KL(), KL(n_samples=4), KL(n_samples=4, importance_weighted=True)])
def test_kl_at_the_exact_posterior_is_the_free_energy_for_every_sample(divergence):
    """log q(h|v) + E(v,h) = F(v) for every h when q = p(h|v): KL = 0, no variance."""
    model, posterior, parts = linear_gaussian_parts()
    v = parts.data.train[:30]
    values = divergence(model, posterior, v)
    assert values.shape == (30,)
    torch.testing.assert_close(values, model.free_energy(v), rtol=1e-10, atol=1e-10)


def test_kl_estimate_matches_the_closed_form_and_is_minimal_at_the_exact_posterior():
    torch.manual_seed(0)
    model, posterior, parts = linear_gaussian_parts()
    v = parts.data.train[:40]
    free = model.free_energy(v).detach()
    kl = KL(n_samples=4000)
    for seed in range(3):
        model.set_exact(posterior)
        perturbed(posterior, 0.2, seed)
        estimate = (kl(model, posterior, v) - free).detach()
        exact = gaussian_kl(posterior, model, v).detach()
        assert exact.mean() > 0.05
        torch.testing.assert_close(estimate.mean(), exact.mean(), rtol=0.05, atol=0.0)


def test_importance_weighting_tightens_the_bound():
    model, posterior, parts = linear_gaussian_parts()
    perturbed(posterior, 0.3, 0)
    v = parts.data.train[:40]
    torch.manual_seed(1)
    plain = KL(n_samples=8)(model, posterior, v)
    torch.manual_seed(1)
    weighted = KL(n_samples=8, importance_weighted=True)(model, posterior, v)
    assert (weighted <= plain + 1e-12).all()  # Jensen, sample by sample
    free = model.free_energy(v)
    assert weighted.mean() > free.mean() and weighted.mean() - free.mean() < plain.mean() - free.mean()


def test_fisher_is_zero_with_zero_gradient_at_the_exact_posterior_and_positive_elsewhere():
    model, posterior, parts = linear_gaussian_parts()
    v = parts.data.train[:30]
    for fisher in [Fisher(), Fisher(n_samples=3)]:
        values = fisher(model, posterior, v)
        assert values.shape == (30,) and values.abs().max() < 1e-20
        grads = torch.autograd.grad(values.mean(), list(posterior.parameters()))
        assert max(g.abs().max() for g in grads) < 1e-12
    for seed in range(3):
        model.set_exact(posterior)
        perturbed(posterior, 0.2, seed)
        assert (Fisher()(model, posterior, v) > 0).all()


@pytest.mark.parametrize("divergence", [KL(), KL(n_samples=3, importance_weighted=True), Fisher(n_samples=2)])
def test_gradients_are_finite_in_phi_and_theta_on_the_linear_gaussian_model(divergence):
    model, posterior, parts = linear_gaussian_parts()
    perturbed(posterior, 0.3, 0)
    value = divergence(model, posterior, parts.data.train[:20]).mean()
    params = list(posterior.parameters()) + list(model.parameters())
    grads = torch.autograd.grad(value, params, allow_unused=True)
    used = [g for g in grads if g is not None]
    assert all(torch.isfinite(g).all() for g in used)
    assert all(g is not None and g.abs().sum() > 0 for g in grads[: len(list(posterior.parameters()))])


@pytest.mark.parametrize("kl", [KL(), KL(n_samples=5), KL(n_samples=5, importance_weighted=True)])
def test_kl_on_a_grbm_with_a_relaxed_bernoulli_posterior(kl):
    torch.manual_seed(0)
    model, posterior = GRBM(2, 4), BernoulliPosterior(2, 4, temperature=0.1)
    v = torch.rand(50, 2)
    value = kl(model, posterior, v)
    assert value.shape == (50,)
    grads = torch.autograd.grad(value.mean(), list(posterior.parameters()) + [model.W, model.c, model.log_sigma])
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    # with q the exact posterior, log q(h|v) + E(v,h) is F(v) for every relaxed h too
    with torch.no_grad():
        posterior.net[0].weight.copy_(model.coupling_weight().T)
        posterior.net[0].bias.copy_(model.c)
    torch.testing.assert_close(kl(model, posterior, v), model.free_energy(v), rtol=1e-5, atol=1e-5)


FISHER_BERNOULLI = """
[data]
kind = "checkerboard"
n_train = 200
n_test = 100
[model]
kind = "grbm"
[posterior]
kind = "bernoulli"
[objective]
kind = "ssm"
[divergence]
kind = "fisher"
[estimator]
kind = "bism-unrolled"
"""


def test_fisher_with_a_bernoulli_latent_is_a_recipe_error():
    recipe = validate(tomllib.loads(FISHER_BERNOULLI), "fisher.toml")
    with pytest.raises(ConfigError) as err:
        build_parts(recipe, torch.device("cpu"))
    assert (err.value.section, err.value.key) == ("divergence", "kind")
    assert "fisher.toml" in str(err.value) and "continuous" in str(err.value)


# ---- the posterior-fisher evaluator ----------------------------------------------------------


def test_posterior_fisher_is_zero_at_the_exact_posterior_and_matches_its_closed_form():
    from eblvm.testing import linear_gaussian_parts as build

    model, posterior, parts = build(d=3, m=2)
    v = parts.data.test
    assert float(Fisher()(model, posterior, v).detach().abs().max()) < 1e-20
    delta = torch.tensor([0.3, -0.2], dtype=torch.float64)
    log_s = torch.tensor([0.4, -0.3], dtype=torch.float64)
    with torch.no_grad():
        posterior.head.bias[:2] += delta
        posterior.head.bias[2:] = log_s
    # ∇_h log q + ∇_h E = (h − μ)(D − 1/s²) + D(μ − μ*), so D_F = ½[Σ_j (D_j − 1/s_j²)² s_j² + ‖Dδ‖²]
    dd, s2 = model.log_d.exp().detach(), (2 * log_s).exp()
    closed = 0.5 * (((dd - 1 / s2) ** 2 * s2).sum() + ((dd * delta) ** 2).sum())
    torch.manual_seed(13)
    values = Fisher(n_samples=20_000)(model, posterior, v).detach()
    assert torch.allclose(values, closed.expand(len(v)), rtol=0.03)


def test_posterior_fisher_evaluator_and_refusals():
    from eblvm.testing import linear_gaussian_parts as build

    model, posterior, parts = build(d=3, m=2)
    scalars = build_posterior_fisher(PosteriorFisherConfig(), parts)(parts).scalars
    assert scalars["test_posterior_fisher"] == pytest.approx(0.0, abs=1e-20)
    with pytest.raises(ConfigError, match="needs a \\[posterior\\]"):
        build_posterior_fisher(PosteriorFisherConfig(), Parts(data=parts.data, model=model))
    grbm = Parts(
        data=DataSplits(train=torch.randn(4, 2), test=torch.randn(4, 2)), model=GRBM(2, 2), posterior=posterior
    )
    with pytest.raises(ConfigError, match="continuous"):
        build_posterior_fisher(PosteriorFisherConfig(), grbm)
