"""Annealed importance sampling (AIS) of a GRBM's log-partition function, run both ways
(Neal 2001; Salakhutdinov & Murray 2008; bidirectional Monte Carlo, Grosse et al. 2015), and the
test log-likelihood evaluator built on it.

The path is geometric between an independent base A and the GRBM (energy E, coupling U):
    p_β(v, h) ∝ exp(−(1 − β) E_A(v) − β E(v, h)),   E_A(v) = Σ_i (v_i − μ_i)²/(2 s_i²),
so the hidden biases c are annealed with the coupling. At β = 0, v ~ N(μ, diag s²) and
h ~ Bernoulli(1/2), and log Z_0 = Σ_i ½ log(2π s_i²) + m log 2. Summing out h, the marginal is
    log f_β(v) = −(1 − β) E_A(v) − β ‖v − b‖²/(2σ²) + Σ_j softplus(β a_j),   a = c + Uᵀv.
The Gibbs sweep at β draws h_j ~ Bernoulli(sigmoid(β a_j)), then v ~ N(m_β, diag 1/λ_β) with
λ_β = (1 − β)/s² + β/σ² and m_β = ((1 − β) μ/s² + β (b/σ² + Uh))/λ_β. MALA and HMC transitions
(``transitions``) move v on U_β = −log f_β instead, with ∇U_β = (1 − β)(v − μ)/s² + β(v − b)/σ² −
β U sigmoid(β a) and the step size ``step_scale``/√max_i λ_β,i: the largest curvature of U_β's
quadratic part sets it, fixed in advance, so every transition leaves p_β invariant as AIS needs.

A run over β_0, …, β_K accumulates log w = Σ_k [log f_(β_k)(v_(k−1)) − log f_(β_(k−1))(v_(k−1))],
with one sweep at β_k after each term but the last. Forward (β from 0 to 1, v_0 exact draws of the
base), E[w] = Z_1/Z_0: log Ẑ = log Z_0 + log mean w is a stochastic lower bound of log Z (Jensen).
Reverse (β from 1 to 0, v_0 draws of the GRBM), E[w] = Z_0/Z_1: log Ẑ = log Z_0 − log mean w is a
stochastic upper bound when the starting draws are exact. The evaluator starts the reverse chains
at training points followed by Gibbs sweeps at β = 1, approximate draws of a model fitted to
them, so the upper bound is approximate; the gap between the two is what shows a failed anneal.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from eblvm.plugin import ConfigError, EvalResult, Evaluator, Parts, non_negative, option, positive, reporting
from eblvm.tools import Chains, Potential, hmc_step, mala_step
from eblvm_grbm.gibbs import gibbs_chain, require_grbm
from eblvm_grbm.model import GRBM


@attrs.frozen
class Base:
    """The independent base model A of the path: v_i ~ N(mean_i, var_i), h ~ Bernoulli(1/2)."""

    mean: Tensor  # μ (d,)
    var: Tensor  # s² (d,)

    def log_partition(self, n_hidden: int) -> Tensor:
        """log Z_0 = Σ_i ½ log(2π s_i²) + m log 2 (scalar)."""
        return 0.5 * torch.log(2 * math.pi * self.var).sum() + n_hidden * math.log(2.0)

    def energy(self, v: Tensor) -> Tensor:
        """E_A(v) = Σ_i (v_i − μ_i)²/(2 s_i²): v (n, d) -> (n,)."""
        return 0.5 * ((v - self.mean) ** 2 / self.var).sum(-1)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n exact draws (n, d) of v under the base."""
        noise = torch.randn(n, len(self.mean), generator=generator, dtype=self.mean.dtype, device=self.mean.device)
        return self.mean + self.var.sqrt() * noise


def model_base(model: GRBM) -> Base:
    """v ~ N(b, σ²I): the GRBM with its coupling and hidden biases switched off."""
    d = model.W.shape[0]
    return Base(model.b.detach().clone(), (model.sigma**2).detach().expand(d).clone())


def data_base(model: GRBM, v: Tensor) -> Base:
    """A base-rate model (Salakhutdinov and Murray 2008) from training points v (n, d): each
    pixel's mean, and its variance plus σ², the variance every component N(b + σ²Uh, σ²I) of
    the GRBM's marginal adds to the spread of the means."""
    return Base(v.mean(0), v.var(0) + (model.sigma**2).detach())


