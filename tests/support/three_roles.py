"""A test plugin: a toy estimator with three roles and three optimizers — an energy E(v) on the
data, a Gaussian encoder q(h|v) and a generator G(h) — to check that the trainer treats roles
generically (checkpoints, resume, schedules, EMA, the NaN guard).

Loaded with ``EBLVM_PLUGIN_MODULES=tests.support.three_roles`` (or ``plugins.load`` after setting it).
Per step: the encoder on a VAE loss (reconstruction through G plus KL(q ‖ N(0, I))), the
generator on that reconstruction plus the energy of its samples, and the energy on
E(data) − E(G(z)) with a small E² penalty; each role's update uses only its own optimizer.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs
import torch
from torch import Tensor, nn

from eblvm_core.config import non_negative, option, positive
from eblvm_core.contracts import EnergyModel, Estimator, EvalResult, Parts, reporting
from eblvm_core.hookspecs import hookimpl


def mlp(n_in: int, width: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, width), nn.SiLU(), nn.Linear(width, n_out))


@attrs.frozen
class WidthConfig:
    width: int = option(16, "hidden width", positive)


class ToyEnergy(EnergyModel):
    """A fully visible energy E(v) = MLP(v): v (B, ...) -> (B,); h is ignored."""

    def __init__(self, d: int, width: int):
        super().__init__()
        self.net = mlp(d, width, 1)

    def energy(self, v: Tensor, h: Tensor | None = None) -> Tensor:
        return self.net(v.flatten(1)).squeeze(-1)


def build_energy(cfg: WidthConfig, parts: Parts) -> ToyEnergy:
    """A small MLP energy E(v), fully visible."""
    return ToyEnergy(parts.need("data", "model").dim, cfg.width)


@attrs.frozen
class GeneratorConfig:
    latent_dim: int = option(2, "dimension of h", positive)
    width: int = option(16, "hidden width", positive)


class ToyGenerator(nn.Module):
    """G(h): h (B, m) -> v (B, *event_shape)."""

    def __init__(self, m: int, shape: tuple[int, ...], width: int):
        super().__init__()
        self.latent_dim, self.shape = m, shape
        self.net = mlp(m, width, math.prod(shape))

    def forward(self, h: Tensor) -> Tensor:
        return self.net(h).view(len(h), *self.shape)


def build_generator(cfg: GeneratorConfig, parts: Parts) -> ToyGenerator:
    """A small MLP generator G(h)."""
    return ToyGenerator(cfg.latent_dim, parts.need("data", "generator").shape, cfg.width)


@attrs.frozen
class ThreeRolesConfig:
    penalty: float = option(0.1, "weight of the E² penalty of the energy's loss", non_negative)
    poison_role: Literal["energy", "encoder", "generator"] | None = option(
        None, "test hook: the role whose parameters turn NaN"
    )
    poison_step: int = option(0, "test hook: after the updates of this step (1-based)", non_negative)


class ThreeRoles(Estimator):
    """Energy, encoder and generator, each stepped by its own optimizer."""

    roles = ("energy", "encoder", "generator")
    precisions = ("fp32", "bf16", "fp16")

    def __init__(self, cfg: ThreeRolesConfig, parts: Parts):
        self.cfg = cfg
        self.energy, self.encoder = parts.need("model", "estimator"), parts.need("posterior", "estimator")
        self.generator = parts.need("generator", "estimator")
        self.trained = {
            role: parts.make_role(role, list(net.parameters()))
            for role, net in zip(self.roles, (self.energy, self.encoder, self.generator))
        }
        self.steps = 0

    def reconstruction(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """(‖G(h) − v‖² with h ~ q(h|v), KL(q(h|v) ‖ N(0, I)) by one sample), each (B,)."""
        h, log_q = self.encoder.rsample_and_log_prob(v, 1)
        log_prior = -0.5 * (h[0] ** 2).sum(-1) - 0.5 * h.shape[-1] * math.log(2 * math.pi)
        return ((self.generator(h[0]) - v) ** 2).flatten(1).sum(1), log_q[0] - log_prior

    def step(self, batch: Tensor) -> dict[str, Tensor]:
        recon, kl = self.reconstruction(batch)
        self.trained["encoder"].update((recon + kl).mean())
        z = torch.randn(len(batch), self.generator.latent_dim, dtype=batch.dtype, device=batch.device)
        recon, _ = self.reconstruction(batch)
        generator_loss = recon.mean() + self.energy.energy(self.generator(z)).mean()
        self.trained["generator"].update(generator_loss)
        real, fake = self.energy.energy(batch), self.energy.energy(self.generator(z).detach())
        loss = real.mean() - fake.mean() + self.cfg.penalty * (real**2 + fake**2).mean()
        self.trained["energy"].update(loss)
        self.steps += 1
        if self.cfg.poison_role is not None and self.steps == self.cfg.poison_step:
            with torch.no_grad():
                self.trained[self.cfg.poison_role].params[0].fill_(float("nan"))
        return {"loss": loss.detach(), "generator_loss": generator_loss.detach()}

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


def build_three_roles(cfg: ThreeRolesConfig, parts: Parts) -> ThreeRoles:
    """Toy estimator with the roles energy, encoder and generator."""
    return ThreeRoles(cfg, parts)


def build_generator_norm(cfg: WidthConfig, parts: Parts):
    """The norm of the generator's parameters (to see which weights evaluators get)."""

    @reporting(["norm"])
    def evaluate(parts: Parts) -> EvalResult:
        return EvalResult(
            scalars={"norm": float(torch.cat([p.detach().flatten() for p in parts.generator.parameters()]).norm())}
        )

    return evaluate


@hookimpl
def register_models(register):
    register("toy-energy", build_energy, WidthConfig)


@hookimpl
def register_generators(register):
    register("toy-generator", build_generator, GeneratorConfig)


@hookimpl
def register_estimators(register):
    register("toy-three-roles", build_three_roles, ThreeRolesConfig)


@hookimpl
def register_evaluators(register):
    register("generator-norm", build_generator_norm, WidthConfig)
