"""Exact-Fisher evaluation with a critic (VaGES appendix E, F.3).

D_F(p_D ‖ p_θ) = max_f E_pD[s_θ(v)ᵀf(v) + tr ∇_v f(v) − ½‖f(v)‖²], attained at
f = s_θ − s_D; f is an MLP trained by Adam on the training split (Hutchinson trace, or the
exact trace for small d) and the objective is then evaluated on the chosen split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import torch
from torch import Tensor, nn

from eblvm.plugin import (
    ConfigError,
    EnergyModel,
    EvalResult,
    Evaluator,
    Parts,
    Posterior,
    exact_score,
    non_negative,
    option,
    positive,
)


@attrs.frozen
class CriticConfig:
    steps: int = option(2000, "Adam steps of the critic", positive)
    lr: float = option(1e-3, "critic learning rate", positive)
    width: int = option(128, "width of the critic's two hidden layers", positive)
    batch_size: int = option(100, "critic batch size", positive)
    n_samples: int = option(10, "posterior samples L of VaES when the model has no free energy", positive)
    exact_trace_max_dim: int = option(16, "exact trace of ∇f up to this dimension, Hutchinson above", non_negative)
    split: Literal["test", "val", "train"] = option("test", "split on which the fitted critic is evaluated")
    seed: int = option(0, "seed of the critic's initialisation and batches")


def vaes_score(model: EnergyModel, posterior: Posterior, n_samples: int) -> Callable[[Tensor], Tensor]:
    """x ↦ (1/L) Σ_l ∇_x log p̃(x, h_l), h_l ~ q(h|x): x (B, ...) -> shaped like x, no graph kept."""

    def score(x: Tensor) -> Tensor:
        n, b = n_samples, x.shape[0]
        h = posterior.sample(x, n).reshape(n * b, -1)
        xl = x.detach().unsqueeze(0).expand(n, *x.shape).reshape(n * b, *x.shape[1:]).requires_grad_(True)
        (grad,) = torch.autograd.grad(-model.energy(xl, h).sum(), xl)
        return grad.view(n, *x.shape).mean(0)

    return score


def critic_objective(f: nn.Module, x: Tensor, s: Tensor, exact_trace: bool) -> Tensor:
    """Per-sample sᵀf + tr ∇f − ½‖f‖² (B,); x (B, d), s (B, d) constant."""
    x = x.detach().requires_grad_(True)
    out = f(x)
    if exact_trace:
        trace = sum(torch.autograd.grad(out[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(x.shape[1]))
    else:
        u = torch.randn_like(x)
        (grad,) = torch.autograd.grad((out * u).sum(), x, create_graph=True)
        trace = (grad * u).sum(-1)
    return (s * out).sum(-1) + trace - 0.5 * (out**2).sum(-1)


class FisherCritic(Evaluator):
    """Evaluator: fits a fresh critic each call and reports ``fisher`` (nats per data point)."""

    reports = ("fisher",)

    def __init__(self, cfg: CriticConfig, parts: Parts):
        self.cfg = cfg
        model = parts.need("model", "eval")
        if not model.has_free_energy and parts.posterior is None:
            raise ConfigError(
                "eval", "kind", "fisher-critic needs a model with a free energy or a [posterior] for VaES"
            )
        if not parts.need("data", "eval").has(cfg.split):
            raise ConfigError("eval", "split", f"the data set has no '{cfg.split}' split")

    def __call__(self, parts: Parts) -> EvalResult:
        cfg, data = self.cfg, parts.data
        model = parts.model
        model_score = (
            (lambda x: exact_score(model, x, create_graph=False))
            if model.has_free_energy
            else vaes_score(model, parts.posterior, cfg.n_samples)
        )

        def score(x: Tensor) -> Tensor:  # flattened points (B, d) -> flattened scores (B, d)
            return model_score(x.view(len(x), *data.shape)).flatten(1)

        target = data.tensor(cfg.split)
        train = data.tensor("train").flatten(1)
        d = train.shape[1]
        exact_trace = d <= cfg.exact_trace_max_dim
        gen = torch.Generator().manual_seed(cfg.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            f = nn.Sequential(
                nn.Linear(d, cfg.width), nn.SiLU(), nn.Linear(cfg.width, cfg.width), nn.SiLU(), nn.Linear(cfg.width, d)
            ).to(train.device, train.dtype)
            opt = torch.optim.Adam(f.parameters(), lr=cfg.lr)
            for _ in range(cfg.steps):
                idx = torch.randint(len(train), (min(cfg.batch_size, len(train)),), generator=gen).to(train.device)
                x = train[idx]
                loss = -critic_objective(f, x, score(x).detach(), exact_trace).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            total = 0.0
            for chunk in target.flatten(1).split(1000):
                total += float(critic_objective(f, chunk, score(chunk).detach(), exact_trace).detach().sum())
        return EvalResult(scalars={"fisher": total / len(target)})


def build_fisher_critic(cfg: CriticConfig, parts: Parts) -> FisherCritic:
    """Fisher divergence D_F(data ‖ model) by a trained MLP critic (VaES score for EBLVMs)."""
    return FisherCritic(cfg, parts)
