"""Posteriors: log-probabilities, binary-concrete limits, reparameterisation gradients, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from eblvm_grbm.model import GRBM
from eblvm_posteriors import (
    BernoulliConfig,
    BernoulliPosterior,
    GaussianConfig,
    GaussianConvConfig,
    build_bernoulli,
    build_gaussian,
    build_gaussian_conv,
)
from torch.distributions import Bernoulli, Normal

from eblvm.testing import LinearGaussianEBLVM
from eblvm_core.contracts import DataSplits, EnergyModel, Parts
from eblvm_core.errors import ConfigError


def parts_for(model: EnergyModel, shape: tuple[int, ...] = (3,)) -> Parts:
    data = torch.rand(20, *shape, dtype=torch.float64)
    return Parts(dtype=torch.float64, data=DataSplits(train=data, test=data), model=model)


@pytest.fixture
def gaussian_parts() -> Parts:
    return parts_for(LinearGaussianEBLVM(3, 2))


def test_bernoulli_log_prob_matches_torch_distributions():
    torch.manual_seed(0)
    post = build_bernoulli(BernoulliConfig(hidden=[5]), parts_for(GRBM(3, 4).double())).double()
    v = torch.randn(6, 3, dtype=torch.float64)
    h = torch.randint(0, 2, (7, 6, 4)).double()
    expected = Bernoulli(logits=post.logits(v)).log_prob(h).sum(-1)
    torch.testing.assert_close(post.log_prob(h, v), expected)
    assert post.log_prob(h[0], v).shape == (6,)
    torch.testing.assert_close(post.mean(v), torch.sigmoid(post.logits(v)))
    # relaxed values: the same Bernoulli formula, linear in h
    soft = torch.rand(6, 4, dtype=torch.float64)
    torch.testing.assert_close(
        post.log_prob(soft, v), (soft * post.logits(v) - torch.nn.functional.softplus(post.logits(v))).sum(-1)
    )


@pytest.mark.parametrize("hidden", [[], [8, 8]])
def test_gaussian_log_prob_matches_torch_distributions(gaussian_parts, hidden):
    torch.manual_seed(0)
    post = build_gaussian(GaussianConfig(hidden=hidden), gaussian_parts).double()
    v = torch.randn(6, 3, dtype=torch.float64)
    h = post.rsample(v, 5)
    assert h.shape == (5, 6, 2)
    mu, log_std = post.params(v)
    torch.testing.assert_close(post.log_prob(h, v), Normal(mu, log_std.exp()).log_prob(h).sum(-1))
    torch.testing.assert_close(post.mean(v), mu)


def test_gaussian_conv_shapes_from_the_data_or_the_config():
    torch.manual_seed(0)
    model = LinearGaussianEBLVM(64, 5)
    post = build_gaussian_conv(GaussianConvConfig(channels=4), parts_for(model, (1, 8, 8))).double()
    v = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    h = post.rsample(v, 2)
    assert h.shape == (2, 3, 5) and post.log_prob(h, v).shape == (2, 3) and post.mean(v).shape == (3, 5)
    flat = build_gaussian_conv(GaussianConvConfig(channels=4, image_shape=[1, 8, 8]), parts_for(model, (64,))).double()
    assert flat.rsample(v.reshape(3, 64), 1).shape == (1, 3, 5)
    with pytest.raises(ConfigError) as err:
        build_gaussian_conv(GaussianConvConfig(image_shape=[1, 7, 8]), parts_for(model, (64,)))
    assert (err.value.section, err.value.key) == ("posterior", "image_shape")
    with pytest.raises(ConfigError):
        build_gaussian_conv(GaussianConvConfig(), parts_for(model, (64,)))


def test_posterior_kind_must_match_the_latent():
    grbm_parts = parts_for(GRBM(3, 4).double())
    for build, config, parts in [
        (build_gaussian, GaussianConfig(), grbm_parts),
        (build_gaussian_conv, GaussianConvConfig(), grbm_parts),
        (build_bernoulli, BernoulliConfig(), parts_for(LinearGaussianEBLVM(3, 2))),
        (build_bernoulli, BernoulliConfig(), parts_for(EnergyModel())),
    ]:
        with pytest.raises(ConfigError) as err:
            build(config, parts)
        assert (err.value.section, err.value.key) == ("posterior", "kind")


def test_relaxed_samples_become_hard_bernoulli_draws_as_the_temperature_falls():
    torch.manual_seed(0)
    post = BernoulliPosterior(2, 3, temperature=1e-3).double()
    with torch.no_grad():
        post.net[0].weight.zero_()
        post.net[0].bias.copy_(torch.tensor([-1.5, 0.0, 2.0]))
    v = torch.zeros(1, 2, dtype=torch.float64)
    h = post.rsample(v, 40000)[:, 0].detach()
    near_binary = ((h - h.round()).abs() < 1e-2).double().mean()
    assert near_binary > 0.99
    p = torch.sigmoid(post.net[0].bias.detach())
    freq = h.round().mean(0)
    assert ((freq - p).abs() < 4 * (p * (1 - p) / 40000).sqrt()).all()


def test_relaxed_samples_concentrate_at_one_half_as_the_temperature_grows():
    torch.manual_seed(0)
    post = BernoulliPosterior(2, 3, temperature=1e4).double()
    h = post.rsample(torch.randn(50, 2, dtype=torch.float64), 100).detach()
    assert (h - 0.5).abs().max() < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.1, 1.0, 1e4])
def test_relaxed_samples_follow_the_binary_concrete_distribution(temperature):
    """h = sigmoid((l + logit u)/T) has the CDF P(h ≤ t) = sigmoid(T·logit t − l): at its
    p-quantiles the empirical CDF is within 1.95/√n of p (the DKW bound at 0.1%), for each logit l."""
    torch.manual_seed(0)
    post = BernoulliPosterior(2, 3, temperature=temperature).double()
    logits = torch.tensor([-1.5, 0.0, 2.0], dtype=torch.float64)
    with torch.no_grad():
        post.net[0].weight.zero_()
        post.net[0].bias.copy_(logits)
    n = 20000
    h = post.rsample(torch.zeros(1, 2, dtype=torch.float64), n)[:, 0].detach()  # (n, 3)
    p = torch.linspace(0.001, 0.999, 999, dtype=torch.float64)
    for j, logit in enumerate(logits):
        t = torch.sigmoid((torch.logit(p) + logit) / temperature)  # the p-quantiles, where the CDF is p
        inside = (t > 1e-9) & (t < 1 - 1e-9)  # at low T the tails are rounded to 0 or 1
        empirical = (h[:, j].unsqueeze(1) <= t[inside]).double().mean(0)
        distance = (empirical - p[inside]).abs().max()
        assert distance < 1.95 / math.sqrt(n), (j, float(distance))


def _fd_check(post, v: torch.Tensor, weights: torch.Tensor) -> None:
    """Pathwise gradient of Σ w·h(φ) with fixed noise against central finite differences."""

    def f() -> torch.Tensor:
        torch.manual_seed(123)
        return (post.rsample(v, 3) * weights).sum()

    params = [p for p in post.parameters()]
    analytic = torch.autograd.grad(f(), params)
    eps = 1e-6
    for p, g in zip(params, analytic):
        for idx in [(0,) * p.dim(), tuple(s - 1 for s in p.shape)]:
            with torch.no_grad():
                p[idx] += eps
                up = f()
                p[idx] -= 2 * eps
                down = f()
                p[idx] += eps
            torch.testing.assert_close(g[idx], (up - down) / (2 * eps), rtol=1e-5, atol=1e-7)


def test_bernoulli_reparameterisation_gradient_matches_finite_differences():
    torch.manual_seed(0)
    post = BernoulliPosterior(3, 4, hidden=[5], temperature=0.5).double()
    _fd_check(post, torch.randn(6, 3, dtype=torch.float64), torch.randn(3, 6, 4, dtype=torch.float64))


def test_gaussian_reparameterisation_gradient_matches_finite_differences(gaussian_parts):
    torch.manual_seed(0)
    post = build_gaussian(GaussianConfig(hidden=[5]), gaussian_parts).double()
    _fd_check(post, torch.randn(6, 3, dtype=torch.float64), torch.randn(3, 6, 2, dtype=torch.float64))


def test_gaussian_reparameterisation_gradient_matches_the_closed_form(gaussian_parts):
    """d/dμ E[h²] = 2μ and d/d log σ E[h²] = 2σ², through the head's biases."""
    torch.manual_seed(0)
    post = build_gaussian(GaussianConfig(hidden=[]), gaussian_parts).double()
    with torch.no_grad():
        post.head.weight.zero_()
        post.head.bias.copy_(torch.tensor([0.7, -0.4, -0.3, 0.2]))
    n = 200000
    h = post.rsample(torch.zeros(1, 3, dtype=torch.float64), n)
    (grad,) = torch.autograd.grad((h**2).sum() / n, post.head.bias)
    mu, sigma = torch.tensor([0.7, -0.4]), torch.tensor([-0.3, 0.2]).exp()
    expected = torch.cat([2 * mu, 2 * sigma**2]).double()
    torch.testing.assert_close(grad, expected, rtol=0.0, atol=0.02)


