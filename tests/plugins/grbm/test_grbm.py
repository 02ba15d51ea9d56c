"""The GRBM's free energy, partition function, likelihood and exact score, checked numerically."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from eblvm_grbm.model import GRBM, all_binary

from eblvm.testing import LinearGaussianEBLVM
from eblvm_core.contracts import exact_score
from tests.support import grbm_away_from_init

COUPLINGS = pytest.mark.parametrize("coupling", ["scaled", "plain"])


random_grbm = partial(grbm_away_from_init, sigma=0.7, weight_std=0.8)


@COUPLINGS
def test_free_energy_is_minus_logsumexp_over_enumerated_hidden_states(coupling):
    model = random_grbm(d=3, m=4, coupling=coupling)
    v = torch.randn(7, 3, dtype=torch.float64)
    hs = all_binary(4, model.W)  # (16, 4)
    energies = torch.stack([model.energy(v, h.expand(len(v), -1)) for h in hs])  # (16, B)
    expected = -torch.logsumexp(-energies, 0)
    torch.testing.assert_close(model.free_energy(v), expected, rtol=0, atol=1e-12)


@COUPLINGS
def test_exact_likelihood_integrates_to_one_on_a_fine_grid(coupling):
    model = random_grbm(d=2, m=3, sigma=0.6, coupling=coupling)
    # modes sit at b + σ²Uh; ±8σ beyond the extreme modes holds all but ~1e-15 of the mass
    modes = model.visible_mean(all_binary(3, model.W)).detach()
    low, high = modes.min(0).values - 8 * model.sigma.item(), modes.max(0).values + 8 * model.sigma.item()
    n = 400
    axes = [torch.linspace(float(lo), float(hi), n, dtype=torch.float64) for lo, hi in zip(low, high)]
    xx, yy = torch.meshgrid(*axes, indexing="ij")
    grid = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)
    with torch.no_grad():
        density = model.log_likelihood(grid).exp().reshape(n, n)
    cell = (axes[0][1] - axes[0][0]) * (axes[1][1] - axes[1][0])
    # the tails vanish at the box edge, so the plain Riemann sum is spectrally accurate
    assert float(density.sum() * cell) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("coupling, scale", [("scaled", lambda sigma: 1 / sigma), ("plain", lambda sigma: 1.0)])
def test_exact_score_matches_closed_form_marginal_score(coupling, scale):
    model = random_grbm(d=3, m=5, coupling=coupling)
    v = torch.randn(11, 3, dtype=torch.float64)
    sigma, s = model.sigma, scale(model.sigma)  # coupling −s·vᵀWh
    closed = -(v - model.b) / sigma**2 + torch.sigmoid(model.c + s * v @ model.W) @ model.W.T * s
    torch.testing.assert_close(exact_score(model, v), closed, rtol=0, atol=1e-12)


def test_exact_score_keeps_the_graph_for_parameter_gradients():
    model = random_grbm(d=2, m=3)
    v = torch.randn(5, 2, dtype=torch.float64)
    s = exact_score(model, v)
    (grad_b,) = torch.autograd.grad(s.sum(), model.b)
    # ∂s_i/∂b_k = δ_ik/σ² for every sample
    torch.testing.assert_close(grad_b, torch.full((2,), 5 / model.sigma.item() ** 2, dtype=torch.float64))


def test_log_partition_refuses_too_many_hidden_units():
    model = GRBM(2, 25)
    with pytest.raises(ValueError, match="2\\^25"):
        model.log_partition()
    with pytest.raises(ValueError, match="exceeds the limit 4"):
        GRBM(2, 5).log_partition(max_hidden=4)


def test_unknown_coupling_is_refused():
    with pytest.raises(ValueError, match="coupling must be"):
        GRBM(2, 3, coupling="tied")


def tempered_draws(model: GRBM, beta: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact draws (v (n, d), h (n, m)) of p_β(v, h) ∝ exp(−β E(v, h)), one per β (n,): h from its
    marginal ∝ exp(β(cᵀh + bᵀUh + ½σ²‖Uh‖²)) by enumeration, then v | h ~ N(b + σ²Uh, σ²/β I)."""
    hs = all_binary(model.W.shape[1], model.W)
    uh = hs @ model.coupling_weight().T
    log_weights = hs @ model.c + uh @ model.b + 0.5 * model.sigma**2 * (uh**2).sum(-1)
    h = hs[torch.multinomial(torch.softmax(beta[:, None] * log_weights, 1), 1, generator=generator)[:, 0]]
    noise = torch.randn(len(beta), model.W.shape[0], generator=generator, dtype=beta.dtype)
    return (model.visible_mean(h) + model.sigma * noise / beta[:, None].sqrt()).detach(), h


@COUPLINGS
def test_gibbs_sweep_keeps_each_rows_tempered_distribution(coupling):
    """Rows at β = 1, 0.4 and 0.1, started at exact draws of p_β: after three sweeps v's first and
    second moments, and the returned h's means, agree with fresh exact draws within 5 standard errors."""
    model = random_grbm(d=2, m=3, coupling=coupling, seed=2)
    generator = torch.Generator().manual_seed(0)
    per_beta = 20_000
    beta = torch.tensor([1.0, 0.4, 0.1], dtype=torch.float64).repeat_interleave(per_beta)
    v, _ = tempered_draws(model, beta, generator)
    for _ in range(3):
        v, h = model.gibbs_sweep(v, beta, generator)
    fresh_v, fresh_h = tempered_draws(model, beta, generator)
    for rows in beta.split(per_beta):
        at = beta == rows[0]
        for a, b in (
            (v, fresh_v),
            (v**2, fresh_v**2),
            (v[:, :1] * v[:, 1:], fresh_v[:, :1] * fresh_v[:, 1:]),
            (h, fresh_h),
        ):
            a, b = a[at], b[at]
            stderr = torch.sqrt((a.var(0) + b.var(0)) / len(a))
            assert ((a.mean(0) - b.mean(0)).abs() < 5 * stderr).all(), (float(rows[0]), a.mean(0), b.mean(0))


def test_the_grbm_declares_its_gibbs_sweep_and_a_model_without_one_refuses():
    model = random_grbm(d=2, m=3)
    assert model.has_gibbs_sweep and not LinearGaussianEBLVM(2, 2).has_gibbs_sweep
    with pytest.raises(NotImplementedError, match="LinearGaussianEBLVM has no block-Gibbs sweep"):
        LinearGaussianEBLVM(2, 2).gibbs_sweep(torch.zeros(1, 2), torch.ones(1))
