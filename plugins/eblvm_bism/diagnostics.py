"""The gradient-bias diagnostic of BiSM Fig. 1 / Theorem 2.

bias(K, N) = ‖∂J_Bi(θ, φ_N(θ))/∂θ − dJ_Bi(θ, φ*(θ))/dθ‖ on one batch, where φ_N comes from K
real lower-level steps and N unrolled ones. For a GRBM with the linear Bernoulli posterior the
exact posterior is representable and the modified score then equals the exact marginal score
for every (relaxed) h, so dJ_Bi(θ, φ*(θ))/dθ is the exact-score gradient (Theorem 1); that is
the reference used here. Objectives must be value-only (DSM), so the reference and BiSM share
the same noise.
"""

from __future__ import annotations

import copy
from typing import Literal

import attrs
import torch

from eblvm.plugin import ConfigError, EvalResult, Evaluator, Parts, exact_score, option, positive


@attrs.frozen
class GradientBiasConfig:
    unroll_steps: list[int] = option([0, 1, 2, 5, 10, 20], "the values of N")
    inner_steps: list[int] = option([0, 5, 20], "the values of K (real posterior steps before unrolling)")
    unroll: Literal["sgd", "adam"] = option("sgd", "unrolled update, as in bism-unrolled")
    inner_lr: float = option(0.1, "step α of the 'sgd' unrolled update", positive)
    batch_size: int = option(100, "points of the training split used", positive)
    n_repeats: int = option(
        20, "hypergradients averaged over this many draws of h (Theorem 2 bounds the bias of their mean)", positive
    )
    seed: int = option(0, "seed of the batch, the noise and the posterior samples")


class GradientBias(Evaluator):
    """Evaluator: scalars ``bias_K{K}_N{N}`` (‖mean of the hypergradients − exact gradient‖), its
    ``_stderr`` (√(tr Cov / repeats): what that norm would be from Monte-Carlo noise alone, so a
    bias within about two of them is not resolved) and ``reference_norm`` (‖exact gradient‖)."""

    def __init__(self, cfg: GradientBiasConfig, parts: Parts):
        self.cfg = cfg
        keys = [f"bias_K{k}_N{n}" for k in cfg.inner_steps for n in cfg.unroll_steps]
        self.reports = ("reference_norm", *keys, *(f"{key}_stderr" for key in keys))
        model = parts.need("model", "eval")
        for name in ("posterior", "objective", "divergence"):
            parts.need(name, "eval")
        if not model.has_free_energy:
            raise ConfigError(
                "eval", "kind", "gradient-bias needs the exact marginal score: a model with a free energy"
            )
        if not parts.objective.value_only:
            raise ConfigError(
                "eval", "kind", "gradient-bias needs a value-only objective (dsm) so both gradients share the noise"
            )

    def __call__(self, parts: Parts) -> EvalResult:
        from eblvm_bism import BiSMUnrolled  # same plugin

        cfg, model = self.cfg, parts.model
        torch.manual_seed(cfg.seed)
        batch = parts.data.tensor("train", cfg.batch_size)
        x, context = parts.objective.points(batch)
        theta = [p for p in model.parameters() if p.requires_grad]
        exact = torch.autograd.grad(parts.objective.loss(lambda y: exact_score(model, y), x, context).mean(), theta)
        reference = torch.cat([g.flatten() for g in exact])
        scalars = {"reference_norm": float(reference.norm())}
        for k in cfg.inner_steps:
            # the recipe's [optim.posterior] if any, else Adam at 1e-3
            local = parts.evolve(posterior=copy.deepcopy(parts.posterior), roles_from_recipe=False)
            estimator = BiSMUnrolled(local, k, 0, cfg.unroll, cfg.inner_lr)
            estimator.fit_posterior(x, weights=parts.objective.point_weights(context))
            for n in cfg.unroll_steps:
                estimator.unroll_steps = n
                drawn = []
                for r in range(cfg.n_repeats):
                    torch.manual_seed(cfg.seed + 1 + r)
                    grads, _ = estimator.hypergradient(x, context)
                    drawn.append(torch.cat([g.flatten() for g in grads]))
                draws = torch.stack(drawn)  # (repeats, parameters)
                scalars[f"bias_K{k}_N{n}"] = float((draws.mean(0) - reference).norm())
                # the size the difference has from Monte-Carlo noise alone: E‖mean − E g‖² = tr Cov(g) / repeats
                noise = draws.var(0).sum() / cfg.n_repeats if cfg.n_repeats > 1 else torch.tensor(float("nan"))
                scalars[f"bias_K{k}_N{n}_stderr"] = float(noise.sqrt())
        return EvalResult(scalars=scalars)


def build_gradient_bias(cfg: GradientBiasConfig, parts: Parts) -> GradientBias:
    """Gradient bias of unrolled BiSM versus N and K against the exact hypergradient (BiSM Fig. 1):
    bias_K{K}_N{N} and its _stderr for each K of inner_steps and N of unroll_steps, and reference_norm."""
    return GradientBias(cfg, parts)
