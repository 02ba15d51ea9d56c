"""Lower-level divergences D(q(h|v) ‖ p(h|v)) of BiSM (Eq. 10-11), computed from E and q only."""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

from eblvm_core.config import option, positive
from eblvm_core.contracts import Divergence, EnergyModel, Parts, Posterior
from eblvm_core.errors import ConfigError
from eblvm_core.hookspecs import hookimpl


def energies(model: EnergyModel, v: Tensor, h: Tensor) -> Tensor:
    """E(v, h) for k samples h (k, B, m): -> (k, B); the samples are flattened into the batch."""
    k, b = h.shape[:2]
    vk = v if k == 1 else v.unsqueeze(0).expand(k, *v.shape).reshape(k * b, *v.shape[1:])
    return model.energy(vk, h.reshape(k * b, -1)).view(k, b)


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
        raise ConfigError("divergence", "kind", f"'fisher' differentiates in h and needs a continuous latent; the model has {kind} latent (use 'kl')")
    return Fisher(cfg.n_samples)


@hookimpl
def register_divergences(register):
    register("kl", build_kl, KLConfig)
    register("fisher", build_fisher, FisherConfig)
