"""The comparison figure of ``eblvm compare``: each method's image in titled rows above the
learning curves of one metric, drawn with matplotlib on eblvm's figure canvas
(``eblvm.tools.figure``, laid out in pixels; ``render`` turns it into an image)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from eblvm.tools import axes_at, figure, widest_text

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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
        legend = max(200, 70 + math.ceil(widest_text(list(curves))))
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
        assert axis is not None, "learning curves need their value axis"
        # room for tick labels and the axis label (left), the title and clip note (top), the
        # step labels (bottom) and the legend (right)
        ax = axes_at(fig, (90, top + 60, width - 90 - legend, CURVES[1] - 60 - 56))
        learning_curves(ax, curves, metric, axis)
    return fig
