"""Annealed Langevin dynamics for deep energies (MDSM, Li et al. 2019; BiSM appendix B.2).

Each step moves x ← x − ½ε²∇E(x) + √T·ε·ξ with step ε and temperature T (stationary density
∝ exp(−E/T) as ε → 0); the temperatures run ``hot_steps`` at T_max, ``anneal_steps`` falling
geometrically from T_max towards 1, then ``cool_steps`` falling linearly from 1 to 0; a final
denoising step x ← x − σ₀²∇E(x) (Tweedie's formula at the training noise σ₀) ends the chain.

Modes: ``marginal`` samples v from a fully visible energy; ``joint`` samples (v, h) of an EBLVM
together and returns v; ``via-q`` fixes h at the posterior mean E_q[h | v] of random training
images and samples v from p(v | h) (the papers' default for EBLVMs: its FIDs are conditioned on
training images, say so when reporting them).
"""

from __future__ import annotations

import math
import sys
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, DataSplits, EnergyModel, Parts, Posterior, Sampler, non_negative, option, positive
from eblvm.tools import evaluation_mode


def temperatures(t_max: float, hot: int, anneal: int, cool: int) -> list[float]:
    """T_max for ``hot`` steps, then T_max·(1/T_max)^(i/anneal) for i < anneal, then 1 − i/cool for i < cool."""
    geometric = [t_max * math.exp(-i * math.log(t_max) / anneal) for i in range(anneal)]
    linear = [1.0 - i / cool for i in range(cool)]
    return [t_max] * hot + geometric + linear


@attrs.frozen
class LangevinConfig:
    mode: Literal["auto", "marginal", "joint", "via-q"] = option(
        "auto",
        "marginal (fully visible E), joint (v and h), via-q (h = E_q[h|v] of training images); auto: marginal or via-q",
    )
    step: float = option(0.02, "ε: the update is −½ε²∇E + √T·ε·ξ", positive)
    t_max: float = option(100.0, "starting temperature", positive)
    hot_steps: int = option(500, "steps at t_max", non_negative)
    anneal_steps: int = option(2000, "steps with the temperature falling geometrically from t_max to 1", non_negative)
    cool_steps: int = option(200, "steps with the temperature falling linearly from 1 to 0", non_negative)
    sigma0: float | None = option(0.1, "σ₀ of the final denoising step v − σ₀²∇E(v); None skips it", positive)
    init_mean: float = option(0.5, "chains start at init_mean + init_std·N(0, I)")
    init_std: float = option(1.0, "spread of the starting points", non_negative)
    batch_size: int = option(500, "chains run together on the device", positive)
    snapshots: int = option(
        0, "states kept along the chain (evenly spaced) for a trajectory image; 0 keeps none", non_negative
    )


class AnnealedLangevin(Sampler):
    """Annealed Langevin sampling of v (and h in ``joint`` mode); the last trajectory's snapshots
    (k, n, *event_shape) are kept in ``trajectory`` when ``snapshots`` > 0."""

    def __init__(self, cfg: LangevinConfig, data: DataSplits | None, posterior: Posterior | None):
        self.cfg, self.data, self.posterior = cfg, data, posterior
        self.temps = temperatures(cfg.t_max, cfg.hot_steps, cfg.anneal_steps, cfg.cool_steps)
        self.trajectory: Tensor | None = None

    def mode(self, model: EnergyModel) -> str:
        if self.cfg.mode != "auto":
            return self.cfg.mode
        return "marginal" if model.latent is None else "via-q"

    def sample(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n samples (n, *event_shape), in chunks of ``batch_size`` chains."""
        chunks = [
            self._chunk(model, min(self.cfg.batch_size, n - i), generator) for i in range(0, n, self.cfg.batch_size)
        ]
        if self.cfg.snapshots:
            self.trajectory = torch.cat([t for _, t in chunks if t is not None], dim=1)
        return torch.cat([s for s, _ in chunks])

    def _chunk(self, model: EnergyModel, n: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        cfg, mode, data = self.cfg, self.mode(model), self.data
        if data is None:
            raise ValueError("annealed Langevin draws chains shaped like the data: it is built with them")
        param = next(model.parameters())
        shape = data.shape

        def noise(*size: int) -> Tensor:
            return torch.randn(size, generator=generator, dtype=param.dtype, device=param.device)

        v = cfg.init_mean + cfg.init_std * noise(n, *shape)
        h_fixed, h = None, None
        if mode == "via-q":
            if self.posterior is None:
                raise ValueError("mode = 'via-q' draws h from the posterior: the recipe needs a [posterior]")
            idx = torch.randint(data.size("train"), (n,), generator=generator, device=param.device)
            with torch.no_grad():
                h_fixed = self.posterior.mean(data.take("train", idx).to(param))
        elif mode == "joint":
            if model.latent is None:
                raise ValueError("mode = 'joint' moves h too: the model needs continuous latents")
            h = cfg.init_mean + cfg.init_std * noise(n, model.latent.dim)

        def energy(v: Tensor, h_moving: Tensor | None) -> Tensor:
            latent = h_fixed if h_fixed is not None else h_moving
            return model.energy(v, latent if latent is not None else v.new_zeros(len(v), 0))

        keep = (
            set(torch.linspace(0, len(self.temps) - 1, cfg.snapshots).round().long().tolist())
            if cfg.snapshots
            else set()
        )
        snapshots = []
        eps = cfg.step
        with evaluation_mode([model]), torch.enable_grad():
            for i, t in enumerate(self._progress(self.temps)):
                inputs = [v.requires_grad_(True)] + ([h.requires_grad_(True)] if h is not None else [])
                grads = torch.autograd.grad(energy(inputs[0], h).sum(), inputs)
                scale = math.sqrt(t) * eps
                v = (v - 0.5 * eps**2 * grads[0] + scale * noise(*v.shape)).detach()
                if h is not None:
                    h = (h - 0.5 * eps**2 * grads[1] + scale * noise(*h.shape)).detach()
                if i in keep:
                    snapshots.append(v.cpu())
            if cfg.sigma0 is not None:
                v = v.requires_grad_(True)
                (grad,) = torch.autograd.grad(energy(v, h).sum(), v)
                v = (v - cfg.sigma0**2 * grad).detach()
        return v, (torch.stack(snapshots) if snapshots else None)

    @staticmethod
    def _progress(temps: list[float]):
        if not sys.stderr.isatty():
            return temps
        from tqdm import tqdm

        return tqdm(temps, desc="annealed Langevin", leave=False, file=sys.stderr)


def build_langevin(cfg: LangevinConfig, parts: Parts) -> AnnealedLangevin:
    """Annealed Langevin dynamics (T 100 → 1 → 0, step 0.02, denoising at σ₀), marginal, joint or via q."""
    data = parts.need("data", "sampler")
    model = parts.model
    mode = cfg.mode
    if model is not None and mode == "auto":
        mode = "marginal" if model.latent is None else "via-q"
    if model is not None:
        if mode == "marginal" and model.latent is not None:
            raise ConfigError(
                "sampler", "mode", "marginal sampling needs a fully visible energy; use joint or via-q for an EBLVM"
            )
        if mode in ("joint", "via-q") and (model.latent is None or model.latent.kind != "gaussian"):
            raise ConfigError("sampler", "mode", f"{mode} sampling needs an EBLVM with continuous (gaussian) h")
    if mode == "via-q" and parts.posterior is None:
        raise ConfigError("sampler", "mode", "via-q sampling needs a [posterior] for E_q[h | v]")
    return AnnealedLangevin(cfg, data, parts.posterior)
