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

from eblvm.plugin import ConfigError, NoConfig, Parts, ScoreField, ScoreObjective, option, positive


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


@attrs.frozen
class MDSMConfig:
    sigma_min: float = option(0.05, "smallest training noise σ_min", positive)
    sigma_max: float = option(1.2, "largest training noise σ_max", positive)
    schedule: Literal["linear", "geometric"] = option(
        "linear", "σ_i uniform in [σ_min, σ_max] (linear) or log-uniform (geometric)"
    )
    sigma0: float = option(
        0.1, "σ₀ of the target: the loss matches the score to −(x̃ − v)/σ₀² (the papers: 0.1)", positive
    )
    spread: Literal["random", "positions"] = option(
        "random",
        "σ_i drawn per sample (the paper's Eq. 5), or spread deterministically over batch positions (the released code)",
    )
    weighting: Literal["none", "inverse-variance"] = option(
        "none",
        "per-sample weight 1 (the paper's Eq. 5) or 1/σ_i² (the released code's loss divides the residual by σ_i)",
    )
    lower_weighting: Literal["none", "inverse-sigma"] = option(
        "none",
        "weight of each point in a bi-level lower level (BiSM, VaGES): 1, or 1/σ_i (the released code divides "
        "the lower-level divergence at x̃_i by σ_i)",
    )


class MDSM(ScoreObjective):
    """Multiscale denoising score matching (MDSM, BiSM Eq. 5): x̃ = v + σ_i ε with σ_i from a
    noise schedule and the loss w_i·½‖s(x̃) + (x̃ − v)/σ₀²‖² = w_i·½‖s(x̃) + σ_i ε/σ₀²‖², w_i = 1 or 1/σ_i².

    The target is the score of the fixed-σ₀ kernel, not of σ_i: the model learns one energy whose
    score denoises at σ₀ wherever the noisy data reach. The context is (ε, σ) with σ (B',).
    """

    value_only = True

    def __init__(self, cfg: MDSMConfig):
        self.cfg = cfg

    def sigmas(self, n: int, like: Tensor) -> Tensor:
        """σ_i (n,) on the schedule: drawn, or spread over the batch positions."""
        lo, hi = self.cfg.sigma_min, self.cfg.sigma_max
        if self.cfg.spread == "positions":
            u = torch.linspace(0, 1, n, dtype=like.dtype, device=like.device)
        else:
            u = torch.rand(n, dtype=like.dtype, device=like.device)
        if self.cfg.schedule == "geometric":
            return lo * (hi / lo) ** u
        return lo + (hi - lo) * u

    def points(self, v: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """v (B, ...) -> (x̃ = v + σ_i ε, (ε, σ)) with ε shaped like v and σ (B,)."""
        sigma = self.sigmas(len(v), v)
        eps = torch.randn_like(v)
        return v + sigma.view(-1, *[1] * (v.dim() - 1)) * eps, (eps, sigma)

    def loss_at(self, x: Tensor, s: Tensor, context: tuple[Tensor, Tensor]) -> Tensor:
        """s at x̃ (shaped like v) -> (B,): w_i·½‖s + σ_i ε/σ₀²‖²."""
        eps, sigma = context
        target = (sigma / self.cfg.sigma0**2).view(-1, *[1] * (eps.dim() - 1)) * eps
        loss = 0.5 * _per_sample((s + target) ** 2)
        return loss / sigma**2 if self.cfg.weighting == "inverse-variance" else loss

    def point_weights(self, context: tuple[Tensor, Tensor]) -> Tensor | None:
        """1/σ_i (B,) with ``lower_weighting = "inverse-sigma"``, else None (all 1)."""
        return 1 / context[1] if self.cfg.lower_weighting == "inverse-sigma" else None


def build_sm(cfg: NoConfig, parts: Parts) -> SM:
    """Score matching with the exact Jacobian trace (d backward passes)."""
    return SM()


def build_ssm(cfg: SSMConfig, parts: Parts) -> SSM:
    """Sliced score matching (variance-reduced), Rademacher or Gaussian slices."""
    return SSM(cfg.n_slices, cfg.projection)


def build_dsm(cfg: DSMConfig, parts: Parts) -> DSM:
    """Denoising score matching at a fixed noise level σ."""
    return DSM(cfg.sigma)


def build_mdsm(cfg: MDSMConfig, parts: Parts) -> MDSM:
    """Multiscale DSM: noise levels from a linear or geometric schedule, target at the fixed σ₀."""

    if cfg.sigma_min > cfg.sigma_max:
        raise ConfigError("objective", "sigma_min", f"{cfg.sigma_min} exceeds sigma_max = {cfg.sigma_max}")
    return MDSM(cfg)
