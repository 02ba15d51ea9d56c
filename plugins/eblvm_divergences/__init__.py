"""Lower-level divergences D(q(h|v) ‖ p(h|v)) of BiSM (Eq. 10-11), computed from E and q only, and
the ``posterior-fisher`` evaluator that measures the Fisher one on a data split.

Their ``model`` is an ``EnergyModel`` or, from estimators, a ``Conditioned`` energy at the
points v (``eblvm_core.contracts``): ``energies`` evaluates the k samples of h from its cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm_core.config import option, positive
from eblvm_core.contracts import Divergence, EnergyModel, EvalResult, Parts, Posterior, energies, reporting
from eblvm_core.errors import ConfigError
from eblvm_core.hookspecs import hookimpl


@attrs.frozen
class KLConfig:
    n_samples: int = option(1, "samples k of h ~ q(h|v) per data point", positive)
    importance_weighted: bool = option(False, "use −log (1/k) Σ_i p̃(v,h_i)/q(h_i|v) instead of the k-sample mean")


class KL(Divergence):
    """E_q[log q(h|v) + E(v, h)] = KL(q ‖ p(h|v)) + F(v) (BiSM Eq. 10), per sample (B,).

    With ``importance_weighted`` the k-sample bound −log (1/k) Σ_i exp(−E(v,h_i) − log q(h_i|v)),
    which tends to the free energy F(v) from above as k grows.
    """

    def __init__(self, n_samples: int = 1, importance_weighted: bool = False):
        self.n_samples, self.importance_weighted = n_samples, importance_weighted

    def __call__(self, model: EnergyModel, posterior: Posterior, v: Tensor) -> Tensor:
        h, log_q = posterior.rsample_and_log_prob(v, self.n_samples)
        terms = log_q + energies(model, v, h)
        if self.importance_weighted:
            return math.log(self.n_samples) - torch.logsumexp(-terms, dim=0)
        return terms.view(-1) if self.n_samples == 1 else terms.mean(0)


def build_kl(cfg: KLConfig, parts: Parts) -> KL:
    """KL divergence E_q[log q + E] (Eq. 10); any latent kind; optionally importance-weighted."""
    return KL(cfg.n_samples, cfg.importance_weighted)


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

    def __call__(self, model: EnergyModel, posterior: Posterior, v: Tensor) -> Tensor:
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

    Reports: {split}_posterior_fisher, {split}_posterior_fisher_stderr
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
    register("posterior-fisher", build_posterior_fisher, PosteriorFisherConfig)
