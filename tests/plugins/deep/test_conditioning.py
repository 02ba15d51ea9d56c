"""Conditioning on v (``EnergyModel.condition``): the deep EBLVM's features f(v) computed once per
update instead of once per evaluation of E, with the same updates as evaluating E in full.

Uncached runs use ``Uncached``, the same ResNet EBLVM (same parameters from the same seed)
without the capability, so the estimators take the path every other model takes."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from eblvm_bism import BiSMImplicit, BiSMUnrolled, modified_score
from eblvm_deep.models import ResNetEBLVM
from eblvm_deep.nets import ResNetFeatures, spectrally_normalise
from eblvm_divergences import KL, Fisher
from eblvm_grbm.model import GRBM
from eblvm_posteriors import GaussianPosterior
from eblvm_score.objectives import DSM, MDSM, SSM, MDSMConfig
from eblvm_vages.estimators import VaGESConfig, VariationalScore

from eblvm.testing import make
from eblvm_core import distributed
from eblvm_core.bilevel import Functional, condition_on, conjugate_gradient, flat, grads_or_zeros, sgd_step
from eblvm_core.contracts import Conditioned, DataSplits, EnergyModel, Parts, energies
from eblvm_core.startup import worker_context
from tests.plugins.bism.test_bism import grbm_parts

F64 = torch.float64
SHAPE = (1, 8, 8)
LATENT = 3


class Uncached(ResNetEBLVM):
    """The ResNet EBLVM without the capability: every evaluation of E computes f(v)."""

    condition = EnergyModel.condition


def resnet(cls: type = ResNetEBLVM, dtype: torch.dtype = F64, seed: int = 0, spectral_norm: bool = False):
    """E = g(f(v), h) at tiny size: width 4, 2 stages of 1 block on 1×8×8 images, m = 3, head 64."""
    torch.manual_seed(seed)
    model = cls(ResNetFeatures(SHAPE[0], 4, 2, 1), 16 * 2 * 2, LATENT, 64)
    if spectral_norm:
        spectrally_normalise(model)
    return model.to(dtype)


def deep_parts(cached: bool, dtype: torch.dtype = F64, spectral_norm: bool = False, seed: int = 0) -> Parts:
    """Parts with the tiny ResNet EBLVM (cached or not, the same parameters) and a Gaussian MLP q."""
    x = torch.rand(16, *SHAPE, generator=torch.Generator().manual_seed(0), dtype=dtype)
    parts = Parts(dtype=dtype, data=DataSplits(train=x, test=x[:4]))
    parts.model = resnet(ResNetEBLVM if cached else Uncached, dtype, seed, spectral_norm)
    torch.manual_seed(seed + 1)
    parts.posterior = make("posteriors", "gaussian", parts, hidden=[8]).to(dtype)
    return parts


def count_feature_forwards(model: ResNetEBLVM) -> list[int]:
    calls = [0]
    model.features.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def parameters(parts: Parts) -> list[torch.Tensor]:
    return [p.detach().clone() for name in ("model", "posterior") for p in parts.networks()[name].parameters()]


def mdsm() -> MDSM:
    return MDSM(MDSMConfig(sigma_min=0.1, sigma_max=1.0, sigma0=0.3))


# ---- the contract --------------------------------------------------------------------------------


def test_the_conditioned_energy_is_the_energy_with_the_same_gradients():
    """h ↦ E(v, h) from the cache equals energy(v, h), and so do ∇_h and ∇_θ; k samples broadcast."""
    model = resnet()
    calls = count_feature_forwards(model)
    g = torch.Generator().manual_seed(3)
    v = torch.rand(5, *SHAPE, generator=g, dtype=F64)
    h = torch.randn(5, LATENT, generator=g, dtype=F64, requires_grad=True)
    theta = list(model.parameters())

    full = model.energy(v, h)
    grads_full = torch.autograd.grad(full.sum(), [h, *theta])
    energy = model.condition(v)
    assert calls[0] == 2
    cached = energy(h)
    grads_cached = torch.autograd.grad(cached.sum(), [h, *theta])
    assert calls[0] == 2  # no forward of f after condition
    torch.testing.assert_close(cached, full, rtol=1e-14, atol=0)
    for a, b in zip(grads_cached, grads_full):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert grads_full[1].abs().max() > 0  # f's first conv gets a gradient

    hk = torch.randn(4, 5, LATENT, generator=g, dtype=F64)  # k = 4 samples per point
    expanded = model.energy(v.repeat(4, 1, 1, 1), hk.reshape(20, LATENT)).view(4, 5)
    torch.testing.assert_close(energy(hk), expanded, rtol=1e-13, atol=0)
    torch.testing.assert_close(energies(energy, v, hk), expanded, rtol=1e-13, atol=0)
    assert calls[0] == 3


def test_a_conditioned_energy_stands_in_for_the_model_at_its_own_points_only():
    model = resnet()
    calls = count_feature_forwards(model)
    g = torch.Generator().manual_seed(4)
    v, other = torch.rand(2, 5, *SHAPE, generator=g, dtype=F64)
    h = torch.randn(5, LATENT, generator=g, dtype=F64)
    energy = model.condition(v)
    assert calls[0] == 1
    torch.testing.assert_close(energy.energy(v, h), model.energy(v, h), rtol=1e-14, atol=0)
    assert calls[0] == 2  # the model's own call; the conditioned one used its cache
    # any other tensor, even an equal copy, is evaluated in full
    for x in (other, v.clone(), v.detach()):
        before = calls[0]
        torch.testing.assert_close(energy.energy(x, h), model.energy(x, h), rtol=0, atol=0)
        assert calls[0] == before + 2
    # v changed in place since: the cache is stale, so the energy is computed in full
    w = v.clone()
    stale = model.condition(w)
    w.add_(0.5)
    assert not stale.conditions(w)
    torch.testing.assert_close(stale.energy(w, h), model.energy(w, h), rtol=0, atol=0)
    # the model's attributes come through; ``model`` is the model itself
    assert energy.latent is model.latent and energy.model is model
    assert [id(p) for p in energy.parameters()] == [id(p) for p in model.parameters()]


def test_a_detached_or_no_grad_conditioned_energy_gives_theta_no_gradient_through_f():
    model = resnet()
    v = torch.rand(5, *SHAPE, generator=torch.Generator().manual_seed(5), dtype=F64)
    h = torch.randn(5, LATENT, dtype=F64)
    f_params = [*model.features.parameters(), *model.to_latent.parameters()]
    for energy in (model.condition(v).detach(), condition_on(model, v, graph=False)):
        assert not energy.cache.requires_grad
        grads = torch.autograd.grad(energy(h).sum(), f_params + list(model.head.parameters()), allow_unused=True)
        assert all(g is None for g in grads[: len(f_params)]) and all(g is not None for g in grads[len(f_params) :])
    assert condition_on(model, v, graph=True).cache.requires_grad


def test_the_capability_is_declared():
    """ResNetEBLVM declares it; the GRBM does not and gets itself back from ``condition_on``; the
    default ``condition`` (no cache) is the model's own energy."""
    assert resnet().has_conditioning and not resnet(Uncached).has_conditioning
    grbm = GRBM(3, 4)
    v, h = torch.randn(6, 3), torch.bernoulli(torch.full((6, 4), 0.5))
    assert not grbm.has_conditioning and condition_on(grbm, v) is grbm and condition_on(grbm, v, graph=False) is grbm
    default = grbm.condition(v)
    assert isinstance(default, Conditioned) and default.cache is None
    assert torch.equal(default(h), grbm.energy(v, h))
    hk = torch.bernoulli(torch.full((3, 6, 4), 0.5))
    assert torch.equal(default(hk), grbm.energy(v.repeat(3, 1), hk.reshape(18, 4)).view(3, 6))


