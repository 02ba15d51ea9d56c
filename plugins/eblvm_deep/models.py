"""Deep energy models on images (BiSM Sec. 5.2, appendix B.2).

- ``resnet-eblvm``: E(v, h) = Σ_k ELU(Linear([f(v) + h, h]))_k² with f = Linear ∘ ResNet: an
  additive coupling of the features and a Gaussian latent h (the papers' deep EBLVM).
- ``resnet-ebm``: the fully visible E(v) = Σ_k ELU(Linear(ResNet(v)))_k², the MDSM baseline;
  its free energy is its energy, which unlocks the exact-score path.

Presets follow the papers' sizes: MNIST padded to 32×32: 3 stages of 2 blocks, width 64
(the released code's ResidualNet6); CIFAR-10 and CelebA at 32×32: 3 stages of 3 blocks,
width 128, channels up to 1024 (ResidualNet9); the head's width is 4·width·(H/8)·(W/8).
"""

from __future__ import annotations

from typing import Literal, TypeVar

import attrs
import torch
from torch import Tensor, nn

from eblvm.plugin import Conditioned, ConfigError, EnergyModel, LatentSpec, Parts, option, positive
from eblvm_deep.nets import ResNetFeatures, SquaredELU, spectrally_normalise, to_channels_last

PRESETS = {"mnist": (64, 2), "cifar10": (128, 3), "celeba": (128, 3)}  # width, blocks per stage


@attrs.frozen
class ResNetConfig:
    preset: Literal["mnist", "cifar10", "celeba", "custom"] = option(
        "custom",
        "the papers' sizes: mnist (width 64, 2 blocks per stage), cifar10 / celeba (width 128, 3 blocks); custom uses width and blocks",
    )
    width: int = option(
        32, "channels after the first conv (doubled at each of the 3 stages); custom preset only", positive
    )
    blocks: int = option(2, "residual blocks per stage; custom preset only", positive)
    stages: int = option(3, "downsampling stages (each halves H and W)", positive)
    head_width: int | None = option(
        None, "hidden width of the squared-ELU head; None: 4·width·(H/2^stages)·(W/2^stages)", positive
    )
    spectral_norm: bool = option(False, "spectral normalisation on every conv and linear layer")
    channels_last: bool = option(False, "keep conv weights (and so activations) channels-last: faster on recent GPUs")


@attrs.frozen
class ResNetEBLVMConfig(ResNetConfig):
    latent_dim: int = option(50, "dimension of the Gaussian latent h (the papers: 20, 50 or 100)", positive)


def _features(cfg: ResNetConfig, parts: Parts, section: str) -> tuple[ResNetFeatures, int, int]:
    """The feature net for the data's images, its feature count and the head's width."""
    shape = parts.need("data", section).image_shape
    if shape is None:
        raise ConfigError(
            section, "kind", f"a conv energy needs image data (C, H, W); the data's examples are {parts.data.shape}"
        )
    c, h, w = shape
    if h % (1 << cfg.stages) or w % (1 << cfg.stages):
        raise ConfigError(
            section,
            "stages",
            f"{cfg.stages} stages halve {h}×{w} images {cfg.stages} times: pad or resize to a multiple of {1 << cfg.stages}",
        )
    width, blocks = PRESETS.get(cfg.preset, (cfg.width, cfg.blocks))
    features = ResNetFeatures(c, width, cfg.stages, blocks)
    n = features.n_features(h, w)
    head = cfg.head_width or 4 * width * (h >> cfg.stages) * (w >> cfg.stages)
    return features, n, head


Deep = TypeVar("Deep", "ResNetEBLVM", "ResNetEBM")


def _finish(model: Deep, cfg: ResNetConfig) -> Deep:
    if cfg.spectral_norm:
        spectrally_normalise(model)
    if cfg.channels_last:
        to_channels_last(model.features)
    return model


class ResNetEBLVM(EnergyModel):
    """E(v, h) = Σ_k ELU(W₂[f(v) + h, h] + b₂)_k², f(v) = W₁ ResNet(v) + b₁ (B, m):
    v (B, C, H, W), h (B, m) -> (B,), E ≥ 0.

    It conditions on v (``condition``): f(v), the ResNet and W₁, is computed once per batch
    and only the head is evaluated for each h.
    """

    def __init__(self, features: ResNetFeatures, n_features: int, latent_dim: int, head_width: int):
        super().__init__()
        self.latent = LatentSpec("gaussian", latent_dim)
        self.features: ResNetFeatures = features
        self.to_latent = nn.Linear(n_features, latent_dim)
        self.head = SquaredELU(2 * latent_dim, head_width)

    def encode(self, v: Tensor) -> Tensor:
        """f(v) = W₁ ResNet(v) + b₁: v (B, C, H, W) -> (B, m), the expensive part of E."""
        return self.to_latent(self.features(v))

    def couple(self, f: Tensor, h: Tensor) -> Tensor:
        """Σ_k ELU(W₂[f + h, h] + b₂)_k²: f (B, m), h (..., B, m) -> (..., B), the cheap head."""
        return self.head(torch.cat([f + h, h], dim=-1))

    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        return self.couple(self.encode(v), h)

    def condition(self, v: Tensor) -> Conditioned:
        """h ↦ E(v, h) with f(v) computed here, once (with the graph autograd records here)."""
        return Conditioned(self, v, self.encode(v), self.couple)


class ResNetEBM(EnergyModel):
    """E(v) = Σ_k ELU(W ResNet(v) + b)_k²: v (B, C, H, W) -> (B,); fully visible, F(v) = E(v)."""

    def __init__(self, features: ResNetFeatures, n_features: int, head_width: int):
        super().__init__()
        self.features: ResNetFeatures = features
        self.head = SquaredELU(n_features, head_width)

    def energy(self, v: Tensor, h: Tensor | None = None) -> Tensor:
        return self.head(self.features(v))

    def free_energy(self, v: Tensor) -> Tensor:
        return self.energy(v)


def build_resnet_eblvm(cfg: ResNetEBLVMConfig, parts: Parts) -> ResNetEBLVM:
    """The papers' deep EBLVM: ResNet features additively coupled with a Gaussian h, squared-ELU head."""
    features, n, head = _features(cfg, parts, "model")
    return _finish(ResNetEBLVM(features, n, cfg.latent_dim, head), cfg)


def build_resnet_ebm(cfg: ResNetConfig, parts: Parts) -> ResNetEBM:
    """The fully visible deep EBM of MDSM: ResNet features and a squared-ELU head."""
    features, n, head = _features(cfg, parts, "model")
    return _finish(ResNetEBM(features, n, head), cfg)
