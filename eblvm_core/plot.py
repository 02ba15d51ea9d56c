"""Every figure eblvm makes: charts on matplotlib's Agg canvas (the object API, no pyplot, no global
state), laid out in pixels at ``DPI`` so 10-12 pt fonts are 14-17 pixels high, returned as the
Figure (``render`` gives (3, H, W) float in [0, 1]); image grids are ``make_grid``'s layout
upscaled by pixel repetition to at least ``MIN_SIDE`` pixels a side. matplotlib and torchvision
are imported inside the functions, so ``eblvm --help`` and plugin loading never pay for them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn, never at start-up
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

Box = tuple[tuple[float, float], tuple[float, float]]  # a view in data units: ((x_lo, x_hi), (y_lo, y_hi))
Rect = tuple[int, int, int, int]  # pixels of a rendered figure: (left, top, width, height), rows from the top

DPI = 100
BOUNDS_COLOUR = (214, 39, 40)  # the data's bounds, and points beyond a scatter's view (matplotlib's tab:red)
POINT_COLOUR = (31, 61, 140)  # the points of a scatter of samples
BOX_LINE = 2 * 72 / DPI  # the bounds' line: 2 pixels wide, in points
MIN_SIDE = 64  # pixels on the shorter side of each image of a grid, unless a scale is given


def _rgb(colour: tuple[int, int, int]) -> tuple[float, float, float]:
    red, green, blue = colour
    return red / 255, green / 255, blue / 255


# ---- canvas ----------------------------------------------------------------------------------


def figure(width: int, height: int, layout: Literal["constrained"] | None = None) -> Figure:
    """A matplotlib Figure on an Agg canvas that renders to exactly ``width`` × ``height`` pixels;
    ``layout="constrained"`` lets matplotlib place the axes, None leaves it to ``axes_at``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    # a hair more than the size: Agg truncates width × DPI, which can fall just short (0.29 × 100)
    fig = Figure(figsize=((width + 1e-3) / DPI, (height + 1e-3) / DPI), dpi=DPI, layout=layout)
    engine = fig.get_layout_engine()
    if isinstance(engine, ConstrainedLayoutEngine):
        engine.set(w_pad=8 / DPI, h_pad=8 / DPI)  # 8 pixels around the edges
    FigureCanvasAgg(fig)
    return fig


def _canvas(fig: Figure) -> FigureCanvasAgg:
    """The Agg canvas ``figure`` gave ``fig``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas
    if not isinstance(canvas, FigureCanvasAgg):
        raise TypeError(f"a figure made by eblvm's figure() draws on an Agg canvas, not {type(canvas).__name__}")
    return canvas


def axes_at(fig: Figure, rect: Rect) -> Axes:
    """New axes filling the pixel rectangle ``rect`` (left, top, width, height) of ``fig``."""
    left, top, width, height = rect
    size_x, size_y = fig.bbox.width, fig.bbox.height
    return fig.add_axes((left / size_x, 1 - (top + height) / size_y, width / size_x, height / size_y))


def render(fig: Figure) -> Tensor:
    """Draw ``fig`` on its Agg canvas: (3, H, W) float in [0, 1] (white where nothing is drawn)."""
    import numpy as np

    canvas = _canvas(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
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


def bounds_box(ax: Axes, bounds: Box) -> None:
    """The data's bounds ((x_lo, x_hi), (y_lo, y_hi)) drawn on ``ax`` as a red box, in data units."""
    from matplotlib.patches import Rectangle

    (x0, x1), (y0, y1) = bounds
    ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor=_rgb(BOUNDS_COLOUR), linewidth=BOX_LINE))


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
    handles: list[Artist] = []
    inside = points[~outside].numpy()
    ax.scatter(inside[:, 0], inside[:, 1], s=dot, color=_rgb(POINT_COLOUR), linewidths=0)
    handles.append(Line2D([], [], linestyle="", marker="o", color=_rgb(POINT_COLOUR), label="samples"))
    if bounds is not None:
        bounds_box(ax, bounds)
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


def widest_text(texts: list[str]) -> float:
    """Width in pixels of the widest of ``texts`` at matplotlib's default font size, as a legend
    draws them (measured on one scratch figure)."""
    fig = figure(1, 1)
    renderer = _canvas(fig).get_renderer()
    return max(fig.text(0, 0, text).get_window_extent(renderer=renderer).width for text in texts)
