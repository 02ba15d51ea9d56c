"""The exact-score baseline: train a model with a free energy on a score objective, using the
exact marginal score −∇_v F(v)."""

from __future__ import annotations

from torch import Tensor

from eblvm.plugin import ConfigError, EnergyModel, Estimator, NoConfig, Parts, ScoreObjective, exact_score


class ExactScore(Estimator):
    """One optimizer step per batch on mean_i F(s)_i with s(x) = −∇_x F(x; θ).

    bf16 is allowed with value-only objectives (DSM), whose bf16 loss and gradient a test
    compares with fp32; SM and SSM differentiate the score again and stay in fp32.
    """

    roles = ("model",)
    graph_safe = True

    def __init__(self, model: EnergyModel, objective: ScoreObjective, parts: Parts):
        self.model, self.objective = model, objective
        self.precisions = ("fp32", "bf16") if objective.value_only else ("fp32",)
        self.precision_note = (
            "" if objective.value_only else "objectives that differentiate the score again stay in fp32"
        )
        params = [p for p in model.parameters() if p.requires_grad]
        self.model_role = parts.make_role("model", params)

    def score(self, x: Tensor) -> Tensor:
        """x (B, d) -> ∇_x log p(x) (B, d), differentiable in x and θ."""
        return exact_score(self.model, x)

    def step(self, batch: Tensor) -> dict[str, Tensor]:
        """batch (B, ...) -> {"loss": mean objective (0-d)}."""
        x, context = self.objective.points(batch)
        loss = self.objective.loss(self.score, x, context).mean()
        self.model_role.update(loss)
        return {"loss": loss.detach()}


def build_exact_score(cfg: NoConfig, parts: Parts) -> ExactScore:
    """Exact marginal-score baseline for models with a tractable free energy (e.g. GRBM)."""
    model = parts.need("model", "estimator")
    if not model.has_free_energy:
        raise ConfigError(
            "estimator",
            "kind",
            f"exact-score needs the model's free energy F(v), and model {type(model).__name__} has none; "
            "use an estimator for latent variable models instead",
        )
    objective = parts.need("objective", "estimator")
    return ExactScore(model, objective, parts)
