"""The density plot of 2-D models: model density beside a histogram of the data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm_core.config import option, positive
from eblvm_core.contracts import EvalResult, Parts, reporting
from eblvm_core.errors import ConfigError

# anchor colours of a viridis-like map, from low (dark purple) to high (yellow)
ANCHORS = (
    (0.267, 0.005, 0.329),
    (0.231, 0.322, 0.545),
    (0.129, 0.569, 0.549),
    (0.369, 0.788, 0.384),
    (0.993, 0.906, 0.144),
)
GAP = 4  # white pixels between the two panels


@attrs.frozen
class DensityPlotConfig:
    grid: int = option(200, "grid points per axis for the model density (and the image's side in pixels)", positive)
    bins: int = option(50, "histogram bins per axis for the data panel", positive)
    split: Literal["test", "train", "val"] = option("test", "data split drawn in the histogram")
    chunk: int = option(10000, "grid points per free-energy evaluation", positive)


def colormap(values: Tensor) -> Tensor:
    """Values (H, W) in [0, 1] -> RGB (3, H, W) in [0, 1], linear between the anchor colours."""
    anchors = torch.tensor(ANCHORS, dtype=values.dtype, device=values.device)  # (K, 3)
    pos = values.clamp(0, 1) * (len(anchors) - 1)
    low = pos.floor().long().clamp(max=len(anchors) - 2)
    frac = (pos - low).unsqueeze(-1)
    rgb = anchors[low] * (1 - frac) + anchors[low + 1] * frac  # (H, W, 3)
    return rgb.permute(2, 0, 1)


def to_image(density: Tensor) -> Tensor:
    """A density on the grid (n_x, n_y), x along dim 0 -> (3, n_y, n_x), y increasing upwards."""
    scaled = density / density.max().clamp_min(torch.finfo(density.dtype).tiny)
    return colormap(scaled.T.flip(0))


def grid_centres(bounds: tuple[tuple[float, float], ...], n: int, like: Tensor) -> tuple[Tensor, float]:
    """Midpoints of an n × n grid over the box: (n * n, 2) in x-major order, and the cell area."""
    axes = [torch.linspace(lo, hi, n + 1, dtype=like.dtype, device=like.device) for lo, hi in bounds]
    mids = [(a[1:] + a[:-1]) / 2 for a in axes]
    xx, yy = torch.meshgrid(*mids, indexing="ij")
    area = (bounds[0][1] - bounds[0][0]) * (bounds[1][1] - bounds[1][0]) / n**2
    return torch.stack([xx.reshape(-1), yy.reshape(-1)], -1), area


def histogram(points: Tensor, bounds: tuple[tuple[float, float], ...], bins: int, n: int) -> Tensor:
    """Empirical density of points (N, 2) in ``bins``² cells, sampled at the n × n pixel centres."""
    low = torch.tensor([b[0] for b in bounds], dtype=points.dtype, device=points.device)
    width = torch.tensor([b[1] - b[0] for b in bounds], dtype=points.dtype, device=points.device)
    idx = ((points - low) / width * bins).floor().long()
    inside = ((idx >= 0) & (idx < bins)).all(-1)
    flat = idx[inside, 0] * bins + idx[inside, 1]
    counts = torch.bincount(flat, minlength=bins * bins).reshape(bins, bins).to(points.dtype)
    density = counts / (len(points) * (width.prod() / bins**2))
    pixel_bin = ((torch.arange(n, device=points.device) + 0.5) * bins / n).long()
    return density[pixel_bin][:, pixel_bin]


def build_density_plot(cfg: DensityPlotConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Model density exp(−F) normalised on a grid, beside a histogram of the data (2-D only)."""
    model = parts.need("model", "")
    data = parts.need("data", "")
    if not model.has_free_energy:
        raise ConfigError(
            "", "kind", f"density-plot needs a model with a free energy F(v); {type(model).__name__} has none"
        )
    if data.dim != 2 or data.bounds is None:
        raise ConfigError(
            "",
            "kind",
            f"density-plot draws 2-D data with known bounds; this dataset has d={data.dim}"
            + ("" if data.bounds else " and no bounds"),
        )
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")

    @reporting(["grid_mass"] if callable(getattr(model, "log_partition", None)) else [])
    def evaluate(parts: Parts) -> EvalResult:
        """{"density": (3, grid, 2·grid + gap)} and, when the model has log Z, {"grid_mass"}."""
        model, data = parts.model, parts.data
        with torch.no_grad():
            points, area = grid_centres(data.bounds, cfg.grid, data.tensor("train", 1))
            log_p = torch.cat([-model.free_energy(chunk) for chunk in points.split(cfg.chunk)])
            scalars = {}
            if callable(getattr(model, "log_partition", None)):
                try:
                    log_z = model.log_partition()
                except ValueError:  # too many hidden units to enumerate: no mass reported
                    pass
                else:
                    scalars["grid_mass"] = float((log_p - log_z).exp().sum() * area)
            density = torch.softmax(log_p, 0).reshape(cfg.grid, cfg.grid) / area
            hist = histogram(data.tensor(cfg.split), data.bounds, cfg.bins, cfg.grid)
            gap = torch.ones(3, cfg.grid, GAP, dtype=density.dtype, device=density.device)
            image = torch.cat([to_image(density), gap, to_image(hist)], -1)
        return EvalResult(scalars=scalars, images={"density": image.float().cpu()})

    return evaluate
