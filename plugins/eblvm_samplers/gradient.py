"""MALA and HMC samplers: batched chains on a model's free energy (marginal p(v)) or joint energy
(v and continuous h), each chain's step size adapted by dual averaging during a warm-up and then
fixed, so the kept states are draws of an exact Metropolis-Hastings chain."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import DataSplits, Draw, EnergyModel, Parts, Sampler, in_range, non_negative, option, positive
from eblvm.tools import (
    Chains,
    DualAveraging,
    Potential,
    Transition,
    autograd_potential,
    chain_diagnostics,
    chain_diagnostics_keys,
    evaluation_mode,
    hmc_step,
    mala_step,
)
from eblvm_samplers.targets import Target, TargetKind, starting_points, target_kind

Move = Callable[[Potential, Chains, Tensor, torch.Generator | None], Transition]
"""One transition of every chain: (potential, chains, step sizes (C,), generator) -> Transition."""


def open_unit(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    """Validator for 0 < value < 1."""
    if not 0 < value < 1:
        raise ValueError(f"must be between 0 and 1 (both excluded), got {value}")


@attrs.frozen
class ChainOptions:
    """The options every gradient-based sampler shares."""

    target: TargetKind = option(
        "auto",
        "what the chains move: 'marginal', v under the free energy F(v) (h summed out; a fully visible model's "
        "E(v)); 'joint', (v, h) under E(v, h) (continuous h); 'auto', marginal where possible, else joint",
    )
    n_chains: int = option(
        16, "parallel chains; the n samples are shared out among them (0: one chain per sample)", non_negative
    )
    warmup: int = option(
        500, "transitions adapting each chain's step size by dual averaging; none of them is kept", non_negative
    )
    thin: int = option(1, "transitions between successive kept states of a chain", positive)
    step_size: float = option(0.1, "initial step size ε of every chain, before the warm-up adapts it", positive)
    init: Literal["noise", "data"] = option(
        "noise", "start v at Gaussian noise matched to the training data, or at training points (h: N(0, I))"
    )
    n_projections: int = option(
        3, "fixed random projections of the samples whose effective sample size and R-hat are reported", non_negative
    )


@attrs.frozen
class MALAConfig(ChainOptions):
    target_acceptance: float = option(
        0.574, "acceptance probability the warm-up adapts the step sizes to (0.574: optimal for MALA)", open_unit
    )


@attrs.frozen
class HMCConfig(ChainOptions):
    leapfrog_steps: int = option(10, "leapfrog steps L per transition (gradient evaluations per transition)", positive)
    step_jitter: float = option(
        0.2,
        "each transition's step size is drawn uniformly from ε(1 ± step_jitter): it breaks the periodic "
        "trajectories a fixed εL runs on near-Gaussian targets, which leave some directions barely moving (0: fixed)",
        in_range(0.0, 0.99),
    )
    target_acceptance: float = option(
        0.65, "acceptance probability the warm-up adapts the step sizes to (0.65: optimal for HMC)", open_unit
    )


@attrs.frozen
class ChainRun:
    """Kept states of C chains: points (N, C, D), their potentials (N, C), the mean acceptance
    probability after the warm-up, and each chain's step size (C,)."""

    points: Tensor
    energies: Tensor
    acceptance: float
    step_size: Tensor


def run_chains(
    potential: Potential,
    start: Tensor,
    move: Move,
    cfg: MALAConfig | HMCConfig,
    draws: int,
    generator: torch.Generator | None,
) -> ChainRun:
    """Chains from ``start`` (C, D): ``cfg.warmup`` transitions adapting each chain's step size, then
    ``draws`` states kept every ``cfg.thin`` transitions at the adapted, fixed step sizes."""
    chains = Chains.at(potential, start)
    adaptation = DualAveraging(torch.full_like(chains.energy, cfg.step_size), cfg.target_acceptance)
    for _ in range(cfg.warmup):
        transition = move(potential, chains, adaptation.step_size, generator)
        chains = transition.chains
        adaptation.update(transition.accept_prob)
    step_size, accepted, points, energies = adaptation.final, [], [], []
    for _ in range(draws * cfg.thin):
        transition = move(potential, chains, step_size, generator)
        chains = transition.chains
        accepted.append(transition.accept_prob)
        if len(accepted) % cfg.thin == 0:
            points.append(chains.x)
            energies.append(chains.energy)
    return ChainRun(torch.stack(points), torch.stack(energies), float(torch.stack(accepted).mean()), step_size)


