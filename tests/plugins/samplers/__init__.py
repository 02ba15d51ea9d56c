"""The checkerboard GRBM (the main job's model) and its exact density, shared by the sampler tests."""

from __future__ import annotations

import math

import torch
from eblvm_grbm.model import GRBM, all_binary

from eblvm_core.contracts import DataSplits, Parts

F64 = torch.float64


def checkerboard_grbm() -> GRBM:
    """grbm_bissm after its 20,000 steps (seed 0; exact test log-likelihood 0.313 nats), rounded to
    four digits: two modes near (0.2, 0.2) and (0.8, 0.8), σ = 0.127, plain coupling. float64, no gradients."""
    model = GRBM(2, 4, coupling="plain").double()
    with torch.no_grad():
        model.W.copy_(torch.tensor([[9.1276, 8.4622, 8.3139, 8.8942], [8.7642, 8.2006, 8.6782, 9.2270]]))
        model.b.copy_(torch.tensor([0.2228, 0.2238]))
        model.c.copy_(torch.tensor([-8.5325, -9.8638, -8.7416, -8.5652]))
        model.log_sigma.fill_(-2.0609)
    return model.requires_grad_(False).eval()


def grbm_parts(model: GRBM, seed: int = 0) -> Parts:
    """Parts holding ``model`` and 1,000 uniform training points in the unit square (where chains start)."""
    g = torch.Generator().manual_seed(seed)
    data = DataSplits(
        train=torch.rand(1000, 2, generator=g, dtype=F64), test=torch.rand(100, 2, generator=g, dtype=F64)
    )
    return Parts(dtype=F64, data=data, model=model)


def mixture(model: GRBM) -> tuple[torch.Tensor, torch.Tensor]:
    """p(v) as the GRBM's Gaussian mixture over h: weights (2^m,) ∝ exp(cᵀh + bᵀUh + ½σ²‖Uh‖²) and
    means b + σ²Uh (2^m, d), each component N(mean, σ²I)."""
    hs = all_binary(model.latent.dim, model.W)
    uh = hs @ model.coupling_weight().T
    logits = hs @ model.c + uh @ model.b + 0.5 * model.sigma**2 * (uh**2).sum(-1)
    return torch.softmax(logits, 0), model.visible_mean(hs)


GRID = torch.linspace(-0.5, 1.5, 21, dtype=F64)  # 20 × 20 cells of side 0.1 around the unit square


def cell_masses(model: GRBM, edges: torch.Tensor = GRID) -> torch.Tensor:
    """The exact probability of each cell of the grid edges × edges: (K·K,), from the mixture's Gaussian CDFs."""
    weights, means = mixture(model)
    sigma = float(model.sigma)
    cdf = 0.5 * (1 + torch.erf((edges[None, None, :] - means[:, :, None]) / (sigma * math.sqrt(2))))  # (2^m, 2, K+1)
    per_axis = cdf[..., 1:] - cdf[..., :-1]  # (2^m, 2, K)
    return (weights[:, None, None] * per_axis[:, 0, :, None] * per_axis[:, 1, None, :]).sum(0).flatten()


def total_variation(samples: torch.Tensor, model: GRBM, edges: torch.Tensor = GRID) -> float:
    """½ Σ |p̂ − p| over the cells, the mass outside the grid counted as one more cell: samples (n, 2)."""
    exact = cell_masses(model, edges)
    counts = torch.histogramdd(samples.double(), bins=[edges, edges]).hist.flatten() / len(samples)
    outside = (1 - exact.sum()) - (1 - counts.sum())
    return 0.5 * float((counts - exact).abs().sum() + outside.abs())


def exact_draws(model: GRBM, n: int, seed: int) -> torch.Tensor:
    """n independent draws (n, d) of p(v): h from the mixture's weights, then v ~ N(b + σ²Uh, σ²I)."""
    g = torch.Generator().manual_seed(seed)
    weights, means = mixture(model)
    index = torch.multinomial(weights, n, replacement=True, generator=g)
    return means[index] + model.sigma * torch.randn(n, means.shape[1], generator=g, dtype=means.dtype)
