"""The variational Rényi α-divergence between q(h|v) and p(h|v) as a BiSM lower level (Li & Turner 2016).

With k samples h_i ~ q(h|v) (reparameterised, or binary-concrete relaxed for Bernoulli h) and
log-weights ℓ_i = log p̃(v, h_i) − log q(h_i|v) = −E(v, h_i) − log q(h_i|v), the k-sample
variational Rényi bound is

    L̂_α = 1/(1−α) · log (1/k) Σ_i exp((1−α) ℓ_i)

and the divergence, per data point, is D = −L̂_α. It needs only the energy E and q.

- Target: as k → ∞, −L̂_α → −L_α = F(v) + D_α(q ‖ p(h|v)), F the free energy and D_α the Rényi
  divergence of order α: zero at q = p(h|v), positive elsewhere (α > 0). F does not depend
  on φ, so D is the Rényi divergence up to a constant in φ.
- Bias for finite k: the log of a sample mean. For 0 < α < 1, Jensen gives E[L̂_α] ≤ L_α, so
  E[−L̂_α] ≥ F(v) + D_α, decreasing in k towards it; still minimal (= F(v), with zero variance)
  at q = p(h|v), where every ℓ_i = −F(v). k = 1 gives −ℓ_1, the one-sample KL form, for every
  α. For α > 1 the bias has the other sign and E[−L̂_α] may fall below F(v) for q ≠ p.
- α → 1: L̂_α → (1/k) Σ_i ℓ_i, the KL form E_q[log q + E] of BiSM Eq. 10 (the `kl` plugin).
  α = 1 is computed in that form. Near 1 the direct formula divides a difference of nearly
  equal logs by 1 − α; when |(1−α)(ℓ_i − ℓ̄)| < ½ for every i the plugin uses
  L̂_α = ℓ̄ + log1p(mean_i expm1((1−α)(ℓ_i − ℓ̄))) / (1−α), which has no such cancellation.
  The two forms agree sample by sample: |L̂_α − ℓ̄| ≤ |1−α|·(max_i ℓ_i − min_i ℓ_i)²/8 (Hoeffding's
  lemma), with L̂_α ≥ ℓ̄ for α < 1 (Jensen): −L̂_α tends to the KL form linearly in 1 − α.
- α = 0 is excluded (``alpha`` > 0): it is the importance-weighted bound (the ``kl`` plugin's
  ``importance_weighted``), whose k → ∞ limit F(v) no longer depends on q.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, Divergence, EnergyModel, Parts, Posterior, hookimpl, option, positive

__all__ = ["Renyi", "RenyiConfig", "build_renyi", "log_weights", "renyi_bound"]


@attrs.frozen
class RenyiConfig:
    alpha: float = option(0.5, "order α > 0 of the Rényi divergence; 1 is the KL form E_q[log q + E]", positive)
    n_samples: int = option(5, "samples k of h ~ q(h|v) per data point; k = 1 is the KL form for every α", positive)


def log_weights(model: EnergyModel, posterior: Posterior, v: Tensor, h: Tensor) -> Tensor:
    """ℓ = −E(v, h) − log q(h|v) for h (k, B, m): -> (k, B); the k samples go through the model as one batch."""
    k, b = h.shape[:2]
    v_k = v.unsqueeze(0).expand(k, *v.shape).reshape(k * b, *v.shape[1:])
    return -model.energy(v_k, h.reshape(k * b, -1)).view(k, b) - posterior.log_prob(h, v)


def renyi_bound(log_w: Tensor, alpha: float) -> Tensor:
    """L̂_α = 1/(1−α) log (1/k) Σ_i exp((1−α) ℓ_i) over dim 0: (k, B) -> (B,); α = 1 gives the mean of ℓ."""
    mean = log_w.mean(0)
    if alpha == 1.0:
        return mean
    eps = 1.0 - alpha
    centred = eps * (log_w - mean)  # (k, B)
    series = torch.log1p(torch.expm1(centred.clamp(-0.5, 0.5)).mean(0)) / eps
    direct = (torch.logsumexp(centred, 0) - math.log(log_w.shape[0])) / eps
    return mean + torch.where(centred.abs().amax(0) < 0.5, series, direct)


class Renyi(Divergence):
    """−L̂_α, the k-sample variational Rényi bound, per data point (B,): D_α(q ‖ p(h|v)) up to F(v).

    Biased for finite k unless α = 1 (see the module docstring); differentiable in φ through the
    reparameterised samples and log q, and in θ through E.
    """

    def __init__(self, alpha: float = 0.5, n_samples: int = 5):
        self.alpha, self.n_samples = alpha, n_samples

    def __call__(self, model: EnergyModel, posterior: Posterior, v: Tensor) -> Tensor:
        """v (B, d) -> (B,)."""
        h = posterior.rsample(v, self.n_samples)
        return -renyi_bound(log_weights(model, posterior, v, h), self.alpha)


def build_renyi(cfg: RenyiConfig, parts: Parts) -> Renyi:
    """Variational Rényi α-divergence −L̂_α from k samples of q (α → 1: the KL form); any latent kind."""
    model = parts.need("model", "divergence")
    if model.latent is None:
        raise ConfigError(
            "divergence",
            "kind",
            f"'renyi' compares q(h|v) with p(h|v); model {type(model).__name__} has no latent variable",
        )
    return Renyi(cfg.alpha, cfg.n_samples)


@hookimpl
def register_divergences(register):
    register("renyi", build_renyi, RenyiConfig)
