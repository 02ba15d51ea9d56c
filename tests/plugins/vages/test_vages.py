"""VaES / VaGES, KSD, the importance-sampled score and the exact-Fisher critic."""

from __future__ import annotations

import math

import pytest
import torch
from eblvm_grbm.model import GRBM, all_binary
from eblvm_posteriors import BernoulliPosterior
from eblvm_score.ksd import KSD
from eblvm_score.objectives import DSM, SSM
from eblvm_vages.critic import CriticConfig, FisherCritic
from eblvm_vages.estimators import (
    ISConfig,
    VaGESConfig,
    build_is_score,
    build_vaes,
    build_vages,
    joint_scores,
    mean_joint_score,
    vaes_value,
)

from eblvm_core.contracts import DataSplits, EnergyModel, Parts, exact_score
from eblvm_core.errors import ConfigError


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def grbm(d: int = 2, m: int = 3, seed: int = 0) -> GRBM:
    torch.manual_seed(seed)
    model = GRBM(d, m, init_sigma=0.7, init_weight_std=0.8).double()
    with torch.no_grad():
        model.b.normal_()
        model.c.normal_()
    return model


def exact_posterior(model: GRBM) -> BernoulliPosterior:
    """The linear Bernoulli q with logits c + Wᵀv/σ: the GRBM's exact posterior."""
    d, m = model.W.shape
    q = BernoulliPosterior(d, m).double()
    (linear,) = q.net
    with torch.no_grad():
        linear.weight.copy_(model.coupling_weight().T)
        linear.bias.copy_(model.c)
    return q


def parts_for(model: EnergyModel, posterior=None, objective=None, divergence=None, data=None) -> Parts:
    data = data or DataSplits(train=torch.rand(200, model.W.shape[0]), test=torch.rand(50, model.W.shape[0]))
    return Parts(data=data, model=model, posterior=posterior, objective=objective, divergence=divergence)


def test_vaes_with_the_exact_posterior_is_the_marginal_score():
    model = grbm()
    q = exact_posterior(model)
    v = torch.randn(6, 2)
    exact = exact_score(model, v, create_graph=False)
    # identity: E_{p(h|v)} ∇_v log p̃(v, h) = ∇_v log p(v), by enumerating h
    hs = all_binary(3, v)
    grads, log_joint = joint_scores(model, v, hs.unsqueeze(1).expand(8, 6, 3))
    weights = torch.softmax(log_joint, 0).unsqueeze(-1)
    torch.testing.assert_close((weights * grads).sum(0), exact)
    # Monte Carlo with q: the error shrinks like 1/√L
    errors = []
    for n in (10, 1000):
        torch.manual_seed(1)
        est = torch.stack([joint_scores(model, v, q.sample(v, n))[0].mean(0) for _ in range(20)])
        errors.append(float((est - exact).pow(2).mean().sqrt().detach()))
    assert errors[1] < errors[0] / 5, errors
    assert errors[1] < 0.05 * float(exact.abs().mean())


def vages_gradients(estimator, x, eps, n):
    h = estimator.posterior.sample(x, n)
    surrogate, _ = estimator.surrogate(x, eps, h)
    grads = torch.autograd.grad(surrogate, estimator.theta, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(estimator.theta, grads)]


@pytest.mark.parametrize("covariance", [True, False])
def test_vages_dsm_gradient_matches_the_exact_marginal_gradient(covariance):
    """Per parameter, against the analytic exact-score DSM gradient; VaES alone is biased."""
    model = grbm()
    q = exact_posterior(model)
    dsm = DSM(sigma=0.3)
    parts = parts_for(model, q, dsm, divergence=lambda *a: None)
    estimator = (build_vages if covariance else build_vaes)(VaGESConfig(n_samples=2, inner_steps=0), parts)
    torch.manual_seed(3)
    x, eps = dsm.points(torch.randn(5, 2))
    exact_loss = dsm.loss_at(x, exact_score(model, x), eps).mean()
    exact = torch.autograd.grad(exact_loss, estimator.theta)
    torch.manual_seed(4)
    estimate = vages_gradients(estimator, x, eps, 200_000)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    errors = {n: float((e - a).norm() / a.norm()) for n, e, a in zip(names, estimate, exact)}
    if covariance:
        assert all(err < 0.03 for err in errors.values()), errors
    else:
        assert errors["W"] > 0.1 and errors["c"] > 0.1, errors  # the covariance part is what makes it right


