"""The interfaces every component implements.

Shapes are per batch ``B``; ``d`` is the visible dimension (flattened), ``m`` the latent one.
Energies follow the sign convention p(v, h) ∝ exp(-E(v, h)): lower energy, higher density.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor, nn

ScoreField = Callable[[Tensor], Tensor]
"""A callable x (B, d) -> estimate of ∇_x log p(x) (B, d), differentiable in x and θ."""


@attrs.frozen
class LatentSpec:
    """What the latent variable h is: its kind and its dimension m."""

    kind: Literal["bernoulli", "gaussian"]
    dim: int


class EnergyModel(nn.Module):
    """An energy-based (latent variable) model p(v, h; θ) = exp(-E(v, h; θ)) / Z(θ).

    Subclasses set ``latent`` (None for fully visible models) and implement ``energy``.
    Models where h can be summed out also implement ``free_energy``; that unlocks the
    exact marginal score, exact-score baselines and exact likelihoods.
    """

    latent: LatentSpec | None = None

    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        """E(v, h; θ): v (B, d), h (B, m) -> (B,)."""
        raise NotImplementedError

    def free_energy(self, v: Tensor) -> Tensor:
        """F(v; θ) = -log Σ_h exp(-E(v, h)): v (B, d) -> (B,). Optional."""
        raise NotImplementedError(f"{type(self).__name__} has no tractable free energy")

    @property
    def has_free_energy(self) -> bool:
        return type(self).free_energy is not EnergyModel.free_energy


def exact_score(model: EnergyModel, v: Tensor, create_graph: bool = True) -> Tensor:
    """The marginal score ∇_v log p(v) = -∇_v F(v): v (B, d) -> (B, d).

    The graph w.r.t. ``v`` and θ is kept when ``create_graph`` is true, so the result can be
    differentiated again (SM, SSM) or trained through.
    """
    if not v.requires_grad:
        v = v.detach().requires_grad_(True)
    free = model.free_energy(v).sum()
    (grad,) = torch.autograd.grad(free, v, create_graph=create_graph)
    return -grad


class Posterior(nn.Module):
    """A variational posterior q(h | v; φ)."""

    def rsample(self, v: Tensor, n: int = 1) -> Tensor:
        """n samples, differentiable in φ: v (B, d) -> h (n, B, m).

        Reparameterised for continuous h; a Gumbel-softmax relaxation for Bernoulli h.
        """
        raise NotImplementedError

    def sample(self, v: Tensor, n: int = 1) -> Tensor:
        """n exact samples, not differentiable: v (B, d) -> h (n, B, m).

        Defaults to detached ``rsample``; posteriors whose ``rsample`` is a relaxation (Bernoulli)
        override it with exact draws.
        """
        with torch.no_grad():
            return self.rsample(v, n)

    def log_prob(self, h: Tensor, v: Tensor) -> Tensor:
        """log q(h | v): h (..., B, m), v (B, d) -> (..., B)."""
        raise NotImplementedError

    def mean(self, v: Tensor) -> Tensor:
        """E_q[h | v]: v (B, d) -> (B, m)."""
        raise NotImplementedError

    def rsample_and_log_prob(self, v: Tensor, n: int = 1) -> tuple[Tensor, Tensor]:
        """``rsample(v, n)`` (n, B, m) and its ``log_prob`` (n, B) in one go; posteriors
        override it to evaluate their network once (lower-level divergences call it)."""
        h = self.rsample(v, n)
        return h, self.log_prob(h, v)


class ScoreObjective:
    """A score-matching functional F (BiSM Eq. 7): per-sample losses given a score field.

    ``points(v)`` says where the score is evaluated (v itself, or a noisy ṽ for DSM) and
    returns a context the loss needs; ``loss`` evaluates the objective. Objectives that use
    the score only through its values at those points set ``value_only = True`` and
    implement ``loss_at``; VaGES relies on that form.
    """

    value_only: bool = False

    def points(self, v: Tensor) -> tuple[Tensor, Any]:
        """Where the score is needed: v (B, d) -> (x (B', d), context)."""
        return v, None

    def loss(self, score: ScoreField, x: Tensor, context: Any) -> Tensor:
        """Per-sample losses (B',) for the score field at the points ``x``."""
        if not self.value_only:
            raise NotImplementedError
        return self.loss_at(x, score(x), context)

    def loss_at(self, x: Tensor, s: Tensor, context: Any) -> Tensor:
        """Per-sample losses (B',) from score values s (B', d) at the points x."""
        raise NotImplementedError(f"{type(self).__name__} needs the score's Jacobian")


class Divergence:
    """A lower-level divergence D(q(h|v) ‖ p(h|v)), per sample, up to a constant in φ.

    It may use only the model's energy and the posterior, never p(h|v) itself.
    ``requires_continuous_latent`` marks divergences that differentiate in h.
    """

    requires_continuous_latent: bool = False

    def __call__(self, model: EnergyModel, posterior: Posterior, v: Tensor) -> Tensor:
        """v (B, d) -> (B,); differentiable in φ (and in θ)."""
        raise NotImplementedError


class Estimator:
    """A learning algorithm: one call to ``step`` consumes one batch and updates parameters.

    ``step`` returns scalar metrics (floats); the key ``loss`` is the training loss that the
    trainer watches for NaN/Inf. ``optimizers`` names the optimizers it steps (made with
    ``parts.make_optimizer``) so the trainer checkpoints them. Extra state to checkpoint (persistent chains, counters)
    goes through ``state_dict`` / ``load_state_dict``; the model, posterior and optimizers
    are checkpointed by the trainer.
    """

    optimizers: dict[str, torch.optim.Optimizer] = {}

    def step(self, batch: Tensor) -> dict[str, float]:
        """batch (B, d) -> metrics; updates parameters through ``eblvm_core.optim.apply_update``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


@attrs.frozen
class DataSplits:
    """A dataset held as tensors: train (N, *shape); val and test alike or None.

    ``bounds`` is the box the data lives in, ((low, high) per dimension) where known; plots
    and grid integrals use it. ``image_shape`` is the (C, H, W) of one example when the data
    are images stored flat (train (N, C·H·W)), so evaluators can reshape them; else None.
    """

    train: Tensor
    test: Tensor
    val: Tensor | None = None
    bounds: tuple[tuple[float, float], ...] | None = None
    image_shape: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.train.shape[1:])

    @property
    def dim(self) -> int:
        return int(self.train[0].numel())


@attrs.frozen
class EvalResult:
    """What an evaluator returns: named scalars and named images (C, H, W) float in [0, 1]."""

    scalars: dict[str, float] = attrs.field(factory=dict)
    images: dict[str, Tensor] = attrs.field(factory=dict)

    @classmethod
    def mean_over_points(cls, name: str, values: Tensor) -> "EvalResult":
        """Scalars ``name`` (mean of per-point values (n,)) and ``name_stderr`` (std/√n; NaN for n = 1)."""
        n = len(values)
        stderr = float(values.std() / math.sqrt(n)) if n > 1 else float("nan")
        return cls(scalars={name: float(values.mean()), f"{name}_stderr": stderr})


@runtime_checkable
class Evaluator(Protocol):
    def __call__(self, parts: Any) -> EvalResult:
        """Evaluate the run's live parts (model, posterior, data, device...)."""


class Sampler:
    """Draws samples of v from a model."""

    def sample(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n samples (n, d)."""
        raise NotImplementedError


class Logger:
    """A sink for metrics and images. Steps are optimizer steps."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Record scalars at ``step``."""

    def log_images(self, step: int, images: dict[str, Tensor]) -> None:
        """Record images (C, H, W) in [0, 1] at ``step``."""

    def close(self) -> None:
        """Flush and release resources."""


@attrs.define
class Parts:
    """The live parts of a run, filled in build order; factories read what they need.

    Order: data, model, posterior, objective, divergence, optimizers, estimator, evaluators.
    ``optimizers`` maps a name ("model", "posterior") to a factory params -> Optimizer, so an
    estimator decides which parameters each optimizer owns.
    """

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    data: DataSplits | None = None
    model: EnergyModel | None = None
    posterior: Posterior | None = None
    objective: ScoreObjective | None = None
    divergence: Divergence | None = None
    optimizer_factories: dict[str, Callable[..., torch.optim.Optimizer]] = attrs.field(factory=dict)
    estimator: Estimator | None = None
    samplers: dict[str, Sampler] = attrs.field(factory=dict)
    run_dir: Any = None

    def make_optimizer(self, name: str, params: Any) -> torch.optim.Optimizer:
        """The optimizer of recipe section [optim.<name>] over ``params`` (Adam, lr 1e-3, if absent)."""
        factory = self.optimizer_factories.get(name)
        if factory is None:
            return torch.optim.Adam(params, lr=1e-3)
        return factory(params)

    def need(self, name: str, section: str, key: str = "kind") -> Any:
        """The part ``name`` or a ConfigError naming the section that needed it."""
        from eblvm_core.errors import ConfigError

        value = getattr(self, name)
        if value is None:
            raise ConfigError(section, key, f"this component needs a [{name}] section")
        return value
