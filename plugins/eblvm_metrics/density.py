"""The density plot of 2-D models: model density beside a histogram of the data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, EvalResult, Parts, non_negative, option, positive, reporting
from eblvm.tools import render
from eblvm_metrics.figures import densities


@attrs.frozen
class DensityPlotConfig:
    grid: int = option(
        200,
        "grid points per axis for the model density (a pixel each; small grids are upscaled to ~200 pixels)",
        positive,
    )
    bins: int = option(50, "histogram bins per axis for the data panel", positive)
    split: Literal["test", "train", "val"] = option("test", "data split drawn in the histogram")
    chunk: int = option(10000, "grid points per free-energy evaluation", positive)
    margin: float = option(
        0.1,
        "view beyond the data's bounds on each side, as a fraction of their width (the bounds are a red box)",
        non_negative,
    )


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
    """Model density exp(−F) normalised on a grid, beside a histogram of the data (2-D only); for a
    model with log Z, also its mass inside the data's bounds (grid_mass).
    """
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

    k = round(cfg.margin * cfg.grid)  # grid cells beyond the bounds on each side
    cells = [(hi - lo) / cfg.grid for lo, hi in data.bounds]
    (x_lo, x_hi), (y_lo, y_hi) = data.bounds
    view = ((x_lo - k * cells[0], x_hi + k * cells[0]), (y_lo - k * cells[1], y_hi + k * cells[1]))
    n = cfg.grid + 2 * k
    bins = round(cfg.bins * n / cfg.grid)  # histogram bins of the same width as over the bounds

    @reporting(["grid_mass"] if callable(getattr(model, "log_partition", None)) else [])
    def evaluate(parts: Parts) -> EvalResult:
        """{"density": (3, H, W)}: the model density exp(−F) normalised on the grid beside a histogram
        of the data, on one colour scale from 0 to the model's highest density (bar at the right;
        data above it in the top colour), axes in data units, the data's bounds as a red box; when
        the model has log Z, {"grid_mass"}: its mass inside the bounds."""
        model, data = parts.model, parts.data
        with torch.no_grad():
            points, area = grid_centres(view, n, data.tensor("train", 1))
            log_p = torch.cat([-model.free_energy(chunk) for chunk in points.split(cfg.chunk)])
            scalars = {}
            if callable(getattr(model, "log_partition", None)):
                try:
                    log_z = model.log_partition()
                except ValueError:  # too many hidden units to enumerate: no mass reported
                    pass
                else:
                    inside = (log_p - log_z).exp().reshape(n, n)[k : k + cfg.grid, k : k + cfg.grid]
                    scalars["grid_mass"] = float(inside.sum() * area)
            density = torch.softmax(log_p, 0).reshape(n, n) / area
            hist = histogram(data.tensor(cfg.split), view, bins, n)
            high = max(float(density.max()), torch.finfo(density.dtype).tiny)  # data above it: the top colour
            figure = densities(
                [("model density", density), (f"data ({cfg.split})", hist)], view, data.bounds, high, "density"
            )
        return EvalResult(scalars=scalars, images={"density": render(figure)})

    return evaluate
