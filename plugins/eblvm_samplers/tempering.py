"""Parallel tempering (replica exchange): each chain is a ladder of K replicas at inverse
temperatures 1 = β_0 > β_1 > ... > β_(K−1) = beta_min (geometric), each moved by its own kernel,
and neighbouring replicas exchange their states with the Metropolis probability
min(1, exp((β_k − β_(k+1))(U_k − U_(k+1)))), U_k the untempered potential of replica k's state. The
β = 1 replica keeps the target invariant; the hot ones cross between modes and hand their states
down. Swap rounds alternate between the pairs (0, 1), (2, 3), ... and (1, 2), (3, 4), ...
(deterministic even-odd swaps, Okabe et al. 2001; Syed et al. 2022).

Moves: ``gibbs``, block-Gibbs sweeps of p_β(v, h) ∝ exp(−β E(v, h)) (models with
``gibbs_sweep``, the GRBM), the replicas' states (v, h) and U = E(v, h); ``mala``, Metropolis-adjusted
Langevin on p_β(x) ∝ exp(−β U(x)), U the free energy or the joint energy (``targets``), each
replica's step size adapted by dual averaging during the warm-up (from ε₀/√β).
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, DataSplits, Draw, EnergyModel, Parts, Sampler, non_negative, option, positive
from eblvm.tools import (
    Chains,
    DualAveraging,
    Potential,
    autograd_potential,
    chain_diagnostics,
    chain_diagnostics_keys,
    evaluation_mode,
    mala_step,
)
from eblvm_samplers.gradient import chains_for, open_unit
from eblvm_samplers.targets import Target, TargetKind, starting_points, target_kind


def at_least_two(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    """Validator for value ≥ 2."""
    if value < 2:
        raise ValueError(f"must be at least 2 (β = 1 and a hotter replica), got {value}")


@attrs.frozen
class TemperingConfig:
    moves: Literal["auto", "gibbs", "mala"] = option(
        "auto",
        "how each replica moves between swaps: 'gibbs', block-Gibbs sweeps at its β (models with a Gibbs sweep: "
        "the GRBM); 'mala', Metropolis-adjusted Langevin on β·U (any model, deep ones included); 'auto', gibbs "
        "where the model has it",
    )
    n_temps: int = option(
        8, "replicas per chain, at inverse temperatures β geometric from 1 down to beta_min", at_least_two
    )
    beta_min: float = option(0.1, "the hottest replica's β", open_unit)
    swap_every: int = option(1, "moves of every replica between two rounds of swap attempts", positive)
    n_chains: int = option(
        16,
        "independent ladders; the n samples are shared out among their β = 1 replicas (0: one per sample)",
        non_negative,
    )
    warmup: int = option(
        500,
        "moves of every replica before the first kept state; MALA moves adapt their step sizes meanwhile",
        non_negative,
    )
    thin: int = option(1, "moves between successive kept states of a β = 1 replica", positive)
    target: TargetKind = option(
        "auto", "what MALA moves: 'marginal' v under F(v), 'joint' (v, h) under E(v, h), 'auto' (the mala sampler's)"
    )
    step_size: float = option(
        0.1, "MALA moves: initial step size at β = 1 (ε₀/√β at β), before the warm-up adapts each replica's", positive
    )
    target_acceptance: float = option(
        0.574, "MALA moves: acceptance probability the step sizes are adapted to", open_unit
    )
    init: Literal["noise", "data"] = option(
        "noise", "start every replica's v at Gaussian noise matched to the training data, or at training points"
    )
    n_projections: int = option(
        3, "fixed random projections of the samples whose effective sample size and R-hat are reported", non_negative
    )


def inverse_temperatures(n_temps: int, beta_min: float) -> Tensor:
    """β_k = beta_min^(k/(K−1)), k = 0, …, K − 1: from 1 down to beta_min, float64 (K,)."""
    return beta_min ** (torch.arange(n_temps, dtype=torch.float64) / (n_temps - 1))


class Replicas(Protocol):
    """K·C replica states, row k·C + c at β_k of chain c, moved together."""

    def move(self, adapting: bool, generator: torch.Generator | None) -> Tensor | None:
        """One move of every replica; the MALA acceptance probabilities (K·C,) or None (Gibbs)."""

    def energy(self) -> Tensor:
        """The untempered potential U of every replica's state (K·C,)."""

    def points(self) -> Tensor:
        """The flat points x (K·C, D) (for Gibbs moves, v)."""

    def permute(self, rows: Tensor) -> None:
        """Take the state of row rows[i] into row i (K·C,)."""


def scaled(chains: Chains, factor: Tensor) -> Chains:
    """The same points with the potential and its gradient multiplied by factor (C,): β·U and β·∇U."""
    return Chains(chains.x, factor * chains.energy, factor[:, None] * chains.grad)


