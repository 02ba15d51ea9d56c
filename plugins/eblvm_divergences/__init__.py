"""Lower-level divergences D(q(h|v) ‖ p(h|v)) of BiSM (Eq. 10-11), computed from E and q only, and
the ``posterior-fisher`` evaluator that measures the Fisher one on a data split.

Their ``model`` is an ``EnergyModel`` or, from estimators, a ``Conditioned`` energy at the
points v (``eblvm_core.contracts``): ``energies`` evaluates the k samples of h from its cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, Protocol, cast

import attrs
import torch
from torch import Tensor

from eblvm.plugin import (
    Conditioned,
    ConfigError,
    DataSplits,
    Divergence,
    EnergyModel,
    EvalResult,
    Parts,
    Posterior,
    energies,
    hookimpl,
    option,
    positive,
    reporting,
)


class ExactExpectation(Protocol):
    """A posterior whose mean and expected log-density are exact (``exact = true``: the Bernoulli q)."""

    def mean_and_expected_log_prob(self, v: Tensor) -> tuple[Tensor, Tensor]: ...


@attrs.frozen
class KLConfig:
    n_samples: int = option(1, "samples k of h ~ q(h|v) per data point", positive)
    importance_weighted: bool = option(False, "use −log (1/k) Σ_i p̃(v,h_i)/q(h_i|v) instead of the k-sample mean")
    exact: bool = option(
        False,
        "E_q in closed form, no samples: E_q[log q] + E(v, E_q[h]), exact for a Bernoulli q and an energy linear "
        "in h (the GRBM; checked when built)",
    )


class KL(Divergence):
    """E_q[log q(h|v) + E(v, h)] = KL(q ‖ p(h|v)) + F(v) (BiSM Eq. 10), per sample (B,).

    With ``importance_weighted`` the k-sample bound −log (1/k) Σ_i exp(−E(v,h_i) − log q(h_i|v)),
    which tends to the free energy F(v) from above as k grows.

    With ``exact`` no samples: for an energy linear in h, E(v, h) = E(v, 0) + hᵀ∇_hE, and a
    posterior whose log q(h|v) is linear in h (Bernoulli: Σ_j h_j l_j − softplus(l_j)), both
    means are the values at E_q[h], so E_q[log q + E] = E_q[log q] + E(v, E_q[h]) exactly: the
    expectation of the sampled estimate with hard samples (T -> 0), noise-free, minimised at
    q = p(h|v) whatever the relaxation temperature.
    """

    def __init__(self, n_samples: int = 1, importance_weighted: bool = False, exact: bool = False):
        self.n_samples, self.importance_weighted, self.exact = n_samples, importance_weighted, exact

    def __call__(self, model: EnergyModel | Conditioned, posterior: Posterior, v: Tensor) -> Tensor:
        if self.exact:
            mean, expected_log_q = cast(ExactExpectation, posterior).mean_and_expected_log_prob(v)
            return expected_log_q + energies(model, v, mean.unsqueeze(0))[0]
        h, log_q = posterior.rsample_and_log_prob(v, self.n_samples)
        terms = log_q + energies(model, v, h)
        if self.importance_weighted:
            return math.log(self.n_samples) - torch.logsumexp(-terms, dim=0)
        return terms.view(-1) if self.n_samples == 1 else terms.mean(0)


def build_kl(cfg: KLConfig, parts: Parts) -> KL:
    """KL divergence E_q[log q + E] (Eq. 10); any latent kind; optionally importance-weighted, or exact."""
    if cfg.exact:
        if cfg.importance_weighted or cfg.n_samples != 1:
            raise ConfigError(
                "divergence", "exact", "the exact KL draws no samples: leave n_samples and importance_weighted unset"
            )
        posterior = parts.need("posterior", "divergence")
        if not hasattr(posterior, "mean_and_expected_log_prob"):
            raise ConfigError(
                "divergence",
                "exact",
                f"needs E_q[h] and E_q[log q] in closed form (a bernoulli posterior); {type(posterior).__name__} has not",
            )
        deviation = nonlinearity_in_latent(parts.need("model", "divergence"), parts.need("data", "divergence"))
        if deviation > LINEARITY_TOLERANCE:
            raise ConfigError(
                "divergence",
                "exact",
                f"the model's energy is not linear in h (off a linear function by {deviation:.2g} of its scale at "
                "random h in [0, 1]): E_q[E(v, h)] is then not E(v, E_q[h])",
            )
    return KL(cfg.n_samples, cfg.importance_weighted, cfg.exact)


LINEARITY_TOLERANCE = 1e-4  # relative; float32 rounding of a linear energy stays below 1e-6


def nonlinearity_in_latent(model: EnergyModel, data: DataSplits, n: int = 4) -> float:
    """How far E(v, h) is from linear in h at n training points: max |E(v, h) − E(v, 0) − Σ_j h_j
    (E(v, e_j) − E(v, 0))| at h uniform in [0, 1]^m, relative to 1 + the largest |term|. 0 up to
    rounding exactly when E is affine in h (which no declared capability says yet: the core's
    contracts have none, so it is measured). Uses its own generator: the run's stream is untouched."""
    latent = model.latent
    if latent is None or latent.kind != "bernoulli":
        return math.inf
    like = next(model.parameters())
    m = latent.dim
    with torch.no_grad():
        v = data.tensor("train", n).to(like.device, like.dtype)
        n = len(v)
        h = torch.rand(n, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(like)
        basis = torch.cat([torch.zeros(1, m), torch.eye(m)]).to(like)  # 0, e_1, ..., e_m
        at_basis = model.energy(v.repeat(m + 1, *[1] * (v.dim() - 1)), basis.repeat_interleave(n, 0)).view(m + 1, n)
        slopes = (at_basis[1:] - at_basis[0]).T  # (n, m)
        linear = at_basis[0] + (h * slopes).sum(-1)
        scale = 1 + at_basis[0].abs() + slopes.abs().sum(-1)
        return float(((model.energy(v, h) - linear).abs() / scale).max())


@attrs.frozen
class FisherConfig:
    n_samples: int = option(1, "samples k of h ~ q(h|v) per data point", positive)


class Fisher(Divergence):
    """½ E_q ‖∇_h log q(h|v) + ∇_h E(v, h)‖² (BiSM Eq. 11), per sample (B,); continuous h only.

    ∇_h is the partial derivative in the argument h at the reparameterised sample, kept
    differentiable in φ and θ.
    """

    requires_continuous_latent = True

    def __init__(self, n_samples: int = 1):
        self.n_samples = n_samples

    def __call__(self, model: EnergyModel | Conditioned, posterior: Posterior, v: Tensor) -> Tensor:
        h, log_q = posterior.rsample_and_log_prob(v, self.n_samples)
        (grad_h,) = torch.autograd.grad((log_q + energies(model, v, h)).sum(), h, create_graph=True)
        return 0.5 * (grad_h * grad_h).sum(-1).mean(0)


def build_fisher(cfg: FisherConfig, parts: Parts) -> Fisher:
    """Fisher divergence ½E_q‖∇_h log q + ∇_h E‖² (Eq. 11); continuous (Gaussian) latents only."""
    latent = parts.need("model", "divergence").latent
    if latent is None or latent.kind != "gaussian":
        kind = "no" if latent is None else f"a {latent.kind}"
        raise ConfigError(
            "divergence",
            "kind",
            f"'fisher' differentiates in h and needs a continuous latent; the model has {kind} latent (use 'kl')",
        )
    return Fisher(cfg.n_samples)


@attrs.frozen
class PosteriorFisherConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average the divergence over")
    n_samples: int = option(1, "draws h ~ q(h|v) per point", positive)
    batch_size: int = option(1000, "points per backward pass", positive)
    seed: int = option(0, "seed of the posterior draws, so that repeated evaluations agree")


def build_posterior_fisher(cfg: PosteriorFisherConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Posterior Fisher divergence D_F(q(h|v) ‖ p(h|v)) of Eq. 11 on a data split (continuous h only).

    Exact, not up to a constant: ∇_h log p(h|v) = −∇_h E(v, h) because p(v) does not depend on h.
    """
    model = parts.need("model", "")
    data = parts.need("data", "")
    if parts.posterior is None:
        raise ConfigError("", "kind", "posterior-fisher measures q(h|v) against p(h|v) and needs a [posterior] section")
    if model.latent is None or model.latent.kind != "gaussian":
        kind = "none" if model.latent is None else model.latent.kind
        raise ConfigError(
            "",
            "kind",
            f"posterior-fisher differentiates in h and needs continuous (gaussian) latents; the model's are {kind}",
        )
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")
    fisher = Fisher(cfg.n_samples)

    @reporting([f"{cfg.split}_posterior_fisher", f"{cfg.split}_posterior_fisher_stderr"])
    def evaluate(parts: Parts) -> EvalResult:
        """{split}_posterior_fisher (mean over points) and its standard error."""
        v = parts.data.tensor(cfg.split)
        devices = [v.device] if v.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.manual_seed(cfg.seed)
            values = torch.cat(
                [fisher(parts.model, parts.posterior, chunk).detach() for chunk in v.split(cfg.batch_size)]
            )
        return EvalResult.mean_over_points(f"{cfg.split}_posterior_fisher", values)

    return evaluate


@hookimpl
def register_divergences(register):
    register("kl", build_kl, KLConfig)
    register("fisher", build_fisher, FisherConfig)


@hookimpl
def register_evaluators(register):
    register(
        "posterior-fisher",
        build_posterior_fisher,
        PosteriorFisherConfig,
        reports=("{split}_posterior_fisher", "{split}_posterior_fisher_stderr"),
    )
