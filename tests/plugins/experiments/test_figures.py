"""The comparison figure (``eblvm_experiments.figures``): learning curves clipped to their axis
with triangles on its edge, panels at their own resolution, and a legend that fits long names."""

from __future__ import annotations

import pytest
import torch
from eblvm_experiments.figures import comparison
from torch import Tensor

from eblvm.tools import render
from eblvm_core.plot import pixel_of


def colour_at(image: Tensor, column: float, row: float) -> Tensor:
    return image[:, round(row), round(column)]


def close(a: Tensor, b: tuple[float, ...] | Tensor, tol: float = 0.02) -> bool:
    return bool((a - torch.as_tensor(b, dtype=a.dtype)).abs().max() < tol)


def texts(fig) -> list:
    """Every visible text of ``fig`` with characters in it (tick labels included, after a render)."""
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def test_learning_curves_clip_to_the_axis_with_triangles_and_name_the_methods():
    from matplotlib.lines import Line2D

    curves = {"A": [(0, 0.0), (10, 5.0), (20, 0.5)], "B": [(0, -4.0), (10, 0.2), (20, 0.4)]}
    fig = comparison([], curves, "eval/x/loss", (-1.0, 1.0))
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A", "B"]
    assert ax.get_ylim() == (-1.0, 1.0) and ax.get_xlabel() == "step" and ax.get_ylabel() == "x/loss"
    assert ax.get_title() == "x/loss vs step\nclipped (triangles on the edge): 1 below, 1 above the axis"
    markers = {
        line.get_marker(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()
        if isinstance(line, Line2D) and line.get_linestyle() == "None"
    }
    assert markers == {"^": ([10], [1.0]), "v": ([0], [-1.0])}  # A's 5.0 above, B's -4.0 below, on the edge
    image = render(fig)
    tab_blue = torch.tensor([31, 119, 180]) / 255
    column, row = pixel_of(ax, 20, 0.5)  # A's last point, in range: a dot of its colour
    assert close(colour_at(image, column, row), tab_blue)
    assert all(t.get_fontsize() >= 9 for t in texts(fig))


def test_comparison_shows_panels_at_their_own_resolution():
    """A 300-pixel panel is copied pixel for pixel under its title; a 40-pixel one is upscaled by 4."""
    generator = torch.Generator().manual_seed(0)
    big = (torch.rand(300, 280, 3, generator=generator) * 255).to(torch.uint8).numpy()
    small = (torch.rand(40, 30, 3, generator=generator) * 255).to(torch.uint8).numpy()
    fig = comparison([("big", big), ("small", small)])
    image = (render(fig) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    titles = [t.get_text() for t in fig.texts]
    assert titles == ["big", "small"] and all(t.get_fontsize() >= 9 for t in fig.texts)
    found = [
        (top, left)
        for top in range(0, 40)
        for left in range(0, 40)
        if (image[top, left : left + 280] == big[0]).all() and (image[top : top + 300, left : left + 280] == big).all()
    ]
    assert len(found) == 1
    top, left = found[0]
    assert top >= 20  # below its title
    upscaled = small.repeat(4, 0).repeat(4, 1)
    cell = 280 + 12
    assert (image[top : top + 160, left + cell : left + cell + 120] == upscaled).all()


@pytest.mark.parametrize(
    "name", ["A", "BiSSM, Gauss-Newton unroll, exact KL", "BiSSM, Gauss-Newton unroll, exact KL, longer"]
)
@pytest.mark.parametrize("panels", [0, 4], ids=["curves alone", "under wide panels"])
def test_comparison_keeps_the_legend_of_long_method_names_inside_the_figure(name, panels):
    """The legend right of the curves gets the room its longest name needs (a fixed 200 pixels cut
    long names off at the figure's edge), also when panels above widen the figure and with it the
    legend's offset from the axes; the curves keep at least 400 pixels."""
    curves = {name: [(0, 0.1), (10, 0.3)], "B": [(0, 0.2), (10, 0.25)]}
    image = torch.zeros(300, 450, 3, dtype=torch.uint8).numpy()
    fig = comparison([(str(i), image) for i in range(panels)], curves, "eval/m", (0.0, 0.5))
    render(fig)
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 > ax.get_window_extent(renderer).x1
    assert legend.x1 <= fig.bbox.width and legend.y0 >= 0 and legend.y1 <= fig.bbox.height
    assert ax.get_window_extent(renderer).width >= 400
