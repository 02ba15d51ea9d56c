"""The Gaussian restricted Boltzmann machine (BiSM Sec. 5.1)."""

from __future__ import annotations

import itertools
import math

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eblvm_core.config import option, positive
from eblvm_core.contracts import EnergyModel, LatentSpec, Parts


@attrs.frozen
class GRBMConfig:
    n_hidden: int = option(4, "number of Bernoulli hidden units m", positive)
    init_sigma: float = option(1.0, "initial σ (log σ is learned)", positive)
    init_weight_std: float = option(0.1, "standard deviation of the initial W entries", positive)
    learn_sigma: bool = option(True, "learn log σ (else it stays at init_sigma)")


class GRBM(EnergyModel):
    """E(v, h) = ‖v − b‖²/(2σ²) − cᵀh − (1/σ) vᵀWh, v ∈ R^d, h ∈ {0,1}^m.

    Parameters: W (d, m), b (d,), c (m,), log_sigma (scalar). The 1/σ coupling follows the
    paper; p(v|h) = N(b + σWh, σ²I) and p(h_j = 1 | v) = sigmoid(c_j + (Wᵀv)_j / σ).
    """

    def __init__(self, n_visible: int, n_hidden: int, init_sigma: float = 1.0, init_weight_std: float = 0.1,
                 learn_sigma: bool = True):
        super().__init__()
        self.latent = LatentSpec("bernoulli", n_hidden)
        self.W = nn.Parameter(torch.randn(n_visible, n_hidden) * init_weight_std)
        self.b = nn.Parameter(torch.zeros(n_visible))
        self.c = nn.Parameter(torch.zeros(n_hidden))
        self.log_sigma = nn.Parameter(torch.tensor(math.log(init_sigma)), requires_grad=learn_sigma)

    @property
    def sigma(self) -> Tensor:
        return self.log_sigma.exp()

    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        """v (B, d), h (B, m) -> (B,)."""
        sigma = self.sigma
        quad = ((v - self.b) ** 2).sum(-1) / (2 * sigma**2)
        return quad - h @ self.c - ((v @ self.W) * h).sum(-1) / sigma

    def hidden_logits(self, v: Tensor) -> Tensor:
        """Logits of p(h_j = 1 | v): v (B, d) -> (B, m)."""
        return self.c + v @ self.W / self.sigma

    def free_energy(self, v: Tensor) -> Tensor:
        """F(v) = ‖v − b‖²/(2σ²) − Σ_j softplus(c_j + (Wᵀv)_j/σ): v (B, d) -> (B,)."""
        quad = ((v - self.b) ** 2).sum(-1) / (2 * self.sigma**2)
        return quad - F.softplus(self.hidden_logits(v)).sum(-1)

    def visible_mean(self, h: Tensor) -> Tensor:
        """Mean of p(v | h) = N(b + σWh, σ²I): h (B, m) -> (B, d)."""
        return self.b + self.sigma * h @ self.W.T

    def log_partition(self, max_hidden: int = 20) -> Tensor:
        """log Z by enumerating the 2^m hidden states (v integrated in closed form).

        Z = Σ_h exp(cᵀh + bᵀWh/σ + ½‖Wh‖²) (2πσ²)^{d/2}. Refuses when m > max_hidden.
        """
        d, m = self.W.shape
        if m > max_hidden:
            raise ValueError(f"exact log Z enumerates 2^{m} hidden states; m={m} exceeds the limit {max_hidden}")
        hs = all_binary(m, self.W)
        wh = hs @ self.W.T  # (2^m, d)
        terms = hs @ self.c + wh @ self.b / self.sigma + 0.5 * (wh**2).sum(-1)
        return torch.logsumexp(terms, 0) + 0.5 * d * torch.log(2 * math.pi * self.sigma**2)

    def log_likelihood(self, v: Tensor, max_hidden: int = 20) -> Tensor:
        """Exact log p(v) = −F(v) − log Z: v (B, d) -> (B,)."""
        return -self.free_energy(v) - self.log_partition(max_hidden)


def all_binary(m: int, like: Tensor) -> Tensor:
    """All 2^m binary vectors (2^m, m), dtype and device of ``like``."""
    return torch.tensor(list(itertools.product([0.0, 1.0], repeat=m)), dtype=like.dtype, device=like.device).reshape(-1, m)


def build_grbm(cfg: GRBMConfig, parts: Parts) -> GRBM:
    """Gaussian RBM with Bernoulli hidden units and a learned σ."""
    data = parts.need("data", "model")
    return GRBM(data.dim, cfg.n_hidden, cfg.init_sigma, cfg.init_weight_std, cfg.learn_sigma)
