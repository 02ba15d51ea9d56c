"""Bi-level score matching (BiSM, Bao et al. 2020): unrolled and implicit-gradient estimators.

Upper level J_Bi(θ, φ) = E F(ŝ) with the modified score ŝ(x) = ∇_x[−E(x, h) − log q(h|x)]
(Eq. 8); lower level G(θ, φ) = E D(q(h|x) ‖ p(h|x)) (Eq. 9). Both see the objective's
points x (the noisy ṽ for DSM). Each step: K real posterior updates on G with the model
frozen, then a θ update along an approximation of dJ_Bi(θ, φ*(θ))/dθ.

A model that conditions on v (``EnergyModel.condition``: the deep EBLVM's E = g(f(v), h)) has
its features f(x) computed once per step, with their graph to θ: the K real steps use them
detached, the N unrolled steps (or the implicit estimator's lower level) with their graph.
The upper level differentiates ŝ in x and needs f's graph to x. Where it is evaluated at the
real φ (N = 0, and the implicit estimator) it shares the same f(x), computed from x made a
leaf that requires grad. With N > 0 it computes its own f(x): φ_N(θ) is then a function of
f(x), and a shared f would let ∇_x of ŝ run through φ_N into x, which Eq. 8 holds fixed.
Other models are evaluated in full at every call, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, Protocol, cast

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
    ScoreField,
    hookimpl,
    non_negative,
    option,
    positive,
)
from eblvm.tools import (
    DifferentiableAdam,
    Functional,
    SolveInfo,
    collectives_active,
    conjugate_gradient,
    fit_posterior,
    flat,
    grads_or_zeros,
    hvp,
    mean_over_ranks,
    neumann,
    sgd_step,
    trainable,
    unflat,
    weighted_mean,
)
from eblvm_bism.diagnostics import GradientBiasConfig, build_gradient_bias


class BlockPosterior(Protocol):
    """A posterior with per-unit Fisher blocks (linear Bernoulli logits: ``has_fisher_blocks``)."""

    def fisher_blocks(self, v: Tensor) -> Any: ...

    def solve_blocks(self, blocks: Any, vectors: dict[str, Tensor], damping: float) -> dict[str, Tensor]: ...


def modified_score(model: EnergyModel | Conditioned, posterior: Posterior) -> ScoreField:
    """ŝ(x) = ∇_x[−E(x, h) − log q(h|x)], x (B, d) -> (B, d), one h ~ q(h|x) per point (Eq. 8).

    h is reparameterised at x.detach(): held fixed while differentiating in x, yet a function
    of φ, so ŝ is differentiable in x (with the graph kept), θ and φ. ``model`` may be a
    ``Conditioned`` energy: at its own points (a leaf that requires grad, whose cache was
    computed with the graph to it) E comes from the cache, elsewhere in full.
    """

    def score(x: Tensor) -> Tensor:
        h = posterior.rsample(x.detach(), 1)[0]
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        total = model.energy(x, h) + posterior.log_prob(h, x)
        (grad,) = torch.autograd.grad(total.sum(), x, create_graph=True)
        return -grad

    return score


class BiSM(Estimator):
    """Shared part of the BiSM estimators: parts, roles, the two levels and the step.

    Subclasses implement ``hypergradient(x, context, energy=None) -> (dJ/dθ per model
    parameter, metrics)``, evaluating the model through ``energy`` (from ``condition``).
    """

    roles = ("model", "posterior")

    def __init__(self, parts: Parts, inner_steps: int):
        self.model: EnergyModel = parts.need("model", "estimator")
        self.posterior: Posterior = parts.need("posterior", "estimator")
        self.objective = parts.need("objective", "estimator")
        self.divergence = parts.need("divergence", "estimator")
        self.inner_steps = inner_steps
        self.theta = [p for p in self.model.parameters() if p.requires_grad]
        self.phi = trainable(self.posterior)
        self.model_role = parts.make_role("model", self.theta)
        self.posterior_role = parts.make_role("posterior", list(self.phi.values()))
        self.functional = Functional(self.posterior)

    @property
    def upper_shares_features(self) -> bool:
        """Whether the upper level is evaluated at the real φ, so it can reuse the lower level's f(x)."""
        return True

    @property
    def block_posterior(self) -> BlockPosterior:
        """The posterior as one with Fisher blocks (the factories check ``has_fisher_blocks``)."""
        return cast(BlockPosterior, self.posterior)

    def condition(self, x: Tensor) -> tuple[Tensor, EnergyModel | Conditioned]:
        """(points, energy) for one step at the current θ. A model that conditions gets
        ``model.condition(x)``, f(x) computed now with its graph to θ, for every level of the
        step; when the upper level shares it (``upper_shares_features``) x is first made a
        leaf that requires grad, so that f(x) carries its graph to x too. Any other model:
        (x, model), as before."""
        if not self.model.has_conditioning:
            return x, self.model
        if self.upper_shares_features:
            x = x.detach().requires_grad_(True)
        return x, self.model.condition(x)

    def lower(
        self, x: Tensor, energy: EnergyModel | Conditioned | None = None, weights: Tensor | None = None
    ) -> Tensor:
        """G(θ, φ) on the points x: scalar batch mean of the divergence, each point weighted by
        ``weights`` (B,) (the objective's ``point_weights``; None: 1) (``energy``: the model or its
        conditioned energy at x; default the model)."""
        return weighted_mean(self.divergence(self.model if energy is None else energy, self.posterior, x), weights)

    def fisher_blocks(self, x: Tensor) -> Any:
        """The posterior's per-unit Fisher blocks at the current φ on x (linear Bernoulli logits),
        averaged over the ranks; a constant (no gradient flows through it), read by its ``solve_blocks``."""
        return self.block_posterior.fisher_blocks(x).mean_over_ranks()

    def upper(self, x: Tensor, context: Any, energy: EnergyModel | Conditioned | None = None) -> Tensor:
        """J_Bi(θ, φ) on the points x: scalar batch mean of the objective on the modified score."""
        score = modified_score(self.model if energy is None else energy, self.posterior)
        return self.objective.loss(score, x, context).mean()

    def fit_posterior(
        self, x: Tensor, energy: EnergyModel | Conditioned | None = None, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        """K real updates of φ on G (points weighted by ``weights``) with the posterior's
        optimizer; θ gets no gradient (a conditioned energy is used detached)."""
        return fit_posterior(
            self.divergence,
            self.model if energy is None else energy,
            self.posterior,
            self.posterior_role,
            x,
            self.inner_steps,
            weights,
        )

    def hypergradient(
        self, x: Tensor, context: Any, energy: EnergyModel | Conditioned | None = None
    ) -> tuple[list[Tensor], dict[str, Tensor]]:
        """dJ/dθ per model parameter and metrics (0-d tensors), at the current φ. ``energy`` is what
        ``condition`` returned with x; without it the estimator conditions on x itself."""
        raise NotImplementedError

    def _energy(self, x: Tensor, energy: EnergyModel | Conditioned | None) -> tuple[Tensor, EnergyModel | Conditioned]:
        return self.condition(x) if energy is None else (x, energy)

    def step(self, batch: Tensor) -> dict[str, Tensor]:
        """batch (B, d) -> metrics; K posterior updates, then one model update."""
        x, context = self.objective.points(batch)
        x, energy = self.condition(x)
        metrics = self.fit_posterior(x, energy, self.objective.point_weights(context))
        grads, more = self.hypergradient(x, context, energy)
        for p, g in zip(self.theta, grads):
            p.grad = g
        self.model_role.update()
        return {**metrics, **more}


class BiSMUnrolled(BiSM):
    """BiSM by gradient unrolling (Algorithm 1, Eq. 12-15).

    From φ_K (a constant in θ), N differentiable updates φⁿ = φⁿ⁻¹ − α∂G/∂φ (``unroll="sgd"``,
    Eq. 13) or steps of a differentiable copy of the posterior's Adam (``unroll="adam"``, the
    released code's choice); θ follows ∂J_Bi(θ, φ_N(θ))/∂θ. N = 0 is the partial derivative
    at φ_K. The unrolled iterates are thrown away: φ keeps its value after the K real steps.
    With several processes ∂G/∂φ is averaged over the ranks inside the graph, so φ_N(θ) is
    that of the union of their batches.

    ``unroll="natural"`` (a posterior with ``fisher_blocks``: linear Bernoulli logits) takes
    Gauss-Newton steps φⁿ = φⁿ⁻¹ − α(F + λI)⁻¹∂G/∂φ, per hidden unit, with F the Fisher blocks
    of q at φ_K on the batch and λ = ``natural_damping``. F is evaluated once, at φ_K, which is a
    constant in θ: the hypergradient is then the exact derivative of the φ_N(θ) computed (F at
    the iterates would depend on θ, and dropping that dependence would leave a term ∝ ∂G/∂φ,
    which vanishes only at the fixed point). Along a direction of curvature λ_i the step
    contracts the error by 1 − αλ_i/(λ_i + λ) instead of 1 − αλ_i, so the flat directions of each
    unit's lower level, which plain steps follow only after ~1/(αλ_i) ≈ 1,000 steps, are reached
    in one or a few (docs/results.md).
    """

    graph_safe = True

    def __init__(
        self,
        parts: Parts,
        inner_steps: int,
        unroll_steps: int,
        unroll: str,
        inner_lr: float,
        natural_damping: float = 1e-6,
    ):
        super().__init__(parts, inner_steps)
        self.unroll_steps, self.unroll, self.inner_lr = unroll_steps, unroll, inner_lr
        self.natural_damping = natural_damping
        # bf16 where tests/core/test_precision.py measures it within tolerance: a value-only objective
        # (MDSM, DSM) and continuous h (a relaxed Bernoulli q magnifies bf16's rounding by 1/temperature)
        latent = self.model.latent
        bf16 = self.objective.value_only and latent is not None and latent.kind == "gaussian"
        self.precisions = ("fp32", "bf16") if bf16 else ("fp32",)
        self.precision_note = "" if bf16 else "bf16 needs a value-only objective (dsm, mdsm) and gaussian latents"

    @property
    def upper_shares_features(self) -> bool:
        """Only at N = 0: φ_N(θ) for N > 0 depends on f(x), which ∇_x of ŝ must not see."""
        return self.unroll_steps == 0

    def _update_rule(self, x: Tensor) -> Callable[[dict[str, Tensor], list[Tensor]], dict[str, Tensor]]:
        if self.unroll == "adam":
            return DifferentiableAdam.from_optimizer(self.posterior_role.optimizer, list(self.phi.values())).step
        if self.unroll == "natural":
            return self._natural_step(x)
        return functools.partial(sgd_step, lr=self.inner_lr)

    def _natural_step(self, x: Tensor) -> Callable[[dict[str, Tensor], list[Tensor]], dict[str, Tensor]]:
        """φ ↦ φ − α(F + λI)⁻¹g per unit, F the Fisher blocks at the current φ (φ_K) on x, averaged
        over the ranks like the gradients (F is a constant: no gradient flows through it)."""
        blocks = self.fisher_blocks(x)
        names, lr, damping = list(self.phi), self.inner_lr, self.natural_damping

        def step(params: dict[str, Tensor], grads: list[Tensor]) -> dict[str, Tensor]:
            direction = self.block_posterior.solve_blocks(blocks, dict(zip(names, grads)), damping)
            return {name: torch.add(p, direction[name], alpha=-lr) for name, p in params.items()}

        return step

    def unrolled(
        self, x: Tensor, energy: EnergyModel | Conditioned | None = None, weights: Tensor | None = None
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """φ_N(θ) after N differentiable updates from the current φ, and G at the current φ (0-d).

        ``energy`` (the model or its conditioned energy at x, with its graph: ∂G/∂φ is a function
        of θ through it) is evaluated by all N steps; ``weights`` weight G's points."""
        params, lower_at_start = self.phi, None
        update = self._update_rule(x)
        ranks = collectives_active()  # asked once per step, not once per unrolled step
        for n in range(self.unroll_steps):
            lower = (
                self.functional.call(params, self.lower, x, energy, weights) if n else self.lower(x, energy, weights)
            )
            if n == 0:
                lower_at_start = lower.detach()
            grads = grads_or_zeros(lower, list(params.values()), create_graph=True)
            params = update(params, mean_over_ranks(grads) if ranks else grads)
        return params, lower_at_start

    def hypergradient(
        self, x: Tensor, context: Any, energy: EnergyModel | Conditioned | None = None
    ) -> tuple[list[Tensor], dict[str, Tensor]]:
        """dJ_Bi(θ, φ_N(θ))/dθ (Eq. 14) at the current φ; metrics as 0-d tensors (no host synchronisation)."""
        x, energy = self._energy(x, energy)
        params, lower = self.unrolled(x, energy, self.objective.point_weights(context))
        if self.unroll_steps:
            upper = self.functional.call(params, self.upper, x, context, energy)
        else:
            upper = self.upper(x, context, energy)
        metrics = {"loss": upper.detach()}
        if lower is not None:
            metrics["lower_loss"] = lower
        return grads_or_zeros(upper, self.theta), metrics


class BiSMImplicit(BiSM):
    """BiSM with the implicit-function-theorem hypergradient at φ_K.

    dJ/dθ = ∂_θJ − ∂²_θφG · w with (∂²_φφG + damping·I) w = ∂_φJ, solved by conjugate gradient
    or a truncated Neumann series on Hessian-vector products (double backward over φ).
    Exact when φ_K is a stationary point of G and the solve converges. With several processes
    the solve sees the Hessian-vector products and ∂_φJ averaged over the ranks, so w is the
    union's and the same on every rank.

    With ``block_damping`` set (``hessian="fisher-blocks"``; linear Bernoulli logits) w is instead
    the exact per-unit solve (F_j + block_damping·I) w_j = (∂_φJ)_j with F the Fisher blocks of q
    on the batch: the lower level's Hessian where q = p(h|v) for an energy linear in h, computed
    from q's logits with no sampling, so it neither adds noise nor needs iterations. The mixed
    term ∂²_θφG·w is still the divergence's (exact with ``[divergence] exact = true``).
    """

    not_graph_safe = (
        "its conjugate-gradient and Neumann solves stop at a tolerance read on the host "
        "([estimator] fixed_iterations = true runs solver_steps of them and compiles)"
    )

    @classmethod
    def graph_safety(cls, config: Any) -> str | None:
        """Graph-safe with a solve of fixed length, or the exact Fisher-block solve."""
        return None if config.fixed_iterations or config.hessian == "fisher-blocks" else cls.not_graph_safe

    def __init__(
        self,
        parts: Parts,
        inner_steps: int,
        solve: Callable[..., Any],
        block_damping: float | None = None,
        graph_safe: bool = False,
    ):
        super().__init__(parts, inner_steps)
        self.solve = solve
        self.block_damping = block_damping
        self.graph_safe = graph_safe

    def _solve_blocks(self, x: Tensor, d_phi: list[Tensor], damping: float) -> tuple[Tensor, SolveInfo]:
        """w = (F + λI)⁻¹∂_φJ per unit (λ = ``damping``), F and ∂_φJ averaged over the ranks; flat,
        like ``solve``'s."""
        names = list(self.phi)
        w = self.block_posterior.solve_blocks(self.fisher_blocks(x), dict(zip(names, mean_over_ranks(d_phi))), damping)
        return flat([w[name] for name in names]), SolveInfo(1, 0.0)

    def hypergradient(
        self, x: Tensor, context: Any, energy: EnergyModel | Conditioned | None = None
    ) -> tuple[list[Tensor], dict[str, Tensor]]:
        """dJ_Bi(θ, φ*(θ))/dθ by the implicit function theorem, at the current φ; metrics as 0-d tensors."""
        x, energy = self._energy(x, energy)
        phi = list(self.phi.values())
        lower = self.lower(x, energy, self.objective.point_weights(context))
        grad_phi = grads_or_zeros(lower, phi, create_graph=True)
        upper = self.upper(x, context, energy)
        # a conditioned energy's f(x) is shared with grad_phi, whose mixed product follows: keep its graph
        partial = grads_or_zeros(upper, self.theta + phi, retain_graph=isinstance(energy, Conditioned))
        d_theta, d_phi = partial[: len(self.theta)], partial[len(self.theta) :]
        if self.block_damping is not None:
            w, info = self._solve_blocks(x, d_phi, self.block_damping)
        else:
            w, info = self.solve(
                lambda vec: flat(mean_over_ranks(hvp(grad_phi, phi, unflat(vec, phi)))), flat(mean_over_ranks(d_phi))
            )
        mixed = hvp(grad_phi, self.theta, unflat(w, phi))
        metrics = {
            "loss": upper.detach(),
            "lower_loss": lower.detach(),
            "solver_iterations": torch.as_tensor(info.iterations, dtype=upper.dtype, device=upper.device),
            "solver_residual": torch.as_tensor(info.residual, dtype=upper.dtype, device=upper.device),
        }
        return [a - b for a, b in zip(d_theta, mixed)], metrics


# ---- configs and factories -----------------------------------------------------------------


@attrs.frozen
class UnrolledConfig:
    inner_steps: int = option(5, "K: real posterior updates on the lower level per batch (model frozen)", positive)
    unroll_steps: int = option(
        5,
        "N: differentiable lower-level updates from φ_K; 0 = partial derivative at φ_K, which misses the path through "
        "φ*(θ): under SM/SSM a term of the objective's own (its trace term pulls on q), under DSM/MDSM only what the "
        "model's score error makes (docs/results.md)",
        non_negative,
    )
    unroll: Literal["sgd", "adam", "natural"] = option(
        "sgd",
        "unrolled update: 'sgd' (Eq. 13, step inner_lr), 'adam' (copy of the posterior's Adam) or 'natural' "
        "(Gauss-Newton: step inner_lr along (F + natural_damping·I)⁻¹∂G/∂φ, F the Fisher blocks of a linear "
        "Bernoulli q; 1.0 is Newton's step)",
    )
    inner_lr: float = option(
        0.1, "step α of the 'sgd' and 'natural' unrolled updates; 'sgd' contracts for α < 2/λ_max(∂²_φφG)", positive
    )
    natural_damping: float = option(
        1e-6, "λ added to each unit's Fisher block in the 'natural' update (unused otherwise)", non_negative
    )


def _needs_fisher_blocks(parts: Parts, key: str, value: str) -> None:
    posterior = parts.need("posterior", "estimator")
    if not getattr(posterior, "has_fisher_blocks", False):
        raise ConfigError(
            "estimator",
            key,
            f"{value} needs the posterior's Fisher blocks: a bernoulli posterior with linear logits (hidden = [])",
        )


def build_unrolled(cfg: UnrolledConfig, parts: Parts) -> BiSMUnrolled:
    """BiSM with K real lower-level steps and N unrolled differentiable ones (Algorithm 1)."""
    if cfg.unroll == "natural":
        _needs_fisher_blocks(parts, "unroll", "'natural'")
    estimator = BiSMUnrolled(parts, cfg.inner_steps, cfg.unroll_steps, cfg.unroll, cfg.inner_lr, cfg.natural_damping)
    if cfg.unroll == "adam" and not isinstance(estimator.posterior_role.optimizer, torch.optim.Adam):
        raise ConfigError(
            "estimator", "unroll", "'adam' copies the posterior's optimizer: set [optim.posterior] kind = \"adam\""
        )
    return estimator


@attrs.frozen
class ImplicitConfig:
    inner_steps: int = option(5, "K: real posterior updates on the lower level per batch (model frozen)", positive)
    solver: Literal["cg", "neumann"] = option("cg", "linear solver for (∂²_φφG + damping·I) w = ∂_φJ")
    solver_steps: int = option(10, "maximum solver iterations (Hessian-vector products)", positive)
    tolerance: float = option(
        1e-4, "stop when the relative residual (CG) or Neumann term falls below this", non_negative
    )
    damping: float = option(1e-3, "added to the Hessian's diagonal", non_negative)
    neumann_step: float = option(0.1, "step of the Neumann series; needs step·λ_max(H) < 2", positive)
    fixed_iterations: bool = option(
        False,
        "run exactly solver_steps solver iterations, tolerance unread (nothing read on the host, so the step "
        "compiles: [run] compile); false stops at the tolerance",
    )
    hessian: Literal["autograd", "fisher-blocks"] = option(
        "autograd",
        "the lower level's Hessian in the solve: 'autograd' (Hessian-vector products of the divergence, by the "
        "solver) or 'fisher-blocks' (a linear Bernoulli q's exact per-unit Fisher blocks, solved exactly with "
        "damping; solver, solver_steps, tolerance and neumann_step are then unused)",
    )


def build_implicit(cfg: ImplicitConfig, parts: Parts) -> BiSMImplicit:
    """BiSM with the implicit-function-theorem hypergradient (CG or Neumann on Hessian-vector products)."""
    if cfg.hessian == "fisher-blocks":
        _needs_fisher_blocks(parts, "hessian", "'fisher-blocks'")
    common: dict[str, Any] = {
        "iterations": cfg.solver_steps,
        "tol": cfg.tolerance,
        "damping": cfg.damping,
        "fixed": cfg.fixed_iterations,
    }
    if cfg.solver == "cg":
        solve = functools.partial(conjugate_gradient, **common)
    else:
        solve = functools.partial(neumann, **common, step=cfg.neumann_step)
    blocks = cfg.hessian == "fisher-blocks"
    return BiSMImplicit(
        parts, cfg.inner_steps, solve, cfg.damping if blocks else None, BiSMImplicit.graph_safety(cfg) is None
    )


@hookimpl
def register_estimators(register):
    register("bism-unrolled", build_unrolled, UnrolledConfig)
    register("bism-implicit", build_implicit, ImplicitConfig)


@hookimpl
def register_evaluators(register):
    register("gradient-bias", build_gradient_bias, GradientBiasConfig)
