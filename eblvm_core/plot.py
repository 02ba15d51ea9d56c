"""Every figure eblvm makes: charts drawn with matplotlib and image grids tiled with torch.

Charts use matplotlib's object API on its non-interactive Agg canvas (``matplotlib.figure.Figure``
with ``FigureCanvasAgg``; no pyplot, no display, no global state) and are laid out in pixels at
``DPI`` pixels per inch, so fonts of 10 pt (tick labels) to 12 pt (titles) are 14 to 17 pixels
high in the saved PNG. The functions that draw return the Figure, so its artists (legends, axes)
can be inspected; ``render`` turns it into what evaluators return, (3, H, W) float in [0, 1].
matplotlib and torchvision are imported inside the functions: ``eblvm --help`` and plugin
loading never pay for them.

Image grids are torchvision's ``make_grid`` layout upscaled by pixel repetition (nearest
neighbour), by default until each image is at least ``MIN_SIDE`` pixels on its shorter side.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn, never at start-up
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Box = tuple[tuple[float, float], tuple[float, float]]  # a view in data units: ((x_lo, x_hi), (y_lo, y_hi))
Rect = tuple[int, int, int, int]  # pixels of a rendered figure: (left, top, width, height), rows from the top

DPI = 100
BOUNDS_COLOUR = (214, 39, 40)  # the data's bounds, and points beyond a scatter's view (matplotlib's tab:red)
POINT_COLOUR = (31, 61, 140)  # the points of a scatter of samples
BOX_LINE = 2 * 72 / DPI  # the bounds' line: 2 pixels wide, in points
MIN_SIDE = 64  # pixels on the shorter side of each image of a grid, unless a scale is given
MIN_PANEL = 200  # pixels on the side of a density panel: small grids are upscaled to at least this
# the density figure's margins in pixels: tick labels and axis label on the left and below, titles
# above, between the panels, and the colour bar with its tick labels and label
LEFT, TOP, BOTTOM, GAP, BAR_GAP, BAR, BAR_RIGHT = 64, 34, 52, 24, 18, 16, 78


def _rgb(colour: tuple[int, int, int]) -> tuple[float, float, float]:
    return tuple(c / 255 for c in colour)


# ---- canvas ----------------------------------------------------------------------------------


def figure(width: int, height: int, layout: str | None = None) -> Figure:
    """A matplotlib Figure on an Agg canvas that renders to exactly ``width`` × ``height`` pixels;
    ``layout="constrained"`` lets matplotlib place the axes, None leaves it to ``axes_at``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # a hair more than the size: Agg truncates width × DPI, which can fall just short (0.29 × 100)
    fig = Figure(figsize=((width + 1e-3) / DPI, (height + 1e-3) / DPI), dpi=DPI, layout=layout)
    if layout == "constrained":
        fig.get_layout_engine().set(w_pad=8 / DPI, h_pad=8 / DPI)  # 8 pixels around the edges
    FigureCanvasAgg(fig)
    return fig


def axes_at(fig: Figure, rect: Rect) -> Axes:
    """New axes filling the pixel rectangle ``rect`` (left, top, width, height) of ``fig``."""
    left, top, width, height = rect
    size_x, size_y = fig.bbox.width, fig.bbox.height
    return fig.add_axes((left / size_x, 1 - (top + height) / size_y, width / size_x, height / size_y))


def render(fig: Figure) -> Tensor:
    """Draw ``fig`` on its Agg canvas: (3, H, W) float in [0, 1] (white where nothing is drawn)."""
    import numpy as np

    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    return torch.from_numpy(np.ascontiguousarray(rgba[..., :3])).permute(2, 0, 1).float() / 255


def pixel_of(ax: Axes, x: float, y: float) -> tuple[float, float]:
    """(column, row) in the rendered image of data point (x, y) of ``ax`` (after ``render``)."""
    column, up = ax.transData.transform((x, y))
    return float(column), float(ax.figure.bbox.height - up)


# ---- image grids -----------------------------------------------------------------------------


def grid_scale(image_shape: tuple[int, ...]) -> int:
    """The smallest whole factor that makes images (..., H, W) at least MIN_SIDE pixels on their shorter side."""
    return max(1, math.ceil(MIN_SIDE / max(1, min(image_shape[-2:]))))


def upscale(image: Tensor, scale: int) -> Tensor:
    """(C, H, W) -> (C, scale·H, scale·W): every pixel repeated scale × scale times (nearest neighbour)."""
    return image.repeat_interleave(scale, -2).repeat_interleave(scale, -1)


