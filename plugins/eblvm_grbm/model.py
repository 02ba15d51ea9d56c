"""The Gaussian restricted Boltzmann machine (BiSM Sec. 5.1)."""

from __future__ import annotations

import itertools
import math
from typing import Literal

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
    coupling: Literal["scaled", "plain"] = option(
        "plain",
        "'plain': −vᵀWh, the papers' released code and every bundled recipe (so docs/results.md's numbers are "
        "this model's); 'scaled': −vᵀWh/σ, the BiSM paper's formula",
    )


class GRBM(EnergyModel):
    """E(v, h) = ‖v − b‖²/(2σ²) − cᵀh − vᵀUh, v ∈ R^d, h ∈ {0,1}^m, with the coupling U = W/σ
    (``coupling="scaled"``, the paper's formula) or U = W (``"plain"``, the released code's).

    Parameters: W (d, m), b (d,), c (m,), log_sigma (scalar). Then p(h_j = 1 | v) =
    sigmoid(c_j + (Uᵀv)_j) and p(v | h) = N(b + σ²Uh, σ²I): b + σWh when scaled. v may come
    shaped as images (B, C, H, W); the model sees it flattened to (B, d).
    """

    def __init__(
        self,
        n_visible: int,
        n_hidden: int,
        init_sigma: float = 1.0,
        init_weight_std: float = 0.1,
        learn_sigma: bool = True,
        coupling: str = "scaled",
    ):
        super().__init__()
        if coupling not in ("scaled", "plain"):
            raise ValueError(f"coupling must be 'scaled' or 'plain', got {coupling!r}")
        self.latent = LatentSpec("bernoulli", n_hidden)
        self.coupling = coupling
        self.W = nn.Parameter(torch.randn(n_visible, n_hidden) * init_weight_std)
        self.b = nn.Parameter(torch.zeros(n_visible))
        self.c = nn.Parameter(torch.zeros(n_hidden))
        self.log_sigma = nn.Parameter(torch.tensor(math.log(init_sigma)), requires_grad=learn_sigma)

    @property
    def sigma(self) -> Tensor:
        return self.log_sigma.exp()

    def coupling_weight(self) -> Tensor:
        """U (d, m): W/σ when scaled, W when plain."""
        return self.W * torch.exp(-self.log_sigma) if self.coupling == "scaled" else self.W

    def visible_quadratic(self, v: Tensor) -> Tensor:
        """‖v − b‖²/(2σ²): v (B, ...) -> (B,)."""
        return 0.5 * ((v.flatten(1) - self.b) ** 2).sum(-1) * torch.exp(-2 * self.log_sigma)

    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        """v (B, ...), h (B, m) -> (B,)."""
        return self.visible_quadratic(v) - (h * self.hidden_logits(v)).sum(-1)

    def hidden_logits(self, v: Tensor) -> Tensor:
        """Logits c + Uᵀv of p(h_j = 1 | v): v (B, ...) -> (B, m)."""
        return self.c + v.flatten(1) @ self.coupling_weight()

    def free_energy(self, v: Tensor) -> Tensor:
        """F(v) = ‖v − b‖²/(2σ²) − Σ_j softplus(c_j + (Uᵀv)_j): v (B, ...) -> (B,)."""
        return self.visible_quadratic(v) - F.softplus(self.hidden_logits(v)).sum(-1)

    def visible_mean(self, h: Tensor) -> Tensor:
        """Mean b + σ²Uh of p(v | h): h (B, m) -> (B, d)."""
        return self.b + self.sigma**2 * h @ self.coupling_weight().T

    def log_partition(self, max_hidden: int = 20) -> Tensor:
        """log Z by enumerating the 2^m hidden states (v integrated in closed form).

        Z = Σ_h exp(cᵀh + bᵀUh + ½σ²‖Uh‖²) (2πσ²)^{d/2}. Refuses when m > max_hidden.
        """
        d, m = self.W.shape
        if m > max_hidden:
            raise ValueError(f"exact log Z enumerates 2^{m} hidden states; m={m} exceeds the limit {max_hidden}")
        hs = all_binary(m, self.W)
        uh = hs @ self.coupling_weight().T  # (2^m, d)
        terms = hs @ self.c + uh @ self.b + 0.5 * self.sigma**2 * (uh**2).sum(-1)
        return torch.logsumexp(terms, 0) + 0.5 * d * torch.log(2 * math.pi * self.sigma**2)

    def log_likelihood(self, v: Tensor, max_hidden: int = 20) -> Tensor:
        """Exact log p(v) = −F(v) − log Z: v (B, ...) -> (B,)."""
        return -self.free_energy(v) - self.log_partition(max_hidden)


def all_binary(m: int, like: Tensor) -> Tensor:
    """All 2^m binary vectors (2^m, m), dtype and device of ``like``."""
    return torch.tensor(list(itertools.product([0.0, 1.0], repeat=m)), dtype=like.dtype, device=like.device).reshape(
        -1, m
    )


def build_grbm(cfg: GRBMConfig, parts: Parts) -> GRBM:
    """Gaussian RBM with Bernoulli hidden units, a learned σ and the scaled (W/σ) or plain (W) coupling."""
    data = parts.need("data", "model")
    return GRBM(data.dim, cfg.n_hidden, cfg.init_sigma, cfg.init_weight_std, cfg.learn_sigma, cfg.coupling)