@attrs.frozen
class AISResult:
    """log Ẑ, its delta-method standard error, the effective sample size (Σw)²/Σw² of the
    chains' weights, and each chain's log w (n,)."""

    log_z: float
    log_z_stderr: float
    ess: float
    log_weights: Tensor


def log_ratio(model: GRBM, base: Base, v: Tensor, logits: Tensor, prev: float, beta: float) -> Tensor:
    """log f_β(v) − log f_prev(v) = (β − prev)(E_A(v) − ‖v − b‖²/(2σ²)) + Σ_j softplus(β a_j) −
    softplus(prev a_j): v (n, d), logits a = c + Uᵀv (n, m) -> (n,)."""
    quadratic = base.energy(v) - model.visible_quadratic(v)
    return (beta - prev) * quadratic + (F.softplus(beta * logits) - F.softplus(prev * logits)).sum(-1)


def sweep(model: GRBM, base: Base, v: Tensor, beta: float, logits: Tensor, generator: torch.Generator | None) -> Tensor:
    """One Gibbs sweep v → h → v at β, leaving p_β(v) invariant; ``logits`` = c + Uᵀv (n, m). -> (n, d)."""
    h = torch.bernoulli(torch.sigmoid(beta * logits), generator=generator)
    inv_var = torch.exp(-2 * model.log_sigma)
    precision = (1 - beta) / base.var + beta * inv_var
    mean = ((1 - beta) * base.mean / base.var + beta * (model.b * inv_var + h @ model.coupling_weight().T)) / precision
    noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + noise / precision.sqrt()


Move = Callable[[GRBM, Base, Tensor, float, Tensor, torch.Generator | None], Tensor]
"""A transition at β leaving p_β(v) invariant: (model, base, v (n, d), β, logits c + Uᵀv (n, m), generator) -> v (n, d)."""


def path_potential(model: GRBM, base: Base, beta: float) -> Potential:
    """U_β(v) = −log f_β(v) = (1 − β)E_A(v) + β‖v − b‖²/(2σ²) − Σ_j softplus(β a_j) and its gradient
    (1 − β)(v − μ)/s² + β(v − b)/σ² − β sigmoid(βa)Uᵀ: v (n, d) -> ((n,), (n, d))."""
    coupling, inv_var = model.coupling_weight(), torch.exp(-2 * model.log_sigma)

    def potential(v: Tensor) -> tuple[Tensor, Tensor]:
        logits = beta * model.hidden_logits(v)
        energy = (1 - beta) * base.energy(v) + beta * model.visible_quadratic(v) - F.softplus(logits).sum(-1)
        grad = (1 - beta) * (v - base.mean) / base.var + beta * (v - model.b) * inv_var
        return energy, grad - beta * torch.sigmoid(logits) @ coupling.T

    return potential


def gradient_move(kind: Literal["mala", "hmc"], step_scale: float, leapfrog_steps: int = 1) -> Move:
    """One MALA or HMC transition (``leapfrog_steps`` steps) on U_β, step size
    ``step_scale``/√max_i λ_β,i with λ_β = (1 − β)/s² + β/σ²."""

    def move(
        model: GRBM, base: Base, v: Tensor, beta: float, logits: Tensor, generator: torch.Generator | None
    ) -> Tensor:
        precision = (1 - beta) / base.var + beta * torch.exp(-2 * model.log_sigma)
        step_size = (step_scale / precision.max().sqrt()).expand(len(v))
        potential = path_potential(model, base, beta)
        chains = Chains.at(potential, v)
        if kind == "mala":
            return mala_step(potential, chains, step_size, generator).chains.x
        return hmc_step(potential, chains, step_size, leapfrog_steps, generator).chains.x

    return move


def anneal(
    model: GRBM,
    base: Base,
    v: Tensor,
    betas: list[float],
    generator: torch.Generator | None = None,
    move: Move = sweep,
) -> Tensor:
    """Run chains from v (n, d) over ``betas``: log w (n,) float64 = Σ_k log f_(β_k)(v_(k−1)) −
    log f_(β_(k−1))(v_(k−1)), with one ``move`` at β_k (a Gibbs sweep by default) after each term but the last."""
    log_w = torch.zeros(len(v), dtype=torch.float64, device=v.device)
    with torch.no_grad():
        for k, (prev, beta) in enumerate(zip(betas[:-1], betas[1:])):
            logits = model.hidden_logits(v)
            log_w += log_ratio(model, base, v, logits, prev, beta).double()
            if k < len(betas) - 2:
                v = move(model, base, v, beta, logits, generator)
    return log_w


