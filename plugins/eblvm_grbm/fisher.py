"""Fisher-type evaluators: the test score-matching loss of the marginal model (BiSM Table 1,
"Fisher" column) and the posterior Fisher divergence D_F(q(h|v) ‖ p(h|v)) (BiSM Eq. 11).

Both are generic: the first needs a model with a free energy, the second a model energy and a
posterior over continuous h.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import attrs
import torch
from torch import Tensor

from eblvm_core.config import option, positive
from eblvm_core.contracts import EnergyModel, EvalResult, Parts, Posterior, exact_score
from eblvm_core.errors import ConfigError


def score_matching_loss(model: EnergyModel, v: Tensor, trace: Literal["exact", "hutchinson"], n_probes: int = 1,
                        generator: torch.Generator | None = None) -> Tensor:
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


def posterior_fisher(model: EnergyModel, posterior: Posterior, v: Tensor, n_samples: int = 1) -> Tensor:
    """D_F(q(h|v) ‖ p(h|v)) = ½ E_q ‖∇_h log q(h|v) + ∇_h E(v, h)‖² (Eq. 11), Monte Carlo over
    ``n_samples`` draws h ~ q per point: v (B, d) -> (B,). Exact, not up to a constant:
    ∇_h log p(h|v) = −∇_h E(v, h) because p(v) does not depend on h."""
    with torch.enable_grad():
        h = posterior.rsample(v, n_samples).detach().requires_grad_(True)  # (n, B, m)
        n, b = h.shape[0], h.shape[1]
        v_rep = v.unsqueeze(0).expand(n, *v.shape).reshape(n * b, *v.shape[1:])
        energy = model.energy(v_rep, h.reshape(n * b, *h.shape[2:]))
        log_q = posterior.log_prob(h, v)
        (grad,) = torch.autograd.grad(log_q.sum() + energy.sum(), h)
    return (0.5 * (grad.reshape(n, b, -1) ** 2).sum(-1).mean(0)).detach()


def _mean_and_stderr(values: Tensor) -> tuple[float, float]:
    n = len(values)
    return float(values.mean()), float(values.std() / math.sqrt(n)) if n > 1 else float("nan")


@attrs.frozen
class ScoreLossConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average the loss over")
    trace: Literal["auto", "exact", "hutchinson"] = option("auto", "tr ∇s: exact (d backward passes), Hutchinson, or exact when d <= exact_max_dim")
    exact_max_dim: int = option(64, "largest dimension for which 'auto' computes the exact trace", positive)
    n_probes: int = option(1, "Rademacher probes per point for the Hutchinson trace", positive)
    batch_size: int = option(1000, "points per backward pass", positive)
    seed: int = option(0, "seed of the Hutchinson probes")


def build_score_loss(cfg: ScoreLossConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Test score-matching loss ½‖s‖² + tr ∇s of the exact marginal score (Fisher divergence up to a data constant)."""
    model = parts.need("model", "")
    data = parts.need("data", "")
    if not model.has_free_energy:
        raise ConfigError("", "kind", f"score-loss needs the exact marginal score, i.e. a free energy F(v); {type(model).__name__} has none")
    if getattr(data, cfg.split) is None:
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")
    trace = cfg.trace if cfg.trace != "auto" else ("exact" if data.dim <= cfg.exact_max_dim else "hutchinson")

    def evaluate(parts: Parts) -> EvalResult:
        """{split}_score_loss (mean over points) and {split}_score_loss_stderr (over points and probes)."""
        v = getattr(parts.data, cfg.split)
        generator = torch.Generator(device=v.device).manual_seed(cfg.seed)
        losses = torch.cat([score_matching_loss(parts.model, chunk, trace, cfg.n_probes, generator)
                            for chunk in v.split(cfg.batch_size)])
        mean, stderr = _mean_and_stderr(losses)
        return EvalResult(scalars={f"{cfg.split}_score_loss": mean, f"{cfg.split}_score_loss_stderr": stderr})

    return evaluate


@attrs.frozen
class PosteriorFisherConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average the divergence over")
    n_samples: int = option(1, "draws h ~ q(h|v) per point", positive)
    batch_size: int = option(1000, "points per backward pass", positive)
    seed: int = option(0, "seed of the posterior draws, so that repeated evaluations agree")


def build_posterior_fisher(cfg: PosteriorFisherConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Posterior Fisher divergence D_F(q(h|v) ‖ p(h|v)) of Eq. 11 (continuous h only)."""
    model = parts.need("model", "")
    data = parts.need("data", "")
    if parts.posterior is None:
        raise ConfigError("", "kind", "posterior-fisher measures q(h|v) against p(h|v) and needs a [posterior] section")
    if model.latent is None or model.latent.kind != "gaussian":
        kind = "none" if model.latent is None else model.latent.kind
        raise ConfigError("", "kind", f"posterior-fisher differentiates in h and needs continuous (gaussian) latents; the model's are {kind}")
    if getattr(data, cfg.split) is None:
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")

    def evaluate(parts: Parts) -> EvalResult:
        """{split}_posterior_fisher (mean over points) and its standard error."""
        v = getattr(parts.data, cfg.split)
        devices = [v.device] if v.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(cfg.seed)
            values = torch.cat([posterior_fisher(parts.model, parts.posterior, chunk, cfg.n_samples)
                                for chunk in v.split(cfg.batch_size)])
        mean, stderr = _mean_and_stderr(values)
        return EvalResult(scalars={f"{cfg.split}_posterior_fisher": mean, f"{cfg.split}_posterior_fisher_stderr": stderr})

    return evaluate
