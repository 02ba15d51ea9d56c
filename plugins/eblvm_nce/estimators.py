"""Noise-contrastive estimation (Gutmann & Hyvärinen 2010) and variational NCE (Rhodes &
Gutmann 2019) with Gaussian noise and a learned log-normaliser.

NCE tells data x from ν·B noise draws y ~ p_n by logistic regression on the log-ratio
    G(u) = log φ(u) − c − log p_n(u) − log ν,
where φ = exp(−F) is the unnormalised model marginal and c a learned estimate of log Z. The
loss (to minimise) is
    L = −mean_x log σ(G(x)) − ν · mean_y log σ(−G(y)),
whose minimiser over (θ, c) is the data distribution with c = log Z when the model family
holds it.

VNCE replaces log φ(u), unavailable for latent-variable models, using a posterior q(h|v):
  - data term: by Jensen (u ↦ log σ(log u − a) is concave), E_x log σ(G(x)) ≥
    E_x E_{h~q} log σ(−E(x,h) − log q(h|x) − c − log p_n(x) − log ν), tight when q = p(h|x);
  - noise term: log φ(y) ≈ log (1/k) Σ_i exp(−E(y,h_i) − log q(h_i|y)), h_i ~ q(h|y)
    (importance weighting with q as the proposal).
q is trained on the lower-level divergence of the recipe (KL: E_q[log q + E]) with the model
frozen, ``inner_steps`` times per batch, as BiSM does; θ and c then take one step on L.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eblvm.plugin import (
    ConfigError,
    DataSplits,
    Divergence,
    EnergyModel,
    Estimator,
    Parts,
    Posterior,
    non_negative,
    option,
    positive,
)


def nce_loss(
    log_model_data: Tensor, log_noise_data: Tensor, log_model_noise: Tensor, log_noise_noise: Tensor, nu: float
) -> Tensor:
    """The NCE loss −mean log σ(G(x)) − ν mean log σ(−G(y)), G = log p_model − log p_n − log ν.

    ``log_model_*`` are normalised model log-densities (log φ − c); data terms have any shape
    (averaged), noise terms too. Returns a scalar.
    """
    g_data = log_model_data - log_noise_data - math.log(nu)
    g_noise = log_model_noise - log_noise_noise - math.log(nu)
    return -F.logsigmoid(g_data).mean() - nu * F.logsigmoid(-g_noise).mean()


class GaussianNoise:
    """The noise distribution p_n = N(mean, L Lᵀ) over flattened v (d,). Its arguments are checked
    here, once; its draws and densities are tensor operations that read nothing on the host (no
    per-call validation), so a step that uses them compiles, the draws taken outside the graph."""

    def __init__(self, mean: Tensor, scale_tril: Tensor):
        torch.distributions.MultivariateNormal(mean, scale_tril=scale_tril, validate_args=True)
        self.dist = torch.distributions.MultivariateNormal(mean, scale_tril=scale_tril, validate_args=False)

    def sample(self, n: int) -> Tensor:
        """(n, d) draws."""
        return self.dist.sample((n,))

    def log_prob(self, u: Tensor) -> Tensor:
        """log p_n(u): u (B, *shape) -> (B,)."""
        return self.dist.log_prob(u.reshape(len(u), -1))


@attrs.frozen
class NCEConfig:
    nu: float = option(1.0, "noise ratio ν: noise draws per data point", positive)
    noise: Literal["fitted", "fixed"] = option(
        "fitted", "Gaussian noise fitted to the training data (mean, covariance), or fixed N(noise_mean, noise_std² I)"
    )
    noise_cov: Literal["full", "diagonal"] = option(
        "diagonal",
        "covariance of the fitted noise; 'full' matches the data's second moments, which cancels a GRBM's W gradient to second order near W = 0",
    )
    noise_scale: float = option(1.0, "multiplies the fitted noise's standard deviations", positive)
    noise_mean: float = option(0.0, "mean of every coordinate of the fixed noise")
    noise_std: float = option(1.0, "standard deviation of the fixed noise", positive)
    init_log_z: float | None = option(
        None, "initial c = log Z; None estimates it by importance sampling from the noise"
    )
    init_samples: int = option(10000, "noise draws of the importance-sampling estimate of the initial c", positive)


@attrs.frozen
class VNCEConfig(NCEConfig):
    inner_steps: int = option(5, "posterior updates on the lower-level divergence per batch (K)", non_negative)
    n_importance: int = option(10, "draws h ~ q(h|y) in the importance-weighted marginal of each noise point", positive)
    n_data_samples: int = option(1, "draws h ~ q(h|x) per data point in the data term", positive)


def make_noise(cfg: NCEConfig, data: DataSplits) -> GaussianNoise:
    """The Gaussian noise of the config, fitted to ``data.train`` or fixed."""
    train = data.tensor("train").flatten(1)
    d = train.shape[1]
    if cfg.noise == "fixed":
        mean = torch.full((d,), cfg.noise_mean, dtype=train.dtype, device=train.device)
        return GaussianNoise(mean, cfg.noise_std * torch.eye(d, dtype=train.dtype, device=train.device))
    mean = train.mean(0)
    centred = train - mean
    if cfg.noise_cov == "diagonal":
        return GaussianNoise(mean, torch.diag(centred.std(0) * cfg.noise_scale))
    cov = centred.T @ centred / (len(train) - 1)
    jitter = 1e-6 * cov.diagonal().mean() * torch.eye(d, dtype=cov.dtype, device=cov.device)
    return GaussianNoise(mean, torch.linalg.cholesky(cov + jitter) * cfg.noise_scale)


def joint_log_weights(model: EnergyModel, posterior: Posterior, v: Tensor, h: Tensor) -> Tensor:
    """log p̃(v, h) − log q(h|v) = −E(v, h) − log q(h|v) for h (k, B, m): -> (k, B).

    Differentiable in θ (through E); q's parameters are not trained through it."""
    k, b = h.shape[:2]
    with torch.no_grad():
        log_q = posterior.log_prob(h, v)
    v_rep = v.unsqueeze(0).expand(k, *v.shape).reshape(k * b, *v.shape[1:])
    return -model.energy(v_rep, h.reshape(k * b, *h.shape[2:])).view(k, b) - log_q


