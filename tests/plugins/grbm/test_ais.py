"""AIS of a GRBM's log Z, forward and reverse, checked against enumeration of the annealing
path, a closed form at Frey face size, and each other."""

from __future__ import annotations

import math
from functools import partial

import attrs
import pytest
import torch
from eblvm_grbm.ais import (
    AISLoglikConfig,
    Base,
    ais_log_partition,
    build_ais_loglik,
    data_base,
    gradient_move,
    log_ratio,
    model_base,
    path_potential,
    reverse_ais_log_partition,
    summarise,
    sweep,
)
from eblvm_grbm.evaluators import ExactLoglikConfig, build_exact_loglik
from eblvm_grbm.model import GRBM, all_binary

from eblvm_core.contracts import DataSplits, Parts
from eblvm_core.errors import ConfigError
from tests.support import grbm_away_from_init

random_grbm = partial(grbm_away_from_init, sigma=0.6, weight_std=0.7)


def skewed_base(d: int) -> Base:
    """A base unlike the model's own: means 0.3, variances 0.5-1.5 (float64)."""
    return Base(torch.full((d,), 0.3, dtype=torch.float64), torch.linspace(0.5, 1.5, d, dtype=torch.float64))


def path_hidden_logits(model: GRBM, base: Base, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """All h (2^m, m) and log ∫ exp(−(1 − β)E_A(v) − βE(v, h)) dv (2^m,), from the Gaussian
    integral over v: precision λ = (1 − β)/s² + β/σ², linear term η = (1 − β)μ/s² + β(b/σ² + Uh)."""
    hs = all_binary(model.W.shape[1], model.W)
    inv_var = 1 / model.sigma**2
    lam = (1 - beta) / base.var + beta * inv_var
    eta = (1 - beta) * base.mean / base.var + beta * (model.b * inv_var + hs @ model.coupling_weight().T)
    const = -(1 - beta) * (base.mean**2 / base.var).sum() / 2 - beta * (model.b**2).sum() * inv_var / 2
    logits = (eta**2 / (2 * lam)).sum(-1) + beta * hs @ model.c + const + 0.5 * torch.log(2 * math.pi / lam).sum()
    return hs, logits.detach()


def path_log_partition(model: GRBM, base: Base, beta: float) -> float:
    """log Z_β of the annealing path by enumerating h."""
    return float(torch.logsumexp(path_hidden_logits(model, base, beta)[1], 0))


def path_samples(model: GRBM, base: Base, beta: float, n: int) -> torch.Tensor:
    """n exact draws (n, d) of v under p_β: h by enumeration, then the Gaussian v | h."""
    hs, logits = path_hidden_logits(model, base, beta)
    h = hs[torch.multinomial(torch.softmax(logits, 0), n, replacement=True)]
    inv_var = 1 / model.sigma**2
    lam = (1 - beta) / base.var + beta * inv_var
    eta = (1 - beta) * base.mean / base.var + beta * (model.b * inv_var + h @ model.coupling_weight().T)
    return (eta / lam + torch.randn(n, len(lam), dtype=lam.dtype) / lam.sqrt()).detach()


# ---- the path ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["scaled", "plain"])
def test_path_runs_from_the_base_to_the_grbm(coupling):
    """log Z_0 is the base's, log Z_1 the GRBM's, and log f_1 − log f_0 is −F + E_A − m log 2."""
    model = random_grbm(d=3, m=4, coupling=coupling)
    base = skewed_base(3)
    assert path_log_partition(model, base, 0.0) == pytest.approx(float(base.log_partition(4)), abs=1e-10)
    assert path_log_partition(model, base, 1.0) == pytest.approx(float(model.log_partition().detach()), abs=1e-10)
    assert path_log_partition(model, model_base(model), 0.0) == pytest.approx(
        float(model_base(model).log_partition(4)), abs=1e-10
    )
    v = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():  # log f_1 = −F and log f_0 = −E_A + m log 2
        ratio = log_ratio(model, base, v, model.hidden_logits(v), 0.0, 1.0)
        torch.testing.assert_close(ratio, -model.free_energy(v) + base.energy(v) - 4 * math.log(2))


def test_data_base_is_pixel_means_and_variances_widened_by_sigma_squared():
    model = random_grbm(d=3, m=2, sigma=0.5)
    v = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 4.0]], dtype=torch.float64)
    base = data_base(model, v)
    torch.testing.assert_close(base.mean, torch.tensor([1.0, 1.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(base.var, torch.tensor([2.25, 0.25, 2.25], dtype=torch.float64))


@pytest.mark.parametrize("coupling, beta", [("scaled", 0.4), ("plain", 0.8)])
def test_sweep_leaves_the_intermediate_distribution_invariant(coupling, beta):
    """Exact draws of p_β stay draws of p_β after three sweeps: means and second moments agree
    with a fresh exact sample within 5 standard errors."""
    model = random_grbm(d=2, m=3, weight_std=1.0, coupling=coupling, seed=3)
    base = skewed_base(2)
    torch.manual_seed(1)
    n = 100_000
    v = path_samples(model, base, beta, n)
    reference = path_samples(model, base, beta, n)
    with torch.no_grad():
        for _ in range(3):
            v = sweep(model, base, v, beta, model.hidden_logits(v), None)
    for stat in (lambda x: x, lambda x: x**2, lambda x: x[:, :1] * x[:, 1:]):
        a, b = stat(v), stat(reference)
        stderr = torch.sqrt((a.var(0) + b.var(0)) / n)
        assert ((a.mean(0) - b.mean(0)).abs() <= 5 * stderr).all(), (a.mean(0), b.mean(0), stderr)


# ---- MALA and HMC transitions on the path ------------------------------------------------------


@pytest.mark.parametrize("coupling", ["scaled", "plain"])
def test_path_potential_is_minus_log_f_and_its_gradient_autograds(coupling):
    """U_prev(v) − U_β(v) is log_ratio's log f_β − log f_prev, and the closed-form gradient is autograd's."""
    model = random_grbm(d=3, m=4, coupling=coupling)
    base = skewed_base(3)
    v = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    energy, grad = path_potential(model, base, 0.7)(v)
    (autograd,) = torch.autograd.grad(energy.sum(), v)
    torch.testing.assert_close(grad, autograd)
    with torch.no_grad():
        before = path_potential(model, base, 0.2)(v)[0]
        torch.testing.assert_close(before - energy, log_ratio(model, base, v, model.hidden_logits(v), 0.2, 0.7))


@pytest.mark.parametrize("kind, beta, step_scale", [("mala", 0.4, 1.0), ("hmc", 0.8, 0.5)])
def test_gradient_moves_leave_the_intermediate_distribution_invariant(kind, beta, step_scale):
    """As the Gibbs sweep: exact draws of p_β stay draws of p_β after three MALA or HMC transitions
    (means and second moments within 5 standard errors of a fresh exact sample), and they move."""
    model = random_grbm(d=2, m=3, weight_std=1.0, seed=3)
    base = skewed_base(2)
    torch.manual_seed(1)
    n = 100_000
    start = path_samples(model, base, beta, n)
    reference = path_samples(model, base, beta, n)
    move, generator = gradient_move(kind, step_scale, 3), torch.Generator().manual_seed(2)
    v = start
    with torch.no_grad():
        for _ in range(3):
            v = move(model, base, v, beta, model.hidden_logits(v), generator)
    assert float((v != start).any(1).double().mean()) > 0.5
    for stat in (lambda x: x, lambda x: x**2, lambda x: x[:, :1] * x[:, 1:]):
        a, b = stat(v), stat(reference)
        stderr = torch.sqrt((a.var(0) + b.var(0)) / n)
        assert ((a.mean(0) - b.mean(0)).abs() <= 5 * stderr).all(), (a.mean(0), b.mean(0), stderr)


@pytest.mark.slow
@pytest.mark.parametrize("transitions, step_scale", [("mala", 1.0), ("hmc", 0.5)])
def test_ais_with_gradient_transitions_reaches_the_enumerated_log_z(transitions, step_scale):
    """The evaluator's AIS with MALA or HMC transitions (300 chains, 300 temperatures, the base-rate
    base): forward and reverse log Ẑ within 4 standard errors of log Z by enumeration, both errors
    under 0.05 nats, and the test log-likelihood within 4 standard errors of the exact one."""
    model = random_grbm(d=4, m=6, seed=1)
    torch.manual_seed(0)
    train = path_samples(model, model_base(model), 1.0, 500)
    parts = Parts(dtype=torch.float64, data=DataSplits(train=train, test=train[:200]), model=model)
    cfg = AISLoglikConfig(
        n_chains=300, n_reverse_chains=300, n_temps=300, transitions=transitions, step_scale=step_scale
    )
    found = build_ais_loglik(cfg, parts)(parts).scalars
    exact = float(model.log_partition().detach())
    for key in ("log_z", "log_z_reverse"):
        assert 0 < found[f"{key}_stderr"] < 0.05
        assert abs(found[key] - exact) <= 4 * found[f"{key}_stderr"], (key, found[key], exact)
    exact_loglik = build_exact_loglik(ExactLoglikConfig(), parts)(parts).scalars["test_loglik"]
    assert abs(found["test_loglik"] - exact_loglik) <= 4 * found["test_loglik_stderr"]


# ---- forward and reverse against enumeration ------------------------------------------------


@pytest.mark.parametrize(
    "seed, coupling, which", [(0, "scaled", "model"), (1, "scaled", "skewed"), (2, "plain", "model")]
)
def test_forward_and_reverse_agree_with_enumeration_within_their_errors(seed, coupling, which):
    model = random_grbm(d=4, m=6, seed=seed, coupling=coupling)
    base = model_base(model) if which == "model" else skewed_base(4)
    exact = float(model.log_partition().detach())
    generator = torch.Generator().manual_seed(seed)
    forward = ais_log_partition(model, base, n_chains=300, n_temps=300, generator=generator)
    torch.manual_seed(seed)
    reverse = reverse_ais_log_partition(model, base, path_samples(model, base, 1.0, 300), 300, generator)
    for result in (forward, reverse):
        assert 0 < result.log_z_stderr < 0.1
        assert abs(result.log_z - exact) <= 4 * result.log_z_stderr, (result.log_z, exact, result.log_z_stderr)


def test_forward_is_a_lower_and_reverse_an_upper_bound_in_expectation():
    """With few temperatures the Jensen gaps show: over many small runs mean log Ẑ sits below log Z
    going forward and above it in reverse from exact draws, while Ẑ pooled over every chain stays
    unbiased going forward."""
    model = random_grbm(d=3, m=5, weight_std=0.9, seed=4)
    base = model_base(model)
    exact = float(model.log_partition().detach())
    repeats, chains, n_temps = 400, 4, 6
    generator = torch.Generator().manual_seed(5)
    forward = ais_log_partition(model, base, repeats * chains, n_temps, generator)
    torch.manual_seed(6)
    reverse = reverse_ais_log_partition(
        model, base, path_samples(model, base, 1.0, repeats * chains), n_temps, generator
    )
    log_z0 = float(base.log_partition(5))
    for result, sign in ((forward, 1.0), (reverse, -1.0)):
        per_run = log_z0 + sign * (torch.logsumexp(result.log_weights.reshape(repeats, chains), 1) - math.log(chains))
        stderr = float(per_run.std()) / math.sqrt(repeats)
        assert sign * (exact - float(per_run.mean())) > 5 * stderr  # the bias is real, not noise, and of this sign
    assert abs(forward.log_z - exact) <= 4 * forward.log_z_stderr


def test_effective_sample_size_of_weights():
    """(Σw)²/Σw²: n for equal weights, 1 for one weight, (1 + 3)²/(1 + 9) for weights 1 and 3."""
    assert summarise(torch.zeros(50, dtype=torch.float64), 1.0, 0.0).ess == pytest.approx(50)
    assert summarise(torch.tensor([0.0, -1e4, -1e4], dtype=torch.float64), 1.0, 0.0).ess == pytest.approx(1)
    assert summarise(torch.tensor([0.0, math.log(3)], dtype=torch.float64), 1.0, 0.0).ess == pytest.approx(1.6)


# ---- a model where one path fails: the Frey face failure in miniature --------------------------


def collective_grbm(d: int = 40, m: int = 12, norm: float = 10.0, c: float = -20.0) -> GRBM:
    """Hidden units that all couple to one direction e (a "mean face"): u_j ≈ norm · e, b = 0,
    c_j = c, σ = 0.3, plain coupling. All units on holds the mass (with k units on, one more adds
    about c + σ²norm²(k + ½) to log p), but from v near b a unit turns on only if c + σ·norm·z > 0:
    a z of 6.7."""
    gen = torch.Generator().manual_seed(0)
    model = GRBM(d, m, init_sigma=0.3, coupling="plain").double()
    e = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
    with torch.no_grad():
        model.W.copy_(norm * e + 0.3 * torch.randn(d, m, generator=gen, dtype=torch.float64) / math.sqrt(d))
        model.b.zero_()
        model.c.fill_(c)
    return model


def test_collective_units_defeat_the_model_base_and_the_reverse_run_shows_it(capsys):
    """From v ~ N(b, σ²I) the chains keep every unit off and miss all the mass, yet their weights
    agree (high ESS, tiny standard error), as the fixed-c path did on Frey face; the reverse run
    from exact draws lands above log Z and the evaluator warns of the gap. The base-rate model
    starts the chains where the data are and gets log Z within its error, without a warning."""
    model = collective_grbm()
    exact = float(model.log_partition().detach())
    torch.manual_seed(0)
    train = path_samples(model, model_base(model), 1.0, 500)  # β = 1: exact draws of the GRBM
    parts = Parts(dtype=torch.float64, data=DataSplits(train=train, test=train[:50]), model=model)
    cfg = AISLoglikConfig(n_chains=100, n_reverse_chains=100, n_temps=200, reverse_burn_in=0)

    good = build_ais_loglik(cfg, parts)(parts).scalars
    assert capsys.readouterr().err == ""
    assert abs(good["log_z"] - exact) <= 4 * good["log_z_stderr"]
    assert abs(good["log_z_reverse"] - exact) <= 4 * good["log_z_reverse_stderr"]

    bad = build_ais_loglik(attrs.evolve(cfg, base="model"), parts)(parts).scalars
    assert bad["log_z"] < exact - 100 and bad["log_z_stderr"] < 0.1 and bad["log_z_ess"] > cfg.min_ess
    assert bad["log_z_reverse"] > exact and bad["log_z_gap"] > 100
    err = capsys.readouterr().err
    assert f"log Z in [{bad['log_z']:.2f}, {bad['log_z_reverse']:.2f}]" in err, err


# ---- Frey face size: a GRBM that factorises over its hidden units -------------------------------


def orthogonal_grbm(coupling: str = "plain", d: int = 560, m: int = 400, seed: int = 0) -> GRBM:
    """A d × m GRBM whose coupling columns u_j are orthogonal, sized like the trained Frey model
    (recipes/freyface_dsm.toml, seed 0): σ = 0.3, ‖u_j‖ spread from 0.5 to 6.2, b_i in
    [−0.01, 0.03], c_j in [−2.5, 1.25]."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, m, generator=gen, dtype=torch.float64))
    norms = torch.exp(torch.empty(m, dtype=torch.float64).uniform_(math.log(0.5), math.log(6.2), generator=gen))
    model = GRBM(d, m, init_sigma=0.3, coupling=coupling).double()
    with torch.no_grad():
        u = q * norms
        model.W.copy_(u * model.sigma if coupling == "scaled" else u)
        model.b.uniform_(-0.01, 0.03, generator=gen)
        model.c.uniform_(-2.5, 1.25, generator=gen)
    return model


def factorised_odds(model: GRBM) -> torch.Tensor:
    """Log-odds of p(h_j = 1) when the u_j are orthogonal: c_j + bᵀu_j + σ²‖u_j‖²/2 (m,), since
    ‖Uh‖² = Σ_j h_j ‖u_j‖² for binary h."""
    u = model.coupling_weight()
    return (model.c + model.b @ u + 0.5 * model.sigma**2 * (u**2).sum(0)).detach()


def factorised_log_partition(model: GRBM) -> float:
    """log Z = (d/2) log(2πσ²) + Σ_j softplus(odds_j): Σ_h exp(cᵀh + bᵀUh + σ²‖Uh‖²/2) factorises."""
    d = model.W.shape[0]
    log_z = (
        0.5 * d * torch.log(2 * math.pi * model.sigma**2) + torch.nn.functional.softplus(factorised_odds(model)).sum()
    )
    return float(log_z.detach())


def factorised_samples(model: GRBM, n: int, seed: int) -> torch.Tensor:
    """n exact draws (n, d): independent h_j ~ Bernoulli(sigmoid(odds_j)), then v ~ N(b + σ²Uh, σ²I)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        h = torch.bernoulli(torch.sigmoid(factorised_odds(model)).expand(n, -1), generator=gen)
        noise = torch.randn(n, model.W.shape[0], generator=gen, dtype=torch.float64)
        return model.visible_mean(h) + model.sigma * noise


def frey_sized_parts(coupling: str) -> tuple[Parts, float]:
    """The orthogonal GRBM with exact draws as its training and test splits, and the exact mean
    test log-likelihood."""
    model = orthogonal_grbm(coupling)
    data = DataSplits(train=factorised_samples(model, 1400, seed=1), test=factorised_samples(model, 265, seed=2))
    with torch.no_grad():
        exact_ll = float(-model.free_energy(data.test).mean()) - factorised_log_partition(model)
    return Parts(dtype=torch.float64, data=data, model=model), exact_ll


def test_factorised_log_partition_is_the_enumerated_one():
    """The closed form the Frey-sized tests rely on, checked on a small orthogonal GRBM."""
    for coupling in ("plain", "scaled"):
        model = orthogonal_grbm(coupling, d=7, m=5)
        assert factorised_log_partition(model) == pytest.approx(float(model.log_partition().detach()), abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["plain", "scaled"])
def test_evaluator_at_frey_size_matches_the_closed_form(coupling, capsys):
    """d = 560, m = 400: forward and reverse log Ẑ and the test log-likelihood within 4 standard
    errors of the closed form, the weights healthy and no warning."""
    parts, exact_ll = frey_sized_parts(coupling)
    cfg = AISLoglikConfig(n_chains=100, n_reverse_chains=100, n_temps=100, reverse_burn_in=0)
    out = build_ais_loglik(cfg, parts)(parts).scalars
    exact = factorised_log_partition(parts.model)
    assert abs(out["log_z"] - exact) <= 4 * out["log_z_stderr"], (out, exact)
    assert abs(out["log_z_reverse"] - exact) <= 4 * out["log_z_reverse_stderr"], (out, exact)
    assert abs(out["test_loglik"] - exact_ll) <= 4 * out["test_loglik_stderr"]
    assert out["test_loglik"] - out["test_loglik_reverse"] == pytest.approx(out["log_z_gap"])
    assert out["log_z_ess"] >= cfg.min_ess and out["log_z_gap"] <= cfg.max_gap
    assert capsys.readouterr().err == ""


def test_evaluator_reports_both_bounds_and_warns_when_they_disagree(capsys):
    """Three temperatures at Frey size: the forward estimate falls well below the closed form and
    the reverse one well above, with standard errors that hide it; the evaluator reports both,
    their gap, the effective sample size of the forward weights (the value of the weights
    recomputed here), and warns on stderr about the gap and the ESS."""
    parts, _ = frey_sized_parts("plain")
    cfg = AISLoglikConfig(n_chains=50, n_reverse_chains=50, n_temps=3, reverse_burn_in=0, seed=3)
    out = build_ais_loglik(cfg, parts)(parts).scalars
    exact = factorised_log_partition(parts.model)
    assert out["log_z"] + 10 * out["log_z_stderr"] < exact < out["log_z_reverse"] - 10 * out["log_z_reverse_stderr"]
    assert out["log_z_gap"] == pytest.approx(out["log_z_reverse"] - out["log_z"])
    assert out["log_z_gap"] > cfg.max_gap
    train = parts.data.tensor("train")
    forward = ais_log_partition(parts.model, data_base(parts.model, train), 50, 3, torch.Generator().manual_seed(3))
    assert out["log_z"] == forward.log_z and out["log_z_ess"] == forward.ess
    assert 1 <= out["log_z_ess"] < cfg.min_ess and 1 <= out["log_z_reverse_ess"] <= 50
    lines = capsys.readouterr().err.splitlines()
    assert any("disagree" in line and f"[{out['log_z']:.2f}, {out['log_z_reverse']:.2f}]" in line for line in lines), (
        lines
    )
    assert any(
        f"effective sample size of the forward weights is {out['log_z_ess']:.1f} of 50" in line for line in lines
    )


def test_evaluator_matches_exact_loglik_on_a_small_grbm_and_is_seeded():
    model = random_grbm(d=3, m=5, seed=6)
    data = DataSplits(
        train=torch.randn(40, 3, dtype=torch.float64),
        test=torch.randn(200, 3, dtype=torch.float64),
        val=torch.randn(30, 3, dtype=torch.float64),
    )
    parts = Parts(dtype=torch.float64, data=data, model=model)
    cfg = AISLoglikConfig(n_chains=300, n_reverse_chains=300, n_temps=300, split="val")
    ais = build_ais_loglik(cfg, parts)(parts).scalars
    exact = build_exact_loglik(ExactLoglikConfig(split="val"), parts)(parts).scalars["val_loglik"]
    assert set(ais) == set(build_ais_loglik(cfg, parts).reports)
    assert abs(ais["val_loglik"] - exact) <= 4 * ais["val_loglik_stderr"]
    assert abs(ais["val_loglik_reverse"] - exact) <= 4 * ais["log_z_reverse_stderr"]
    assert build_ais_loglik(cfg, parts)(parts).scalars == ais  # seeded


def test_evaluator_refusals():
    model = random_grbm(d=2, m=2)
    data = DataSplits(train=torch.randn(4, 2), test=torch.randn(4, 2))
    with pytest.raises(ConfigError, match="no 'val' split"):
        build_ais_loglik(AISLoglikConfig(split="val"), Parts(data=data, model=model))
    with pytest.raises(ConfigError, match="at least 2 temperatures"):
        build_ais_loglik(AISLoglikConfig(n_temps=1), Parts(data=data, model=model))
    with pytest.raises(ConfigError, match="needs a GRBM"):
        build_ais_loglik(AISLoglikConfig(), Parts(data=data, model=torch.nn.Linear(2, 2)))  # type: ignore[arg-type]


def test_exact_loglik_standard_error_is_the_spread_of_the_mean_over_independent_test_sets():
    """The reported standard error predicts how much the mean moves from one test set to another
    (60 independent test sets of 400 points; any i.i.d. source will do)."""
    model = random_grbm(d=2, m=3, seed=4)
    gen = torch.Generator().manual_seed(0)
    means, stderrs = [], []
    for _ in range(60):
        v = 1.5 * torch.randn(400, 2, generator=gen, dtype=torch.float64)
        parts = Parts(dtype=torch.float64, data=DataSplits(train=v, test=v), model=model)
        out = build_exact_loglik(ExactLoglikConfig(), parts)(parts).scalars
        means.append(out["test_loglik"])
        stderrs.append(out["test_loglik_stderr"])
    spread = torch.tensor(means).std().item()
    assert 0.7 < spread / (sum(stderrs) / len(stderrs)) < 1.35, (spread, stderrs[:3])
