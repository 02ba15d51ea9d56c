"""Markov chain Monte Carlo on a batch of chains: the Metropolis-adjusted Langevin (MALA) and
Hamiltonian Monte Carlo (HMC) transitions, per-chain step sizes adapted by dual averaging, and the
effective sample size and split R-hat of the chains' traces.

A target is a potential U(x) = −log p̃(x) over flat points x (C, D), one row per chain, given as a
``Potential``: x -> (U(x) (C,), ∇U(x) (C, D)). Step sizes are per chain (C,). Every random draw
comes from the ``generator`` passed in, so a seeded generator gives the same chains.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch
from torch import Tensor

Potential = Callable[[Tensor], tuple[Tensor, Tensor]]
"""x (C, D) -> (U(x) (C,), ∇_x U(x) (C, D)): the potential of the target p(x) ∝ exp(−U(x)) and its gradient."""


def autograd_potential(energy: Callable[[Tensor], Tensor]) -> Potential:
    """The ``Potential`` of ``energy`` (x (C, D) -> U(x) (C,)), its gradient by autograd; no graph is kept."""

    def potential(x: Tensor) -> tuple[Tensor, Tensor]:
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            u = energy(x)
            (grad,) = torch.autograd.grad(u.sum(), x)
        return u.detach(), grad

    return potential


@attrs.frozen
class Chains:
    """C chains at points ``x`` (C, D), with the potential U(x) (C,) and its gradient ∇U(x) (C, D) there."""

    x: Tensor
    energy: Tensor
    grad: Tensor

    @classmethod
    def at(cls, potential: Potential, x: Tensor) -> Chains:
        """The chains at x (C, D), the potential evaluated there."""
        return cls(x, *potential(x))

    def where(self, keep_other: Tensor, other: Chains) -> Chains:
        """Row c from ``other`` where ``keep_other`` (C,) is true, else from self."""
        return Chains(
            torch.where(keep_other[:, None], other.x, self.x),
            torch.where(keep_other, other.energy, self.energy),
            torch.where(keep_other[:, None], other.grad, self.grad),
        )


@attrs.frozen
class Transition:
    """One Metropolis-Hastings transition of C chains: where they are now, and each proposal's
    acceptance probability min(1, r) (C,) (0 where the proposal's potential is not finite)."""

    chains: Chains
    accept_prob: Tensor


def metropolis(current: Chains, proposed: Chains, log_ratio: Tensor, generator: torch.Generator | None) -> Transition:
    """Accept each proposal with probability min(1, exp(log_ratio)) (C,); a NaN ratio is a rejection."""
    log_ratio = torch.nan_to_num(log_ratio, nan=-math.inf)
    accept_prob = log_ratio.clamp(max=0.0).exp()
    u = torch.rand(log_ratio.shape, generator=generator, dtype=log_ratio.dtype, device=log_ratio.device)
    return Transition(current.where(u < accept_prob, proposed), accept_prob)


def normal_like(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal noise shaped like x, from ``generator``."""
    return torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)


def mala_step(potential: Potential, chains: Chains, step_size: Tensor, generator: torch.Generator | None) -> Transition:
    """One MALA transition per chain: propose x' = x − ½ε²∇U(x) + εξ (ξ ~ N(0, I), ε (C,)), accept
    with r = exp(U(x) − U(x')) q(x | x') / q(x' | x), q(x' | x) = N(x'; x − ½ε²∇U(x), ε²I)."""
    eps = step_size[:, None]
    x = chains.x - 0.5 * eps**2 * chains.grad + eps * normal_like(chains.x, generator)
    proposed = Chains.at(potential, x)
    log_ratio = chains.energy - proposed.energy + langevin_log_density(proposed, chains.x, eps)
    log_ratio = log_ratio - langevin_log_density(chains, proposed.x, eps)
    return metropolis(chains, proposed, log_ratio, generator)


def langevin_log_density(start: Chains, end: Tensor, eps: Tensor) -> Tensor:
    """log q(end | start) + const = −‖end − start.x + ½ε²∇U(start.x)‖²/(2ε²): (C, D), ε (C, 1) -> (C,)."""
    return -((end - start.x + 0.5 * eps**2 * start.grad) ** 2).sum(-1) / (2 * eps[:, 0] ** 2)


def leapfrog(
    potential: Potential, chains: Chains, momentum: Tensor, eps: Tensor, n_steps: int
) -> tuple[Chains, Tensor]:
    """``n_steps`` leapfrog steps of Hamilton's equations for H = U(x) + ½‖p‖² with step ε (C, 1):
    half a momentum step, (position step, momentum step) n times with the last momentum step halved."""
    p = momentum - 0.5 * eps * chains.grad
    for i in range(n_steps):
        chains = Chains.at(potential, chains.x + eps * p)
        p = p - (0.5 if i == n_steps - 1 else 1.0) * eps * chains.grad
    return chains, p


def hmc_step(
    potential: Potential,
    chains: Chains,
    step_size: Tensor,
    n_leapfrog: int,
    generator: torch.Generator | None,
    jitter: float = 0.0,
) -> Transition:
    """One HMC transition per chain: a fresh momentum p ~ N(0, I), ``n_leapfrog`` leapfrog steps of
    size ε (C,) (each chain's drawn uniformly from ε(1 ± ``jitter``) first, which breaks the
    periodic trajectories a fixed εL runs on near-Gaussian targets), accepted with
    r = exp(H(x, p) − H(x', p')), H = U(x) + ½‖p‖²."""
    if jitter:
        uniform = torch.rand(step_size.shape, generator=generator, dtype=step_size.dtype, device=step_size.device)
        step_size = step_size * (1 + jitter * (2 * uniform - 1))
    momentum = normal_like(chains.x, generator)
    proposed, p = leapfrog(potential, chains, momentum, step_size[:, None], n_leapfrog)
    log_ratio = chains.energy + 0.5 * (momentum**2).sum(-1) - proposed.energy - 0.5 * (p**2).sum(-1)
    return metropolis(chains, proposed, log_ratio, generator)


class DualAveraging:
    """Per-chain step sizes adapted towards a target acceptance probability δ by dual averaging
    (Hoffman and Gelman 2014, Algorithm 5): after the t-th transition with acceptance probabilities
    α_t (C,), H̄_t = (1 − 1/(t + t₀)) H̄_(t−1) + (δ − α_t)/(t + t₀), log ε_t = μ − √t/γ · H̄_t with
    μ = log(10 ε₀), and the average log ε̄_t = t^(−κ) log ε_t + (1 − t^(−κ)) log ε̄_(t−1). Chains
    sample with ``step_size`` (ε_t) during the warm-up and with ``final`` (ε̄_t) after it."""

    def __init__(self, initial: Tensor, target: float, gamma: float = 0.05, t0: float = 10.0, kappa: float = 0.75):
        self.target, self.gamma, self.t0, self.kappa = target, gamma, t0, kappa
        self.mu = torch.log(10 * initial)
        self.step_size = initial.clone()
        self.error = torch.zeros_like(initial)  # H̄
        self.log_average = torch.zeros_like(initial)  # log ε̄
        self.t = 0

    def update(self, accept_prob: Tensor) -> Tensor:
        """Fold in one transition's acceptance probabilities (C,); returns the next step sizes ε_t (C,)."""
        self.t += 1
        t, weight = self.t, self.t ** (-self.kappa)
        self.error = (1 - 1 / (t + self.t0)) * self.error + (self.target - accept_prob) / (t + self.t0)
        log_step = self.mu - math.sqrt(t) / self.gamma * self.error
        self.log_average = weight * log_step + (1 - weight) * self.log_average
        self.step_size = log_step.exp()
        return self.step_size

    @property
    def final(self) -> Tensor:
        """The averaged step sizes ε̄ (C,) to sample with once the warm-up is over (ε₀ before any update)."""
        return self.log_average.exp() if self.t else self.step_size


# ---- diagnostics of the traces ------------------------------------------------------------------

MIN_DRAWS = 4  # per chain: split R-hat halves each chain and needs two draws in each half


def split_chains(trace: Tensor) -> Tensor:
    """Each chain cut in two halves (a middle draw of an odd length dropped): (N, M) -> (N // 2, 2M), float64."""
    half = trace.shape[0] // 2
    trace = trace.double()
    return torch.cat([trace[:half], trace[trace.shape[0] - half :]], dim=1)


def split_rhat(trace: Tensor) -> float:
    """Split R-hat of draws (N, M) of M chains (Gelman et al., Bayesian Data Analysis 3rd ed., 11.4):
    sqrt(var⁺/W), var⁺ = (n − 1)/n · W + B/n over the 2M half-chains of n draws, W the mean of their
    variances and B/n the variance of their means. 1 when the chains agree; above 1.01 they have not mixed."""
    chains = split_chains(trace)
    n = chains.shape[0]
    within = chains.var(0).mean()
    var_plus = (n - 1) / n * within + chains.mean(0).var()
    return float((var_plus / within).sqrt())


def autocovariance(chains: Tensor) -> Tensor:
    """Each chain's autocovariance at lags 0, …, n − 1, divided by n, by FFT: (n, M) -> (n, M)."""
    n = chains.shape[0]
    centred = chains - chains.mean(0)
    spectrum = torch.fft.rfft(centred, n=2 * n, dim=0)
    return torch.fft.irfft(spectrum * spectrum.conj(), n=2 * n, dim=0)[:n] / n


def effective_sample_size(trace: Tensor) -> float:
    """Effective sample size of draws (N, M) of M chains (Vehtari et al. 2021, without rank
    normalisation): over the 2M half-chains of n draws, ρ_t = 1 − (W − mean autocovariance_t)/var⁺,
    summed by Geyer's initial monotone sequence of pairs P_k = ρ_2k + ρ_(2k+1) (kept while positive,
    made non-increasing): ESS = 2Mn / (−1 + 2 Σ_k P_k), at most 2Mn·log10(2Mn) as in Stan. About N·M
    for independent draws; N·M/τ for draws with integrated autocorrelation time τ (AR(1) with
    coefficient φ: τ = (1 + φ)/(1 − φ))."""
    chains = split_chains(trace)
    n, m = chains.shape
    acov = autocovariance(chains)
    within = acov[0].mean() * n / (n - 1)
    var_plus = (n - 1) / n * within + chains.mean(0).var()
    rho = 1 - (within - acov.mean(1)) / var_plus
    pairs = rho[: n - n % 2].view(-1, 2).sum(1)
    negative = (pairs < 0).nonzero()
    kept = pairs[: int(negative[0]) if len(negative) else len(pairs)]
    tau = -1 + 2 * kept.cummin(0).values.sum()
    return float(n * m / tau.clamp(min=1 / math.log10(max(n * m, 10))))


def projection_directions(dim: int, k: int, like: Tensor) -> Tensor:
    """k fixed unit directions (dim, k) in R^dim (seed 0, whatever the sampler's seed), dtype and device of ``like``."""
    directions = torch.randn(dim, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (directions / directions.norm(dim=0)).to(like)


def chain_diagnostics_keys(draws: int, n_projections: int = 3) -> tuple[str, ...]:
    """The keys ``chain_diagnostics`` returns for ``draws`` kept draws per chain: none below MIN_DRAWS."""
    if draws < MIN_DRAWS:
        return ()
    return ("ess_energy", "rhat_energy") + (("ess_projections", "rhat_projections") if n_projections else ())


def chain_diagnostics(energies: Tensor, points: Tensor, n_projections: int = 3) -> dict[str, float]:
    """The effective sample size and split R-hat of kept draws of M chains: on their energies (N, M)
    (``ess_energy``, ``rhat_energy``) and on ``n_projections`` fixed random projections of their
    points (N, M, ...) (the smallest ESS, ``ess_projections``, and the largest R-hat,
    ``rhat_projections``); ``chain_diagnostics_keys`` says which are there."""
    keys = chain_diagnostics_keys(energies.shape[0], n_projections)
    if not keys:
        return {}
    result = {"ess_energy": effective_sample_size(energies), "rhat_energy": split_rhat(energies)}
    if n_projections:
        flat = points.flatten(2)
        traces = (flat @ projection_directions(flat.shape[-1], n_projections, flat)).unbind(-1)
        result["ess_projections"] = min(effective_sample_size(t) for t in traces)
        result["rhat_projections"] = max(split_rhat(t) for t in traces)
    return result
