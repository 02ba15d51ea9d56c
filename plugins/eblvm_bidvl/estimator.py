"""Bi-level doubly variational learning (BiDVL, Kan et al. 2022, Sec. 4 and Algorithm 1).

The decoupled EBLVM p(v, h) = p_ψ(v) q_ω1(h|v), p_ψ(v) ∝ exp(−E_ψ(v)), is learnt with a
variational joint p_ω2(v, h) = p(h) δ(v − G_ω2(h)), p(h) = N(0, I). Roles: ``energy`` (ψ, the
[model]), ``encoder`` (ω1, the [posterior]) and ``generator`` (ω2, the [generator]).

Lower level (Eq. 13, offset), N steps per upper step, per data batch v and fresh z ~ p(h):
    r'·[‖G(h) − v‖² + KL(q(h|v) ‖ p(h))], h ~ q(h|v)     (encoder and generator: the importance-
                                                        weighted VAE loss, D_r(v) of Eq. 11)
  + E_ψ(G(z))                                           (generator: its samples' energy)
  + λ·‖μ(G(z)) − z‖²                                     (generator: the latent reconstruction,
                                                        KL(p_ω2 ‖ q_ω1) up to q's variance)
Upper level (Eq. 14, offset): ψ on mean E_ψ(v) − mean E_ψ(G(z)) (samples held fixed); the
hinge form (Eq. 23) uses mean ReLU(1 + E_ψ(v)) + mean ReLU(1 − E_ψ(G(z))). Not offset (Eq. 11-12):
the latent reconstruction also trains the encoder in the lower level, and in the upper level the
encoder minimises KL(q(h|G(z)) ‖ p(h)) / m (the paper's Sec. 4.4 stand-in for −KL(p_ω2 ‖ q_ω1)).

Choices where the paper is silent, each an option: the squared error is summed over pixels and
the KL over latents, both averaged over the batch (the released code); λ defaults to 1/m (the
released code); the lower level runs first (Algorithm 1; the released code runs the upper
first); the best-response Jacobian is dropped and the levels alternate, as the paper does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol, cast

import attrs
import torch
from torch import Tensor, nn

from eblvm.plugin import ConfigError, Estimator, Parts, non_negative, option, positive
from eblvm_bidvl.nets import posterior_codes


def gaussian_kl(mu: Tensor, log_std: Tensor) -> Tensor:
    """KL(N(μ, diag σ²) ‖ N(0, I)) = ½ Σ_j (μ_j² + σ_j² − 1 − log σ_j²): (B, m) -> (B,)."""
    return 0.5 * (mu**2 + (2 * log_std).exp() - 1 - 2 * log_std).sum(-1)


def squared_error(x: Tensor, y: Tensor) -> Tensor:
    """‖x − y‖² per example: (B, ...) -> (B,)."""
    return (x - y).square().flatten(1).sum(1)


@attrs.frozen
class BiDVLConfig:
    lower_steps: int = option(1, "N: lower-level steps per upper step (the paper: 1)", positive)
    ratio: float = option(
        0.05, "r′, the basic importance ratio weighting the VAE loss (the paper: 0.05 at 32×32, 0.1 at 64×64)", positive
    )
    ratio_bias: Literal["none", "sigmoid"] = option(
        "none",
        "the bias term of r(v) (Sec. 5.4): none, or r′·sigmoid(mean E_ψ − E_ψ(v)) per data point (the paper's estimate)",
    )
    upper: Literal["offset", "not-offset", "hinge"] = option(
        "offset", "upper level: offset (Eq. 14), not-offset (Eq. 11-12) or hinge (Eq. 23, with the offset lower level)"
    )
    latent_weight: float | None = option(
        None, "λ of the latent reconstruction; None: 1/m (the released code)", non_negative
    )
    order: Literal["lower-first", "upper-first"] = option(
        "lower-first", "lower-first: Algorithm 1; upper-first: the released code"
    )
    shared_prior: bool = option(
        False,
        "the upper step and the lower steps of one update use the same z ~ p(h) (the released code); "
        "false: each draws its own",
    )


class VisibleEnergy(Protocol):
    """A fully visible energy E_ψ(v) (its model's latent is None): ``energy`` takes v alone."""

    def energy(self, v: Tensor, h: Tensor | None = None) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class GaussianEncoder(Protocol):
    """q(h|v) = N(μ(v), diag σ(v)²): ``params`` gives (μ, log σ), ``mean`` μ."""

    def params(self, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def mean(self, v: Tensor) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class BiDVL(Estimator):
    """BiDVL with the energy, the encoder and the generator each stepped by its own optimizer.

    bf16: tests/core/test_precision.py holds its gradients and losses near fp32's. Graph-safe: the
    same kernels on same-shaped tensors every step, no device value read on the host (spectral
    norm's power iteration and batch norm's statistics update their buffers in place).
    """

    roles = ("energy", "encoder", "generator")
    precisions = ("fp32", "bf16")
    graph_safe = True

    def __init__(
        self, cfg: BiDVLConfig, energy: VisibleEnergy, encoder: GaussianEncoder, generator: nn.Module, parts: Parts
    ):
        self.cfg, self.energy, self.encoder, self.generator = cfg, energy, encoder, generator
        self.m = cast(int, generator.latent_dim)
        self.latent_weight = cfg.latent_weight if cfg.latent_weight is not None else 1.0 / self.m
        self.energy_role = parts.make_role("energy", [p for p in energy.parameters() if p.requires_grad])
        self.encoder_role = parts.make_role("encoder", [p for p in encoder.parameters() if p.requires_grad])
        self.generator_role = parts.make_role("generator", [p for p in generator.parameters() if p.requires_grad])

    def prior(self, n: int, like: Tensor) -> Tensor:
        """z ~ p(h) = N(0, I): (n, m)."""
        return torch.randn(n, self.m, dtype=like.dtype, device=like.device)

    def weights(self, v: Tensor) -> Tensor:
        """r(v) per data point (B,): r′, times sigmoid(mean E − E(v)) with the bias term; no gradient."""
        if self.cfg.ratio_bias == "none":
            return torch.full((len(v),), self.cfg.ratio, dtype=v.dtype, device=v.device)
        with torch.no_grad():
            e = self.energy.energy(v)
            return self.cfg.ratio * torch.sigmoid(e.mean() - e)

    def vae_loss(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """Per data point r(v)·[‖G(h) − v‖² + KL(q(h|v) ‖ p(h))] with h ~ q(h|v) (B,), and the squared error (B,)."""
        mu, log_std = self.encoder.params(v)
        h = mu + log_std.exp() * torch.randn_like(mu)
        with posterior_codes(self.generator):  # batch norm's statistics of this path, if it keeps them apart
            error = squared_error(self.generator(h), v)
        return self.weights(v) * (error + gaussian_kl(mu, log_std)), error

    def latent_reconstruction(self, generated: Tensor, z: Tensor, through_encoder: bool) -> Tensor:
        """λ‖μ(x) − z‖² per sample (B,) for x = G(z) given as ``generated`` (B, C, H, W); the encoder's
        parameters get its gradient only if ``through_encoder``."""
        if through_encoder:
            return self.latent_weight * squared_error(self.encoder.mean(generated), z)
        frozen = [p for p in self.encoder.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            return self.latent_weight * squared_error(self.encoder.mean(generated), z)
        finally:
            for p in frozen:
                p.requires_grad_(True)

    def lower_step(self, v: Tensor, z: Tensor | None = None) -> dict[str, Tensor]:
        """One lower-level step: the encoder and the generator on Eq. 13 (Eq. 11 when not offset);
        ``z`` (B, m) ~ p(h) for the generator's terms, drawn here when None."""
        vae, error = self.vae_loss(v)
        z = self.prior(len(v), v) if z is None else z
        generated = self.generator(z)  # one pass for both terms: batch norm updates its statistics once, as released
        latent = self.latent_reconstruction(generated, z, through_encoder=self.cfg.upper == "not-offset")
        lower = vae.mean() + self.energy.energy(generated).mean() + latent.mean()
        params = self.encoder_role.params + self.generator_role.params
        grads = torch.autograd.grad(lower, params, allow_unused=True)
        for p, g in zip(params, grads):
            p.grad = torch.zeros_like(p) if g is None else g
        self.encoder_role.update()
        self.generator_role.update()
        return {
            "lower_loss": lower.detach(),
            "reconstruction": error.mean().detach(),
            "latent_reconstruction": latent.mean().detach(),
        }

    def upper_step(self, v: Tensor, z: Tensor | None = None) -> dict[str, Tensor]:
        """One upper-level step on E_ψ (and, not offset, on the encoder); ``z`` (B, m) ~ p(h) for
        the generated samples, drawn here when None."""
        z = self.prior(len(v), v) if z is None else z
        with torch.no_grad():
            generated = self.generator(z)
        e_data, e_gen = self.energy.energy(v), self.energy.energy(generated)
        if self.cfg.upper == "hinge":
            loss = torch.relu(1 + e_data).mean() + torch.relu(1 - e_gen).mean()
        else:
            loss = e_data.mean() - e_gen.mean()
        self.energy_role.update(loss)
        metrics = {
            "loss": loss.detach(),
            "energy_data": e_data.mean().detach(),
            "energy_generated": e_gen.mean().detach(),
        }
        if self.cfg.upper == "not-offset":
            mu, log_std = self.encoder.params(generated)
            kl = gaussian_kl(mu, log_std).mean() / self.m
            self.encoder_role.update(kl)
            metrics["upper_encoder_kl"] = kl.detach()
        return metrics

    def step(self, batch: Tensor) -> dict[str, Tensor]:
        """batch (B, C, H, W) in the data's range -> metrics; N lower steps and one upper step, in the configured order."""
        metrics: dict[str, Tensor] = {}
        z = self.prior(len(batch), batch) if self.cfg.shared_prior else None
        if self.cfg.order == "upper-first":
            metrics.update(self.upper_step(batch, z))
        for _ in range(self.cfg.lower_steps):
            metrics.update(self.lower_step(batch, z))
        if self.cfg.order == "lower-first":
            metrics.update(self.upper_step(batch, z))
        return metrics


def build_bidvl(cfg: BiDVLConfig, parts: Parts) -> BiDVL:
    """BiDVL: an energy E_ψ(v), a Gaussian encoder and a generator, trained at two levels (Algorithm 1, offset by default)."""
    energy = parts.need("model", "estimator")
    encoder = parts.need("posterior", "estimator")
    generator = parts.need("generator", "estimator")
    if energy.latent is not None:
        raise ConfigError(
            "model",
            "kind",
            "BiDVL's marginal energy E_ψ(v) is fully visible; the latent lives in the encoder and the generator",
        )
    if not hasattr(encoder, "params"):
        raise ConfigError(
            "posterior",
            "kind",
            "BiDVL needs a Gaussian encoder (gaussian, gaussian-conv, gaussian-conv3, gaussian-dcgan)",
        )
    m = getattr(generator, "latent_dim", None)
    if m is None or encoder.head.out_features // 2 != m:
        raise ConfigError(
            "generator",
            "latent_dim",
            f"the generator's latent_dim ({m}) must equal the encoder's ({encoder.head.out_features // 2})",
        )
    return BiDVL(cfg, cast(VisibleEnergy, energy), cast(GaussianEncoder, encoder), generator, parts)