def test_bernoulli_reparameterisation_gradient_matches_the_closed_form():
    """At T = 1 and logit 0 the pathwise gradient of E[h] is E[σ'(L)] = E[U(1 − U)] = 1/6."""
    torch.manual_seed(0)
    post = BernoulliPosterior(1, 1, temperature=1.0).double()
    with torch.no_grad():
        post.net[0].weight.zero_()
        post.net[0].bias.zero_()
    n = 400000
    h = post.rsample(torch.zeros(1, 1, dtype=torch.float64), n)
    (grad,) = torch.autograd.grad(h.sum() / n, post.net[0].bias)
    torch.testing.assert_close(grad, torch.tensor([1 / 6], dtype=torch.float64), rtol=0.0, atol=3e-3)


def test_rsample_and_log_prob_agrees_with_rsample_then_log_prob(gaussian_parts):
    from eblvm_core.contracts import Posterior

    class Plain(Posterior):  # uses the contract's default
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def rsample(self, v, n=1):
            return self.inner.rsample(v, n)

        def log_prob(self, h, v):
            return self.inner.log_prob(h, v)

    v = torch.randn(6, 3, dtype=torch.float64)
    for post in [
        BernoulliPosterior(3, 4, hidden=[5], temperature=0.3).double(),
        build_gaussian(GaussianConfig(hidden=[5]), gaussian_parts).double(),
    ]:
        for candidate in [post, Plain(post)]:
            torch.manual_seed(3)
            h, log_q = candidate.rsample_and_log_prob(v, 4)
            torch.manual_seed(3)
            expected = post.rsample(v, 4)
            assert h.shape == expected.shape and log_q.shape == (4, 6)
            torch.testing.assert_close(h, expected)
            torch.testing.assert_close(log_q, post.log_prob(expected, v))