def image_grid(images: Tensor, nrow: int, padding: int = 2, scale: int | None = None) -> Tensor:
    """Images (n, C, H, W) in [0, 1] tiled ``nrow`` to a row with ``padding`` white pixels around
    each (torchvision's ``make_grid``), then upscaled ``scale`` times (None: ``grid_scale``):
    (3, scale·H', scale·W') for C in (1, 3)."""
    from torchvision.utils import make_grid  # imported here: torchvision adds 2 s to every CLI start

    grid = make_grid(images.float().cpu(), nrow=nrow, padding=padding, pad_value=1.0)
    return upscale(grid, scale or grid_scale(images.shape))


# ---- 2-D densities and scatters ---------------------------------------------------------------


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
    from matplotlib.patches import Rectangle

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
            (bx0, bx1), (by0, by1) = bounds
            ax.add_patch(
                Rectangle(
                    (bx0, by0), bx1 - bx0, by1 - by0, fill=False, edgecolor=_rgb(BOUNDS_COLOUR), linewidth=BOX_LINE
                )
            )
    above = any(float(values.max()) > high for _, values in panels)
    fig.colorbar(image, cax=axes_at(fig, bar), label=label, extend="max" if above else "neither")
    return fig


def scatter_view(points: Tensor, bounds: Box | None, reach: float = 0.5) -> Box:
    """The view of a scatter: the bounds and the points, at most ``reach`` × the bounds' width beyond
    them on each side, plus 5%; without bounds, the points plus 5%."""
    lo, hi = points.min(0).values, points.max(0).values
    if bounds is not None:
        b_lo = torch.tensor([b[0] for b in bounds], dtype=torch.float32)
        b_hi = torch.tensor([b[1] for b in bounds], dtype=torch.float32)
        reach_width = reach * (b_hi - b_lo)
        lo = torch.minimum(b_lo, lo).clamp_min(b_lo - reach_width)
        hi = torch.maximum(b_hi, hi).clamp_max(b_hi + reach_width)
    pad = 0.05 * (hi - lo).clamp_min(1e-6)
    lo, hi = lo - pad, hi + pad
    return (float(lo[0]), float(hi[0])), (float(lo[1]), float(hi[1]))


