"""The test score-matching loss of the marginal model (BiSM Table 1, "Fisher" column); generic:
it needs a model with a free energy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, EnergyModel, EvalResult, Parts, exact_score, option, positive, reporting


def score_matching_loss(
    model: EnergyModel,
    v: Tensor,
    trace: Literal["exact", "hutchinson"],
    n_probes: int = 1,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Per-point SM loss ½‖s(v)‖² + tr ∇_v s(v) with s = −∇_v F: v (B, *shape) -> (B,).

    Its mean over data equals the Fisher divergence D_F(p_data ‖ p_θ) minus a constant of the
    data only. ``exact`` takes one backward pass per dimension; ``hutchinson`` averages
    uᵀ∇_v(uᵀs) over ``n_probes`` Rademacher vectors u (unbiased for the trace).
    """
    with torch.enable_grad():
        v = v.detach().requires_grad_(True)
        s = exact_score(model, v).reshape(len(v), -1)
        half_norm = 0.5 * (s**2).sum(-1)
        d = s.shape[1]
        tr = torch.zeros_like(half_norm)
        if trace == "exact":
            for i in range(d):
                (g,) = torch.autograd.grad(s[:, i].sum(), v, retain_graph=True)
                tr = tr + g.reshape(len(v), -1)[:, i]
        else:
            for _ in range(n_probes):
                u = torch.randint(0, 2, s.shape, generator=generator, device=s.device).to(s.dtype) * 2 - 1
                (g,) = torch.autograd.grad((s * u).sum(), v, retain_graph=True)
                tr = tr + (g.reshape(len(v), -1) * u).sum(-1) / n_probes
    return (half_norm + tr).detach()


@attrs.frozen
class ScoreLossConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average the loss over")
    trace: Literal["auto", "exact", "hutchinson"] = option(
        "auto", "tr ∇s: exact (d backward passes), Hutchinson, or exact when d <= exact_max_dim"
    )
    exact_max_dim: int = option(64, "largest dimension for which 'auto' computes the exact trace", positive)
    n_probes: int = option(1, "Rademacher probes per point for the Hutchinson trace", positive)
    batch_size: int = option(1000, "points per backward pass", positive)
    seed: int = option(0, "seed of the Hutchinson probes")


def build_score_loss(cfg: ScoreLossConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Score-matching loss ½‖s‖² + tr ∇s of the exact marginal score on a data split (the Fisher
    divergence up to a data constant).
    """
    model = parts.need("model", "")
    data = parts.need("data", "")
    if not model.has_free_energy:
        raise ConfigError(
            "",
            "kind",
            f"score-loss needs the exact marginal score, i.e. a free energy F(v); {type(model).__name__} has none",
        )
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")
    trace = cfg.trace if cfg.trace != "auto" else ("exact" if data.dim <= cfg.exact_max_dim else "hutchinson")

    @reporting([f"{cfg.split}_score_loss", f"{cfg.split}_score_loss_stderr"])
    def evaluate(parts: Parts) -> EvalResult:
        """{split}_score_loss (mean over points) and {split}_score_loss_stderr (over points and probes)."""
        v = parts.data.tensor(cfg.split)
        generator = torch.Generator(device=v.device).manual_seed(cfg.seed)
        losses = torch.cat(
            [
                score_matching_loss(parts.model, chunk, trace, cfg.n_probes, generator)
                for chunk in v.split(cfg.batch_size)
            ]
        )
        return EvalResult.mean_over_points(f"{cfg.split}_score_loss", losses)

    return evaluate
