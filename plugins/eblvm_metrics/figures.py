"""The metrics plugin's figures: 2-D densities side by side on one colour scale, and 2-D
embeddings coloured by class (drawn with eblvm.tools' canvas, off-screen)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import Tensor

from eblvm.tools import axes_at, bounds_box, figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Box = tuple[tuple[float, float], tuple[float, float]]  # a view in data units: ((x_lo, x_hi), (y_lo, y_hi))
Rect = tuple[int, int, int, int]  # pixels of a rendered figure: (left, top, width, height), rows from the top
MIN_PANEL = 200  # pixels on the side of a density panel: small grids are upscaled to at least this
# the density figure's margins in pixels: tick labels and axis label on the left and below, titles
# above, between the panels, and the colour bar with its tick labels and label
LEFT, TOP, BOTTOM, GAP, BAR_GAP, BAR, BAR_RIGHT = 64, 34, 52, 24, 18, 16, 78


def density_layout(n_panels: int, n: int) -> tuple[list[Rect], Rect, tuple[int, int]]:
    """Where ``densities`` puts ``n_panels`` square panels of n × n grid cells: their pixel
    rectangles (each cell a square of side // n pixels, side ≥ MIN_PANEL), the colour bar's, and
    the figure's (width, height)."""
    side = n * max(1, math.ceil(MIN_PANEL / n))
    panels = [(LEFT + i * (side + GAP), TOP, side, side) for i in range(n_panels)]
    bar = (LEFT + n_panels * side + (n_panels - 1) * GAP + BAR_GAP, TOP, BAR, side)
    return panels, bar, (bar[0] + BAR + BAR_RIGHT, TOP + side + BOTTOM)


def densities(
    panels: list[tuple[str, Tensor]],
    view: Box,
    bounds: Box | None = None,
    high: float = 1.0,
    label: str = "density",
) -> Figure:
    """Titled densities on an n × n grid over ``view`` (each (n_x, n_y), x along dim 0) side by side
    on one colour scale (viridis) from 0 to ``high`` (above: the top colour, and a triangle atop
    the colour bar), cell by cell, with axes in data units (y upwards), the data's ``bounds`` as a
    red box, and a colour bar named ``label``; laid out by ``density_layout``. Returns the Figure."""
    rects, bar, size = density_layout(len(panels), panels[0][1].shape[0])
    fig = figure(*size)
    (x0, x1), (y0, y1) = view
    image = None
    for i, ((title, values), rect) in enumerate(zip(panels, rects)):
        ax = axes_at(fig, rect)
        image = ax.imshow(
            values.detach().T.float().cpu().numpy(),
            origin="lower",
            extent=(x0, x1, y0, y1),
            cmap="viridis",
            vmin=0.0,
            vmax=high,
            interpolation="nearest",
            aspect="auto",
        )
        ax.set_title(title)
        ax.set_xlabel("v₁")
        if i == 0:
            ax.set_ylabel("v₂")
        else:
            ax.tick_params(labelleft=False)
        if bounds is not None:
            bounds_box(ax, bounds)
    above = any(float(values.max()) > high for _, values in panels)
    assert image is not None, "a density figure has at least one panel"
    fig.colorbar(image, cax=axes_at(fig, bar), label=label, extend="max" if above else "neither")
    return fig


def embedding(points: Tensor, labels: Tensor, title: str, axis_name: str, size: int = 480) -> Figure:
    """2-D points (n, 2) coloured by their class ``labels`` (n,), with axes "<axis_name> 1/2", a title
    and a legend of the classes (a colour bar beyond 20 classes). Returns the Figure (``size``
    pixels high)."""
    import matplotlib

    points, labels = points.detach().float().cpu(), labels.detach().cpu()
    classes = sorted(int(c) for c in labels.unique())
    fig = figure(size + 120, size, layout="constrained")
    ax = fig.add_subplot()
    dot = 12 if len(points) <= 2000 else 4
    if len(classes) <= 20:
        colours = matplotlib.colormaps["tab10" if len(classes) <= 10 else "tab20"]
        for i, c in enumerate(classes):
            chosen = points[labels == c].numpy()
            ax.scatter(chosen[:, 0], chosen[:, 1], s=dot, color=colours(i), linewidths=0, label=str(c))
        fig.legend(title="class", loc="outside right upper", markerscale=2, frameon=False)
    else:
        drawn = ax.scatter(points[:, 0], points[:, 1], c=labels.numpy(), s=dot, cmap="viridis", linewidths=0)
        fig.colorbar(drawn, ax=ax, label="class")
    ax.set_xlabel(f"{axis_name} 1")
    ax.set_ylabel(f"{axis_name} 2")
    ax.set_title(title)
    return fig
