"""The MCMC machinery against what is known exactly: the ESS of AR(1) chains (τ = (1 + φ)/(1 − φ)),
split R-hat of chains with offset means, MALA as one-step HMC, leapfrog's reversibility and its
O(ε²) energy error, dual averaging reaching its target acceptance, and MALA and HMC drawing a
Gaussian with a known mean and covariance, with the ESS that the spread of batch means shows."""

from __future__ import annotations

import math

import pytest
import torch

from eblvm_core.mcmc import (
    Chains,
    DualAveraging,
    autograd_potential,
    chain_diagnostics,
    chain_diagnostics_keys,
    effective_sample_size,
    hmc_step,
    leapfrog,
    mala_step,
    split_rhat,
)

F64 = torch.float64


def ar1(phi: float, draws: int, chains: int, seed: int = 0) -> torch.Tensor:
    """Stationary AR(1) chains x_t = φ x_(t−1) + √(1 − φ²) ξ_t with unit variance: (draws, chains)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(draws, chains, generator=g, dtype=F64) * math.sqrt(1 - phi**2)
    x = torch.empty(draws, chains, dtype=F64)
    x[0] = torch.randn(chains, generator=g, dtype=F64)
    for t in range(1, draws):
        x[t] = phi * x[t - 1] + noise[t]
    return x


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.9, -0.5])
def test_effective_sample_size_of_ar1_chains_is_draws_over_their_autocorrelation_time(phi):
    """τ = (1 + φ)/(1 − φ): 8 chains of 4,000 draws hold 32,000/τ independent draws, within 10%."""
    x = ar1(phi, 4000, 8)
    assert effective_sample_size(x) == pytest.approx(32000 * (1 - phi) / (1 + phi), rel=0.1)


def test_split_rhat_is_one_for_agreeing_chains_and_sqrt_one_plus_spread_for_offset_ones():
    """Chains N(μ_m, 1) with μ_m = ±1 half each: var⁺/W → 1 + Var(μ) = 2. A chain drifting from
    one level to another is caught by the split alone (one chain, its halves disagree)."""
    g = torch.Generator().manual_seed(0)
    agreeing = torch.randn(2000, 8, generator=g, dtype=F64)
    assert split_rhat(agreeing) == pytest.approx(1.0, abs=0.005)
    offset = agreeing + torch.tensor([1.0, -1.0] * 4, dtype=F64)
    assert split_rhat(offset) == pytest.approx(math.sqrt(2), abs=0.03)
    drifting = torch.cat([torch.zeros(1000, 1), 3 * torch.ones(1000, 1)]).double() + agreeing[:, :1]
    assert split_rhat(drifting) > 1.5


def test_chain_diagnostics_report_the_keys_they_promise_and_none_below_four_draws():
    x = ar1(0.5, 40, 4)
    points = torch.stack([x, -x, 2 * x], dim=-1)  # (N, M, 3)
    for draws in (3, 4, 40):
        for projections in (0, 2):
            found = chain_diagnostics(x[:draws], points[:draws], projections)
            assert tuple(found) == chain_diagnostics_keys(draws, projections)
    assert chain_diagnostics(x[:3], points[:3]) == {}


def gaussian(dim: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A mean (dim,) and a covariance (dim, dim) with eigenvalues spread over a factor of about 10."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=g, dtype=F64)
    return torch.arange(dim, dtype=F64) - 1.0, a @ a.T / dim + 0.3 * torch.eye(dim, dtype=F64)


def gaussian_potential(mean: torch.Tensor, cov: torch.Tensor):
    precision = torch.linalg.inv(cov)
    return autograd_potential(lambda x: 0.5 * (((x - mean) @ precision) * (x - mean)).sum(-1))


def test_mala_is_hmc_with_one_leapfrog_step():
    """x' = x − ½ε²∇U + εp is one leapfrog step from momentum p, and the two acceptance ratios agree."""
    mean, cov = gaussian()
    potential = gaussian_potential(mean, cov)
    chains = Chains.at(potential, torch.randn(50, 3, generator=torch.Generator().manual_seed(1), dtype=F64))
    step = torch.linspace(0.2, 1.5, 50, dtype=F64)
    by_mala = mala_step(potential, chains, step, torch.Generator().manual_seed(2))
    by_hmc = hmc_step(potential, chains, step, 1, torch.Generator().manual_seed(2))
    torch.testing.assert_close(by_mala.accept_prob, by_hmc.accept_prob)
    torch.testing.assert_close(by_mala.chains.x, by_hmc.chains.x)
    assert 0 < float(by_mala.accept_prob.min()) < 0.5 < float(by_mala.accept_prob.max()) <= 1  # some of each


