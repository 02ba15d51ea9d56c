"""Hypergradients that see the flat directions of BiSM's lower level (docs/results.md, "Why BiSSM
plateaus below SSM"): the KL lower level in closed form for an energy linear in h (``[divergence] exact``), the Bernoulli
posterior's Fisher blocks, the Gauss-Newton unrolled step (``unroll = "natural"``) and the block
solve of the implicit estimator (``hessian = "fisher-blocks"``); each hypergradient against
central finite differences, and the options off changing nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from eblvm_bism import (
    BiSMImplicit,
    BiSMUnrolled,
    ImplicitConfig,
    UnrolledConfig,
    build_implicit,
    build_unrolled,
    modified_score,
)
from eblvm_divergences import KL, KLConfig, build_kl, nonlinearity_in_latent
from eblvm_grbm.model import GRBM, all_binary
from eblvm_posteriors import BernoulliPosterior
from eblvm_score.objectives import DSM, SM, SSM

from eblvm.testing import linear_gaussian_parts
from eblvm_core.bilevel import flat, grads_or_zeros
from eblvm_core.contracts import DataSplits, Parts, exact_score
from eblvm_core.errors import ConfigError
from tests.plugins.bism.test_bism import FixedNoiseBernoulli, FixedSSM, small_grbm
from tests.plugins.bism.test_bism import exact_grbm_posterior as set_exact
from tests.plugins.grbm.test_grbm_baselines import exact_samples
from tests.support import RECIPES

F64 = torch.float64


def perturb(posterior: BernoulliPosterior, scale: float = 0.3, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in posterior.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def grbm_parts(
    n: int = 48, d: int = 2, m: int = 3, coupling: str = "plain", exact_kl: bool = True, temperature: float = 0.3
) -> Parts:
    """float64 GRBM parts, q near (not at) the exact posterior, fixed relaxation noise and slices."""
    model = small_grbm(d, m, coupling=coupling)
    v = torch.randn(n, d, dtype=F64, generator=torch.Generator().manual_seed(0))
    posterior = FixedNoiseBernoulli(d, m, temperature=temperature).double()
    set_exact(model, posterior)
    perturb(posterior)
    return Parts(
        dtype=F64,
        data=DataSplits(train=v, test=v),
        model=model,
        posterior=posterior,
        objective=FixedSSM(n, d),
        divergence=KL(exact=exact_kl),
    )


def unit_vector(posterior: BernoulliPosterior) -> torch.Tensor:
    """φ as (m, d + 1) rows [bias_j, weight_j]: the Fisher blocks' layout."""
    return torch.cat([posterior.net[0].bias.unsqueeze(-1), posterior.net[0].weight], -1)


# ---- the exact KL ---------------------------------------------------------------------------------


def enumerated_kl(model: GRBM, posterior: BernoulliPosterior, v: torch.Tensor) -> torch.Tensor:
    """Σ_h q(h|v)[log q(h|v) + E(v, h)] over the 2^m binary h: (B,)."""
    hs = all_binary(posterior.net[0].out_features, v)  # (2^m, m)
    b = len(v)
    log_q = torch.stack([posterior.log_prob(h.expand(b, -1), v) for h in hs])  # (2^m, B)
    energy = torch.stack([model.energy(v, h.expand(b, -1)) for h in hs])
    return (log_q.exp() * (log_q + energy)).sum(0)