class Unconditioned(EnergyModel):
    """The same energy without ``condition``: every (x, h) pair is evaluated in full."""

    def __init__(self, model: EnergyModel):
        super().__init__()
        self.model, self.latent = model, model.latent

    def energy(self, v, h):
        return self.model.energy(v, h)


@pytest.mark.parametrize("covariance", [True, False])
def test_vages_through_the_features_once_equals_the_evaluation_on_every_pair(covariance):
    """On a tiny ResNet EBLVM (float64), the surrogate that runs the features f(x) once for the L
    samples (ŝ = J_fᵀG, zᵀ∇_x log p̃ per sample through J_f z) gives the scores, log p̃, the
    covariance coefficients and the θ-gradient of the evaluation on the L·B points, also with z
    from samples of its own (their VaES through the same f(x): one more product with J_fᵀ)."""
    from eblvm.testing import make
    from eblvm_core.bilevel import condition_on

    torch.manual_seed(0)
    images = torch.rand(12, 1, 8, 8)
    parts = Parts(dtype=torch.float64, data=DataSplits(train=images, test=images[:4]))
    model = make("models", "resnet-eblvm", parts, width=4, blocks=1, stages=2, latent_dim=3).double()
    parts.model = model
    parts.posterior = make("posteriors", "gaussian-conv3", parts, channels=4).double()
    parts.objective = DSM(sigma=0.3)
    parts.divergence = lambda *a: None
    x, eps = parts.objective.points(images[:5])
    h, z = torch.randn(3, 5, 3), torch.randn(5, 1, 8, 8)
    full_model = Unconditioned(model)
    assert model.has_conditioning and not full_model.has_conditioning
    fast, full = mean_joint_score(model, x, h), mean_joint_score(full_model, x, h)
    torch.testing.assert_close(fast[0], full[0])
    torch.testing.assert_close(fast[1], full[1])
    torch.testing.assert_close(fast[2](z), full[2](z))
    assert float(fast[2](z).std(0).abs().mean()) > 1e-3  # the samples' coefficients differ: the check can fail

    h_z = torch.randn(3, 5, 3)
    points = x.detach().requires_grad_(True)
    on_features = vaes_value(condition_on(model, points), points, h_z)
    torch.testing.assert_close(on_features, vaes_value(full_model, x, h_z))
    assert float((on_features - fast[0].detach()).abs().mean()) > 1e-3  # other samples, another estimate

    build = build_vages if covariance else build_vaes
    cfg = VaGESConfig(n_samples=3, inner_steps=0)
    for samples_of_z in (None, h_z):
        estimates = []
        for energy in (model, full_model):
            estimator = build(cfg, parts_for(energy, parts.posterior, parts.objective, parts.divergence, parts.data))
            at = x.detach().requires_grad_(True)
            whole = condition_on(energy, at) if energy is model else None
            surrogate, _ = estimator.surrogate(at, eps, h, whole, samples_of_z)
            estimates.append(torch.autograd.grad(surrogate, list(model.parameters())))
        for a, b in zip(*estimates):
            torch.testing.assert_close(a, b)