# ---- BiSM and VaGES: cached and uncached updates are the same ------------------------------------

BISM = {
    "unrolled-sgd-K3-N2-mdsm-fisher": (lambda p: BiSMUnrolled(p, 3, 2, "sgd", 1e-3), mdsm, Fisher),
    "unrolled-adam-K3-N2-dsm-kl": (lambda p: BiSMUnrolled(p, 3, 2, "adam", 1e-3), lambda: DSM(0.3), KL),
    "unrolled-sgd-K3-N2-ssm-fisher": (lambda p: BiSMUnrolled(p, 3, 2, "sgd", 1e-3), SSM, Fisher),
    "unrolled-K5-N0-mdsm-fisher": (lambda p: BiSMUnrolled(p, 5, 0, "sgd", 1e-3), mdsm, Fisher),
    "implicit-K3-mdsm-fisher": (
        lambda p: BiSMImplicit(p, 3, functools.partial(conjugate_gradient, iterations=3, damping=1e-3)),
        mdsm,
        Fisher,
    ),
}
# fp32: the two paths sum f's gradient contributions in another order (one backward through f of
# their sum, or one per evaluation); Adam then turns a rounding difference of the gradient into one
# of the step. Measured: 3e-8 after 3 steps of 1e-3; the tolerance is 0.1% of one step.
TOLERANCE = {F64: 1e-10, torch.float32: 1e-6}


