"""The Rényi divergence plugin, tested with eblvm's test kit (eblvm.testing; conftest.py opts into its fixtures)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from eblvm_renyi import Renyi, log_weights, renyi_bound

from eblvm.plugin import ConfigError
from eblvm.testing import entry, linear_gaussian_setup, make, parametrize_with_checks, tiny_grbm_setup

torch.set_num_threads(1)
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grbm_bissm_renyi.toml"


def test_registered_through_the_eblvm_entry_point_group(linear_gaussian):
    registered = entry("divergences", "renyi")
    assert registered.plugin == "renyi" and "Rényi" in registered.doc
    div = make("divergences", "renyi", linear_gaussian.parts, alpha=0.3, n_samples=2)
    assert isinstance(div, Renyi) and (div.alpha, div.n_samples) == (0.3, 2)


@parametrize_with_checks([Renyi(0.5, 5), Renyi(0.2, 3), Renyi(1.0, 5)])
def test_divergence_contract(component, check):
    """Finite, differentiable in φ and θ, minimal at the exact posterior: on the linear-Gaussian
    model (continuous h) and on the tiny GRBM (Bernoulli h, relaxed samples)."""
    report = check(component)
    assert set(report) == {"linear-gaussian", "tiny-grbm"}


@pytest.mark.parametrize("setup", [linear_gaussian_setup, tiny_grbm_setup])
@pytest.mark.parametrize("alpha", [0.3, 0.999, 1.0, 2.0])
def test_at_the_exact_posterior_every_sample_gives_the_free_energy(setup, alpha):
    """q = p(h|v): every log-weight is −F(v), so −L̂_α = F(v) exactly, for any α and k."""
    exact = setup()
    values = Renyi(alpha, 7)(exact.model, exact.posterior, exact.v)
    torch.testing.assert_close(values, exact.model.free_energy(exact.v), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("setup", [linear_gaussian_setup, tiny_grbm_setup])
def test_agrees_with_the_kl_plugin_as_alpha_tends_to_1(setup):
    """On the same samples, KL − D_α = L̂_α − ℓ̄ lies in [0, (1−α) R²/8], R = max ℓ − min ℓ
    (Jensen below, Hoeffding's lemma above), and (KL − D_α)/(1 − α) → ½ Var_k(ℓ) (second
    cumulant) with an error O(1 − α); at α = 1 the two are equal."""
    exact = setup()
    exact.perturb(0.5, seed=0)
    model, q, v, k = exact.model, exact.posterior, exact.v, 6
    kl = make("divergences", "kl", exact.parts, n_samples=k)

    def seeded(fn):
        torch.manual_seed(11)
        return fn().detach()

    log_w = seeded(lambda: log_weights(model, q, v, q.rsample(v, k)))
    kl_values = seeded(lambda: kl(model, q, v))
    torch.testing.assert_close(kl_values, -log_w.mean(0), rtol=1e-12, atol=1e-12)  # the same samples
    spread = log_w.amax(0) - log_w.amin(0)
    half_var = 0.5 * log_w.var(0, unbiased=False)
    for alpha in (0.9, 0.99, 0.999):
        gap = kl_values - seeded(lambda a=alpha: Renyi(a, k)(model, q, v))
        assert (gap >= -1e-12).all() and (gap <= (1 - alpha) * spread**2 / 8 + 1e-12).all()
        third = (1 - alpha) * ((log_w - log_w.mean(0)).abs() ** 3).mean(0)  # bounds the next cumulant's term
        assert ((gap / (1 - alpha) - half_var).abs() <= third + 1e-9).all()
    torch.testing.assert_close(seeded(lambda: Renyi(1.0, k)(model, q, v)), kl_values, rtol=1e-12, atol=1e-12)


def test_near_alpha_1_float32_has_no_cancellation():
    """1/(1−α) multiplies rounding errors of the direct formula; the series form does not."""
    log_w = 3 * torch.randn(8, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) - 20
    for alpha in (1 - 1e-4, 1 - 1e-6, 1 + 1e-6):
        exact = renyi_bound(log_w, alpha)
        torch.testing.assert_close(renyi_bound(log_w.float(), alpha).double(), exact, rtol=1e-6, atol=1e-5)


def gaussian_renyi(mu_q, log_sq, mu_p, log_sp, alpha):
    """Closed-form D_α(N(μ_q, σ_q²) ‖ N(μ_p, σ_p²)) for diagonal Gaussians, summed over dimensions (B,)."""
    var_q, var_p = (2 * log_sq).exp(), (2 * log_sp).exp()
    var_a = alpha * var_p + (1 - alpha) * var_q
    terms = log_sp - log_sq + torch.log(var_p / var_a) / (2 * (alpha - 1)) + alpha * (mu_q - mu_p) ** 2 / (2 * var_a)
    return terms.sum(-1)


def test_finite_k_bias_is_upward_and_shrinks_with_k_to_the_closed_form():
    """0 < α < 1: E[−L̂_α] ≥ F + D_α(q‖p), non-increasing in k (the sample mean of k i.i.d.
    terms is the average of its (k−1)-subsets' means, and log is concave); the bias is O(1/k)
    (delta method), so at k = 256 it is at most twice 4/256 of the bias measured at k = 4."""
    exact = linear_gaussian_setup(n=8)
    exact.perturb(0.3, seed=1)
    model, q, v, alpha = exact.model, exact.posterior, exact.v, 0.5
    with torch.no_grad():
        mu_q, log_sq = q.params(v)
        target = model.free_energy(v) + gaussian_renyi(mu_q, log_sq, model.posterior_mean(v), -0.5 * model.log_d, alpha)
    torch.manual_seed(0)
    means, ses = [], []
    for k, repeats in ((1, 4000), (4, 1000), (256, 200)):
        values = Renyi(alpha, k)(model, q, v.repeat(repeats, 1)).detach().view(repeats, len(v)).mean(1)
        means.append(float(values.mean()))
        ses.append(float(values.std()) / math.sqrt(repeats))
    goal = float(target.mean())
    assert means[0] > means[1] > means[2] > goal - 4 * ses[2]
    assert means[0] - goal > 10 * ses[0]  # the bias is real at k = 1
    assert means[2] - goal < 4 * ses[2] + 2 * (4 / 256) * (means[1] - goal)  # and O(1/k)


def test_options_are_validated_and_models_without_latents_refused(linear_gaussian):
    with pytest.raises(ConfigError, match="alpha.*must be > 0"):
        make("divergences", "renyi", linear_gaussian.parts, alpha=0.0)
    with pytest.raises(ConfigError, match="n_sample"):
        make("divergences", "renyi", linear_gaussian.parts, n_sample=3)
    linear_gaussian.model.latent = None
    with pytest.raises(ConfigError, match="no latent variable"):
        make("divergences", "renyi", linear_gaussian.parts)


def test_the_example_recipe_trains_with_renyi(short_run):
    result = short_run(RECIPE, steps=3, data__n_train=600, estimator__inner_steps=2, estimator__unroll_steps=2)
    assert result.recipe["divergence"] == {"kind": "renyi", "alpha": 0.5, "n_samples": 5}
    lower = result.series("train/lower_loss")
    assert lower and all(math.isfinite(x) for x in lower)
    assert math.isfinite(result.results["eval/exact-loglik/test_loglik"])


def test_lower_level_steps_on_renyi_bring_q_to_the_exact_posterior():
    """What BiSM's real lower-level steps do with this divergence: from a perturbed q on the tiny
    GRBM, Adam on the batch mean of −L̂_α shrinks the exact KL(q ‖ p(h|v)) (factorised Bernoulli,
    closed form) severalfold; a gradient of the wrong sign would grow it."""
    from eblvm.plugin import TrainingRole
    from eblvm.tools import fit_posterior

    exact = tiny_grbm_setup(n=64)
    exact.perturb(1.0, seed=0)
    model, q, v = exact.model, exact.posterior, exact.v

    def kl() -> float:
        with torch.no_grad():
            a, b = q.mean(v), torch.sigmoid(model.hidden_logits(v))
            return float((a * (a / b).log() + (1 - a) * ((1 - a) / (1 - b)).log()).sum(-1).mean())

    before = kl()
    torch.manual_seed(0)
    fit_posterior(Renyi(0.5, 5), model, q, TrainingRole("posterior", torch.optim.Adam(q.parameters(), lr=0.05)), v, 150)
    assert before > 0.1 and kl() < before / 4, (before, kl())
