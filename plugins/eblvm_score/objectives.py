"""Score-matching objectives (BiSM Eq. 2-4): per-sample losses of a score field s(x) ≈ ∇_x log p(x).

In expectation over the data (for DSM, over the data convolved with the noise) each loss is
the Fisher divergence from data to model up to a model-independent constant: lower is
better, and values can be negative.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm_core.config import option, positive
from eblvm_core.contracts import Parts, ScoreField, ScoreObjective
from eblvm_core.registry import NoConfig


def _leaf(x: Tensor) -> Tensor:
    """``x`` itself when it already requires grad, else a detached copy that does."""
    return x if x.requires_grad else x.detach().requires_grad_(True)


def _per_sample(x: Tensor) -> Tensor:
    """Sum over every dimension but the batch: (B, ...) -> (B,)."""
    return x.flatten(1).sum(1)


class SM(ScoreObjective):
    """Score matching: ½‖s(x)‖² + tr ∇_x s(x), the trace exact (one backward per dimension)."""

    def loss(self, score: ScoreField, x: Tensor, context: None) -> Tensor:
        """x (B, ...) -> (B,); differentiable in whatever ``score`` depends on."""
        x = _leaf(x)
        s = score(x).flatten(1)
        trace = torch.zeros_like(s[:, 0])
        for i in range(s.shape[1]):
            (grad,) = torch.autograd.grad(s[:, i].sum(), x, create_graph=True)
            trace = trace + grad.flatten(1)[:, i]
        return 0.5 * (s**2).sum(1) + trace


@attrs.frozen
class SSMConfig:
    n_slices: int = option(1, "random projections u per sample (their terms are averaged)", positive)
    projection: Literal["rademacher", "gaussian"] = option("rademacher", "distribution of the slices u")


class SSM(ScoreObjective):
    """Sliced score matching, variance-reduced form: ½‖s(x)‖² + uᵀ∇_x(uᵀs(x)), E[uuᵀ] = I.

    The Jacobian term is averaged over ``n_slices`` independent u per sample.
    """

    def __init__(self, n_slices: int = 1, projection: str = "rademacher"):
        self.n_slices, self.projection = n_slices, projection

    def slices(self, like: Tensor) -> Tensor:
        """Random directions u (n_slices, B, ...) with E[uuᵀ] = I."""
        u = torch.randn((self.n_slices, *like.shape), dtype=like.dtype, device=like.device)
        return u.sign() if self.projection == "rademacher" else u

    def loss(self, score: ScoreField, x: Tensor, context: None) -> Tensor:
        """x (B, ...) -> (B,); differentiable in whatever ``score`` depends on."""
        x = _leaf(x)
        s = score(x)
        jac = torch.zeros_like(s.flatten(1)[:, 0])
        for u in self.slices(s):
            (grad,) = torch.autograd.grad((u * s).sum(), x, create_graph=True)
            jac = jac + _per_sample(u * grad)
        return 0.5 * _per_sample(s**2) + jac / self.n_slices


@attrs.frozen
class DSMConfig:
    sigma: float = option(0.1, "noise standard deviation σ of x̃ = v + σε", positive)


class DSM(ScoreObjective):
    """Denoising score matching: ½‖s(x̃) + (x̃ − v)/σ²‖² with x̃ = v + σε, ε ~ N(0, I)."""

    value_only = True

    def __init__(self, sigma: float = 0.1):
        self.sigma = sigma

    def points(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """v (B, ...) -> (x̃, ε), both shaped like v; ε is the context ``loss_at`` needs."""
        eps = torch.randn_like(v)
        return v + self.sigma * eps, eps

    def loss_at(self, x: Tensor, s: Tensor, context: Tensor) -> Tensor:
        """s at x̃, context ε (both shaped like v) -> (B,); (x̃ − v)/σ² = ε/σ."""
        return 0.5 * _per_sample((s + context / self.sigma) ** 2)


def build_sm(cfg: NoConfig, parts: Parts) -> SM:
    """Score matching with the exact Jacobian trace (d backward passes)."""
    return SM()


def build_ssm(cfg: SSMConfig, parts: Parts) -> SSM:
    """Sliced score matching (variance-reduced), Rademacher or Gaussian slices."""
    return SSM(cfg.n_slices, cfg.projection)


def build_dsm(cfg: DSMConfig, parts: Parts) -> DSM:
    """Denoising score matching at a fixed noise level σ."""
    return DSM(cfg.sigma)