def test_leapfrog_is_reversible_and_its_energy_error_falls_as_step_squared():
    """Flipping the momentum retraces the path; the error in H = U + ½‖p‖² after a fixed time
    falls fourfold when ε halves."""
    mean, cov = gaussian()
    potential = gaussian_potential(mean, cov)
    g = torch.Generator().manual_seed(3)
    start = Chains.at(potential, torch.randn(20, 3, generator=g, dtype=F64))
    p0 = torch.randn(20, 3, generator=g, dtype=F64)
    eps = torch.full((20, 1), 0.1, dtype=F64)
    end, p1 = leapfrog(potential, start, p0, eps, 10)
    back, p2 = leapfrog(potential, end, -p1, eps, 10)
    torch.testing.assert_close(back.x, start.x)
    torch.testing.assert_close(-p2, p0)

    def energy_error(step: float) -> float:
        n = round(1.0 / step)
        end, p = leapfrog(potential, start, p0, torch.full((20, 1), step, dtype=F64), n)
        h0 = start.energy + 0.5 * (p0**2).sum(-1)
        return float((end.energy + 0.5 * (p**2).sum(-1) - h0).abs().max())

    assert energy_error(0.1) / energy_error(0.05) == pytest.approx(4, rel=0.1)


def test_dual_averaging_reaches_its_target_acceptance():
    """MALA on a 3-D Gaussian from steps 10 times too small and 10 times too large: after 300
    adapting transitions every chain's averaged step gives the target acceptance of 0.574 within 0.06."""
    mean, cov = gaussian()
    potential = gaussian_potential(mean, cov)
    g = torch.Generator().manual_seed(4)
    chains = Chains.at(potential, mean + torch.randn(400, 3, generator=g, dtype=F64))
    initial = torch.cat([torch.full((200,), 0.1, dtype=F64), torch.full((200,), 10.0, dtype=F64)])
    adaptation = DualAveraging(initial, target=0.574)
    for _ in range(300):
        transition = mala_step(potential, chains, adaptation.step_size, g)
        chains = transition.chains
        adaptation.update(transition.accept_prob)
    accepted = torch.stack([mala_step(potential, chains, adaptation.final, g).accept_prob for _ in range(50)])
    assert float(accepted.mean()) == pytest.approx(0.574, abs=0.06)
    assert float(adaptation.final.max() / adaptation.final.min()) < 3  # both groups reach the same scale


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mala", "hmc"])
def test_mala_and_hmc_draw_a_gaussian_with_the_ess_their_batch_means_show(kind):
    """200 chains at adapted step sizes (HMC's jittered by ±20%), 2,000 draws each: the pooled draws' mean and covariance
    match N(μ, Σ) within 4 standard errors (the ESS's), and the ESS of the first coordinate agrees
    within 20% with N·Var(x₁)/(L·Var of its means over batches of L = 500 draws), the variance of
    a mean that an effective sample size stands for."""
    mean, cov = gaussian()
    potential = gaussian_potential(mean, cov)
    g = torch.Generator().manual_seed(5)

    def move(chains: Chains, step: torch.Tensor):
        if kind == "mala":
            return mala_step(potential, chains, step, g)
        return hmc_step(potential, chains, step, 4, g, jitter=0.2)

    chains = Chains.at(potential, mean + torch.randn(200, 3, generator=g, dtype=F64))
    adaptation = DualAveraging(torch.full((200,), 0.5, dtype=F64), target=0.574 if kind == "mala" else 0.65)
    for _ in range(300):
        transition = move(chains, adaptation.step_size)
        chains = transition.chains
        adaptation.update(transition.accept_prob)
    kept = []
    for _ in range(2000):
        chains = move(chains, adaptation.final).chains
        kept.append(chains.x)
    draws = torch.stack(kept)  # (2000, 200, 3)
    pooled = draws.reshape(-1, 3)
    ess = effective_sample_size(draws[..., 0])
    assert 0.01 * len(pooled) < ess < len(pooled)
    stderr = (cov.diagonal() / ess).sqrt()
    assert ((pooled.mean(0) - mean).abs() < 4 * stderr).all()
    covariance_error = torch.cov(pooled.T) - cov
    assert covariance_error.abs().max() < 4 * math.sqrt(2 / ess) * float(cov.diagonal().max())
    batch_means = draws[..., 0].reshape(4, 500, 200).mean(1)
    from_batch_means = len(pooled) * float(draws[..., 0].var()) / (500 * float(batch_means.var()))
    assert ess == pytest.approx(from_batch_means, rel=0.2)