def scatter(
    points: Tensor, bounds: Box | None = None, reach: float = 0.5, size: tuple[int, int] = (520, 560)
) -> Figure:
    """2-D points (n, 2) as dots on axes over ``scatter_view`` with the data's ``bounds`` as a red
    box; points beyond the view are drawn in red on its edge and counted in the legend. Returns
    the Figure (``size`` = (width, height) pixels)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    points = points.detach().float().cpu()
    (x0, x1), (y0, y1) = view = scatter_view(points, bounds, reach)
    lo, hi = torch.tensor([x0, y0]), torch.tensor([x1, y1])
    outside = ((points < lo) | (points > hi)).any(1)
    fig = figure(*size, layout="constrained")
    ax = fig.add_subplot()
    dot = 16 if len(points) <= 2000 else 4  # marker area in points²
    handles = []
    inside = points[~outside].numpy()
    ax.scatter(inside[:, 0], inside[:, 1], s=dot, color=_rgb(POINT_COLOUR), linewidths=0)
    handles.append(Line2D([], [], linestyle="", marker="o", color=_rgb(POINT_COLOUR), label="samples"))
    if bounds is not None:
        (bx0, bx1), (by0, by1) = bounds
        ax.add_patch(
            Rectangle((bx0, by0), bx1 - bx0, by1 - by0, fill=False, edgecolor=_rgb(BOUNDS_COLOUR), linewidth=BOX_LINE)
        )
        handles.append(Rectangle((0, 0), 1, 1, fill=False, edgecolor=_rgb(BOUNDS_COLOUR), label="data bounds"))
    n_out = int(outside.sum())
    if n_out:
        edge = torch.maximum(torch.minimum(points[outside], hi), lo).numpy()
        ax.scatter(edge[:, 0], edge[:, 1], s=dot, color=_rgb(BOUNDS_COLOUR), linewidths=0, clip_on=False, zorder=3)
        handles.append(
            Line2D(
                [],
                [],
                linestyle="",
                marker="o",
                color=_rgb(BOUNDS_COLOUR),
                label=f"{n_out} beyond the view (drawn on its edge)",
            )
        )
    ax.set_xlim(*view[0])
    ax.set_ylim(*view[1])
    ax.set_xlabel("v₁")
    ax.set_ylabel("v₂")
    ax.set_title(f"{len(points)} samples")
    fig.legend(handles=handles, loc="outside lower center", ncols=min(2, len(handles)), frameon=False)
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


# ---- comparisons -----------------------------------------------------------------------------

PANEL_HEIGHT = 160  # images of a comparison shorter than this are upscaled (whole factors)
PANELS_WIDTH = 2000  # pixels: a comparison puts as many images in a row as fit, at most 4
CURVES = (960, 440)  # pixels of the learning-curve plot: (least width, height)


def learning_curves(
    ax: Axes, curves: dict[str, list[tuple[int, float]]], metric: str, axis: tuple[float, float]
) -> None:
    """Each method's curve "<metric> vs step" on ``ax``, the value axis fixed to ``axis`` (low,
    high); values beyond it are drawn as open triangles on its edge, pointing the way they left,
    and counted under the title; a legend names the methods."""
    import matplotlib

    lo, hi = axis
    colours = matplotlib.colormaps["tab10" if len(curves) <= 10 else "tab20"]
    clipped = {"below": 0, "above": 0}
    for i, (name, curve) in enumerate(curves.items()):
        colour = colours(i % colours.N)
        steps = [s for s, _ in curve]
        values = [min(max(v, lo), hi) for _, v in curve]
        ax.plot(steps, values, color=colour, linewidth=1.8, marker="o", markersize=3.5, label=name)
        for where, marker, test in (("below", "v", lambda v: v < lo), ("above", "^", lambda v: v > hi)):
            out = [s for s, v in curve if test(v)]
            if out:
                clipped[where] += len(out)
                ax.plot(
                    out,
                    [lo if where == "below" else hi] * len(out),
                    linestyle="",
                    marker=marker,
                    markersize=9,
                    markerfacecolor="white",
                    markeredgecolor=colour,
                    markeredgewidth=1.5,
                    clip_on=False,
                    zorder=3,
                )
    steps = [s for c in curves.values() for s, _ in c]
    margin = 0.02 * (max(steps) - min(steps)) or 1
    ax.set_xlim(min(steps) - margin, max(steps) + margin)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("step")
    ax.set_ylabel(metric.removeprefix("eval/"))
    title = f"{metric.removeprefix('eval/')} vs step"
    if clipped["below"] or clipped["above"]:
        counts = ", ".join(f"{n} {where}" for where, n in clipped.items() if n)
        title += f"\nclipped (triangles on the edge): {counts} the axis"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, borderaxespad=0)


def comparison(
    panels: list[tuple[str, Any]],
    curves: dict[str, list[tuple[int, float]]] | None = None,
    metric: str = "",
    axis: tuple[float, float] | None = None,
) -> Figure:
    """Titled images (name, RGB array (H, W, 3) uint8) in rows at their own resolution (images
    shorter than PANEL_HEIGHT upscaled by whole factors), above ``learning_curves`` of ``curves``
    of ``metric`` on the value ``axis`` (low, high; needed with curves). Returns the Figure."""
    import numpy as np

    title_h, pad = 26, 12
    scaled = []
    for name, array in panels:
        k = max(1, math.ceil(PANEL_HEIGHT / array.shape[0]))
        scaled.append((name, np.repeat(np.repeat(array, k, 0), k, 1)))
    cell = max((a.shape[1] for _, a in scaled), default=0) + pad
    per_row = max(1, min(4, PANELS_WIDTH // max(cell, 1)))
    rows = [scaled[i : i + per_row] for i in range(0, len(scaled), per_row)]
    heights = [title_h + max(a.shape[0] for _, a in row) + pad for row in rows]
    width = max(pad + cell * min(per_row, len(scaled)) if scaled else 0, CURVES[0] if curves else 0)
    if curves:  # the legend's room: its longest method name, its line sample and pads, and
        # its offset from the axes (learning_curves: 2% of the axes' width)
        legend = max(200, 70 + widest_text(list(curves)))
        width = max(width, 90 + 400 + legend)
        legend += math.ceil(0.02 * (width - 90 - legend))
    height = sum(heights) + (CURVES[1] if curves else 0)
    fig = figure(width, height)
    top = 0
    for row, row_height in zip(rows, heights):
        for j, (name, array) in enumerate(row):
            left = pad + j * cell
            fig.text(left / fig.bbox.width, 1 - (top + 6) / fig.bbox.height, name, va="top", fontsize=12, weight="bold")
            fig.figimage(array, xo=left, yo=height - top - title_h - array.shape[0], origin="upper")
        top += row_height
    if curves:
        # room for tick labels and the axis label (left), the title and clip note (top), the
        # step labels (bottom) and the legend (right)
        ax = axes_at(fig, (90, top + 60, width - 90 - legend, CURVES[1] - 60 - 56))
        learning_curves(ax, curves, metric, axis)
    return fig


def widest_text(texts: list[str]) -> float:
    """Width in pixels of the widest of ``texts`` at matplotlib's default font size, as a legend
    draws them (measured on one scratch figure)."""
    fig = figure(1, 1)
    renderer = fig.canvas.get_renderer()
    return max(fig.text(0, 0, text).get_window_extent(renderer=renderer).width for text in texts)
