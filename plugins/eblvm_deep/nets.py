"""The deep energy networks of the BiSM paper (appendix B.2): a pre-activation residual conv
net f with mean-pool downsampling, and the squared-ELU head E = Σ ELU(Linear(·))²."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm


class ResidualBlock(nn.Module):
    """x + shortcut: ELU -> 3×3 conv (c_in -> c_in) -> ELU -> 3×3 conv (c_in -> c_out) [-> mean pool];
    the shortcut is a 1×1 conv after the same pooling. (B, c_in, H, W) -> (B, c_out, H', W')."""

    def __init__(self, c_in: int, c_out: int, down: bool):
        super().__init__()
        self.act = nn.ELU()
        self.conv1 = nn.Conv2d(c_in, c_in, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1)
        self.pool = nn.AvgPool2d(2) if down else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.pool(self.conv2(self.act(self.conv1(self.act(x)))))
        return out + self.shortcut(self.pool(x))


class ResNetFeatures(nn.Module):
    """f(v): a 3×3 conv to ``width`` channels, then ``stages`` stages of ``blocks`` residual blocks;
    the first block of each stage doubles the channels and halves the resolution. Returns the
    flattened features (B, width·2^stages · (H/2^stages)·(W/2^stages))."""

    def __init__(self, in_channels: int, width: int, stages: int, blocks: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(in_channels, width, 3, padding=1)]
        channels = width
        for _ in range(stages):
            layers.append(ResidualBlock(channels, 2 * channels, down=True))
            layers += [ResidualBlock(2 * channels, 2 * channels, down=False) for _ in range(blocks - 1)]
            channels *= 2
        self.net = nn.Sequential(*layers)
        self.out_channels, self.stages = channels, stages
        self.channels_last = False  # set with to_channels_last: inputs are then converted too

    def n_features(self, height: int, width: int) -> int:
        return self.out_channels * (height >> self.stages) * (width >> self.stages)

    def forward(self, v: Tensor) -> Tensor:
        if self.channels_last:
            v = v.contiguous(memory_format=torch.channels_last)
        return self.net(v).flatten(1)


class SquaredELU(nn.Module):
    """The scalar head Σ_k ELU(Linear(x))_k²: (B, n_in) -> (B,), non-negative."""

    def __init__(self, n_in: int, n_hidden: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_hidden)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.elu(self.linear(x)).square().sum(-1)


def to_channels_last(features: ResNetFeatures) -> ResNetFeatures:
    """Conv weights and the inputs in channels-last memory format (faster convolutions on GPUs)."""
    features.channels_last = True
    return features.to(memory_format=torch.channels_last)


def spectrally_normalise(module: nn.Module) -> nn.Module:
    """Put spectral normalisation (one power iteration per call) on every conv and linear layer."""
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Conv2d, nn.Linear)):
            setattr(module, name, spectral_norm(child))
        else:
            spectrally_normalise(child)
    return module
