"""Bi-level score matching: Theorem 1 numerically, unrolled vs implicit hypergradients, steps, recipes."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from eblvm_bism import BiSMImplicit, BiSMUnrolled, UnrolledConfig, build_unrolled, modified_score
from eblvm_divergences import KL, Fisher
from eblvm_grbm.model import GRBM, all_binary
from eblvm_posteriors import BernoulliPosterior, relaxed_bernoulli
from eblvm_score.objectives import DSM, MDSM, SSM, MDSMConfig
from eblvm_vages.estimators import VaGESConfig, build_vages

from eblvm.testing import linear_gaussian_parts
from eblvm_core.bilevel import conjugate_gradient, flat, neumann, unflat
from eblvm_core.contracts import DataSplits, Parts, exact_score
from eblvm_core.errors import ConfigError
from tests.support import RECIPES

NEW_RECIPES = ["grbm_bissm.toml", "grbm_bidsm.toml", "grbm_bism_implicit.toml"]


class FixedSSM(SSM):
    """SSM with its Rademacher slices drawn once, so compared computations share them."""

    def __init__(self, batch: int, dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.u = torch.randn(1, batch, dim, generator=g, dtype=torch.float64).sign()

    def slices(self, like: torch.Tensor) -> torch.Tensor:
        return self.u


class FixedNoiseBernoulli(BernoulliPosterior):
    """Bernoulli posterior whose relaxed samples (``rsample`` and ``rsample_and_log_prob``) reuse
    the same uniforms on every call, which makes the lower level a deterministic function of (θ, φ)."""

    def _sample(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        u = torch.rand((n, *logits.shape), generator=torch.Generator().manual_seed(1), dtype=logits.dtype)
        return relaxed_bernoulli(logits, u, self.temperature)


def exact_grbm_posterior(model: GRBM, posterior: BernoulliPosterior) -> None:
    """Set the linear logits to the GRBM's p(h_j = 1|v) logits c + Uᵀv (U = W/σ or W)."""
    with torch.no_grad():
        posterior.net[0].weight.copy_(model.coupling_weight().T)
        posterior.net[0].bias.copy_(model.c)


def small_grbm(d: int = 3, m: int = 4, seed: int = 0, coupling: str = "scaled") -> GRBM:
    torch.manual_seed(seed)
    model = GRBM(d, m, init_weight_std=0.7, coupling=coupling).double()
    with torch.no_grad():
        model.b.normal_(0, 0.5)
        model.c.normal_(0, 0.5)
        model.log_sigma.fill_(-0.3)
    return model