def test_vages_with_l_2_is_unbiased_when_z_has_samples_of_its_own():
    """At the exact posterior, the average of many L = 2 VaGES gradients is the exact DSM gradient
    when z = ∂F/∂s comes from L samples of its own (the default, as the released code): F is
    quadratic in s, so E[zᵀĝ] = E[z]ᵀE[ĝ]. With z from the estimate's own two samples they share
    their noise and the average stays about 5% off (the largest error over the parameters, eight
    seeds of 40,000 estimates: 5.2-6.6% shared, 0.4-1.8% with samples of its own, Monte Carlo)."""
    model = grbm(seed=5)
    q = exact_posterior(model)
    dsm = DSM(sigma=0.3)
    estimator = build_vages(
        VaGESConfig(n_samples=2, inner_steps=0), parts_for(model, q, dsm, divergence=lambda *a: None)
    )
    torch.manual_seed(6)
    x, eps = dsm.points(torch.randn(3, 2))
    exact = torch.autograd.grad(dsm.loss_at(x, exact_score(model, x), eps).mean(), estimator.theta)
    # repeat the batch so one call averages many independent L = 2 estimates
    reps = 40_000
    xr, er = x.repeat(reps, 1), eps.repeat(reps, 1)
    errors = {}
    for z_samples in ("own", "shared"):
        torch.manual_seed(7)
        h = estimator.posterior.sample(xr, 2)
        h_z = estimator.posterior.sample(xr, 2) if z_samples == "own" else None
        surrogate, _ = estimator.surrogate(xr, er, h, None, h_z)
        grads = torch.autograd.grad(surrogate, estimator.theta, allow_unused=True)
        errors[z_samples] = max(float(((-a) if g is None else g - a).norm() / a.norm()) for g, a in zip(grads, exact))
    assert errors["own"] < 0.03 and errors["shared"] > 0.04, errors


def ksd_by_autograd(x, s, y, t, bandwidth):
    """u(x, y) from the definition, kernel derivatives by autograd (one pair at a time)."""
    out = []
    for xi, si, yi, ti in zip(x, s, y, t):
        xi, yi = xi.clone().requires_grad_(True), yi.clone().requires_grad_(True)
        k = torch.exp(-((xi - yi) ** 2).sum() / (2 * bandwidth**2))
        gx, gy = torch.autograd.grad(k, (xi, yi), create_graph=True)
        trace = sum(torch.autograd.grad(gy[j], xi, retain_graph=True)[0][j] for j in range(len(xi)))
        out.append(k * si @ ti + si @ gy + gx @ ti + trace)
    return torch.stack(out).detach()


def test_ksd_kernel_matches_its_definition():
    ksd = KSD(bandwidth=0.7)
    x, s, y, t = (torch.randn(8, 3) for _ in range(4))
    torch.testing.assert_close(ksd.stein_kernel(x, s, y, t), ksd_by_autograd(x, s, y, t, 0.7))


@pytest.mark.slow
def test_ksd_is_zero_for_the_true_score_and_positive_otherwise():
    torch.manual_seed(0)
    x = torch.randn(2000, 2)
    ksd = KSD(bandwidth=1.0)
    right = ksd.loss_at(x, -x, None)
    wrong = ksd.loss_at(x, -(x - 0.5), None)
    stderr = float(right.std() / math.sqrt(len(right)))
    assert abs(float(right.mean())) < 4 * stderr
    assert float(wrong.mean()) > 10 * stderr
    halves = KSD(bandwidth=1.0, pairing="halves").loss_at(x, -x, None)
    assert halves.shape == (1000,) and abs(float(halves.mean())) < 4 * float(halves.std() / math.sqrt(1000))


def test_importance_score_is_exact_with_many_proposals():
    model = grbm(m=2)
    parts = parts_for(model, objective=DSM(0.3))
    est = build_is_score(ISConfig(n_samples=20_000), parts)
    v = torch.randn(4, 2)
    torch.testing.assert_close(est.score(v).detach(), exact_score(model, v, create_graph=False), rtol=0.05, atol=0.02)


