"""Likelihood evaluators for GRBMs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import torch

from eblvm_core.config import option, positive
from eblvm_core.contracts import EvalResult, Parts, reporting
from eblvm_core.errors import ConfigError


@attrs.frozen
class ExactLoglikConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average log p(v) over")
    max_hidden: int = option(20, "refuse models with more hidden units than this (cost grows as 2^m)", positive)
    batch_size: int = option(10000, "points per free-energy evaluation", positive)


def build_exact_loglik(cfg: ExactLoglikConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Mean exact log p(v) in nats, enumerating the 2^m hidden states for log Z, and its standard
    error over the split's points (sample sd / √n: the test set's own sampling error).

    Reports: {split}_loglik, {split}_loglik_stderr
    """
    model = parts.need("model", "")
    data = parts.need("data", "")
    if not (callable(getattr(model, "log_partition", None)) and model.has_free_energy and model.latent is not None):
        raise ConfigError(
            "",
            "kind",
            f"exact-loglik needs a GRBM-like model with free_energy and log_partition; {type(model).__name__} has not both",
        )
    if model.latent.dim > cfg.max_hidden:
        raise ConfigError(
            "",
            "max_hidden",
            f"exact-loglik enumerates 2^m hidden states and the model has m={model.latent.dim} > max_hidden={cfg.max_hidden}; "
            "use an AIS estimate, or raise max_hidden if 2^m states fit in memory",
        )
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")
    key = f"{cfg.split}_loglik"

    @reporting([key, f"{key}_stderr"])
    def evaluate(parts: Parts) -> EvalResult:
        model, v = parts.model, parts.data.tensor(cfg.split)
        with torch.no_grad():
            log_z = model.log_partition(cfg.max_hidden)
            loglik = torch.cat(
                [
                    (-model.free_energy(chunk.reshape(len(chunk), -1)) - log_z).double()
                    for chunk in v.split(cfg.batch_size)
                ]
            )
        return EvalResult.mean_over_points(key, loglik)

    return evaluate


@attrs.frozen
class PosteriorKLConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average the divergence over")
    n: int = option(1000, "points averaged (the first n of the split)", positive)


def bernoulli_kl(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) ‖ Bern(p)) summed over the last dimension, from probabilities (..., m) -> (...)."""
    q, p = q.clamp(1e-12, 1 - 1e-12), p.clamp(1e-12, 1 - 1e-12)
    return (q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()).sum(-1)


def build_posterior_kl(cfg: PosteriorKLConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Exact KL(q(h|v) ‖ p(h|v)) of a factorised Bernoulli posterior against a GRBM's, which factorises too: how good q is.

    Reports: {split}_posterior_kl, {split}_posterior_kl_stderr
    """
    from eblvm_grbm.gibbs import require_grbm

    require_grbm(parts.need("model", ""), "", "posterior-kl")
    posterior = parts.need("posterior", "")
    if not hasattr(posterior, "logits"):
        raise ConfigError(
            "", "kind", f"posterior-kl needs a factorised Bernoulli posterior (logits); got {type(posterior).__name__}"
        )
    if not parts.need("data", "").has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")

    @reporting([f"{cfg.split}_posterior_kl", f"{cfg.split}_posterior_kl_stderr"])
    def evaluate(parts: Parts) -> EvalResult:
        """Mean over points of Σ_j KL(Bern(σ(l_j(v))) ‖ Bern(σ(c_j + (Uᵀv)_j))), in nats, and its standard error."""
        v = parts.data.tensor(cfg.split, cfg.n)
        with torch.no_grad():
            values = bernoulli_kl(torch.sigmoid(parts.posterior.logits(v)), torch.sigmoid(parts.model.hidden_logits(v)))
        return EvalResult.mean_over_points(f"{cfg.split}_posterior_kl", values)

    return evaluate
