"""Figures drawn with PIL and torch alone (no plotting library): axes with ticks, a colour map and
its bar, panels of 2-D densities and scatters framed by their axes and the data's bounds.

Coordinates: a view ((x_lo, x_hi), (y_lo, y_hi)) in data units maps onto a panel of pixels with
y increasing upwards.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

Box = tuple[tuple[float, float], tuple[float, float]]  # ((x_lo, x_hi), (y_lo, y_hi))

# anchor colours of a viridis-like map, from low (dark purple) to high (yellow)
ANCHORS = (
    (0.267, 0.005, 0.329),
    (0.231, 0.322, 0.545),
    (0.129, 0.569, 0.549),
    (0.369, 0.788, 0.384),
    (0.993, 0.906, 0.144),
)
BOUNDS_COLOUR = (214, 39, 40)  # the data's bounds and clipped points
LEFT, TOP, BOTTOM, GAP = 46, 18, 22, 14  # margins in pixels: tick labels, titles, between panels
BAR = 12  # width of the colour bar


def colormap(values: Tensor) -> Tensor:
    """Values (H, W) in [0, 1] -> RGB (3, H, W) in [0, 1], linear between the anchor colours."""
    anchors = torch.tensor(ANCHORS, dtype=values.dtype, device=values.device)  # (K, 3)
    pos = values.clamp(0, 1) * (len(anchors) - 1)
    low = pos.floor().long().clamp(max=len(anchors) - 2)
    frac = (pos - low).unsqueeze(-1)
    rgb = anchors[low] * (1 - frac) + anchors[low + 1] * frac  # (H, W, 3)
    return rgb.permute(2, 0, 1)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """At most about ``n`` round values (1, 2 or 5 × 10^k apart) inside [lo, hi], ascending."""
    if not hi > lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for factor in (1, 2, 5, 10):
        if (hi - lo) / (step * factor) <= n:
            step *= factor
            break
    first = math.ceil(lo / step - 1e-9)
    ticks = [(first + i) * step for i in range(int((hi - lo) / step + 1e-9) + 2)]
    return [round(t, 12) + 0.0 for t in ticks if lo - 1e-9 * step <= t <= hi + 1e-9 * step]


def label(value: float) -> str:
    """A tick label: an integer in full ("20000"), else 3 significant digits without trailing zeros."""
    if value == int(value) and abs(value) < 1e7:
        return str(int(value))
    return f"{value:.3g}"


SPACE = 4  # pixels between words: the default font's own space (2 pixels) runs words together


def text(draw: Any, xy: tuple[float, float], line: str, fill: Any = "black") -> float:
    """Draw ``line`` at ``xy`` (left, top) word by word with SPACE-pixel gaps; returns its width."""
    x, y = xy
    for i, word in enumerate(line.split(" ")):
        if i:
            x += SPACE
        draw.text((x, y), word, fill=fill)
        x += draw.textlength(word)
    return x - xy[0]


def text_width(line: str) -> float:
    """The width in pixels of ``line`` as ``text`` draws it."""
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    return sum(draw.textlength(word) for word in line.split(" ")) + SPACE * line.count(" ")


def to_pil(image: Tensor) -> Any:
    """(3, H, W) in [0, 1] -> a PIL RGB image."""
    from PIL import Image

    pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy(), "RGB")


def from_pil(image: Any) -> Tensor:
    """A PIL RGB image -> (3, H, W) float in [0, 1]."""
    from torchvision.transforms.functional import pil_to_tensor

    return pil_to_tensor(image.convert("RGB")).float() / 255


def pixel(view: Box, size: tuple[int, int], x: float, y: float) -> tuple[float, float]:
    """Data point (x, y) -> pixel (column, row) of a (width, height) panel over ``view``; y upwards.
    Pixel centres sit at data positions of cell midpoints."""
    (x0, x1), (y0, y1) = view
    width, height = size
    return (x - x0) / (x1 - x0) * width - 0.5, (y1 - y) / (y1 - y0) * height - 0.5


def framed(
    panels: list[tuple[str, Tensor]],
    view: Box,
    bounds: Box | None = None,
    colour_range: tuple[float, float] | None = None,
    note: str = "",
) -> tuple[Tensor, list[tuple[int, int]]]:
    """Panels (3, H, W) over the same ``view`` side by side, each with a title, a frame and ticked
    axes, the data's ``bounds`` drawn as a red box, a colour bar for ``colour_range`` (low, high)
    and a ``note`` line under them: ((3, H', W') in [0, 1], the (column, row) of each panel's top
    left pixel in it)."""
    from PIL import Image, ImageDraw

    height = panels[0][1].shape[1]
    widths = [p.shape[2] for _, p in panels]
    bar_width = BAR + 50 if colour_range is not None else 0
    canvas_width = LEFT + sum(widths) + GAP * len(panels) + bar_width
    if note:
        canvas_width = max(canvas_width, LEFT + math.ceil(text_width(note)))
    canvas = Image.new("RGB", (canvas_width, TOP + height + BOTTOM + (14 if note else 0)), "white")
    draw = ImageDraw.Draw(canvas)
    origins = []
    x = LEFT
    for i, (title, panel) in enumerate(panels):
        width = panel.shape[2]
        canvas.paste(to_pil(panel), (x, TOP))
        origins.append((x, TOP))
        text(draw, (x, 3), title)
        _axes(draw, (x, TOP, width, height), view, y_labels=i == 0)
        if bounds is not None:
            (bx0, by0), (bx1, by1) = (
                pixel(view, (width, height), bounds[0][0], bounds[1][1]),
                pixel(view, (width, height), bounds[0][1], bounds[1][0]),
            )
            draw.rectangle([x + bx0, TOP + by0, x + bx1, TOP + by1], outline=BOUNDS_COLOUR)
        x += width + GAP
    if colour_range is not None:
        _colour_bar(canvas, draw, (x, TOP, BAR, height), colour_range)
    if note:
        text(draw, (LEFT, TOP + height + BOTTOM - 2), note)
    return from_pil(canvas), origins


def _axes(draw: Any, box: tuple[int, int, int, int], view: Box, y_labels: bool) -> None:
    """A black frame around the panel at ``box`` (left, top, width, height) with ticks at round
    values of ``view``, labelled below (x) and, with ``y_labels``, on the left (y)."""
    left, top, width, height = box
    draw.rectangle([left - 1, top - 1, left + width, top + height], outline="black")
    for t in nice_ticks(*view[0]):
        col = left + pixel(view, (width, height), t, view[1][0])[0]
        draw.line([col, top + height, col, top + height + 3], fill="black")
        draw.text((col - 3 * len(label(t)), top + height + 5), label(t), fill="black")
    for t in nice_ticks(*view[1]):
        row = top + pixel(view, (width, height), view[0][0], t)[1]
        draw.line([left - 4, row, left - 1, row], fill="black")
        if y_labels:
            draw.text((left - 7 - 6 * len(label(t)), row - 5), label(t), fill="black")


def _colour_bar(canvas: Any, draw: Any, box: tuple[int, int, int, int], colour_range: tuple[float, float]) -> None:
    """The colour map from low (bottom) to high (top) at ``box``, with ticked values on its right."""
    left, top, width, height = box
    ramp = torch.linspace(1, 0, height).unsqueeze(1).expand(height, width)
    canvas.paste(to_pil(colormap(ramp)), (left, top))
    draw.rectangle([left - 1, top - 1, left + width, top + height], outline="black")
    lo, hi = colour_range
    for t in nice_ticks(lo, hi, 4):
        row = top + (hi - t) / (hi - lo) * (height - 1) if hi > lo else top
        draw.line([left + width, row, left + width + 3, row], fill="black")
        draw.text((left + width + 6, row - 5), label(t), fill="black")


def scatter(points: Tensor, bounds: Box | None, size: int = 256, reach: float = 0.5) -> Tensor:
    """2-D points (n, 2) as dark 3×3-pixel dots on a framed, ticked panel with the data's bounds as a
    red box: (3, H, W) in [0, 1]. The view spans the bounds and the points, at most
    ``reach`` × the bounds' width beyond them on each side; points farther out are drawn in red on
    its edge and counted in the note. Without bounds the view spans the points."""
    points = points.detach().float().cpu()
    lo, hi = points.min(0).values, points.max(0).values
    if bounds is not None:
        b_lo = torch.tensor([b[0] for b in bounds], dtype=torch.float32)
        b_hi = torch.tensor([b[1] for b in bounds], dtype=torch.float32)
        reach_width = reach * (b_hi - b_lo)
        lo = torch.minimum(b_lo, lo).clamp_min(b_lo - reach_width)
        hi = torch.maximum(b_hi, hi).clamp_max(b_hi + reach_width)
    pad = 0.05 * (hi - lo).clamp_min(1e-6)
    lo, hi = lo - pad, hi + pad
    view = ((float(lo[0]), float(hi[0])), (float(lo[1]), float(hi[1])))
    outside = ((points < lo) | (points > hi)).any(1)
    cols, rows = pixel(view, (size, size), points[:, 0], points[:, 1])
    cols, rows = cols.round().long().clamp(1, size - 2), rows.round().long().clamp(1, size - 2)
    image = torch.ones(3, size, size)
    for mask, colour in ((~outside, (0.12, 0.24, 0.55)), (outside, tuple(c / 255 for c in BOUNDS_COLOUR))):
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                image[:, rows[mask] + dy, cols[mask] + dx] = torch.tensor(colour).unsqueeze(1)
    n_out = int(outside.sum())
    note = f"{n_out} of {len(points)} points beyond the view, drawn in red on its edge" if n_out else ""
    return framed([(f"{len(points)} samples", image)], view, bounds, note=note)[0]