def steps(parts: Parts, estimator, n: int = 3) -> list[torch.Tensor]:
    batch = parts.data.train
    torch.manual_seed(11)
    for _ in range(n):
        metrics = estimator.step(batch)
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())
    return parameters(parts)


def compare_cached_and_uncached(build, objective, divergence, dtype, **parts_options) -> None:
    runs = []
    for cached in (True, False):
        parts = deep_parts(cached, dtype, **parts_options)
        parts.objective, parts.divergence = objective(), divergence()
        start = parameters(parts)
        runs.append(steps(parts, build(parts)))
    moved = max(float((a - b).abs().max()) for a, b in zip(runs[1], start))
    gap = max(float((a - b).abs().max()) for a, b in zip(*runs))
    assert moved > 1e-3, "the parameters hardly move: the comparison would prove nothing"
    assert gap <= TOLERANCE[dtype], f"cached and uncached parameters differ by {gap:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(BISM))
def test_cached_and_uncached_bism_updates_give_the_same_parameters(case, dtype):
    """Three steps (K real, N unrolled, the θ update) from the same parameters and random stream."""
    build, objective, divergence = BISM[case]
    compare_cached_and_uncached(build, objective, divergence, dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
def test_cached_and_uncached_vages_updates_give_the_same_parameters(dtype):
    """VaGES-MDSM with K = 3 lower-level steps and 3 Langevin steps on h, which use f(x) once."""

    def build(parts):
        return VariationalScore(parts, VaGESConfig(n_samples=2, inner_steps=3, langevin_steps=3), covariance=True)

    compare_cached_and_uncached(build, mdsm, Fisher, dtype)


@pytest.mark.parametrize("mode", ["eval", "one power iteration per update"])
def test_with_spectral_norm_the_paths_agree_when_the_power_iteration_does(mode):
    """Spectral norm's power iteration advances at every evaluation of a normalised weight in
    training mode: uncached, f's layers iterate once per evaluation of E (K + N + 1 times per
    update), cached once per f computed, so in training mode their σ estimates (and the updates)
    differ by the iteration's residual. With the iteration frozen (eval) or run once per update
    in both (``parametrize.cached()`` around the step) they are the same math."""
    runs = []
    for cached in (True, False):
        parts = deep_parts(cached, spectral_norm=True)
        if mode == "eval":
            parts.model.eval()
        parts.objective, parts.divergence = mdsm(), Fisher()
        estimator = BiSMUnrolled(parts, 3, 2, "sgd", 1e-3)
        torch.manual_seed(11)
        for _ in range(3):
            with parametrize.cached() if mode != "eval" else torch.enable_grad():
                estimator.step(parts.data.train)
        runs.append(parameters(parts))
    gap = max(float((a - b).abs().max()) for a, b in zip(*runs))
    assert gap <= 1e-10, gap


def test_the_real_lower_level_steps_see_f_without_its_graph_and_the_unrolled_ones_with_it():
    """One f(x) per update: the K real steps get it detached (θ gets no gradient there), the N
    unrolled steps with its graph (∂G/∂φ is a function of θ through it); all see the same values
    at the same points."""
    seen = []

    class Spy(Fisher):
        def __call__(self, model, posterior, v):
            seen.append((model, v))
            return super().__call__(model, posterior, v)

    parts = deep_parts(True)
    parts.objective, parts.divergence = mdsm(), Spy()
    BiSMUnrolled(parts, 3, 2, "sgd", 1e-3).step(parts.data.train)
    assert [isinstance(m, Conditioned) and m.conditions(v) for m, v in seen] == [True] * 5
    assert [m.cache.requires_grad for m, _ in seen] == [False, False, False, True, True]
    assert all(torch.equal(m.cache, seen[0][0].cache) and v is seen[0][1] for m, v in seen)


# ---- the unrolled hypergradient through the cached features --------------------------------------


@pytest.mark.parametrize(
    "unroll, objective, divergence",
    [("sgd", mdsm, Fisher), ("sgd", lambda: DSM(0.3), KL), ("adam", lambda: DSM(0.3), KL)],
    ids=["sgd-mdsm-fisher", "sgd-dsm-kl", "adam-dsm-kl"],
)
def test_the_cached_unrolled_hypergradient_matches_finite_differences(unroll, objective, divergence):
    """dJ_Bi(θ, φ_N(θ))/dθ with N = 2, f(x) cached for the unrolled steps, against central
    differences of θ ↦ J_Bi(θ, φ_N(θ)) (the same noise at every evaluation) along a random
    direction over all of θ and one over f's parameters alone. The partial derivative at a fixed
    φ_N is off by more than a hundred times the tolerance along both (SGD: 9% or more; Adam's
    first steps hardly depend on the gradient's size: 4e-4), so the check sees the path through
    φ_N(θ)."""
    parts = deep_parts(True)
    parts.objective, parts.divergence = objective(), divergence()
    estimator = BiSMUnrolled(parts, 1, 2, unroll, 1e-3)
    torch.manual_seed(5)
    x, context = parts.objective.points(parts.data.train)
    theta = estimator.theta

    def hypergradient():
        torch.manual_seed(9)
        return estimator.hypergradient(x, context)

    grads, metrics = hypergradient()
    grad = flat(grads)
    calls = count_feature_forwards(parts.model)
    torch.manual_seed(9)
    points, energy = estimator.condition(x)
    params, _ = estimator.unrolled(points, energy)
    upper = estimator.functional.call(
        {k: p.detach() for k, p in params.items()}, estimator.upper, points, context, energy
    )
    partial = flat(grads_or_zeros(upper, theta))
    assert calls[0] == 2  # f(x) once for the unrolled steps, once for the upper level

    in_f = torch.cat(
        [
            torch.full((p.numel(),), float(name.startswith(("features", "to_latent"))))
            for name, p in parts.model.named_parameters()
        ]
    )
    g = torch.Generator().manual_seed(1)
    eps = 1e-4
    for mask in (torch.ones_like(in_f), in_f):
        d = torch.randn(grad.numel(), generator=g, dtype=F64) * mask.to(F64)
        d = d / d.norm()

        def shift(step: float, d: torch.Tensor = d) -> None:
            with torch.no_grad():
                for p, part in zip(theta, d.split([p.numel() for p in theta])):
                    p.add_(step * part.view_as(p))

        shift(eps)
        up = float(hypergradient()[1]["loss"])
        shift(-2 * eps)
        down = float(hypergradient()[1]["loss"])
        shift(eps)
        fd = (up - down) / (2 * eps)
        assert abs(float(grad @ d) - fd) <= 1e-6 * abs(fd), (float(grad @ d), fd)
        assert abs(float(partial @ d) - fd) > 1e-4 * abs(fd)  # a hundred times the tolerance


# ---- under data parallelism ------------------------------------------------------------------------


class PointNoiseGaussian(GaussianPosterior):
    """The Gaussian q with its noise a function of each point alone (not of a random stream), so
    that two ranks holding halves of a batch draw what one process holding the batch draws."""

    def noise(self, v: torch.Tensor, n: int, m: int) -> torch.Tensor:
        mix = torch.randn(v[0].numel(), n * m, generator=torch.Generator().manual_seed(0), dtype=v.dtype)
        return torch.sin(1e3 * v.detach().flatten(1) @ mix).view(len(v), n, m).transpose(0, 1)

    def rsample(self, v: torch.Tensor, n: int = 1) -> torch.Tensor:
        return self.rsample_and_log_prob(v, n)[0]

    def rsample_and_log_prob(self, v: torch.Tensor, n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.params(v)
        h = mu + log_std.exp() * self.noise(v, n, mu.shape[-1])
        return h, self._log_prob(h, mu, log_std)


def point_noise_estimator(cached: bool) -> BiSMUnrolled:
    parts = deep_parts(cached)
    made = parts.posterior
    parts.posterior = PointNoiseGaussian(made.trunk, made.head.in_features, LATENT)
    parts.posterior.head = made.head
    parts.objective, parts.divergence = DSM(0.3), Fisher()
    return BiSMUnrolled(parts, 1, 2, "sgd", 1e-3)


def rank_hypergradient(rank: int, store: str, x: torch.Tensor, eps: torch.Tensor, out: str) -> None:
    """On each of two ranks: the cached hypergradient (N = 2) of its half of the batch, averaged."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    grads, _ = point_noise_estimator(cached=True).hypergradient(x[rank::2], eps[rank::2])
    mean = flat(grads)
    torch.distributed.all_reduce(mean)
    if rank == 0:
        torch.save(mean / 2, out)
    distributed.leave_process_group()  # together: a rank leaving alone can abort the other


@pytest.mark.slow
def test_two_ranks_with_cached_features_give_the_hypergradient_of_one_process_fed_their_union(tmp_path):
    """The unrolled steps average ∂G/∂φ over the ranks inside the graph (``mean_over_ranks``):
    with f(x) cached per rank, two processes give the uncached hypergradient of one process."""
    est = point_noise_estimator(cached=False)
    torch.manual_seed(5)
    x, eps = est.objective.points(est.posterior.head.weight.new_empty(16, *SHAPE).uniform_())
    expected = flat(est.hypergradient(x, eps)[0])
    out = tmp_path / "mean.pt"
    worker_context()  # the ranks forked from the fork server, which loaded torch once
    args = (str(tmp_path / "store"), x, eps, str(out))
    torch.multiprocessing.start_processes(rank_hypergradient, args, nprocs=2, start_method="forkserver")
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-10, atol=1e-12)


# ---- computed once per update ----------------------------------------------------------------------

COUNTS = {  # case: (estimator, feature forwards per update uncached, cached)
    "unrolled K=5 N=2": (lambda p: BiSMUnrolled(p, 5, 2, "sgd", 1e-3), 8, 2),
    "unrolled K=5 N=0": (lambda p: BiSMUnrolled(p, 5, 0, "sgd", 1e-3), 6, 1),
    "implicit K=5": (lambda p: BiSMImplicit(p, 5, functools.partial(conjugate_gradient, iterations=2)), 7, 1),
    "vages K=5 C=5 L=2": (lambda p: VariationalScore(p, VaGESConfig(inner_steps=5, langevin_steps=5), True), 12, 1),
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_features_are_computed_once_per_update(case):
    """Forward passes of f per update. Uncached: one per evaluation of E (K real steps, N
    unrolled ones, the upper level; VaGES: K, C Langevin steps, the surrogate, z's own VaES). Cached: BiSM
    computes f(x) once with its graph for every level, or (N > 0) once for the K + N lower-level
    steps and once in the upper level; VaGES once with its graph, used detached for the K and C
    steps and whole in the surrogate for the L samples together."""
    build, uncached, cached = COUNTS[case]
    for is_cached, expected in ((False, uncached), (True, cached)):
        parts = deep_parts(is_cached)
        parts.objective, parts.divergence = mdsm(), Fisher()
        estimator = build(parts)
        calls = count_feature_forwards(parts.model)
        torch.manual_seed(0)
        estimator.step(parts.data.train)
        assert calls[0] == expected, (is_cached, calls[0])


# ---- a model without the capability is untouched -----------------------------------------------------


def algorithm_1_step(est: BiSMUnrolled, batch: torch.Tensor) -> None:
    """A BiSM step as written before conditioning existed: every evaluation through ``model.energy``."""
    model, posterior, divergence = est.model, est.posterior, est.divergence
    x, context = est.objective.points(batch)
    for _ in range(est.inner_steps):
        est.posterior_role.update(divergence(model, posterior, x).mean())
    functional, params = Functional(posterior), est.phi
    for n in range(est.unroll_steps):
        lower = functional.call(params, lambda: divergence(model, posterior, x).mean()) if n else None
        lower = divergence(model, posterior, x).mean() if n == 0 else lower
        params = sgd_step(params, grads_or_zeros(lower, list(params.values()), create_graph=True), est.inner_lr)
    upper = functional.call(params, lambda: est.objective.loss(modified_score(model, posterior), x, context).mean())
    for p, g in zip(est.theta, grads_or_zeros(upper, est.theta)):
        p.grad = g
    est.model_role.update()


def test_a_model_without_the_capability_takes_the_path_it_always_took():
    """GRBM BiSSM (K = 2, N = 3): the divergence gets the model itself and the points as the
    objective made them, and three steps are bit-identical to Algorithm 1 written out plainly."""
    seen = []

    class Spy(KL):
        def __call__(self, model, posterior, v):
            seen.append((model, v))
            return super().__call__(model, posterior, v)

    runs = []
    for new in (True, False):
        parts = grbm_parts(SSM())
        parts.divergence = Spy()
        est = BiSMUnrolled(parts, 2, 3, "sgd", 0.1)
        torch.manual_seed(3)
        for _ in range(3):
            est.step(parts.data.train[:50]) if new else algorithm_1_step(est, parts.data.train[:50])
        runs.append(parameters(parts))
        if new:
            assert len(seen) == 3 * (2 + 3) and all(model is parts.model for model, _ in seen)
            assert not any(v.requires_grad for _, v in seen)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("estimator", ["implicit", "vages"])
def test_other_estimators_hand_a_model_without_the_capability_to_the_divergence_as_it_is(estimator):
    seen = []

    class Spy(KL):
        def __call__(self, model, posterior, v):
            seen.append((model, v))
            return super().__call__(model, posterior, v)

    parts = grbm_parts(DSM(0.1))
    parts.divergence = Spy()
    if estimator == "implicit":
        est = BiSMImplicit(parts, 2, functools.partial(conjugate_gradient, iterations=3, damping=1e-3))
    else:
        est = VariationalScore(parts, VaGESConfig(n_samples=2, inner_steps=2), covariance=True)
    est.step(parts.data.train[:50])
    assert len(seen) == (3 if estimator == "implicit" else 2)
    assert all(model is parts.model and not v.requires_grad for model, v in seen)
