"""Gibbs sampling, CD/PCD and the Fisher evaluators of the GRBM plugin, checked against
enumeration, closed forms and independent computations."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from eblvm_grbm.contrastive import CDConfig, PCDConfig, build_cd, build_pcd, contrastive_loss
from eblvm_grbm.fisher import ScoreLossConfig, build_score_loss, score_matching_loss
from eblvm_grbm.gibbs import GibbsConfig, GibbsSampler, gibbs_chain
from eblvm_grbm.model import GRBM, all_binary
from torch.func import grad, vmap

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import DataSplits, Parts
from eblvm_core.errors import ConfigError
from tests.support import grbm_away_from_init

random_grbm = partial(grbm_away_from_init, sigma=0.7, weight_std=0.8)


def hidden_marginal(model: GRBM) -> tuple[torch.Tensor, torch.Tensor]:
    """All hidden states (2^m, m) and their exact marginal p(h) (2^m,), v integrated out."""
    hs = all_binary(model.W.shape[1], model.W)
    scale = 1 / model.sigma if model.coupling == "scaled" else 1.0  # coupling −scale·vᵀWh
    wh = scale * hs @ model.W.T
    logits = hs @ model.c + wh @ model.b + 0.5 * model.sigma**2 * (wh**2).sum(-1)
    return hs, torch.softmax(logits, 0).detach()


def conditional_mean(model: GRBM, h: torch.Tensor) -> torch.Tensor:
    """E[v | h] = b + σ²·scale·Wh (scale 1/σ when scaled), written here from the energy, not
    taken from the model's ``visible_mean``, which the Gibbs sampler uses."""
    scale = 1 / model.sigma if model.coupling == "scaled" else 1.0
    return model.b + model.sigma**2 * scale * h @ model.W.T


def exact_samples(model: GRBM, n: int) -> torch.Tensor:
    """n exact draws of v: h ~ p(h) by enumeration, then v ~ p(v | h), a Gaussian."""
    with torch.no_grad():
        hs, p_h = hidden_marginal(model)
        h = hs[torch.multinomial(p_h, n, replacement=True)]
        return conditional_mean(model, h) + model.sigma * torch.randn(n, model.W.shape[0], dtype=model.W.dtype)


def exact_moments(model: GRBM) -> tuple[torch.Tensor, torch.Tensor]:
    """E[v] (d,) and E[vvᵀ] (d, d) of the GRBM, from the mixture over enumerated h."""
    with torch.no_grad():
        hs, p_h = hidden_marginal(model)
        means = conditional_mean(model, hs)
        d = means.shape[1]
        second = model.sigma**2 * torch.eye(d, dtype=means.dtype) + torch.einsum("k,ki,kj->ij", p_h, means, means)
        return p_h @ means, second


def assert_moments_match(model: GRBM, v: torch.Tensor, n_sigma: float = 5.0) -> None:
    """Sample mean and second moments within n_sigma standard errors of the exact ones."""
    mean, second = exact_moments(model)
    n = len(v)
    outer = v.unsqueeze(2) * v.unsqueeze(1)  # (n, d, d)
    for estimate, target, spread in [(v.mean(0), mean, v.std(0)), (outer.mean(0), second, outer.std(0))]:
        stderr = spread / math.sqrt(n)
        assert ((estimate - target).abs() <= n_sigma * stderr + 1e-12).all(), (estimate, target, stderr)


# ---- Gibbs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("coupling", ["scaled", "plain"])
def test_gibbs_sweep_leaves_the_exact_distribution_invariant(coupling):
    model = random_grbm(d=2, m=3, coupling=coupling)
    torch.manual_seed(1)
    start = exact_samples(model, 100_000)
    assert_moments_match(model, start)
    assert_moments_match(model, gibbs_chain(model, start, n_steps=3))


def test_gibbs_sampler_from_noise_reaches_the_exact_moments():
    model = random_grbm(d=2, m=3, seed=2)
    data = DataSplits(train=torch.rand(50, 2, dtype=torch.float64), test=torch.rand(5, 2, dtype=torch.float64))
    sampler = GibbsSampler(GibbsConfig(burn_in=60, n_chains=25_000, n_steps=10), data)
    v = sampler.sample(model, 50_000, torch.Generator().manual_seed(3))
    assert v.shape == (50_000, 2)
    assert_moments_match(model, v)