def summarise(log_w: Tensor, sign: float, log_z0: float) -> AISResult:
    """log Ẑ = log Z_0 + sign · log mean w, its standard error std(w)/(mean(w)√n) and the ESS."""
    n = len(log_w)
    log_mean_w = float(torch.logsumexp(log_w, 0)) - math.log(n)
    w = torch.exp(log_w - log_w.max())
    rel_stderr = float(w.std() / (w.mean() * math.sqrt(n))) if n > 1 else float("inf")
    ess = float(torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)))
    return AISResult(log_z0 + sign * log_mean_w, rel_stderr, ess, log_w)


def linear_betas(n_temps: int) -> list[float]:
    """``n_temps`` values of β, linear from 0 to 1 inclusive."""
    return torch.linspace(0.0, 1.0, n_temps, dtype=torch.float64).tolist()


def ais_log_partition(
    model: GRBM,
    base: Base,
    n_chains: int,
    n_temps: int,
    generator: torch.Generator | None = None,
    move: Move = sweep,
) -> AISResult:
    """Forward AIS: ``n_chains`` exact base draws annealed over ``n_temps`` linear β from 0 to 1
    by ``move``; log Ẑ is a stochastic lower bound of log Z."""
    log_z0 = float(base.log_partition(model.W.shape[1]))
    log_w = anneal(model, base, base.sample(n_chains, generator), linear_betas(n_temps), generator, move)
    return summarise(log_w, 1.0, log_z0)


def reverse_ais_log_partition(
    model: GRBM,
    base: Base,
    v: Tensor,
    n_temps: int,
    generator: torch.Generator | None = None,
    move: Move = sweep,
) -> AISResult:
    """Reverse AIS: draws v (n, d) of the GRBM annealed over ``n_temps`` linear β from 1 to 0 by
    ``move``; log Ẑ is a stochastic upper bound of log Z when the draws are exact."""
    log_z0 = float(base.log_partition(model.W.shape[1]))
    log_w = anneal(model, base, v, linear_betas(n_temps)[::-1], generator, move)
    return summarise(log_w, -1.0, log_z0)


@attrs.frozen
class AISLoglikConfig:
    n_chains: int = option(2000, "forward AIS chains (the papers used 2,000)", positive)
    n_reverse_chains: int = option(
        500, "reverse AIS chains, started at training points after reverse_burn_in sweeps at β = 1", positive
    )
    n_temps: int = option(
        2000, "inverse temperatures β, linear in [0, 1], of each direction (the papers used 2,000)", positive
    )
    base: Literal["data", "model"] = option(
        "data",
        "β = 0 model, h ~ Bernoulli(1/2) in both (c is annealed with the coupling): 'data', v_i ~ N(training "
        "pixel mean, pixel variance + σ²), a base-rate model (Salakhutdinov and Murray 2008), the one that works "
        "on Frey face (forward ESS 181 of 200 chains at 2,000 β, against 15); 'model', v ~ N(b, σ²I)",
    )
    reverse_burn_in: int = option(
        100, "Gibbs sweeps at β = 1 from the training points before the reverse run", non_negative
    )
    max_gap: float = option(
        1.0, "warn on stderr when the forward and reverse log Ẑ differ by more than this (nats)", positive
    )
    min_ess: float = option(
        20.0, "warn on stderr when the effective sample size of either direction's weights is below this", positive
    )
    split: Literal["test", "train", "val"] = option("test", "data split to average log p(v) over")
    seed: int = option(0, "seed of the AIS chains, so that repeated evaluations agree")
    batch_size: int = option(10000, "points per free-energy evaluation", positive)
    transitions: Literal["gibbs", "mala", "hmc"] = option(
        "gibbs",
        "the move at each β: 'gibbs', a block-Gibbs sweep v → h → v; 'mala', a Metropolis-adjusted Langevin step "
        "on v; 'hmc', an HMC transition of leapfrog_steps steps on v (both on the path's marginal p_β(v))",
    )
    step_scale: float = option(
        0.5,
        "mala and hmc: step size at β as a fraction of 1/√λ_β, λ_β = max_i (1 − β)/s_i² + β/σ², the largest "
        "curvature of the path's quadratic part",
        positive,
    )
    leapfrog_steps: int = option(5, "hmc: leapfrog steps per transition", positive)