class LangevinReplicas:
    """Replicas moved by MALA on p_β(x) ∝ exp(−β U(x)), their step sizes adapted during the warm-up."""

    def __init__(self, potential: Potential, start: Tensor, betas: Tensor, cfg: TemperingConfig):
        self.potential, self.betas = potential, betas
        self.chains = Chains.at(potential, start)  # U and ∇U untempered: a swap moves rows as they are
        self.adaptation = DualAveraging(cfg.step_size / betas.sqrt(), cfg.target_acceptance)

    @property
    def step_size(self) -> Tensor:
        """Each replica's step size (K·C,) once the warm-up is over."""
        return self.adaptation.final

    def tempered(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """β·U(x) and β·∇U(x), each row at its replica's β: x (K·C, D)."""
        energy, grad = self.potential(x)
        return self.betas * energy, self.betas[:, None] * grad

    def move(self, adapting: bool, generator: torch.Generator | None) -> Tensor:
        step_size = self.adaptation.step_size if adapting else self.adaptation.final
        transition = mala_step(self.tempered, scaled(self.chains, self.betas), step_size, generator)
        self.chains = scaled(transition.chains, 1 / self.betas)
        if adapting:
            self.adaptation.update(transition.accept_prob)
        return transition.accept_prob

    def energy(self) -> Tensor:
        return self.chains.energy

    def points(self) -> Tensor:
        return self.chains.x

    def permute(self, rows: Tensor) -> None:
        self.chains = Chains(self.chains.x[rows], self.chains.energy[rows], self.chains.grad[rows])


class GibbsReplicas:
    """Replicas (v, h) moved by the model's block-Gibbs sweep at their β; U = E(v, h)."""

    def __init__(
        self,
        model: EnergyModel,
        start: Tensor,
        betas: Tensor,
        event_shape: tuple[int, ...],
        generator: torch.Generator | None,
    ):
        self.model, self.betas = model, betas
        self.v, self.h = model.gibbs_sweep(start.view(len(start), *event_shape), betas, generator)

    def move(self, adapting: bool, generator: torch.Generator | None) -> None:
        self.v, self.h = self.model.gibbs_sweep(self.v, self.betas, generator)

    def energy(self) -> Tensor:
        with torch.no_grad():
            return self.model.energy(self.v, self.h)

    def points(self) -> Tensor:
        return self.v.flatten(1)

    def permute(self, rows: Tensor) -> None:
        self.v, self.h = self.v[rows], self.h[rows]


def swap_round(energy: Tensor, betas: Tensor, parity: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """One round of swap attempts between replicas k and k + 1 for every k of this parity, in every
    chain: energy (K, C) untempered, β (K,) -> (rows (K·C,): the replica each row takes its state
    from, the acceptance probabilities (K − 1, C), NaN for the pairs not attempted)."""
    n_temps, n_chains = energy.shape
    lower = torch.arange(parity, n_temps - 1, 2, device=energy.device)
    log_ratio = (betas[lower] - betas[lower + 1])[:, None] * (energy[lower] - energy[lower + 1])
    accept_prob = torch.nan_to_num(log_ratio, nan=-math.inf).clamp(max=0.0).exp()
    u = torch.rand(accept_prob.shape, generator=generator, dtype=accept_prob.dtype, device=accept_prob.device)
    swap = u < accept_prob
    source = torch.arange(n_temps, device=energy.device)[:, None].expand(n_temps, n_chains).clone()
    source[lower] = torch.where(swap, lower[:, None] + 1, lower[:, None])
    source[lower + 1] = torch.where(swap, lower[:, None], lower[:, None] + 1)
    rows = source * n_chains + torch.arange(n_chains, device=energy.device)
    per_pair = torch.full((n_temps - 1, n_chains), math.nan, dtype=accept_prob.dtype, device=accept_prob.device)
    per_pair[lower] = accept_prob
    return rows.flatten(), per_pair


@attrs.frozen
class TemperingRun:
    """The β = 1 replicas' kept states: points (N, C, D) and potentials (N, C); the mean swap
    acceptance probability of each neighbouring pair (K − 1,); the β = 1 replicas' mean MALA
    acceptance probability after the warm-up (None for Gibbs moves)."""

    points: Tensor
    energies: Tensor
    swap_acceptance: Tensor
    acceptance: float | None


def temper(
    replicas: Replicas, betas: Tensor, cfg: TemperingConfig, draws: int, generator: torch.Generator | None
) -> TemperingRun:
    """``cfg.warmup`` moves, then ``draws`` states of the β = 1 replicas kept every ``cfg.thin``
    moves; a swap round after every ``cfg.swap_every`` moves."""
    n_temps = len(betas)
    n_chains = len(replicas.energy()) // n_temps
    betas = betas.to(replicas.energy())
    swaps, accepted, points, energies = [], [], [], []
    for i in range(cfg.warmup + draws * cfg.thin):
        accept_prob = replicas.move(i < cfg.warmup, generator)
        if accept_prob is not None and i >= cfg.warmup:
            accepted.append(accept_prob[:n_chains])
        if (i + 1) % cfg.swap_every == 0:
            parity = ((i + 1) // cfg.swap_every) % 2
            rows, per_pair = swap_round(replicas.energy().view(n_temps, n_chains), betas, parity, generator)
            replicas.permute(rows)
            swaps.append(per_pair)
        if i >= cfg.warmup and (i - cfg.warmup + 1) % cfg.thin == 0:
            points.append(replicas.points()[:n_chains])
            energies.append(replicas.energy()[:n_chains])
    swap_acceptance = torch.stack(swaps).nanmean((0, 2)) if swaps else torch.full((n_temps - 1,), math.nan)
    acceptance = float(torch.stack(accepted).mean()) if accepted else None
    return TemperingRun(torch.stack(points), torch.stack(energies), swap_acceptance, acceptance)


def move_kind(cfg: TemperingConfig, model: EnergyModel) -> str:
    """``gibbs`` or ``mala`` for this model; a ConfigError naming [sampler] moves where Gibbs is asked of a model without it."""
    if cfg.moves == "gibbs" and not model.has_gibbs_sweep:
        raise ConfigError("sampler", "moves", f"{type(model).__name__} has no block-Gibbs sweep: use moves = 'mala'")
    if cfg.moves == "auto":
        return "gibbs" if model.has_gibbs_sweep else "mala"
    return cfg.moves


class TemperingSampler(Sampler):
    """Parallel tempering: ``n_chains`` ladders of ``n_temps`` replicas; the β = 1 replicas' states
    are the samples, kept every ``thin`` moves after ``warmup`` moves, draw by draw."""

    def __init__(self, cfg: TemperingConfig, data: DataSplits):
        self.cfg, self.data = cfg, data

    def sample(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n samples (n, *event_shape) of v."""
        return self.draw(model, n, generator).samples

    def draw(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Draw:
        """n samples (n, *event_shape) of v from the β = 1 replicas, with the swap acceptance of each
        neighbouring pair (``swap_acceptance_k_k+1``, k = 0 the β = 1 replica), the MALA moves'
        acceptance and step size at β = 1, and the ESS and split R-hat of the β = 1 chains."""
        cfg = self.cfg
        moves = move_kind(cfg, model)
        target = Target(model, "marginal" if moves == "gibbs" else target_kind(cfg.target, model), self.data.shape)
        n_chains, draws = chains_for(cfg.n_chains, n)
        like = next(model.parameters())
        betas = inverse_temperatures(cfg.n_temps, cfg.beta_min)
        start = starting_points(cfg.init, n_chains * cfg.n_temps, target, self.data, like, generator)
        row_betas = betas.to(like).repeat_interleave(n_chains)
        replicas: Replicas
        with evaluation_mode([model]):
            if moves == "gibbs":
                replicas = GibbsReplicas(model, start, row_betas, self.data.shape, generator)
            else:
                replicas = LangevinReplicas(autograd_potential(target.energy), start, row_betas, cfg)
            run = temper(replicas, betas, cfg, draws, generator)
        visible = target.visible(run.points)
        diagnostics = {f"swap_acceptance_{k}_{k + 1}": float(p) for k, p in enumerate(run.swap_acceptance)}
        if isinstance(replicas, LangevinReplicas) and run.acceptance is not None:
            diagnostics |= {"acceptance": run.acceptance, "step_size": float(replicas.step_size[:n_chains].mean())}
        diagnostics |= chain_diagnostics(run.energies, visible, cfg.n_projections)
        return Draw(visible.reshape(-1, *self.data.shape)[:n].detach(), diagnostics)

    def diagnostics_keys(self, model: EnergyModel, n: int) -> tuple[str, ...]:
        cfg = self.cfg
        swaps = tuple(f"swap_acceptance_{k}_{k + 1}" for k in range(cfg.n_temps - 1))
        mala = ("acceptance", "step_size") if move_kind(cfg, model) == "mala" else ()
        return swaps + mala + chain_diagnostics_keys(chains_for(cfg.n_chains, n)[1], cfg.n_projections)


def build_tempering(cfg: TemperingConfig, parts: Parts) -> TemperingSampler:
    """Parallel tempering over a geometric ladder of inverse temperatures, with Gibbs (GRBM) or MALA moves between swaps."""
    data = parts.need("data", "sampler")
    if parts.model is not None and move_kind(cfg, parts.model) == "mala":
        target_kind(cfg.target, parts.model)
    return TemperingSampler(cfg, data)