@pytest.mark.parametrize("coupling", ["plain", "scaled"])
def test_the_exact_kl_is_the_expectation_over_every_binary_h_with_its_gradients(coupling):
    """[divergence] exact equals Σ_h q(h)[log q + E] by enumeration, value and gradient in θ and φ,
    and KL(q ‖ p) + F(v) with KL computed from p(h|v) itself; it is 0 + F(v) at q = p."""
    parts = grbm_parts(n=12, d=3, m=4, coupling=coupling)
    model, posterior, v = parts.model, parts.posterior, parts.data.train
    exact = KL(exact=True)(model, posterior, v)
    enumerated = enumerated_kl(model, posterior, v)
    torch.testing.assert_close(exact, enumerated, rtol=1e-12, atol=1e-12)
    params = list(model.parameters()) + list(posterior.parameters())
    for a, b in zip(
        torch.autograd.grad(exact.sum(), params), torch.autograd.grad(enumerated_kl(model, posterior, v).sum(), params)
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # KL(q ‖ p) from the model's exact posterior, independently
    q = posterior.mean(v)
    p = torch.sigmoid(model.hidden_logits(v))
    kl = (q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()).sum(-1)
    torch.testing.assert_close(exact.detach(), (kl + model.free_energy(v)).detach(), rtol=1e-12, atol=1e-12)
    assert kl.min() > 1e-3  # q is away from p here
    set_exact(model, posterior)
    torch.testing.assert_close(KL(exact=True)(model, posterior, v), model.free_energy(v), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_the_sampled_kl_tends_to_the_exact_one_at_a_low_temperature():
    """Many relaxed samples at T = 0.02: their mean is the exact KL within its Monte-Carlo error."""
    model = small_grbm(3, 4, coupling="plain")
    posterior = BernoulliPosterior(3, 4, temperature=0.02).double()
    set_exact(model, posterior)
    perturb(posterior, 0.5)
    v = torch.randn(8, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    draws = torch.stack([KL(n_samples=1)(model, posterior, v).detach() for _ in range(20000)])
    exact = KL(exact=True)(model, posterior, v).detach()
    error = (draws.mean(0) - exact).abs()
    stderr = draws.std(0) / math.sqrt(len(draws))
    assert (error < 4 * stderr + 2e-3).all(), (error, stderr)
    assert draws.std(0).min() > 0.05  # the sampled one is noisy; the exact one has no noise at all


def test_the_exact_kl_is_refused_where_it_is_not_exact():
    """Its factory checks the energy's linearity in h (no declared capability exists yet) and the
    posterior's closed forms; an energy with an h_j h_k term, a Gaussian latent, samples: refused."""

    class Coupled(GRBM):
        def energy(self, v, h):
            return super().energy(v, h) + 0.5 * h[..., 0] * h[..., 1]

    v = torch.randn(20, 2)
    for model in (GRBM(2, 3), Coupled(2, 3)):
        parts = Parts(data=DataSplits(train=v, test=v), model=model, posterior=BernoulliPosterior(2, 3))
        if type(model) is GRBM:
            assert nonlinearity_in_latent(model, parts.data) < 1e-6
            assert build_kl(KLConfig(exact=True), parts).exact
            for bad in (KLConfig(exact=True, n_samples=2), KLConfig(exact=True, importance_weighted=True)):
                with pytest.raises(ConfigError, match="draws no samples"):
                    build_kl(bad, parts)
        else:
            assert nonlinearity_in_latent(model, parts.data) > 1e-2
            with pytest.raises(ConfigError, match="not linear in h") as err:
                build_kl(KLConfig(exact=True), parts)
            assert (err.value.section, err.value.key) == ("divergence", "exact")
    _model, _posterior, gaussian = linear_gaussian_parts()
    with pytest.raises(ConfigError, match="closed form"):
        build_kl(KLConfig(exact=True), gaussian)


# ---- Fisher blocks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("coupling", ["plain", "scaled"])
def test_the_fisher_blocks_are_the_exact_kl_hessian_at_the_exact_posterior(coupling):
    """At q = p(h|v), autograd's Hessian of the batch-mean exact KL in φ is block-diagonal over the
    hidden units, each block F_j = mean q_j(1 − q_j) z zᵀ; away from it the Hessian differs (the
    blocks are then its Gauss-Newton part). The mixed Hessian in (c_j, U_j) and φ_j is −F_j (plain)."""
    parts = grbm_parts(n=30, d=2, m=3, coupling=coupling)
    model, posterior, v = parts.model, parts.posterior, parts.data.train
    m, k = 3, 3

    def hessian() -> torch.Tensor:
        phi0 = unit_vector(posterior).detach().reshape(-1)

        def lower(vec: torch.Tensor) -> torch.Tensor:
            rows = vec.view(m, k)
            logits = rows[:, 0] + v @ rows[:, 1:].T
            q = torch.sigmoid(logits)
            negative_entropy = (q * logits - torch.nn.functional.softplus(logits)).sum(-1)
            return (negative_entropy + model.energy(v, q)).mean()

        return torch.autograd.functional.hessian(lower, phi0).view(m, k, m, k)

    set_exact(model, posterior)
    blocks = posterior.fisher_blocks(v).matrices()
    assert blocks.shape == (m, k, k) and blocks.dtype == F64 and not blocks.requires_grad
    full = hessian().detach()
    for i in range(m):
        for j in range(m):
            expected = blocks[i] if i == j else torch.zeros(k, k, dtype=F64)
            torch.testing.assert_close(full[i, :, j, :], expected, rtol=1e-10, atol=1e-12)
    assert min(float(torch.linalg.eigvalsh(b).min()) for b in blocks) > 1e-6  # positive definite
    # the mixed Hessian ∂²G/∂φ_j∂(c_j, W_j) = −F_j for the plain coupling
    if coupling == "plain":
        grad_phi = torch.autograd.grad(
            KL(exact=True)(model, posterior, v).mean(),
            [posterior.net[0].bias, posterior.net[0].weight],
            create_graph=True,
        )
        for j in range(m):
            row_c = torch.autograd.grad(grad_phi[0][j], [model.c, model.W], retain_graph=True)
            torch.testing.assert_close(row_c[0][j], -blocks[j][0, 0], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(row_c[1][:, j], -blocks[j][0, 1:], rtol=1e-10, atol=1e-12)
    perturb(posterior, 0.5)
    away = hessian().detach()
    blocks = posterior.fisher_blocks(v).matrices()
    assert max(float((away[j, :, j, :] - blocks[j]).abs().max()) for j in range(m)) > 1e-3


def test_solve_blocks_solves_each_unit_and_keeps_the_layout():
    posterior = BernoulliPosterior(2, 3).double()
    v = torch.randn(40, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    blocks = posterior.fisher_blocks(v)
    g = torch.Generator().manual_seed(2)
    vectors = {
        "net.0.bias": torch.randn(3, generator=g, dtype=F64),
        "net.0.weight": torch.randn(3, 2, generator=g, dtype=F64),
    }
    out = posterior.solve_blocks(blocks, vectors, 0.01)
    assert {k: t.shape for k, t in out.items()} == {k: t.shape for k, t in vectors.items()}
    x = torch.cat([out["net.0.bias"].unsqueeze(-1), out["net.0.weight"]], -1)
    rhs = torch.cat([vectors["net.0.bias"].unsqueeze(-1), vectors["net.0.weight"]], -1)
    dense = blocks.matrices()
    torch.testing.assert_close((dense + 0.01 * torch.eye(3, dtype=F64)) @ x.unsqueeze(-1), rhs.unsqueeze(-1))
    assert posterior.has_fisher_blocks and not BernoulliPosterior(2, 3, hidden=[4]).has_fisher_blocks


@pytest.mark.parametrize("damping", [1e-6, 1e-2])
def test_fewer_points_than_dimensions_solve_by_woodbury_as_the_dense_blocks_do(damping):
    """n = 12 points of d = 30 (Frey face's shape: 100 of 560): the n × n solve per unit gives the
    dense (F_j + λI)⁻¹g, for a g off the points' span too, and its gradient in g (the unrolled step's)."""
    g = torch.Generator().manual_seed(3)
    posterior = BernoulliPosterior(30, 5).double()
    with torch.no_grad():
        posterior.net[0].weight.normal_(0, 0.5, generator=g)
    blocks = posterior.fisher_blocks(torch.rand(12, 30, dtype=F64, generator=g))
    assert blocks.z.shape == (12, 31)
    rhs = torch.randn(5, 31, generator=g, dtype=F64, requires_grad=True)
    woodbury = blocks.solve(rhs, damping)
    dense = torch.linalg.solve(blocks.matrices() + damping * torch.eye(31, dtype=F64), rhs.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(woodbury, dense, rtol=1e-7, atol=1e-9 * float(dense.detach().abs().max()))
    weights = torch.randn(5, 31, generator=g, dtype=F64)
    (grad_woodbury,) = torch.autograd.grad((woodbury * weights).sum(), rhs)
    (grad_dense,) = torch.autograd.grad((dense * weights).sum(), rhs)
    torch.testing.assert_close(grad_woodbury, grad_dense, rtol=1e-7, atol=1e-9 * float(grad_dense.abs().max()))


# ---- hypergradients against finite differences ------------------------------------------------------

ESTIMATORS = {
    "natural-N1-exact-kl": (lambda p: BiSMUnrolled(p, 1, 1, "natural", 1.0, 1e-6), True),
    "natural-N3-exact-kl": (lambda p: BiSMUnrolled(p, 1, 3, "natural", 0.7, 1e-3), True),
    "natural-N1-sampled-kl": (lambda p: BiSMUnrolled(p, 1, 1, "natural", 1.0, 1e-2), False),
    "natural-N3-sampled-kl": (lambda p: BiSMUnrolled(p, 1, 3, "natural", 0.5, 1e-2), False),
    "sgd-N5-exact-kl": (lambda p: BiSMUnrolled(p, 1, 5, "sgd", 1.0), True),
}


def along(estimator, direction: torch.Tensor, eps: float, value) -> float:
    """Central difference of ``value()`` along ``direction`` over θ."""
    theta = estimator.theta

    def shift(step: float) -> None:
        with torch.no_grad():
            for p, part in zip(theta, direction.split([p.numel() for p in theta])):
                p.add_(step * part.view_as(p))

    shift(eps)
    up = value()
    shift(-2 * eps)
    down = value()
    shift(eps)
    return (up - down) / (2 * eps)


@pytest.mark.parametrize("coupling", ["plain", "scaled"])
@pytest.mark.parametrize("case", list(ESTIMATORS))
def test_the_unrolled_hypergradients_match_finite_differences(case, coupling):
    """dJ_Bi(θ, φ_N(θ))/dθ against central differences of θ ↦ J_Bi(θ, φ_N(θ)) (the same relaxation
    noise and slices at every evaluation), along three random directions over all of θ. The partial
    derivative at the fixed φ_N misses by far more than the tolerance, so the check sees φ_N(θ)."""
    build, exact_kl = ESTIMATORS[case]
    parts = grbm_parts(coupling=coupling, exact_kl=exact_kl)
    check_against_finite_differences(build(parts), parts.data.train)


def test_the_gauss_newton_hypergradient_by_woodbury_matches_finite_differences():
    """Fewer points than dimensions (6 in 8, as Frey face's 100 in 560): the step's block solve goes
    through Woodbury's n × n systems, and the hypergradient still matches central differences."""
    parts = grbm_parts(n=6, d=8, m=3, exact_kl=True)
    estimator = BiSMUnrolled(parts, 1, 2, "natural", 0.8, 1e-3)
    x = parts.data.train
    assert estimator.fisher_blocks(x).z.shape == (6, 9)  # n < k: the Woodbury path
    check_against_finite_differences(estimator, x)


def check_against_finite_differences(estimator: BiSMUnrolled, x: torch.Tensor) -> None:
    """The hypergradient along three random directions of θ against central differences of
    θ ↦ J_Bi(θ, φ_N(θ)); the partial derivative at the fixed φ_N must miss."""
    grad = flat(estimator.hypergradient(x, None)[0])
    params, _ = estimator.unrolled(x)
    upper = estimator.functional.call({k: p.detach() for k, p in params.items()}, estimator.upper, x, None)
    partial = flat(grads_or_zeros(upper, estimator.theta))
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        d = torch.randn(grad.numel(), generator=g, dtype=F64)
        d /= d.norm()
        fd = along(estimator, d, 1e-5, lambda: float(estimator.hypergradient(x, None)[1]["loss"]))
        assert abs(float(grad @ d) - fd) <= 1e-6 * abs(fd) + 1e-9, (float(grad @ d), fd)
        assert abs(float(partial @ d) - fd) > 1e-3 * abs(fd)


@pytest.mark.parametrize("coupling", ["plain", "scaled"])
@pytest.mark.parametrize("exact_kl", [True, False], ids=["exact-kl", "sampled-kl"])
def test_the_implicit_block_hypergradient_matches_finite_differences_through_the_exact_posterior(coupling, exact_kl):
    """At q = p(h|v), the minimiser of the exact KL, the implicit hypergradient with the Fisher
    blocks (no damping) is d/dθ J_Bi(θ, φ*(θ)), φ*(θ) = (c, Uᵀ): against central differences with
    q reset to the exact posterior at every θ. With the sampled KL the mixed term is one sample's,
    so it matches only with the exact lower level (the check fails by far with the sampled one)."""
    parts = grbm_parts(coupling=coupling, exact_kl=exact_kl)
    model, posterior, x = parts.model, parts.posterior, parts.data.train
    estimator = BiSMImplicit(parts, 1, None, block_damping=0.0)
    set_exact(model, posterior)
    grad = flat(estimator.hypergradient(x, None)[0])

    def value() -> float:
        set_exact(model, posterior)
        return float(estimator.upper(x, None).detach())

    g = torch.Generator().manual_seed(5)
    errors = []
    for _ in range(3):
        d = torch.randn(grad.numel(), generator=g, dtype=F64)
        d /= d.norm()
        fd = along(estimator, d, 1e-5, value)
        errors.append(abs(float(grad @ d) - fd) / abs(fd))
    if exact_kl:
        assert max(errors) < 1e-6, errors
    else:
        assert max(errors) > 1e-2, errors


@pytest.mark.parametrize("objective", ["ssm", "dsm"])
def test_one_gauss_newton_step_on_the_exact_kl_gives_the_exact_score_gradient(objective):
    """What removes the bias (docs/results.md): for a GRBM and linear logits the residual l − ℓ is
    linear in [1, v], so one undamped Gauss-Newton step on the exact KL lands on φ*(θ) from any q
    and its derivative is dφ*/dθ: the hypergradient is the exact-score gradient of the objective
    on the same points and slices, whatever the relaxation noise. Five plain steps are far off."""
    parts = grbm_parts(n=64, coupling="scaled")
    parts.objective = FixedSSM(64, 2) if objective == "ssm" else DSM(0.3)
    torch.manual_seed(0)
    x, context = parts.objective.points(parts.data.train)
    model = parts.model
    loss = parts.objective.loss(lambda z: exact_score(model, z), x, context).mean()
    exact = flat(torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad]))

    def error(estimator) -> float:
        return float((flat(estimator.hypergradient(x, context)[0]) - exact).norm() / exact.norm())

    assert error(BiSMUnrolled(parts, 1, 1, "natural", 1.0, 0.0)) < 1e-8
    assert error(BiSMUnrolled(parts, 1, 5, "sgd", 1.0)) > 0.05
    parts.divergence = KL()  # one relaxed sample: the Newton step follows its noise
    assert error(BiSMUnrolled(parts, 1, 1, "natural", 1.0, 1e-6)) > 0.05


@pytest.mark.parametrize("coupling", ["plain", "scaled"])
def test_sigma_reaches_the_posterior_only_under_the_scaled_coupling(coupling):
    """Why BiSSM with plain unrolled steps fails under the scaled coupling (docs/results.md): with q
    at the exact posterior, the partial derivative (N = 0) misses the path through φ*(θ). Under the
    plain coupling the logits c + Wᵀv hold no σ, so in log σ the partial derivative is the exact
    SM gradient; under the scaled one (c + Wᵀv/σ) it is not, while W, which moves φ* under both,
    is missed under both."""
    parts = grbm_parts(n=64, coupling=coupling)
    set_exact(parts.model, parts.posterior)
    model = parts.model
    x, context = parts.objective.points(parts.data.train)
    loss = parts.objective.loss(lambda z: exact_score(model, z), x, context).mean()
    names = [name for name, _ in model.named_parameters()]
    exact = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    partial = dict(zip(names, BiSMUnrolled(parts, 1, 0, "sgd", 1.0).hypergradient(x, context)[0]))
    sigma_miss = float((partial["log_sigma"] - exact["log_sigma"]).abs() / exact["log_sigma"].abs())
    assert float((partial["W"] - exact["W"]).norm() / exact["W"].norm()) > 0.05
    assert torch.allclose(partial["b"], exact["b"], rtol=1e-10, atol=1e-12)  # b is not in the logits
    if coupling == "plain":
        assert sigma_miss < 1e-10
    else:
        assert sigma_miss > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["plain", "scaled"])
def test_what_the_partial_derivative_misses_is_sm_s_trace_term_through_q(coupling):
    """Why BiSSM's partial derivative misses so much and BiDSM's little (docs/results.md). Integrated
    by parts, SM's objective on the modified score is ½E‖ŝ − ∇log p_data‖² − E[ŝᵀ∇_v log r(h|v)] + const
    (r: the density h is drawn from, ∇_v at fixed h). At φ* ŝ is the marginal score for every h, so
    on data drawn from the model (no score error) ∂J/∂φ is the second term's alone: for linear
    logits l = Av + c', ∂J/∂A_j = E_x[m′(l_j)]·A_j with m(l) = E[h_j] under the relaxed draw, and
    ∂J/∂c' = 0. DSM has no such term: its ∂J/∂φ is linear in the model's score error."""
    model = small_grbm(2, 3, coupling=coupling)
    posterior = BernoulliPosterior(2, 3, temperature=0.3).double()
    set_exact(model, posterior)
    torch.manual_seed(0)
    x = exact_samples(model, 50_000)
    weight, bias = posterior.net[0].weight, posterior.net[0].bias
    grad_weight, grad_bias = torch.autograd.grad(
        SM().loss(modified_score(model, posterior), x, None).mean(), [weight, bias]
    )
    u = (torch.arange(250, dtype=F64) + 0.5) / 250  # midpoint rule over the relaxed draw's uniform (1e-5 relative)
    with torch.no_grad():
        h = torch.sigmoid((posterior.logits(x).unsqueeze(-1) + torch.logit(u)) / posterior.temperature)
        closed_form = (h * (1 - h)).mean((0, 2))[:, None] / posterior.temperature * weight
    error = float((grad_weight - closed_form).norm() / closed_form.norm())
    assert error < 0.04, error  # the Monte Carlo error: 0.9% (scaled), 1.8% (plain)
    assert float(grad_bias.norm() / closed_form.norm()) < 0.03


# ---- configuration, and the options off -------------------------------------------------------------


def test_the_natural_unroll_and_the_block_solve_need_linear_bernoulli_logits():
    v = torch.randn(20, 2)
    for posterior, ok in ((BernoulliPosterior(2, 3), True), (BernoulliPosterior(2, 3, hidden=[4]), False)):
        parts = Parts(
            data=DataSplits(train=v, test=v), model=GRBM(2, 3), posterior=posterior, objective=SSM(), divergence=KL()
        )
        for build, cfg, key in (
            (build_unrolled, UnrolledConfig(unroll="natural"), "unroll"),
            (build_implicit, ImplicitConfig(hessian="fisher-blocks"), "hessian"),
        ):
            if ok:
                assert build(cfg, parts) is not None
            else:
                with pytest.raises(ConfigError, match="Fisher blocks") as err:
                    build(cfg, parts)
                assert (err.value.section, err.value.key) == ("estimator", key)
    assert build_implicit(ImplicitConfig(), parts).block_damping is None


def checkpoint_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    return {f"{net}.{name}": t for net, params in state["networks"].items() for name, t in params.items()}


@pytest.mark.slow
def test_the_options_off_change_nothing_and_on_they_train(tmp_path):
    """grbm_bissm for 30 steps: with every new option spelled out at its off value (and the natural
    damping, unused by the sgd unroll, changed) the checkpoint is bit-identical to the recipe's; the
    variant of recipes/compare/checkerboard_flat.toml trains to finite values and moves away from it."""
    from tests.support import session_run as run

    base = ["run.steps=30", "run.log_every=10", "run.eval_every=30", "run.checkpoint_every=30", "eval.1.grid=20"]
    off = ["divergence.exact=false", 'estimator.unroll="sgd"', "estimator.natural_damping=0.5"]
    on = ["divergence.exact=true", 'estimator.unroll="natural"', "estimator.unroll_steps=1"]
    runs = {}
    for name, extra in (("recipe", []), ("off", off), ("on", on)):
        run_dir, results = run(
            RECIPES / "grbm_bissm.toml", [*base, *extra], device="cpu", out=tmp_path / name, echo=lambda _: None
        )
        assert math.isfinite(results["eval/exact-loglik/test_loglik"])
        runs[name] = checkpoint_tensors(run_dir)
    assert runs["recipe"].keys() == runs["off"].keys()
    assert all(torch.equal(runs["recipe"][k], runs["off"][k]) for k in runs["recipe"])
    assert not torch.equal(runs["recipe"]["model.W"], runs["on"]["model.W"])
