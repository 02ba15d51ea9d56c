"""Annealed importance sampling (AIS) of a GRBM's log-partition function (Neal 2001;
Salakhutdinov & Murray 2008), and the test log-likelihood evaluator built on it.

The path runs over the coupling β from 0 to 1: p_β(v, h) ∝ exp(−E_β(v, h)) with
E_β = ‖v − b‖²/(2σ²) − cᵀh − β vᵀWh/σ. At β = 0 the model factorises (v ~ N(b, σ²I),
h_j ~ Bernoulli(sigmoid(c_j))), so sampling is exact and
    log Z_0 = (d/2) log(2πσ²) + Σ_j softplus(c_j).
Each chain accumulates log w = Σ_k [F_{β_(k−1)}(v_(k−1)) − F_{β_k}(v_(k−1))] over the marginal
free energies F_β(v) = ‖v − b‖²/(2σ²) − Σ_j softplus(c_j + β(Wᵀv)_j/σ), moving v by one Gibbs
sweep at β_k after each term. E[w] = Z_1/Z_0, so Ẑ = Z_0 · mean(w) is unbiased and log Ẑ is a
stochastic lower bound (Jensen): E[log Ẑ] ≤ log Z.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from eblvm_core.config import option, positive
from eblvm_core.contracts import EvalResult, Parts, reporting
from eblvm_core.errors import ConfigError
from eblvm_grbm.gibbs import require_grbm, sample_visible
from eblvm_grbm.model import GRBM


def base_log_partition(model: GRBM) -> Tensor:
    """log Z_0 of the β = 0 model: (d/2) log(2πσ²) + Σ_j softplus(c_j)."""
    d = model.W.shape[0]
    return 0.5 * d * torch.log(2 * math.pi * model.sigma**2) + F.softplus(model.c).sum()


@attrs.frozen
class AISResult:
    """log Ẑ, its standard error (delta method on the weights), and each chain's log w (n,)."""

    log_z: float
    log_z_stderr: float
    log_weights: Tensor


def ais_log_partition(model: GRBM, n_chains: int, n_temps: int, generator: torch.Generator | None = None) -> AISResult:
    """AIS estimate of log Z with ``n_chains`` chains over ``n_temps`` β values, linearly
    spaced in [0, 1] (β_0 = 0, β_(n_temps−1) = 1).

    Ẑ = Z_0 · mean_i w_i; its standard error is Ẑ · std(w) / (mean(w) √n), so the standard
    error of log Ẑ is std(w) / (mean(w) √n), computed from weights rescaled by their maximum.
    """
    with torch.no_grad():
        betas = torch.linspace(0.0, 1.0, n_temps).tolist()
        d = model.W.shape[0]
        noise = torch.randn(n_chains, d, generator=generator, dtype=model.W.dtype, device=model.W.device)
        v = model.b + model.sigma * noise  # exact draws of the β = 0 marginal
        log_w = torch.zeros(n_chains, dtype=torch.float64, device=model.W.device)  # summed over n_temps terms
        for prev, beta in zip(betas[:-1], betas[1:]):
            a = v @ model.coupling_weight()  # (n, m); the quadratic term of F_β cancels in the difference
            log_w += (F.softplus(model.c + beta * a) - F.softplus(model.c + prev * a)).sum(-1).double()
            if beta < 1.0:  # one Gibbs sweep at β (its h-step reuses a)
                h = torch.bernoulli(torch.sigmoid(model.c + beta * a), generator=generator)
                v = sample_visible(model, h, beta, generator)
        log_mean_w = torch.logsumexp(log_w, 0) - math.log(n_chains)
        w = torch.exp(log_w - log_w.max())
        rel_stderr = w.std() / (w.mean() * math.sqrt(n_chains)) if n_chains > 1 else torch.tensor(float("inf"))
        log_z = base_log_partition(model) + log_mean_w
    return AISResult(float(log_z), float(rel_stderr), log_w)


@attrs.frozen
class AISLoglikConfig:
    n_chains: int = option(2000, "AIS chains (the papers used 2,000)", positive)
    n_temps: int = option(
        2000, "intermediate inverse temperatures β, linear in [0, 1] (the papers used 2,000)", positive
    )
    split: Literal["test", "train", "val"] = option("test", "data split to average log p(v) over")
    seed: int = option(0, "seed of the AIS chains, so that repeated evaluations agree")
    batch_size: int = option(10000, "points per free-energy evaluation", positive)


def build_ais_loglik(cfg: AISLoglikConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Mean log p(v) with log Z estimated by AIS from the W = 0 model; reports its standard error."""
    require_grbm(parts.need("model", ""), "", "ais-loglik")
    data = parts.need("data", "")
    if cfg.n_temps < 2:
        raise ConfigError("", "n_temps", f"AIS needs at least 2 temperatures (β = 0 and β = 1), got {cfg.n_temps}")
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")

    @reporting([f"{cfg.split}_loglik", f"{cfg.split}_loglik_stderr", "log_z", "log_z_stderr"])
    def evaluate(parts: Parts) -> EvalResult:
        """{split}_loglik = mean −F(v) − log Ẑ, {split}_loglik_stderr (from log Ẑ), log_z, log_z_stderr."""
        model, v = parts.model, parts.data.tensor(cfg.split)
        generator = torch.Generator(device=model.W.device).manual_seed(cfg.seed)
        ais = ais_log_partition(model, cfg.n_chains, cfg.n_temps, generator)
        with torch.no_grad():
            neg_free = sum(
                float(-model.free_energy(chunk.reshape(len(chunk), -1)).sum()) for chunk in v.split(cfg.batch_size)
            )
        mean_ll = neg_free / len(v) - ais.log_z
        return EvalResult(
            scalars={
                f"{cfg.split}_loglik": mean_ll,
                f"{cfg.split}_loglik_stderr": ais.log_z_stderr,
                "log_z": ais.log_z,
                "log_z_stderr": ais.log_z_stderr,
            }
        )

    return evaluate
