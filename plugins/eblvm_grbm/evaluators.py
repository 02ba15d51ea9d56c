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
    """Mean exact log p(v) in nats, enumerating the 2^m hidden states for log Z."""
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

    @reporting([key])
    def evaluate(parts: Parts) -> EvalResult:
        model, v = parts.model, parts.data.tensor(cfg.split)
        with torch.no_grad():
            log_z = model.log_partition(cfg.max_hidden)
            total = sum(
                float((-model.free_energy(chunk.reshape(len(chunk), -1)) - log_z).sum())
                for chunk in v.split(cfg.batch_size)
            )
        return EvalResult(scalars={key: total / len(v)})

    return evaluate