def chains_for(n_chains: int, n: int) -> tuple[int, int]:
    """(chains, kept states per chain) for n samples: ``n_chains`` chains (0: n), never more than n."""
    chains = min(n_chains or n, n)
    return chains, math.ceil(n / chains)


class GradientSampler(Sampler):
    """Batched Metropolis-Hastings chains moved by ``move`` (MALA or HMC): ``n_chains`` chains run
    ``warmup`` adapting transitions, then each keeps a state every ``thin`` transitions until n
    samples are collected, draw by draw (the first state of every chain, then the second...).
    ``settings`` are reported with the diagnostics as they are (HMC's ``leapfrog_steps``)."""

    def __init__(self, cfg: MALAConfig | HMCConfig, data: DataSplits, move: Move, settings: dict[str, float]):
        self.cfg, self.data, self.move, self.settings = cfg, data, move, settings

    def sample(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n samples (n, *event_shape) of v."""
        return self.draw(model, n, generator).samples

    def draw(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Draw:
        """n samples (n, *event_shape) of v, with the mean acceptance probability after the warm-up,
        the chains' mean step size, and the ESS and split R-hat of the potential and of projections of v."""
        cfg = self.cfg
        target = Target(model, target_kind(cfg.target, model), self.data.shape)
        n_chains, draws = chains_for(cfg.n_chains, n)
        start = starting_points(cfg.init, n_chains, target, self.data, next(model.parameters()), generator)
        with evaluation_mode([model]):
            run = run_chains(autograd_potential(target.energy), start, self.move, cfg, draws, generator)
        visible = target.visible(run.points)  # (N, C, *event_shape)
        diagnostics = {"acceptance": run.acceptance, "step_size": float(run.step_size.mean()), **self.settings}
        diagnostics |= chain_diagnostics(run.energies, visible, cfg.n_projections)
        return Draw(visible.reshape(-1, *self.data.shape)[:n].detach(), diagnostics)

    def diagnostics_keys(self, model: EnergyModel, n: int) -> tuple[str, ...]:
        draws = chains_for(self.cfg.n_chains, n)[1]
        return ("acceptance", "step_size", *self.settings) + chain_diagnostics_keys(draws, self.cfg.n_projections)


def build_mala(cfg: MALAConfig, parts: Parts) -> GradientSampler:
    """Metropolis-adjusted Langevin chains on the free energy (p(v)) or the joint energy (v, continuous h), step sizes by dual averaging."""
    data = parts.need("data", "sampler")
    if parts.model is not None:
        target_kind(cfg.target, parts.model)
    return GradientSampler(cfg, data, mala_step, {})


def build_hmc(cfg: HMCConfig, parts: Parts) -> GradientSampler:
    """Hamiltonian Monte Carlo chains (L leapfrog steps) on the free energy or the joint energy, step sizes by dual averaging."""
    data = parts.need("data", "sampler")
    if parts.model is not None:
        target_kind(cfg.target, parts.model)

    def move(potential: Potential, chains: Chains, step_size: Tensor, generator: torch.Generator | None) -> Transition:
        return hmc_step(potential, chains, step_size, cfg.leapfrog_steps, generator, cfg.step_jitter)

    return GradientSampler(cfg, data, move, {"leapfrog_steps": float(cfg.leapfrog_steps)})