@pytest.mark.slow
def test_critic_approaches_the_exact_fisher_divergence():
    """VaGES F.3 in small dimension: data from a standard Gaussian, a GRBM model."""
    torch.manual_seed(0)
    data = DataSplits(train=torch.randn(4000, 2), test=torch.randn(2000, 2))
    model = grbm(seed=2)
    exact = 0.5 * float(((exact_score(model, data.test, create_graph=False) + data.test) ** 2).sum(-1).mean())
    # the critic estimates D_F up to nothing: max_f E[sᵀf + tr∇f − ½‖f‖²] = D_F exactly
    cfg = CriticConfig(steps=600, lr=1e-2, width=32, batch_size=200)
    parts = parts_for(model, data=data)
    value = FisherCritic(cfg, parts)(parts).scalars["fisher"]
    assert abs(value - exact) < 0.1 * exact + 0.02, (value, exact)

    class NoFreeEnergy(EnergyModel):
        """The same GRBM seen only through its energy: the critic must use VaES."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.latent = inner, inner.latent

        def energy(self, v, h):
            return self.inner.energy(v, h)

    hidden = NoFreeEnergy(model)
    parts = parts_for(model, exact_posterior(model), data=data)
    parts.model = hidden
    value = FisherCritic(attrs_evolve(cfg, n_samples=20), parts)(parts).scalars["fisher"]
    assert abs(value - exact) < 0.15 * exact + 0.03, (value, exact)


def attrs_evolve(cfg, **changes):
    import attrs

    return attrs.evolve(cfg, **changes)


def test_estimators_refuse_what_they_cannot_do():
    model = grbm()
    q = exact_posterior(model)
    with pytest.raises(ConfigError, match="only score values"):
        build_vages(VaGESConfig(), parts_for(model, q, SSM(), divergence=lambda *a: None))
    with pytest.raises(ConfigError, match="at least 2"):
        build_vages(VaGESConfig(n_samples=1), parts_for(model, q, DSM(), divergence=lambda *a: None))
    build_vaes(VaGESConfig(n_samples=1), parts_for(model, q, DSM(), divergence=lambda *a: None))
    with pytest.raises(ConfigError, match="gaussian"):
        build_vages(VaGESConfig(langevin_steps=2), parts_for(model, q, DSM(), divergence=lambda *a: None))


def test_vages_step_trains_the_model_and_the_posterior():
    from eblvm_divergences import KL

    model = grbm()
    q = BernoulliPosterior(2, 3).double()
    estimator = build_vages(VaGESConfig(), parts_for(model, q, DSM(0.1), KL()))
    before = [p.detach().clone() for p in [*model.parameters(), *q.parameters()]]
    metrics = estimator.step(torch.rand(50, 2))
    assert all(math.isfinite(v) for v in metrics.values())
    after = [*model.parameters(), *q.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("independent", [True, False])
def test_a_step_draws_z_its_own_samples_unless_told_not_to(independent, monkeypatch):
    model = grbm()
    estimator = build_vages(
        VaGESConfig(n_samples=3, inner_steps=0, independent_z=independent),
        parts_for(model, exact_posterior(model), DSM(0.3), divergence=lambda *a: None),
    )
    calls = []
    real = estimator.surrogate
    monkeypatch.setattr(estimator, "surrogate", lambda *a: calls.append(a) or real(*a))
    estimator.step(torch.rand(20, 2))
    (_, _, h, _, h_z) = calls[0]
    assert h.shape == (3, 20, 3)
    assert (h_z is not None and h_z.shape == h.shape and not torch.equal(h_z, h)) if independent else h_z is None


def test_at_the_exact_posterior_a_vages_step_moves_the_model_along_the_exact_gradient():
    """The whole step (samples, surrogate, update): with plain SGD the model's update, averaged
    over draws, points along −∇θ of the exact-score DSM loss; VaES without the covariance term does not."""
    model = grbm()
    q = exact_posterior(model)
    dsm = DSM(sigma=0.3)
    batch = torch.randn(32, 2, generator=torch.Generator().manual_seed(0))
    saved = {k: t.clone() for k, t in model.state_dict().items()}
    cosines = {}
    for name, build in (("vages", build_vages), ("vaes", build_vaes)):
        parts = parts_for(model, q, dsm, divergence=lambda *a: None)
        parts.optimizer_factories = {"model": lambda p: torch.optim.SGD(p, lr=1e-3)}
        estimator = build(VaGESConfig(n_samples=4, inner_steps=0), parts)
        update = torch.zeros(sum(p.numel() for p in estimator.theta))
        for i in range(64):
            torch.manual_seed(100 + i)
            estimator.step(batch)
            update += torch.cat([(saved[n] - p.detach()).flatten() for n, p in model.named_parameters()]) / 64e-3
            model.load_state_dict(saved)
        torch.manual_seed(7)
        reference = torch.zeros_like(update)
        for _ in range(64):
            x, eps = dsm.points(batch)
            loss = dsm.loss_at(x, exact_score(model, x), eps).mean() / 64
            reference += torch.cat([g.flatten() for g in torch.autograd.grad(loss, estimator.theta)])
        cosines[name] = float(update @ reference / (update.norm() * reference.norm()))
    assert cosines["vages"] > 0.95 and cosines["vages"] > cosines["vaes"], cosines


class LinearGaussian(EnergyModel):
    """E(v, h) = ½‖v‖² + ½ Σ_j d_j h_j² − vᵀWh − cᵀh: ∇_h E = D h − (Wᵀv + c), mode μ(v) = D⁻¹(Wᵀv + c)."""

    def __init__(self):
        super().__init__()
        from eblvm_core.contracts import LatentSpec

        g = torch.Generator().manual_seed(0)
        self.latent = LatentSpec("gaussian", 3)
        self.W = torch.nn.Parameter(torch.randn(2, 3, generator=g))
        self.c = torch.nn.Parameter(torch.randn(3, generator=g))
        self.d = torch.tensor([0.5, 1.0, 2.0])

    def energy(self, v, h):
        return 0.5 * (v**2).sum(-1) + 0.5 * (self.d * h * h).sum(-1) - ((v @ self.W) * h).sum(-1) - h @ self.c

    def mode(self, v):
        return (v @ self.W + self.c) / self.d


@pytest.mark.slow
def test_the_langevin_correction_descends_the_energy_in_h():
    """Without noise, C steps h ← h − ½α∇_h E contract h − μ(v) by (1 − ½α d_j)^C exactly; with
    noise s = √α they are an (unadjusted) Langevin sampler that keeps p(h|v) = N(μ, D⁻¹) (to O(α))."""
    from eblvm_vages.estimators import langevin_correct

    model = LinearGaussian()
    v = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    h0 = torch.randn(3, 5, 3, generator=torch.Generator().manual_seed(2))
    alpha, steps = 0.1, 7
    h = langevin_correct(model, v, h0, steps, alpha, noise=0.0)
    mu = model.mode(v).detach()
    torch.testing.assert_close(h - mu, (1 - 0.5 * alpha * model.d) ** steps * (h0 - mu))
    torch.manual_seed(3)
    alpha, n = 0.01, 2000
    start = mu + torch.randn(n, 5, 3) / model.d.sqrt()  # exact draws of p(h|v): the sampler must keep them
    draws = langevin_correct(model, v, start, 300, alpha, noise=math.sqrt(alpha))
    se = draws.std(0) / math.sqrt(n)
    assert ((draws.mean(0) - mu).abs() < 5 * se).all()
    variance = draws.var(0).mean(0)
    torch.testing.assert_close(variance, 1 / model.d, rtol=0.05, atol=0)


@pytest.mark.slow
def test_the_critics_hutchinson_trace_is_unbiased_above_the_exact_trace_dimension():
    """d = 20 > 16 = exact_trace_max_dim: the probe's E[uᵀ∇(uᵀf)] is tr ∇f, so the critic's
    objective averaged over probes equals the exact-trace objective."""
    from eblvm_vages.critic import critic_objective

    torch.manual_seed(0)
    d = 20
    f = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.SiLU(), torch.nn.Linear(16, d))
    x, s = torch.randn(8, d), torch.randn(8, d)
    exact = critic_objective(f, x, s, exact_trace=True).detach()
    probes = torch.stack([critic_objective(f, x, s, exact_trace=False).detach() for _ in range(4000)])
    se = probes.std(0) / math.sqrt(len(probes))
    assert ((probes.mean(0) - exact).abs() < 5 * se).all() and (probes.std(0) > 0).all()


@pytest.mark.slow
def test_a_critic_with_the_hutchinson_trace_approaches_the_exact_fisher_divergence():
    torch.manual_seed(0)
    data = DataSplits(train=torch.randn(4000, 2), test=torch.randn(2000, 2))
    model = grbm(seed=2)
    exact = 0.5 * float(((exact_score(model, data.test, create_graph=False) + data.test) ** 2).sum(-1).mean())
    cfg = CriticConfig(steps=600, lr=1e-2, width=32, batch_size=200, exact_trace_max_dim=1)
    parts = parts_for(model, data=data)
    value = FisherCritic(cfg, parts)(parts).scalars["fisher"]
    assert abs(value - exact) < 0.15 * exact + 0.03, (value, exact)
