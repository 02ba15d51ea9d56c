"""Contrastive divergence (CD-k) and persistent CD for GRBMs.

Both follow the maximum-likelihood gradient through the free energy,
    −∂/∂θ E_data[log p(v)] = E_data[∂F/∂θ] − E_model[∂F/∂θ],
with the model expectation replaced by Gibbs samples: k sweeps from the data batch (CD) or
from persistent chains carried across updates (PCD, Tieleman 2008). The surrogate loss
mean F(v_data) − mean F(v_model), with the samples held constant, has exactly that gradient.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import Estimator, Parts, non_negative, option, positive
from eblvm_grbm.gibbs import gibbs_chain, initial_states, require_grbm
from eblvm_grbm.model import GRBM


def contrastive_loss(model: GRBM, data: Tensor, samples: Tensor) -> Tensor:
    """mean F(data) − mean F(samples), samples detached: its θ-gradient is the negative
    log-likelihood gradient with E_model estimated by ``samples``. data (B, d), samples (S, d)."""
    return model.free_energy(data).mean() - model.free_energy(samples.detach()).mean()


class ContrastiveDivergence(Estimator):
    """CD-k: negative samples are k Gibbs sweeps from the data batch, so each sample pairs
    with a data point and the metrics report the mean squared reconstruction distance."""

    pairs_with_data = True
    graph_safe = True  # the same kernels on same-shaped tensors each step, tensors as metrics, state updated in place

    def __init__(self, model: GRBM, k: int, parts: Parts):
        self.model, self.k = model, k
        self.model_role = parts.make_role("model", [p for p in model.parameters() if p.requires_grad])

    def negatives(self, batch: Tensor) -> Tensor:
        """Model samples (B, d) paired with the batch."""
        return gibbs_chain(self.model, batch, self.k)

    def step(self, batch: Tensor) -> dict[str, Tensor]:
        batch = batch.reshape(len(batch), -1)
        samples = self.negatives(batch)
        loss = contrastive_loss(self.model, batch, samples)
        self.model_role.update(loss)
        metrics = {"loss": loss.detach(), "sigma": self.model.sigma.detach()}
        if self.pairs_with_data:
            metrics["reconstruction"] = ((samples - batch) ** 2).sum(-1).mean()
        return metrics


class PersistentCD(ContrastiveDivergence):
    """PCD: ``n_chains`` Gibbs chains advance k sweeps per update and are never reset; their
    state is checkpointed through ``state_dict``."""

    pairs_with_data = False

    def __init__(self, model: GRBM, k: int, chains: Tensor, parts: Parts):
        super().__init__(model, k, parts)
        self.chains = chains

    def negatives(self, batch: Tensor) -> Tensor:
        with torch.no_grad():
            self.chains.copy_(gibbs_chain(self.model, self.chains, self.k))  # in place: a replayed step updates it
        return self.chains

    def state_dict(self) -> dict[str, Any]:
        return {"chains": self.chains}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chains = state["chains"].to(self.chains)


@attrs.frozen
class CDConfig:
    k: int = option(1, "Gibbs sweeps v→h→v from the data per update (CD-k)", positive)


@attrs.frozen
class PCDConfig:
    k: int = option(1, "Gibbs sweeps of the persistent chains per update", positive)
    n_chains: int = option(100, "number of persistent chains", positive)
    init: Literal["noise", "data"] = option("data", "chains start at random training points or at data-matched noise")
    burn_in: int = option(0, "sweeps run on the fresh chains before training", non_negative)


def build_cd(cfg: CDConfig, parts: Parts) -> ContrastiveDivergence:
    """Contrastive divergence CD-k for GRBMs (Hinton 2002)."""
    model = require_grbm(parts.need("model", "estimator"), "estimator", "cd")
    return ContrastiveDivergence(model, cfg.k, parts)


def build_pcd(cfg: PCDConfig, parts: Parts) -> PersistentCD:
    """Persistent contrastive divergence for GRBMs (Tieleman 2008)."""
    model = require_grbm(parts.need("model", "estimator"), "estimator", "pcd")
    with torch.no_grad():
        chains = gibbs_chain(model, initial_states(cfg.init, cfg.n_chains, parts.data, model.b), cfg.burn_in)
    return PersistentCD(model, cfg.k, chains, parts)