def score_at(model, posterior, v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """∇_v[−E(v, h) − log q(h|v)] for a given h (B, m)."""
    v = v.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad((model.energy(v, h) + posterior.log_prob(h, v)).sum(), v)
    return -grad


# ---- Theorem 1 (a): the modified score on a GRBM with the exact posterior ------------------


@pytest.mark.parametrize("coupling", ["scaled", "plain"])
def test_modified_score_is_the_marginal_score_for_every_h_on_a_grbm(coupling):
    model = small_grbm(coupling=coupling)
    posterior = BernoulliPosterior(3, 4).double()
    exact_grbm_posterior(model, posterior)
    v = torch.randn(5, 3, dtype=torch.float64)
    target = exact_score(model, v, create_graph=False)
    hard = all_binary(4, v)  # every binary h
    for h in hard:
        torch.testing.assert_close(score_at(model, posterior, v, h.expand(5, 4)), target)
    for h in [torch.rand(5, 4, dtype=torch.float64), 3 * torch.randn(5, 4, dtype=torch.float64)]:
        torch.testing.assert_close(score_at(model, posterior, v, h), target)
    for temperature in [0.1, 1.0]:  # and the estimator's own relaxed samples
        posterior.temperature = temperature
        torch.testing.assert_close(modified_score(model, posterior)(v), target)


def test_modified_score_holds_h_fixed_in_x_and_keeps_the_graph():
    model, posterior = small_grbm(), BernoulliPosterior(3, 4, temperature=0.5).double()  # not the exact q
    v = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    s = modified_score(model, posterior)(v)
    torch.manual_seed(5)
    h = posterior.rsample(v.detach(), 1)[0]
    torch.testing.assert_close(s, score_at(model, posterior, v, h))
    (jac,) = torch.autograd.grad(s[:, 0].sum(), v, create_graph=True)  # differentiable again in x
    grads = torch.autograd.grad(jac.sum(), [model.log_sigma, posterior.net[0].weight])
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


# ---- Theorem 1 (b): hypergradients on a linear-Gaussian EBLVM ------------------------------


def lg_setup(objective_name: str, divergence, batch: int = 40):
    model, posterior, parts = linear_gaussian_parts()
    v = parts.data.train[:batch]
    objectives = {
        "ssm": lambda: FixedSSM(batch, v.shape[1]),
        "dsm": lambda: DSM(0.3),
        "mdsm": lambda: MDSM(MDSMConfig(sigma_min=0.1, sigma_max=1.0, sigma0=0.3, weighting="inverse-variance")),
        "mdsm-weighted-lower": lambda: MDSM(
            MDSMConfig(
                sigma_min=0.1, sigma_max=1.0, sigma0=0.3, weighting="inverse-variance", lower_weighting="inverse-sigma"
            )
        ),
    }
    objective = objectives[objective_name]()
    torch.manual_seed(0)
    x, context = objective.points(v)  # the noise (and MDSM's noise levels) are drawn once and shared
    parts.objective, parts.divergence = objective, divergence
    loss = objective.loss(lambda z: exact_score(model, z), x, context).mean()
    exact = flat(torch.autograd.grad(loss, list(model.parameters())))
    return model, posterior, parts, x, context, exact


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def implicit(parts: Parts, **kw) -> BiSMImplicit:
    kw = {"iterations": 100, "tol": 1e-13, **kw}
    return BiSMImplicit(parts, 1, functools.partial(conjugate_gradient, **kw))


def largest_hessian_eigenvalue(est, x: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    phi = list(est.phi.values())
    grad = flat(torch.autograd.grad(est.lower(x, None, weights), phi, create_graph=True))
    hessian = torch.stack([flat(torch.autograd.grad(g, phi, retain_graph=True)) for g in grad])
    return float(torch.linalg.eigvalsh(hessian).max())


@pytest.mark.parametrize("objective_name", ["ssm", "dsm", "mdsm", "mdsm-weighted-lower"])
def test_theorem_1_hypergradients_match_the_exact_marginal_gradient(objective_name):
    """With q equal to the exact posterior, BiSM's implicit hypergradient equals the exact-score
    gradient of the objective (BiMDSM's included, with its lower level's points weighted by 1/σ_i
    too: every D_i is 0 at φ*, so φ*(θ) does not depend on the weights), and unrolling converges
    to it as N grows."""
    model, posterior, parts, x, context, exact = lg_setup(objective_name, Fisher())
    est = implicit(parts)
    grads, metrics = est.hypergradient(x, context)
    assert rel_err(flat(grads), exact) < 1e-8
    assert metrics["lower_loss"] < 1e-20 and metrics["solver_residual"] < 1e-12
    step = 1.0 / largest_hessian_eigenvalue(est, x, parts.objective.point_weights(context))
    torch.manual_seed(1)
    errors = [
        rel_err(flat(BiSMUnrolled(parts, 1, n, "sgd", step).hypergradient(x, context)[0]), exact)
        for n in (0, 10, 30, 60)
    ]
    assert errors[0] > 0.1  # the plain partial derivative at φ* is not the gradient
    assert errors[1] > errors[2] > errors[3] and errors[3] < 0.01  # fresh lower-level samples each step
    # a wrong q: φ away from φ*, the implicit hypergradient no longer matches
    with torch.no_grad():
        posterior.head.bias.add_(0.3)
    assert rel_err(flat(implicit(parts).hypergradient(x, context)[0]), exact) > 0.05


def test_theorem_1_with_the_kl_lower_level_up_to_sampling_error():
    """One KL sample set is not stationary at φ*, so agreement is only up to Monte-Carlo error."""
    model, posterior, parts, x, context, exact = lg_setup("ssm", KL(n_samples=256))
    torch.manual_seed(3)
    close = rel_err(flat(implicit(parts).hypergradient(x, context)[0]), exact)
    partial = rel_err(flat(BiSMUnrolled(parts, 1, 0, "sgd", 0.1).hypergradient(x, context)[0]), exact)
    assert close < 0.02 and partial > 0.1


def test_implicit_and_unrolled_hypergradients_converge_to_the_same_vector_on_a_grbm():
    model = small_grbm(2, 4)
    posterior = FixedNoiseBernoulli(2, 4, temperature=0.5).double()
    v = torch.randn(64, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    parts = Parts(
        dtype=torch.float64,
        data=DataSplits(train=v, test=v),
        model=model,
        posterior=posterior,
        objective=FixedSSM(64, 2),
        divergence=KL(n_samples=8),
    )
    imp = implicit(parts)
    phi = list(imp.phi.values())
    exact_grbm_posterior(model, posterior)
    for _ in range(8):  # Newton's method to the stationary point φ* of the deterministic lower level
        grad = flat(torch.autograd.grad(imp.lower(v), phi, create_graph=True))
        hessian = torch.stack([flat(torch.autograd.grad(g, phi, retain_graph=True)) for g in grad])
        with torch.no_grad():
            for p, s in zip(phi, unflat(torch.linalg.solve(hessian, grad), phi)):
                p -= s
    assert grad.norm() < 1e-10 and torch.linalg.eigvalsh(hessian.detach()).min() > 0
    target = flat(imp.hypergradient(v, None)[0])
    step = 1.0 / largest_hessian_eigenvalue(imp, v)
    errors = [
        rel_err(flat(BiSMUnrolled(parts, 1, n, "sgd", step).hypergradient(v, None)[0]), target)
        for n in (0, 10, 40, 120)
    ]
    assert errors[0] > 0.1 and errors[0] > errors[1] > errors[2] > errors[3] and errors[3] < 1e-8
    series = BiSMImplicit(parts, 1, functools.partial(neumann, iterations=200, tol=1e-13, step=step))
    assert rel_err(flat(series.hypergradient(v, None)[0]), target) < 1e-8


# ---- estimator steps ------------------------------------------------------------------------


def grbm_parts(objective) -> Parts:
    torch.manual_seed(0)
    data = torch.rand(200, 2)
    return Parts(
        data=DataSplits(train=data, test=data),
        model=GRBM(2, 4),
        posterior=BernoulliPosterior(2, 4),
        objective=objective,
        divergence=KL(),
    )


def gaussian_parts(objective) -> Parts:
    model, posterior, parts = linear_gaussian_parts()
    with torch.no_grad():
        posterior.head.bias.add_(0.2)
    parts.objective, parts.divergence = objective, Fisher()
    return parts


ESTIMATORS = {
    "unrolled-sgd": lambda parts: BiSMUnrolled(parts, 2, 3, "sgd", 0.1),
    "unrolled-adam": lambda parts: BiSMUnrolled(parts, 2, 3, "adam", 0.1),
    "unrolled-N0": lambda parts: BiSMUnrolled(parts, 2, 0, "sgd", 0.1),
    "implicit-cg": lambda parts: BiSMImplicit(
        parts, 2, functools.partial(conjugate_gradient, iterations=5, damping=1e-3)
    ),
    "implicit-neumann": lambda parts: BiSMImplicit(parts, 2, functools.partial(neumann, iterations=5, step=0.05)),
}


@pytest.mark.parametrize("family", ["grbm", "gaussian"])
@pytest.mark.parametrize("objective", ["ssm", "dsm"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_a_step_gives_finite_metrics_and_moves_both_levels(family, objective, estimator):
    parts = (grbm_parts if family == "grbm" else gaussian_parts)(SSM() if objective == "ssm" else DSM(0.1))
    est = ESTIMATORS[estimator](parts)
    batch = parts.data.train[:50]
    theta0 = [p.detach().clone() for p in est.theta]
    phi0 = [p.detach().clone() for p in est.phi.values()]
    for _ in range(2):
        metrics = est.step(batch)
    assert {"loss", "lower_loss"} <= set(metrics)
    assert all(math.isfinite(float(v)) for v in metrics.values())
    norms = [role.take_mean_grad_norm() for role in parts.roles.values()]
    assert all(norm is not None and math.isfinite(norm) for norm in norms)
    moved = [not torch.equal(a, b) for a, b in zip(theta0, est.theta)]
    # with N = 0 the GRBM's c gets no gradient: ŝ depends on c only through φ*(θ)
    assert all(moved) or (estimator == "unrolled-N0" and any(moved))
    assert all(not torch.equal(a, b) for a, b in zip(phi0, est.phi.values()))
    assert set(parts.roles) == {"model", "posterior"}


@pytest.mark.parametrize("estimator", ["unrolled-sgd", "implicit-cg"])
def test_the_posterior_keeps_its_value_after_the_k_real_steps(estimator):
    """The unrolled iterates (and the solve) never touch φ: after a step, φ is what K real
    updates alone give from the same random stream."""
    parts = grbm_parts(DSM(0.1))
    est = ESTIMATORS[estimator](parts)
    state = {k: v.clone() for k, v in parts.posterior.state_dict().items()}
    batch = parts.data.train[:50]
    torch.manual_seed(11)
    est.step(batch)
    stepped = [p.detach().clone() for p in est.phi.values()]

    fresh = grbm_parts(DSM(0.1))
    fresh.posterior.load_state_dict(state)
    other = ESTIMATORS[estimator](fresh)
    torch.manual_seed(11)
    x, _ = other.objective.points(batch)
    other.fit_posterior(x)
    for a, b in zip(stepped, other.phi.values()):
        torch.testing.assert_close(a, b.detach())


def test_the_lower_level_and_the_posterior_see_the_noisy_points_of_dsm():
    seen: list[torch.Tensor] = []

    class Spy(KL):
        def __call__(self, model, posterior, v):
            seen.append(v)
            return super().__call__(model, posterior, v)

    parts = grbm_parts(DSM(0.5))
    parts.divergence = Spy()
    batch = parts.data.train[:50]
    BiSMUnrolled(parts, 2, 2, "sgd", 0.1).step(batch)
    assert len(seen) == 4
    assert all(torch.equal(s, seen[0]) for s in seen) and not torch.equal(seen[0], batch)
    assert (seen[0] - batch).std() == pytest.approx(0.5, rel=0.2)


WEIGHTED_LOWER = {  # K = 2; which divergence call the reported lower loss comes from
    "unrolled-N0": (ESTIMATORS["unrolled-N0"], 1),  # the K-th real step's
    "unrolled-sgd": (ESTIMATORS["unrolled-sgd"], 2),  # the first after the real steps
    "implicit-cg": (ESTIMATORS["implicit-cg"], 2),
    "vages": (lambda parts: build_vages(VaGESConfig(inner_steps=2), parts), 1),
}


@pytest.mark.parametrize("estimator", list(WEIGHTED_LOWER))
@pytest.mark.parametrize("weighting", ["none", "inverse-sigma"])
def test_mdsm_weights_each_lower_level_point_by_one_over_its_noise_level(estimator, weighting):
    """``lower_weighting = "inverse-sigma"`` (the released BiSM and VaGES code divide the lower-level
    divergence at x̃_i by σ_i): BiSM's K real steps and its hypergradient's lower level, and
    VaGES's K steps, use G = mean D_i/σ_i; the reported lower loss is that weighted mean of the
    per-point divergences."""
    seen: list[torch.Tensor] = []

    class Spy(Fisher):
        def __call__(self, model, posterior, v):
            seen.append(super().__call__(model, posterior, v))
            return seen[-1]

    build, call = WEIGHTED_LOWER[estimator]
    cfg = MDSMConfig(sigma_min=0.1, sigma_max=3.0, schedule="geometric", spread="positions", lower_weighting=weighting)
    parts = gaussian_parts(MDSM(cfg))
    parts.divergence = Spy()
    batch = parts.data.train[:50]
    metrics = build(parts).step(batch)
    sigma = 0.1 * 30 ** torch.linspace(0, 1, 50, dtype=batch.dtype)  # spread over the positions
    weights = 1 / sigma if weighting == "inverse-sigma" else torch.ones_like(sigma)
    d = seen[call].detach()
    assert d.mean() > 1e-2  # q is off the exact posterior: the divergences are not all 0
    torch.testing.assert_close(torch.as_tensor(metrics["lower_loss"], dtype=d.dtype), (weights * d).mean())


def test_adam_unroll_needs_an_adam_posterior_optimizer():
    parts = grbm_parts(SSM())
    parts.optimizer_factories["posterior"] = lambda params: torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ConfigError) as err:
        build_unrolled(UnrolledConfig(unroll="adam"), parts)
    assert (err.value.section, err.value.key) == ("estimator", "unroll")
    assert isinstance(build_unrolled(UnrolledConfig(unroll="sgd"), parts), BiSMUnrolled)


# ---- recipes --------------------------------------------------------------------------------


def test_the_new_recipes_validate(cli):
    result = cli(["validate", *(RECIPES / name for name in NEW_RECIPES)])
    assert result.exit_code == 0, result.output


def test_a_short_cpu_run_of_grbm_bissm(tmp_path):
    from tests.support import session_run as run

    overrides = ["run.steps=20", "run.log_every=10", "eval.1.grid=20"]
    run_dir, results = run(RECIPES / "grbm_bissm.toml", overrides, device="cpu", out=tmp_path, echo=lambda _: None)
    assert math.isfinite(results["eval/exact-loglik/test_loglik"])
    assert (run_dir / "metrics.jsonl").exists()


# ---- directions: what a step does, against exact gradients ----------------------------------------


def exact_setup(family: str, objective) -> Parts:
    """float64 parts with q at the exact posterior and plain SGD for both roles (update = −lr·gradient)."""
    if family == "grbm":
        model = small_grbm(2, 4)
        posterior = BernoulliPosterior(2, 4).double()
        exact_grbm_posterior(model, posterior)
        v = torch.randn(64, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        parts = Parts(dtype=torch.float64, data=DataSplits(train=v, test=v), model=model, posterior=posterior)
        parts.divergence = KL()
    else:
        _model, _posterior, parts = linear_gaussian_parts()
        parts.divergence = Fisher()
    parts.objective = objective
    parts.optimizer_factories = {
        "model": lambda params: torch.optim.SGD(params, lr=1e-3),
        "posterior": lambda params: torch.optim.SGD(params, lr=1e-3),
    }
    return parts


def mean_update(params: list[torch.Tensor], act, draws: int, restore) -> torch.Tensor:
    """−Δ/lr of ``params`` (flattened) averaged over ``draws`` calls of ``act(i)`` from the same state."""
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(draws):
        before = flat([p.detach().clone() for p in params])
        torch.manual_seed(1000 + i)
        act(i)
        total += (before - flat([p.detach() for p in params])) / (1e-3 * draws)
        restore()
    return total


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("family", ["grbm", "gaussian"])
@pytest.mark.parametrize("estimator", ["unrolled-sgd", "implicit-cg"])
def test_at_the_exact_posterior_a_step_moves_the_model_along_the_exact_gradient(family, estimator):
    """Theorem 1 through the whole step (K real posterior steps, the hypergradient, the update):
    the model's update, averaged over draws, points along −∇θ of the exact-score objective."""
    parts = exact_setup(family, DSM(0.3))
    est = ESTIMATORS[estimator](parts)
    batch = parts.data.train[:32]
    saved = {k: net.state_dict() for k, net in parts.networks().items()}
    saved = {k: {n: t.clone() for n, t in state.items()} for k, state in saved.items()}

    def restore() -> None:
        for k, net in parts.networks().items():
            net.load_state_dict(saved[k])

    update = mean_update(est.theta, lambda i: est.step(batch), 16, restore)
    torch.manual_seed(7)
    reference = torch.zeros_like(update)
    for _ in range(64):
        x, context = parts.objective.points(batch)
        loss = parts.objective.loss(lambda z: exact_score(parts.model, z), x, context).mean() / 64
        reference += flat(torch.autograd.grad(loss, est.theta))
    assert cosine(update, reference) > 0.9, cosine(update, reference)


@pytest.mark.parametrize("family", ["grbm", "gaussian"])
def test_the_real_lower_level_steps_descend_the_divergence(family):
    """From a perturbed q, one real posterior step moves φ along −∇φ E[G] (G averaged over many samples)."""
    parts = exact_setup(family, DSM(0.3))
    with torch.no_grad():
        for p in parts.posterior.parameters():
            p.add_(0.5 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(2)))
    est = ESTIMATORS["unrolled-sgd"](parts)
    est.inner_steps = 1
    x = parts.data.train[:32]
    phi = list(est.phi.values())
    saved = [p.detach().clone() for p in phi]

    def restore() -> None:
        with torch.no_grad():
            for p, s in zip(phi, saved):
                p.copy_(s)

    update = mean_update(phi, lambda i: est.fit_posterior(x), 32, restore)
    many = type(parts.divergence)(n_samples=4096)
    torch.manual_seed(3)
    reference = flat(torch.autograd.grad(many(parts.model, parts.posterior, x).mean(), phi))
    assert cosine(update, reference) > 0.9, cosine(update, reference)
