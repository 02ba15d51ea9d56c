"""BiDVL's networks (Kan et al. 2022, Sec. 5 and appendix B): a spectrally normalised conv energy
E_ψ(v) and a DCGAN-style generator G(h), and their SNGAN-style residual variants."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal, TypeVar, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

from eblvm.plugin import ConfigError, EnergyModel, Parts, option, positive


def square_side(parts: Parts, section: str) -> tuple[int, int]:
    """(channels, side) of square images whose side is a power of two ≥ 4; else a ConfigError."""
    shape = parts.need("data", section).image_shape
    if shape is None or shape[1] != shape[2] or shape[1] < 4 or shape[1] & (shape[1] - 1):
        raise ConfigError(
            section,
            "kind",
            f"needs square images with a power-of-two side ≥ 4; the data's examples are {parts.data.shape}",
        )
    return shape[0], shape[1]


def output_activation(name: str, x: Tensor) -> Tensor:
    return {"softplus": F.softplus, "identity": lambda t: t}[name](x)


Net = TypeVar("Net", bound=nn.Module)


def normal_init_(net: Net, std: float | None) -> Net:
    """Draw every conv and transposed-conv weight (the original of a spectrally normalised one)
    from N(0, std²), as BiDVL's released code does with std = 0.02; None keeps torch's default."""
    if std is None:
        return net
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            parametrized = cast("nn.ModuleDict | None", getattr(m, "parametrizations", None))
            weight = cast(Tensor, parametrized["weight"].original) if parametrized is not None else m.weight
            nn.init.normal_(weight, 0.0, std)
    return net


class ConvEnergy(EnergyModel):
    """E_ψ(v): pairs of spectrally normalised convs (3×3, then 4×4 stride 2), LeakyReLU 0.1, doubling
    the channels down to 4×4, a 3×3 conv, a 4×4 conv to 1×1, a 1×1 conv with LeakyReLU and one to
    a scalar (the released code has no activation between the 4×4 and the first 1×1 conv), then
    softplus (or none): v (B, C, H, W) -> (B,). Fully visible: F(v) = E(v)."""

    def __init__(self, channels: int, side: int, base: int, activation: str):
        super().__init__()
        layers: list[nn.Module] = []
        c_in, c = channels, base
        while side > 4:
            layers += [
                spectral_norm(nn.Conv2d(c_in, c, 3, 1, 1)),
                nn.LeakyReLU(0.1),
                spectral_norm(nn.Conv2d(c, c, 4, 2, 1)),
                nn.LeakyReLU(0.1),
            ]
            c_in, c, side = c, 2 * c, side // 2
        layers += [
            spectral_norm(nn.Conv2d(c_in, c, 3, 1, 1)),
            nn.LeakyReLU(0.1),
            spectral_norm(nn.Conv2d(c, c, 4, 1, 0)),
            spectral_norm(nn.Conv2d(c, c, 1)),
            nn.LeakyReLU(0.1),
            spectral_norm(nn.Conv2d(c, 1, 1)),
        ]
        self.net = nn.Sequential(*layers)
        self.activation = activation

    def energy(self, v: Tensor, h: Tensor | None = None) -> Tensor:
        return output_activation(self.activation, self.net(v).flatten(1).squeeze(1))

    def free_energy(self, v: Tensor) -> Tensor:
        return self.energy(v)


class DBlock(nn.Module):
    """SNGAN discriminator block: [ReLU] → SN 3×3 conv → ReLU → SN 3×3 conv → [avg pool], plus a
    (pooled) 1×1 SN shortcut; the first block of the net takes no leading ReLU."""

    def __init__(self, c_in: int, c_out: int, down: bool, first: bool = False):
        super().__init__()
        self.conv1, self.conv2 = (
            spectral_norm(nn.Conv2d(c_in, c_out, 3, 1, 1)),
            spectral_norm(nn.Conv2d(c_out, c_out, 3, 1, 1)),
        )
        self.shortcut = spectral_norm(nn.Conv2d(c_in, c_out, 1))
        self.down, self.first = down, first

    def forward(self, x: Tensor) -> Tensor:
        pool = (lambda t: F.avg_pool2d(t, 2)) if self.down else (lambda t: t)
        h = self.conv2(F.relu(self.conv1(x if self.first else F.relu(x))))
        skip = self.shortcut(pool(x)) if self.first else pool(self.shortcut(x))
        return pool(h) + skip


class ResNetEnergy(EnergyModel):
    """SNGAN-discriminator-style E_ψ(v): downsampling residual blocks until the side is ``down_to``
    (then two at that side), ReLU, sum over positions, an SN linear map to a scalar, softplus (or
    none)."""

    def __init__(self, channels: int, side: int, width: int, activation: str, down_to: int = 4):
        super().__init__()
        blocks, c_in, first = [], channels, True
        while side > down_to:
            blocks.append(DBlock(c_in, width, down=True, first=first))
            c_in, side, first = width, side // 2, False
        blocks += [DBlock(width, width, down=False), DBlock(width, width, down=False)]
        self.blocks = nn.Sequential(*blocks)
        self.linear = spectral_norm(nn.Linear(width, 1))
        self.activation = activation

    def energy(self, v: Tensor, h: Tensor | None = None) -> Tensor:
        return output_activation(self.activation, self.linear(F.relu(self.blocks(v)).sum((2, 3))).squeeze(1))

    def free_energy(self, v: Tensor) -> Tensor:
        return self.energy(v)


@attrs.frozen
class EnergyConfig:
    architecture: Literal["conv", "resnet"] = option(
        "conv", "conv: the paper's 8-layer SN conv net; resnet: SNGAN's discriminator"
    )
    base: int = option(
        64, "channels of the first conv (conv, doubled per stage) or of every block (resnet: 128)", positive
    )
    activation: Literal["softplus", "identity"] = option(
        "softplus", "applied to the net's output: softplus keeps E > 0 (the released code), identity leaves it free"
    )
    init_std: float | None = option(
        None, "conv weights drawn from N(0, init_std²) (the released code: 0.02); None: torch's default", positive
    )
    down_to: int = option(
        4,
        "resnet: the side at which the downsampling blocks stop and two more blocks follow "
        "(SNGAN's 32×32 discriminator and BiDVL's released ResNet code: 8)",
        positive,
    )


def build_energy(cfg: EnergyConfig, parts: Parts) -> EnergyModel:
    """BiDVL's marginal energy E_ψ(v) on images: a spectrally normalised conv net, or an SNGAN-style ResNet."""
    channels, side = square_side(parts, "model")
    if cfg.architecture == "conv":
        net: EnergyModel = ConvEnergy(channels, side, cfg.base, cfg.activation)
    else:
        if cfg.down_to >= side or cfg.down_to & (cfg.down_to - 1):
            raise ConfigError(
                "model", "down_to", f"must be a power of two below the image side {side}, not {cfg.down_to}"
            )
        net = ResNetEnergy(channels, side, cfg.base, cfg.activation, cfg.down_to)
    return normal_init_(net, cfg.init_std)


STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def batch_norms(net: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """Every batch norm module of ``net``, in module order."""
    return [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def keep_posterior_statistics(net: nn.Module) -> nn.Module:
    """Give every batch norm of ``net`` a second set of running statistics (buffers
    ``posterior_running_mean`` etc.), read and moved inside ``posterior_codes``. A state dict
    without them (a checkpoint from before) loads with both sets equal to its one set."""
    for m in batch_norms(net):
        for name in STATISTICS:
            m.register_buffer(f"posterior_{name}", getattr(m, name).clone())
        m.register_load_state_dict_pre_hook(_one_set_serves_both)
    return net


def _one_set_serves_both(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for name in STATISTICS:
        if prefix + name in state_dict and f"posterior_{name}" in module._buffers:
            state_dict.setdefault(f"{prefix}posterior_{name}", state_dict[prefix + name])


def _swap_statistics(norms: list[nn.modules.batchnorm._BatchNorm]) -> None:
    for m in norms:
        for name in STATISTICS:
            m._buffers[name], m._buffers[f"posterior_{name}"] = m._buffers[f"posterior_{name}"], m._buffers[name]


@contextlib.contextmanager
def posterior_codes(generator: nn.Module) -> Iterator[None]:
    """Within the block the generator's batch norm reads (eval mode) and moves (train mode) its
    statistics of codes h ~ q(h|v), not those of prior draws z ~ p(h); a no-op for a generator
    without a second set (``posterior_statistics = false``). The swap exchanges tensors, not
    values, so a CUDA graph captured through it replays onto the right buffers."""
    norms = [m for m in batch_norms(generator) if "posterior_running_mean" in m._buffers]
    _swap_statistics(norms)
    try:
        yield
    finally:
        _swap_statistics(norms)


class DCGANGenerator(nn.Module):
    """G(h): h (B, m) -> v (B, C, S, S): a 4×4 transposed conv from h, 4×4 stride-2 transposed convs
    halving the channels up to S, batch norm and ReLU between, a 3×3 one to C channels, then tanh,
    sigmoid or nothing (to match the data's value range)."""

    def __init__(self, latent_dim: int, channels: int, side: int, base: int, output: str):
        super().__init__()
        ups = side.bit_length() - 3  # stride-2 layers from 4×4 to side×side
        c = base * 2 ** max(ups, 1)
        layers: list[nn.Module] = [nn.ConvTranspose2d(latent_dim, c, 4, 1, 0, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        for i in range(ups):
            c_out = c if i == 0 else c // 2
            layers += [nn.ConvTranspose2d(c, c_out, 4, 2, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
            c = c_out
        layers.append(nn.ConvTranspose2d(c, channels, 3, 1, 1))
        self.net = nn.Sequential(*layers)
        self.latent_dim, self.output = latent_dim, output

    def forward(self, h: Tensor) -> Tensor:
        x = self.net(h.view(len(h), -1, 1, 1))
        return {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "identity": lambda t: t}[self.output](x)


class GBlock(nn.Module):
    """SNGAN generator block: BN → ReLU → ×2 upsample → 3×3 conv → BN → ReLU → 3×3 conv, plus an upsampled 1×1 shortcut."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(c_in), nn.BatchNorm2d(c_out)
        self.conv1, self.conv2 = nn.Conv2d(c_in, c_out, 3, 1, 1), nn.Conv2d(c_out, c_out, 3, 1, 1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: Tensor) -> Tensor:
        up = F.interpolate(F.relu(self.bn1(x)), scale_factor=2)
        return self.conv2(F.relu(self.bn2(self.conv1(up)))) + self.shortcut(F.interpolate(x, scale_factor=2))


class ResNetGenerator(nn.Module):
    """SNGAN-style G(h): a linear map to 4×4 features, upsampling residual blocks to S×S, BN, ReLU, a 3×3 conv, tanh/sigmoid."""

    def __init__(self, latent_dim: int, channels: int, side: int, width: int, output: str):
        super().__init__()
        self.linear = nn.Linear(latent_dim, 16 * width)
        self.blocks = nn.Sequential(*[GBlock(width, width) for _ in range(side.bit_length() - 3)])
        self.out = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, channels, 3, 1, 1))
        self.latent_dim, self.width, self.output = latent_dim, width, output

    def forward(self, h: Tensor) -> Tensor:
        x = self.out(self.blocks(self.linear(h).view(len(h), self.width, 4, 4)))
        return {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "identity": lambda t: t}[self.output](x)


@attrs.frozen
class GeneratorConfig:
    latent_dim: int = option(100, "dimension of h (the paper: 100)", positive)
    architecture: Literal["dcgan", "resnet"] = option(
        "dcgan", "dcgan: the paper's transposed-conv generator; resnet: SNGAN's"
    )
    base: int = option(
        48,
        "channels at the last stage (dcgan, doubled towards h; the released code: 48) or of every block (resnet: 256)",
        positive,
    )
    output: Literal["auto", "tanh", "sigmoid", "identity"] = option(
        "auto", "output activation; auto: tanh for data in [−1, 1], sigmoid for [0, 1]"
    )
    init_std: float | None = option(
        None, "conv weights drawn from N(0, init_std²) (the released code: 0.02); None: torch's default", positive
    )
    posterior_statistics: bool = option(
        True,
        "batch norm keeps a second set of running statistics for codes h ~ q(h|v) (the reconstruction "
        "path), apart from those of prior draws z ~ p(h) (the sampling path); false: one set for both, "
        "as the released code (training is the same either way)",
    )


def build_generator(cfg: GeneratorConfig, parts: Parts) -> nn.Module:
    """BiDVL's generator G(h), DCGAN-style or SNGAN-ResNet-style, with p(h) = N(0, I)."""
    channels, side = square_side(parts, "generator")
    output = cfg.output
    if output == "auto":
        low = parts.data.bounds[0][0] if parts.data.bounds else 0.0
        output = "tanh" if low < 0 else "sigmoid"
    cls = DCGANGenerator if cfg.architecture == "dcgan" else ResNetGenerator
    net = normal_init_(cls(cfg.latent_dim, channels, side, cfg.base, output), cfg.init_std)
    return keep_posterior_statistics(net) if cfg.posterior_statistics else net