def transition(cfg: AISLoglikConfig) -> Move:
    """The move at each β that ``cfg.transitions`` names."""
    if cfg.transitions == "gibbs":
        return sweep
    return gradient_move(cfg.transitions, cfg.step_scale, cfg.leapfrog_steps)


def build_ais_loglik(cfg: AISLoglikConfig, parts: Parts) -> Evaluator:
    """Mean log p(v), log Z by forward AIS from a base-rate model (Gibbs, MALA or HMC transitions), checked by reverse AIS; warns on a gap or low ESS."""
    require_grbm(parts.need("model", ""), "", "ais-loglik")
    data = parts.need("data", "")
    if cfg.n_temps < 2:
        raise ConfigError("", "n_temps", f"AIS needs at least 2 temperatures (β = 0 and β = 1), got {cfg.n_temps}")
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")
    s = cfg.split

    @reporting(
        [f"{s}_loglik", f"{s}_loglik_stderr", f"{s}_loglik_reverse"]
        + ["log_z", "log_z_stderr", "log_z_ess", "log_z_reverse", "log_z_reverse_stderr", "log_z_reverse_ess"]
        + ["log_z_gap"]
    )
    def evaluate(parts: Parts) -> EvalResult:
        """{split}_loglik = mean −F(v) − log Ẑ (forward), {split}_loglik_reverse (with the reverse log Ẑ),
        both log Ẑ with their standard errors and ESS, and log_z_gap = reverse − forward."""
        model = parts.model
        train = parts.data.tensor("train").flatten(1).to(model.W)
        base = data_base(model, train) if cfg.base == "data" else model_base(model)
        generator = torch.Generator(device=model.W.device).manual_seed(cfg.seed)
        move = transition(cfg)
        forward = ais_log_partition(model, base, cfg.n_chains, cfg.n_temps, generator, move)
        start = train[torch.randint(len(train), (cfg.n_reverse_chains,), generator=generator, device=train.device)]
        start = gibbs_chain(model, start, cfg.reverse_burn_in, generator)
        reverse = reverse_ais_log_partition(model, base, start, cfg.n_temps, generator, move)
        with torch.no_grad():
            v = parts.data.tensor(s)
            neg_free = sum(float(-model.free_energy(chunk.flatten(1)).sum()) for chunk in v.split(cfg.batch_size))
        mean_neg_free = neg_free / len(v)
        gap = reverse.log_z - forward.log_z
        if gap > cfg.max_gap:
            warn(
                f"forward and reverse AIS disagree: log Z in [{forward.log_z:.2f}, {reverse.log_z:.2f}] "
                f"(gap {gap:.2f} > {cfg.max_gap} nats); the anneal has not converged: raise n_temps"
            )
        elif gap < -cfg.max_gap:
            warn(
                f"reverse AIS ends {-gap:.2f} nats below the forward log Z {forward.log_z:.2f} (> {cfg.max_gap}): "
                "its starting points are not draws of the model: raise reverse_burn_in"
            )
        for name, result, n in (("forward", forward, cfg.n_chains), ("reverse", reverse, cfg.n_reverse_chains)):
            if result.ess < cfg.min_ess:
                warn(
                    f"effective sample size of the {name} weights is {result.ess:.1f} of {n} chains "
                    f"(< {cfg.min_ess}): its standard error {result.log_z_stderr:.3g} is not to be trusted"
                )
        return EvalResult(
            scalars={
                f"{s}_loglik": mean_neg_free - forward.log_z,
                f"{s}_loglik_stderr": forward.log_z_stderr,
                f"{s}_loglik_reverse": mean_neg_free - reverse.log_z,
                "log_z": forward.log_z,
                "log_z_stderr": forward.log_z_stderr,
                "log_z_ess": forward.ess,
                "log_z_reverse": reverse.log_z,
                "log_z_reverse_stderr": reverse.log_z_stderr,
                "log_z_reverse_ess": reverse.ess,
                "log_z_gap": gap,
            }
        )

    return evaluate


def warn(message: str) -> None:
    """One line on stderr, prefixed by the evaluator's name."""
    print(f"ais-loglik: warning: {message}", file=sys.stderr)