class NCE(Estimator):
    """NCE for models with a free energy: log φ(u) = −F(u); the log-normaliser c is a learned
    scalar stepped by the model's optimizer and checkpointed in ``state_dict``."""

    roles: tuple[str, ...] = ("model",)
    graph_safe = True

    def __init__(self, model: EnergyModel, noise: GaussianNoise, nu: float, parts: Parts):
        self.model, self.noise, self.nu = model, noise, nu
        self.log_z = nn.Parameter(torch.zeros((), dtype=parts.dtype, device=parts.device))
        params = [p for p in model.parameters() if p.requires_grad] + [self.log_z]
        self.model_role = parts.make_role("model", params)

    def log_unnormalised(self, u: Tensor, for_noise: bool) -> Tensor:
        """log φ(u) = −F(u): u (B, *shape) -> (B,)."""
        return -self.model.free_energy(u)

    def initial_log_z(self, n: int, like: Tensor) -> float:
        """log Z ≈ log mean_i φ(y_i)/p_n(y_i), y_i ~ p_n (importance sampling from the noise)."""
        with torch.no_grad():
            y = self.noise.sample(n).reshape(n, *like.shape[1:])
            log_w = torch.cat(
                [self.log_unnormalised(chunk, True) - self.noise.log_prob(chunk) for chunk in y.split(1000)]
            )
            return float(torch.logsumexp(log_w, 0) - math.log(n))

    def data_term(self, x: Tensor) -> Tensor:
        """log φ(x) − c: (B,), or (k, B) for VNCE's per-draw bound."""
        return self.log_unnormalised(x, False) - self.log_z

    def step(self, batch: Tensor) -> dict[str, Tensor]:
        n_noise = max(1, round(self.nu * len(batch)))
        nu = n_noise / len(batch)
        y = self.noise.sample(n_noise).reshape(n_noise, *batch.shape[1:])
        loss = nce_loss(
            self.data_term(batch),
            self.noise.log_prob(batch),
            self.log_unnormalised(y, True) - self.log_z,
            self.noise.log_prob(y),
            nu,
        )
        self.model_role.update(loss)
        return {"loss": loss.detach(), "log_z": self.log_z.detach().clone()}

    def state_dict(self) -> dict[str, Any]:
        return {"log_z": self.log_z.detach().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.log_z.copy_(state["log_z"])


class VNCE(NCE):
    """Variational NCE for latent-variable models: the data term is the per-draw Jensen bound
    with h ~ q(h|x), the noise term uses the importance-weighted marginal with q as proposal."""

    roles = ("model", "posterior")

    def __init__(
        self,
        model: EnergyModel,
        noise: GaussianNoise,
        nu: float,
        parts: Parts,
        posterior: Posterior,
        divergence: Divergence,
        cfg: VNCEConfig,
    ):
        super().__init__(model, noise, nu, parts)
        self.posterior, self.divergence, self.cfg = posterior, divergence, cfg
        self.posterior_role = parts.make_role("posterior", list(posterior.parameters()))

    def log_unnormalised(self, u: Tensor, for_noise: bool) -> Tensor:
        """Noise points: log (1/k) Σ_i p̃(u, h_i)/q(h_i|u) (B,). Data points: the k per-draw
        terms log p̃(u, h_i) − log q(h_i|u) (k, B), averaged inside log σ by the loss."""
        k = self.cfg.n_importance if for_noise else self.cfg.n_data_samples
        log_w = joint_log_weights(self.model, self.posterior, u, self.posterior.sample(u, k))  # exact draws h ~ q
        if for_noise:
            return torch.logsumexp(log_w, 0) - math.log(k)
        return log_w

    def step(self, batch: Tensor) -> dict[str, Tensor]:
        lower = None
        for _ in range(self.cfg.inner_steps):
            lower = self.divergence(self.model, self.posterior, batch).mean()
            self.posterior_role.update(lower)
        metrics = super().step(batch)
        if lower is not None:
            metrics["lower_level"] = lower.detach()
        return metrics


def _noise_for(cfg: NCEConfig, parts: Parts) -> GaussianNoise:
    return make_noise(cfg, parts.need("data", "estimator"))


def _initialise(estimator: NCE, cfg: NCEConfig, parts: Parts) -> None:
    value = cfg.init_log_z
    if value is None:
        value = estimator.initial_log_z(cfg.init_samples, parts.data.tensor("train", 1))
    with torch.no_grad():
        estimator.log_z.fill_(value)


def build_nce(cfg: NCEConfig, parts: Parts) -> NCE:
    """Noise-contrastive estimation with Gaussian noise and a learned log-normaliser (needs a free energy)."""
    model = parts.need("model", "estimator")
    if not model.has_free_energy:
        raise ConfigError(
            "estimator", "kind", f"nce needs the model's free energy F(v); {type(model).__name__} has none (use vnce)"
        )
    estimator = NCE(model, _noise_for(cfg, parts), cfg.nu, parts)
    _initialise(estimator, cfg, parts)
    return estimator


def build_vnce(cfg: VNCEConfig, parts: Parts) -> VNCE:
    """Variational NCE: q trained on the lower-level divergence, importance-weighted noise term."""
    model = parts.need("model", "estimator")
    if model.latent is None:
        raise ConfigError(
            "estimator", "kind", f"vnce is for latent-variable models; {type(model).__name__} has no latent (use nce)"
        )
    posterior = parts.need("posterior", "estimator")
    divergence = parts.need("divergence", "estimator")
    estimator = VNCE(model, _noise_for(cfg, parts), cfg.nu, parts, posterior, divergence, cfg)
    _initialise(estimator, cfg, parts)
    return estimator
