"""The metrics plugin's figures (eblvm_metrics.figures): what a density figure draws where in the
rendered array, and an embedding's legend and colours."""

from __future__ import annotations

import pytest
import torch
from eblvm_metrics import figures
from torch import Tensor

from eblvm_core import plot
from eblvm_core.contracts import DataSplits, Parts
from tests.core.test_figures import BOX, close, colour_at, texts

matplotlib = pytest.importorskip("matplotlib")


# ---- densities --------------------------------------------------------------------------------


def test_density_puts_each_cell_where_its_point_is_with_y_upwards():
    """One bright cell at x index 3, y index 17 of a 20 × 20 grid: the k × k block of pixels at
    column 3 and row 20 - 1 - 17 of the left panel, exactly in the colour map's top colour."""
    n = 20
    density = torch.zeros(n, n)
    density[3, 17] = 2.0
    fig = figures.densities([("model", density), ("data", density / 4)], BOX, BOX, high=2.0)
    image = plot.render(fig)
    rects, bar, (width, height) = figures.density_layout(2, n)
    assert image.shape == (3, height, width)
    for ax, (left, top, side, _) in zip(fig.axes, rects):  # the axes fill the layout's rectangles
        x0, y0, x1, y1 = ax.get_window_extent().extents
        assert (round(x0), round(height - y1), round(x1 - x0)) == (left, top, side)
    left, top, side, _ = rects[0]
    k = side // n
    assert k * n >= figures.MIN_PANEL
    row, col = n - 1 - 17, 3
    block = image[:, top + row * k : top + (row + 1) * k, left + col * k : left + (col + 1) * k]
    top_colour = torch.tensor(matplotlib.colormaps["viridis"](1.0)[:3], dtype=torch.float32)
    assert (block - top_colour[:, None, None]).abs().max() < 0.01
    panel = image[:, top + 2 : top + side - 2, left + 2 : left + side - 2]
    bright = (panel - top_colour[:, None, None]).abs().max(0).values < 0.01
    rows, cols = bright.nonzero().T
    assert (rows.min() + 2) // k == row and (rows.max() + 2) // k == row  # nowhere else
    assert (cols.min() + 2) // k == col and (cols.max() + 2) // k == col
    # the data panel at a quarter of the scale: the colour map's value 0.25 in the same cell
    left2 = rects[1][0]
    quarter = torch.tensor(matplotlib.colormaps["viridis"](0.25)[:3], dtype=torch.float32)
    assert close(image[:, top + row * k + k // 2, left2 + col * k + k // 2], quarter)


def test_density_of_a_gaussian_peaks_where_it_does_and_has_labelled_axes_and_bar():
    n = 50
    centres = (torch.arange(n) + 0.5) / n
    xx, yy = torch.meshgrid(centres, centres, indexing="ij")
    density = torch.exp(-((xx - 0.7) ** 2 + (yy - 0.2) ** 2) / 0.02)  # (n_x, n_y), peak at (0.7, 0.2)
    fig = figures.densities([("model density", density), ("data", density)], BOX, BOX, high=float(density.max()))
    image = plot.render(fig)
    ax = fig.axes[0]
    left, top, side, _ = figures.density_layout(2, n)[0][0]
    panel = image[:, top + 3 : top + side - 3, left + 3 : left + side - 3]
    row, col = divmod(int(panel.sum(0).argmax()), panel.shape[2])
    column, up = plot.pixel_of(ax, 0.7, 0.2)
    assert abs(left + 3 + col - column) <= side / n and abs(top + 3 + row - up) <= side / n
    assert ax.get_title() == "model density" and ax.get_xlabel() and ax.get_ylabel()
    assert fig.axes[-1].get_ylabel() == "density"  # the colour bar
    assert all(t.get_fontsize() >= 9 for t in texts(fig))  # tick labels included


def test_embedding_colours_points_by_class_with_a_legend():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(300) % 10
    angle = labels.float() * 2 * torch.pi / 10
    points = 3 * torch.stack([angle.cos(), angle.sin()], 1) + 0.1 * torch.randn(300, 2, generator=generator)
    fig = figures.embedding(points, labels, "title", "PCA", size=400)
    legend = fig.legends[0]
    assert legend.get_title().get_text() == "class"
    assert [t.get_text() for t in legend.get_texts()] == [str(c) for c in range(10)]
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("PCA 1", "PCA 2", "title")
    image = plot.render(fig)
    assert image.shape == (3, 400, 520)
    tab10 = matplotlib.colormaps["tab10"]
    for c in (0, 3, 7):  # each class's cluster is drawn in its own colour
        centre = plot.pixel_of(
            ax,
            3 * float(torch.cos(torch.tensor(c * 2 * torch.pi / 10))),
            3 * float(torch.sin(torch.tensor(c * 2 * torch.pi / 10))),
        )
        assert close(colour_at(image, *centre), tab10(c)[:3], tol=0.05)
    assert all(t.get_fontsize() >= 9 for t in texts(fig))
    many = figures.embedding(points, torch.arange(300) % 30, "title", "t-SNE")
    assert not many.legends and many.axes[-1].get_ylabel() == "class"  # 30 classes: a colour bar


def test_posterior_embedding_evaluator_returns_the_rendered_figure():
    from eblvm_metrics.probes import EmbeddingConfig, build_posterior_embedding

    class Means:
        def mean(self, v: Tensor) -> Tensor:
            return v.flatten(1)[:, :4]

    data = DataSplits.stand_in((6,), n=200)
    parts = Parts(data=data, posterior=Means())
    image = build_posterior_embedding(EmbeddingConfig(n=50, size=300), parts)(parts).images["embedding"]
    assert image.shape == (3, 300, 420) and 0 <= image.min() and image.max() <= 1
    assert (image < 0.9).any(0).float().mean() > 0.01  # drawn on
