"""What the gradient-based samplers move: flat points x (C, D), one row per chain, whose potential
U(x) is the model's free energy F(v) (``marginal``: h summed out, or a fully visible model's
E(v)), or its joint energy E(v, h) with x = (v, h) (``joint``: continuous h)."""

from __future__ import annotations

import math
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, DataSplits, EnergyModel

TargetKind = Literal["auto", "marginal", "joint"]


def target_kind(requested: TargetKind, model: EnergyModel, section: str = "sampler") -> str:
    """``marginal`` or ``joint`` for this model (``auto``: marginal where h can be summed out or
    there is none, else joint); a ConfigError naming ``[section] target`` where it cannot be done."""
    marginal_ok = model.latent is None or model.has_free_energy
    joint_ok = model.latent is not None and model.latent.kind == "gaussian"
    kind = requested if requested != "auto" else ("marginal" if marginal_ok else "joint")
    if kind == "marginal" and not marginal_ok:
        raise ConfigError(
            section, "target", f"{type(model).__name__} has latent h and no free energy: use target = 'joint'"
        )
    if kind == "joint" and not joint_ok:
        raise ConfigError(
            section,
            "target",
            f"joint sampling moves h by its gradient: it needs continuous (gaussian) h, "
            f"{type(model).__name__} has {'none' if model.latent is None else model.latent.kind + ' h'}",
        )
    return kind


@attrs.frozen
class Target:
    """The potential of ``model`` over flat points x = v (``marginal``) or x = (v, h) (``joint``),
    v of shape ``event_shape``."""

    model: EnergyModel
    kind: str
    event_shape: tuple[int, ...]

    @property
    def visible_dim(self) -> int:
        return math.prod(self.event_shape)

    @property
    def latent_dim(self) -> int:
        """The size of the h part of a point: m for joint (v, h), else 0."""
        latent = self.model.latent
        return latent.dim if self.kind == "joint" and latent is not None else 0

    @property
    def dim(self) -> int:
        """D, the size of a point: d, or d + m for joint (v, h)."""
        return self.visible_dim + self.latent_dim

    def visible(self, x: Tensor) -> Tensor:
        """The v part of points x (..., D): (..., *event_shape)."""
        return x[..., : self.visible_dim].reshape(*x.shape[:-1], *self.event_shape)

    def energy(self, x: Tensor) -> Tensor:
        """U(x): F(v), E(v) of a fully visible model, or E(v, h); x (C, D) -> (C,)."""
        v = self.visible(x)
        if self.kind == "joint":
            return self.model.energy(v, x[:, self.visible_dim :])
        if self.model.latent is None:
            return self.model.energy(v, x.new_zeros(len(x), 0))
        return self.model.free_energy(v)


def starting_points(
    init: str, n: int, target: Target, data: DataSplits, like: Tensor, generator: torch.Generator | None
) -> Tensor:
    """n starting points (n, D): v at random training points (``data``) or Gaussian noise with the
    training data's per-dimension mean and std (``noise``); h (joint) standard normal."""
    train = data.tensor("train").reshape(data.size("train"), -1).to(like)
    if init == "data":
        v = train[torch.randint(len(train), (n,), generator=generator, device=like.device)]
    else:
        noise = torch.randn(n, target.visible_dim, generator=generator, dtype=like.dtype, device=like.device)
        v = train.mean(0) + train.std(0) * noise
    h = torch.randn(n, target.latent_dim, generator=generator, dtype=like.dtype, device=like.device)
    return torch.cat([v, h], dim=1)