def test_gibbs_sampler_is_reproducible_and_refuses_other_models():
    model = random_grbm(d=2, m=3)
    sampler = GibbsSampler(GibbsConfig(burn_in=5, final_mean=True), None)
    a = sampler.sample(model, 7, torch.Generator().manual_seed(0))
    b = sampler.sample(model, 7, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (7, 2)
    with pytest.raises(ConfigError, match="needs a GRBM"):
        sampler.sample(torch.nn.Linear(2, 2), 3)  # type: ignore[arg-type]


def test_gibbs_final_mean_returns_the_conditional_means_of_equilibrium_hidden_states():
    """With final_mean, each sample is E[v | h] = b + σ²Uh for the last hidden draw: one of the 2^m
    component means, picked with the hidden marginal p(h) once the chains have mixed."""
    model = random_grbm(d=2, m=3, seed=4)
    hs, p_h = hidden_marginal(model)
    components = conditional_mean(model, hs).detach()  # (2^m, d)
    v = GibbsSampler(GibbsConfig(burn_in=60, final_mean=True), None).sample(
        model, 40_000, torch.Generator().manual_seed(5)
    )
    distance, which = (v.unsqueeze(1) - components).abs().amax(-1).min(1)
    assert distance.max() < 1e-12, "every sample must be a component mean"
    freq = torch.bincount(which, minlength=len(hs)).double() / len(v)
    assert ((freq - p_h).abs() <= 5 * (p_h * (1 - p_h) / len(v)).sqrt() + 1e-12).all(), (freq, p_h)


# ---- CD / PCD --------------------------------------------------------------------------------


def per_sample_free_energy_grads(model: GRBM, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """∂F(v_i)/∂θ for each sample: name -> (n, *shape)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    return vmap(grad(lambda p, x: _free_energy_with(p, x)), in_dims=(None, 0))(params, v)


def _free_energy_with(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """F(x) of one point with parameters ``p`` (the GRBM formula, written out)."""
    sigma = p["log_sigma"].exp()
    return ((x - p["b"]) ** 2).sum() / (2 * sigma**2) - torch.nn.functional.softplus(p["c"] + x @ p["W"] / sigma).sum()


def exact_nll_gradient(model: GRBM, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """∂/∂θ of −mean log p(data) = mean F(data) + log Z, by autograd through enumeration."""
    loss = model.free_energy(data).mean() + model.log_partition()
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, [p for _, p in model.named_parameters()])))


def surrogate_gradient(model: GRBM, data: torch.Tensor, samples: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(contrastive_loss(model, data, samples), [p for _, p in model.named_parameters()])
    return dict(zip(names, grads))


def test_free_energy_formula_in_tests_is_the_models():
    model = random_grbm(d=2, m=2)
    v = torch.randn(3, 2, dtype=torch.float64)
    params = dict(model.named_parameters())
    torch.testing.assert_close(torch.stack([_free_energy_with(params, x) for x in v]), model.free_energy(v))


def test_long_cd_chains_give_the_exact_likelihood_gradient():
    """CD with k large: E_data ∂F − E_chains ∂F equals ∂(−mean log p)/∂θ within Monte Carlo error."""
    model = random_grbm(d=2, m=2, sigma=0.8, weight_std=0.9, seed=7)
    torch.manual_seed(8)
    data = torch.rand(200, 2, dtype=torch.float64)
    starts = data.repeat(200, 1)  # 40,000 chains from the data, as CD starts
    samples = gibbs_chain(model, starts, n_steps=40)
    estimate = surrogate_gradient(model, data, samples)
    exact = exact_nll_gradient(model, data)
    per_sample = per_sample_free_energy_grads(model, samples)
    for name, value in exact.items():
        stderr = per_sample[name].std(0) / math.sqrt(len(samples))
        assert ((estimate[name] - value).abs() <= 5 * stderr + 1e-10).all(), (name, estimate[name], value, stderr)


def test_cd1_gradient_vanishes_in_expectation_when_data_come_from_the_model():
    model = random_grbm(d=2, m=3, seed=9)
    torch.manual_seed(10)
    data = exact_samples(model, 60_000)
    samples = gibbs_chain(model, data, n_steps=1)
    estimate = surrogate_gradient(model, data, samples)
    diffs = {
        k: a - b
        for (k, a), b in zip(
            per_sample_free_energy_grads(model, data).items(), per_sample_free_energy_grads(model, samples).values()
        )
    }
    for name, value in estimate.items():
        stderr = diffs[name].std(0) / math.sqrt(len(data))
        assert (value.abs() <= 5 * stderr + 1e-12).all(), (name, value, stderr)


@pytest.mark.parametrize("kind", ["cd", "pcd"])
def test_cd_and_pcd_steps_raise_the_exact_likelihood(kind):
    model = random_grbm(d=2, m=3, sigma=1.0, weight_std=0.3, seed=11)
    torch.manual_seed(12)
    data = DataSplits(
        train=0.3 * torch.randn(500, 2, dtype=torch.float64) + 2.0, test=torch.randn(5, 2, dtype=torch.float64)
    )
    parts = Parts(
        dtype=torch.float64,
        data=data,
        model=model,
        optimizer_factories={"model": lambda params: torch.optim.SGD(params, lr=0.02)},
    )
    estimator = build_cd(CDConfig(k=1), parts) if kind == "cd" else build_pcd(PCDConfig(k=1, n_chains=500), parts)
    before = float(model.log_likelihood(data.train).mean().detach())
    for _ in range(20):
        metrics = estimator.step(data.train)
    after = float(model.log_likelihood(data.train).mean().detach())
    assert math.isfinite(float(metrics["loss"])) and set(metrics) >= {"loss", "sigma"}
    assert ("reconstruction" in metrics) == (kind == "cd")
    assert after > before + 0.1


def test_pcd_chains_persist_and_round_trip_through_a_checkpoint(tmp_path):
    model = random_grbm(d=2, m=3)
    data = DataSplits(train=torch.randn(100, 2, dtype=torch.float64), test=torch.randn(5, 2, dtype=torch.float64))
    parts = Parts(dtype=torch.float64, data=data, model=model)
    estimator = build_pcd(PCDConfig(n_chains=17, init="noise"), parts)
    start = estimator.chains.clone()
    estimator.step(data.train[:10])
    assert estimator.chains.shape == (17, 2) and not torch.equal(estimator.chains, start)
    ckpt.save_atomic({"estimator": estimator.state_dict()}, tmp_path / "c.pt")
    other = build_pcd(PCDConfig(n_chains=17), parts)
    other.load_state_dict(ckpt.load(tmp_path / "c.pt")["estimator"])
    assert torch.equal(other.chains, estimator.chains)


def test_cd_refuses_models_without_gibbs():
    from eblvm.testing import linear_gaussian_parts as build

    _, _, parts = build()
    with pytest.raises(ConfigError, match="cd needs a GRBM"):
        build_cd(CDConfig(), parts)


# ---- score-loss ---------------------------------------------------------------------------


def grbm_score_loss_closed_form(model: GRBM, v: torch.Tensor) -> torch.Tensor:
    """½‖s‖² + tr ∇s with s = −(v − b)/σ² + W p/σ and tr ∇s = −d/σ² + Σ_j p_j(1−p_j)‖W_j‖²/σ²."""
    sigma = model.sigma
    p = torch.sigmoid(model.hidden_logits(v))
    s = -(v - model.b) / sigma**2 + p @ model.W.T / sigma
    trace = -v.shape[1] / sigma**2 + (p * (1 - p)) @ (model.W**2).sum(0) / sigma**2
    return (0.5 * (s**2).sum(-1) + trace).detach()


def test_score_loss_exact_trace_equals_the_grbm_closed_form():
    model = random_grbm(d=3, m=4)
    v = torch.randn(20, 3, dtype=torch.float64)
    torch.testing.assert_close(
        score_matching_loss(model, v, "exact"), grbm_score_loss_closed_form(model, v), rtol=0, atol=1e-10
    )


@pytest.mark.slow
def test_hutchinson_trace_is_unbiased():
    model = random_grbm(d=6, m=4)
    v = torch.randn(3, 6, dtype=torch.float64)
    exact = score_matching_loss(model, v, "exact")
    probes = torch.stack(
        [score_matching_loss(model, v, "hutchinson", 1, torch.Generator().manual_seed(i)) for i in range(1500)]
    )
    stderr = probes.std(0) / math.sqrt(len(probes))
    assert ((probes.mean(0) - exact).abs() <= 5 * stderr).all()


def test_score_loss_evaluator_picks_the_trace_and_averages():
    model = random_grbm(d=3, m=4)
    data = DataSplits(train=torch.randn(10, 3, dtype=torch.float64), test=torch.randn(25, 3, dtype=torch.float64))
    parts = Parts(dtype=torch.float64, data=data, model=model)
    scalars = build_score_loss(ScoreLossConfig(batch_size=7), parts)(parts).scalars
    expected = grbm_score_loss_closed_form(model, data.test)
    assert scalars["test_score_loss"] == pytest.approx(float(expected.mean()), abs=1e-10)
    assert scalars["test_score_loss_stderr"] == pytest.approx(float(expected.std() / 5), abs=1e-10)
    # Hutchinson: unbiased, so the mean over points and 400 probes lies within 5 standard errors of
    # the exact value; the probe noise's standard error is that of one probe over √(points·probes)
    noisy = build_score_loss(ScoreLossConfig(trace="hutchinson", n_probes=400), parts)(parts).scalars
    single = torch.stack(
        [score_matching_loss(model, data.test, "hutchinson", 1, torch.Generator().manual_seed(i)) for i in range(200)]
    )
    probe_se = float((single - expected).std()) / math.sqrt(25 * 400)
    assert 0 < abs(noisy["test_score_loss"] - scalars["test_score_loss"]) < 5 * probe_se
    with pytest.raises(ConfigError, match="no 'val' split"):
        build_score_loss(ScoreLossConfig(split="val"), parts)
