"""VaES / VaGES (Bao et al., ICML 2021) and the importance-sampled score baseline.

For value-only objectives F(s) (DSM, KSD): the score at the objective's points is estimated
from L posterior samples, ŝ(x) = (1/L) Σ_l ∇_x log p̃(x, h_l) (VaES), and its θ-gradient by
(1/L) Σ_l ∂∇_x log p̃(x, h_l)/∂θ + Cov_q(∇_x log p̃(x, h), ∇_θ log p̃(x, h)) (VaGES). The
posterior is fitted by K lower-level steps per batch, as in BiSM, without unrolling. A model
that conditions on v (``EnergyModel.condition``) has its features of x computed once per step,
with their graph: cut from it for the K lower-level steps and the Langevin steps on h (θ gets no
gradient from either), whole for the surrogate, where ``mean_joint_score`` takes the L samples'
scores through that one pass of the features instead of L passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from eblvm.plugin import (
    Conditioned,
    ConfigError,
    EnergyModel,
    Estimator,
    Parts,
    Posterior,
    ScoreObjective,
    non_negative,
    option,
    positive,
)
from eblvm.tools import condition_on, fit_posterior


def joint_scores(model: EnergyModel | Conditioned, x: Tensor, h: Tensor, graph: bool = True) -> tuple[Tensor, Tensor]:
    """∇_x log p̃(x, h_l) (L, *x.shape), with the graph to θ kept if ``graph``, and log p̃(x, h_l) (L, B).

    x (B, ...) is detached inside; h (L, B, m) is treated as a constant.
    """
    n, b = h.shape[:2]
    xl = x.detach().unsqueeze(0).expand(n, *x.shape).reshape(n * b, *x.shape[1:]).requires_grad_(True)
    log_joint = -model.energy(xl, h.reshape(n * b, -1))
    (grad,) = torch.autograd.grad(log_joint.sum(), xl, create_graph=graph)
    return grad.view(n, *x.shape), log_joint.view(n, b)


def mean_joint_score(
    model: EnergyModel | Conditioned, x: Tensor, h: Tensor
) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """(ŝ, log p̃(x, h_l) (L, B), a): ŝ = (1/L) Σ_l ∇_x log p̃(x, h_l), shaped like x, with the graph
    to θ kept; ``a(z)`` = [zᵀ∇_x log p̃(x, h_l)]_l (L, B) for a constant z shaped like x, without a
    graph (the covariance term's coefficients). h (L, B, m) is a constant. ``model`` may come
    conditioned on x already, with its graph (x then a leaf that requires grad); otherwise x is
    detached inside.

    A model that conditions on x through one feature tensor F = f(x) (B, ...) runs f once for the L
    samples: with G = (1/L) Σ_l ∂log p̃(x, h_l)/∂F (the head only), ŝ = J_fᵀ G, and zᵀ∇_x log p̃(x, h_l)
    = (∂log p̃(x, h_l)/∂F) · J_f z, where J_f z = ∂(zᵀŝ)/∂G comes back through ŝ's graph. Any other
    model is evaluated on the L·B points (``joint_scores``).
    """
    n = h.shape[0]
    conditioned: EnergyModel | Conditioned
    if isinstance(model, Conditioned) and model.conditions(x) and x.requires_grad:
        xg, conditioned = x, model
    else:
        xg = x.detach().requires_grad_(True)
        conditioned = condition_on(model, xg)
    if not (isinstance(conditioned, Conditioned) and isinstance(conditioned.cache, Tensor)):
        grads, log_joint = joint_scores(conditioned.model if isinstance(conditioned, Conditioned) else model, x, h)
        return grads.mean(0), log_joint, lambda z: (grads.detach() * z).flatten(2).sum(-1)
    features = conditioned.cache
    log_joint = -conditioned(h)
    (mean_feature_grad,) = torch.autograd.grad(log_joint.sum() / n, features, create_graph=True)
    (score,) = torch.autograd.grad(features, xg, mean_feature_grad, create_graph=True)

    def directional(z: Tensor) -> Tensor:
        (jz,) = torch.autograd.grad(score, mean_feature_grad, z, retain_graph=True)  # J_f z
        per_sample = [torch.autograd.grad(log_joint[i].sum(), features, retain_graph=True)[0] for i in range(n)]
        return torch.stack([(w * jz).flatten(1).sum(-1) for w in per_sample])

    return score, log_joint, directional


def vaes_value(model: EnergyModel | Conditioned, x: Tensor, h: Tensor) -> Tensor:
    """VaES (1/L) Σ_l ∇_x log p̃(x, h_l), shaped like x, as a value (no graph to θ); h (L, B, m).

    Where ``model`` is conditioned on x (a leaf that requires grad) with one feature tensor, the
    head is evaluated on the features and one vector-Jacobian product through f(x) gives the score,
    keeping f's graph for the caller; any other model is evaluated on the L·B points."""
    if isinstance(model, Conditioned) and model.conditions(x) and x.requires_grad and isinstance(model.cache, Tensor):
        features = model.cache
        (mean_feature_grad,) = torch.autograd.grad(-model(h).sum() / h.shape[0], features, retain_graph=True)
        (score,) = torch.autograd.grad(features, x, mean_feature_grad, retain_graph=True)
        return score.detach()
    base = model.model if isinstance(model, Conditioned) else model
    return joint_scores(base, x, h, graph=False)[0].mean(0).detach()


def langevin_correct(
    model: EnergyModel | Conditioned, x: Tensor, h: Tensor, steps: int, step_size: float, noise: float
) -> Tensor:
    """C steps h ← h − ½α∇_h E(x, h) + s·ξ on h (L, B, m), continuous h; returns detached h.

    With s ≪ √α (the papers' deep-model setting s = 1e-4) this is noisy gradient descent on the
    energy in h, not a sampler of p(h|x). A model that conditions on x (or ``model`` conditioned
    on x already) has its features of x computed once, without a graph, for all C steps.
    """
    n, b = h.shape[:2]
    energy = condition_on(model, x, graph=False)
    if isinstance(energy, Conditioned):

        def total(hf: Tensor) -> Tensor:
            return energy(hf.view(n, b, -1)).sum()
    else:
        xl = x.detach().unsqueeze(0).expand(n, *x.shape).reshape(n * b, *x.shape[1:])

        def total(hf: Tensor) -> Tensor:
            return energy.energy(xl, hf).sum()

    h = h.detach().reshape(n * b, -1)
    for _ in range(steps):
        h = h.requires_grad_(True)
        (grad,) = torch.autograd.grad(total(h), h)
        h = (h - 0.5 * step_size * grad + noise * torch.randn_like(h)).detach()
    return h.view(n, b, -1)


class VariationalScore(Estimator):
    """Trains θ on a value-only objective through VaES (``covariance=False``) or VaGES.

    Graph-safe: K lower-level steps, L samples and C Langevin steps on h of fixed shapes, no
    device value read on the host. bf16 with continuous (gaussian) h only, as tests/core/test_precision.py
    measures: a relaxed Bernoulli posterior magnifies bf16's rounding of its logits by 1/temperature.
    """

    roles = ("model", "posterior")
    graph_safe = True

    def __init__(self, parts: Parts, cfg: VaGESConfig, covariance: bool):
        self.model: EnergyModel = parts.need("model", "estimator")
        self.posterior: Posterior = parts.need("posterior", "estimator")
        self.objective: ScoreObjective = parts.need("objective", "estimator")
        self.divergence = parts.need("divergence", "estimator")
        if not self.objective.value_only:
            raise ConfigError(
                "objective", "kind", "VaES/VaGES need an objective that uses only score values (dsm, ksd)"
            )
        if covariance and cfg.n_samples < 2:
            raise ConfigError(
                "estimator", "n_samples", "VaGES needs at least 2 posterior samples for the covariance term"
            )
        if cfg.langevin_steps and self.model.latent is not None and self.model.latent.kind != "gaussian":
            raise ConfigError("estimator", "langevin_steps", "Langevin correction needs continuous (gaussian) h")
        self.cfg, self.covariance = cfg, covariance
        continuous = self.model.latent is not None and self.model.latent.kind == "gaussian"
        self.precisions = ("fp32", "bf16") if continuous else ("fp32",)
        self.precision_note = "" if continuous else "bf16 needs continuous (gaussian) latents"
        self.theta = [p for p in self.model.parameters() if p.requires_grad]
        self.model_role = parts.make_role("model", self.theta)
        self.posterior_role = parts.make_role("posterior", [p for p in self.posterior.parameters() if p.requires_grad])

    def fit_posterior(
        self, x: Tensor, energy: EnergyModel | Conditioned | None = None, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        """K updates of φ on the lower-level divergence at the points x (weighted by ``weights``
        (B,), the objective's ``point_weights``); θ gets no gradient. ``energy``: the model or its
        conditioned energy at x (default the model)."""
        return fit_posterior(
            self.divergence,
            self.model if energy is None else energy,
            self.posterior,
            self.posterior_role,
            x,
            self.cfg.inner_steps,
            weights,
        )

    def posterior_samples(self, x: Tensor, energy: EnergyModel | Conditioned | None = None, n: int = 0) -> Tensor:
        """h_1..h_n ~ q(h|x) (n, B, m) (n = 0: L), exact draws, optionally Langevin-corrected; constants."""
        h = self.posterior.sample(x.detach(), n or self.cfg.n_samples)
        if self.cfg.langevin_steps:
            h = langevin_correct(
                self.model if energy is None else energy,
                x,
                h,
                self.cfg.langevin_steps,
                self.cfg.langevin_step_size,
                self.cfg.langevin_noise,
            )
        return h

    def surrogate(
        self,
        x: Tensor,
        context: Any,
        h: Tensor,
        energy: EnergyModel | Conditioned | None = None,
        h_z: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(surrogate, objective value): the surrogate's θ-gradient is z · (VaGES estimate of ∂s/∂θ).

        z = ∂F/∂s at s = VaES of the samples ``h_z`` (L', B, m), or of ``h`` when None (a
        constant); surrogate = Σ_b z_b·ŝ_b + (1/(L−1)) Σ_{l,b} stopgrad(a_lb − ā_b) log p̃(x_b, h_lb)
        with ŝ the VaES of h and a_lb = z_b·∇_x log p̃(x_b, h_lb). z from samples of its own makes
        the gradient unbiased where F is quadratic in s (DSM, MDSM, KSD) and q = p(h|x); from h
        itself z and the estimate share their noise, a bias of order 1/L.
        """
        model = self.model if energy is None else energy
        s, log_joint, directional = mean_joint_score(model, x, h)
        s_const = (s.detach() if h_z is None else vaes_value(model, x, h_z)).requires_grad_(True)
        value = self.objective.loss_at(x.detach(), s_const, context).mean()
        (z,) = torch.autograd.grad(value, s_const)
        surrogate = (z * s).sum()
        if self.covariance:
            a = directional(z)  # (L, B)
            centred = a - a.mean(0, keepdim=True)
            surrogate = surrogate + (centred * log_joint).sum() / (h.shape[0] - 1)
        return surrogate, value.detach()

    def step(self, batch: Tensor) -> dict[str, float | Tensor]:
        """batch (B, d) -> metrics: K posterior updates, then one θ update along VaGES. A model that
        conditions on x has its features f(x) computed once, with their graph: detached for the
        lower level and the Langevin steps on h, whole for the surrogate."""
        x, context = self.objective.points(batch)
        x = x.detach()
        whole: EnergyModel | Conditioned
        lower: EnergyModel | Conditioned
        if self.model.has_conditioning:
            points = x.detach().requires_grad_(True)
            whole = condition_on(self.model, points)
            assert isinstance(whole, Conditioned), "a model with has_conditioning conditions on its points"
            lower = whole.detach(x)
        else:
            points, whole, lower = x, self.model, self.model
        metrics: dict[str, float | Tensor] = {**self.fit_posterior(x, lower, self.objective.point_weights(context))}
        n = self.cfg.n_samples
        if self.cfg.independent_z:
            h_z, h = self.posterior_samples(x, lower, 2 * n).split(n)
        else:
            h_z, h = None, self.posterior_samples(x, lower)
        surrogate, value = self.surrogate(points, context, h, whole, h_z)
        self.model_role.update(surrogate)
        metrics["loss"] = value
        return metrics


@attrs.frozen
class VaGESConfig:
    n_samples: int = option(2, "posterior samples L per point (VaGES needs L >= 2)", positive)
    independent_z: bool = option(
        True,
        "z = ∂F/∂s from L samples of its own (the released code; unbiased where F is quadratic in s and "
        "q is exact); false: from the estimate's own L samples (cheaper, biased by O(1/L))",
    )
    inner_steps: int = option(5, "lower-level posterior updates K per batch", non_negative)
    langevin_steps: int = option(0, "Langevin correction steps C on h (continuous h only)", non_negative)
    langevin_step_size: float = option(1e-2, "Langevin step size α", positive)
    langevin_noise: float = option(1e-4, "Langevin noise scale s; s ≪ √α makes it noisy gradient descent", non_negative)


def build_vages(cfg: VaGESConfig, parts: Parts) -> VariationalScore:
    """VaGES: variational score and score-gradient estimates (with the covariance term)."""
    return VariationalScore(parts, cfg, covariance=True)


def build_vaes(cfg: VaGESConfig, parts: Parts) -> VariationalScore:
    """VaES: the objective is fed the variational score estimate; no covariance term."""
    return VariationalScore(parts, cfg, covariance=False)


@attrs.frozen
class ISConfig:
    n_samples: int = option(2, "uniform Bernoulli proposals L per point", positive)


class ImportanceScore(Estimator):
    """Baseline (IS-KSD in the VaGES paper): the score of the importance-sampled free energy.

    log p̂(x) = logsumexp_l(−E(x, h_l)) − log L + m log 2 with h_l ~ Uniform{0,1}^m held fixed,
    so ŝ(x) = Σ_l w_l ∇_x log p̃(x, h_l) with self-normalised weights w ∝ p̃(x, h_l).
    """

    roles = ("model",)
    graph_safe = True

    def __init__(self, parts: Parts, n_samples: int):
        self.model: EnergyModel = parts.need("model", "estimator")
        self.objective: ScoreObjective = parts.need("objective", "estimator")
        latent = self.model.latent
        if latent is None or latent.kind != "bernoulli":
            raise ConfigError(
                "estimator", "kind", "is-score uses uniform Bernoulli proposals: the model needs Bernoulli h"
            )
        self.n_samples, self.m = n_samples, latent.dim
        self.model_role = parts.make_role("model", [p for p in self.model.parameters() if p.requires_grad])

    def score(self, x: Tensor) -> Tensor:
        """x (B, d) -> ŝ(x) (B, d), differentiable in x and θ; fresh proposals each call."""
        n, b = self.n_samples, x.shape[0]
        h = torch.bernoulli(torch.full((n * b, self.m), 0.5, dtype=x.dtype, device=x.device))
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        xl = x.unsqueeze(0).expand(n, *x.shape).reshape(n * b, *x.shape[1:])
        log_joint = -self.model.energy(xl, h).view(n, b)
        log_p = torch.logsumexp(log_joint, 0) - math.log(n) + self.m * math.log(2.0)
        (grad,) = torch.autograd.grad(log_p.sum(), x, create_graph=True)
        return grad

    def step(self, batch: Tensor) -> dict[str, float | Tensor]:
        x, context = self.objective.points(batch)
        loss = self.objective.loss(self.score, x, context).mean()
        self.model_role.update(loss)
        return {"loss": loss.detach()}


def build_is_score(cfg: ISConfig, parts: Parts) -> ImportanceScore:
    """Importance-sampled score with uniform Bernoulli proposals (the IS-KSD baseline)."""
    return ImportanceScore(parts, cfg.n_samples)
