"""Figures (eblvm_core.plot): what is drawn where in the rendered arrays, the artists of the
matplotlib figures (legends, titles, font sizes), image grids upscaled exactly by repetition,
`eblvm sample --scale`, and matplotlib staying out of the start-up path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import Tensor

from eblvm_core import plot
from eblvm_core.contracts import DataSplits, Parts

matplotlib = pytest.importorskip("matplotlib")

BOX = ((0.0, 1.0), (0.0, 1.0))


def colour_at(image: Tensor, column: float, row: float) -> Tensor:
    return image[:, round(row), round(column)]


def close(a: Tensor, b: tuple[float, ...] | Tensor, tol: float = 0.02) -> bool:
    return bool((a - torch.as_tensor(b, dtype=a.dtype)).abs().max() < tol)


def rgb(colour: tuple[int, int, int]) -> tuple[float, ...]:
    return tuple(c / 255 for c in colour)


def texts(fig) -> list:
    """Every visible text of ``fig`` with characters in it (tick labels included, after a render)."""
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def test_render_gives_the_asked_size_in_unit_range_on_the_agg_canvas():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for width, height in ((29, 57), (113, 201), (640, 360)):  # 0.29 × 100 is 28.999...: still 29 pixels
        fig = plot.figure(width, height)
        assert isinstance(fig.canvas, FigureCanvasAgg)
        image = plot.render(fig)
        assert image.shape == (3, height, width) and image.dtype == torch.float32
        assert torch.equal(image, torch.ones_like(image))  # nothing drawn: white
    fig = plot.figure(200, 100)
    ax = plot.axes_at(fig, (20, 10, 100, 50))
    ax.set_axis_off()
    ax.imshow([[0.0]], cmap="gray", vmin=0, vmax=1, extent=(0, 1, 0, 1), aspect="auto")
    image = plot.render(fig)
    dark = (image.sum(0) < 0.1).nonzero()
    assert dark[:, 0].min() == 10 and dark[:, 0].max() == 59 and dark[:, 1].min() == 20 and dark[:, 1].max() == 119


# ---- densities --------------------------------------------------------------------------------


def test_density_puts_each_cell_where_its_point_is_with_y_upwards():
    """One bright cell at x index 3, y index 17 of a 20 × 20 grid: the k × k block of pixels at
    column 3 and row 20 - 1 - 17 of the left panel, exactly in the colour map's top colour."""
    n = 20
    density = torch.zeros(n, n)
    density[3, 17] = 2.0
    fig = plot.densities([("model", density), ("data", density / 4)], BOX, BOX, high=2.0)
    image = plot.render(fig)
    rects, bar, (width, height) = plot.density_layout(2, n)
    assert image.shape == (3, height, width)
    for ax, (left, top, side, _) in zip(fig.axes, rects):  # the axes fill the layout's rectangles
        x0, y0, x1, y1 = ax.get_window_extent().extents
        assert (round(x0), round(height - y1), round(x1 - x0)) == (left, top, side)
    left, top, side, _ = rects[0]
    k = side // n
    assert k * n >= plot.MIN_PANEL
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
    fig = plot.densities([("model density", density), ("data", density)], BOX, BOX, high=float(density.max()))
    image = plot.render(fig)
    ax = fig.axes[0]
    left, top, side, _ = plot.density_layout(2, n)[0][0]
    panel = image[:, top + 3 : top + side - 3, left + 3 : left + side - 3]
    row, col = divmod(int(panel.sum(0).argmax()), panel.shape[2])
    column, up = plot.pixel_of(ax, 0.7, 0.2)
    assert abs(left + 3 + col - column) <= side / n and abs(top + 3 + row - up) <= side / n
    assert ax.get_title() == "model density" and ax.get_xlabel() and ax.get_ylabel()
    assert fig.axes[-1].get_ylabel() == "density"  # the colour bar
    assert all(t.get_fontsize() >= 9 for t in texts(fig))  # tick labels included


# ---- scatters ---------------------------------------------------------------------------------


def test_scatter_draws_points_where_they_are_and_far_ones_in_red_on_the_edge():
    points = torch.tensor([[0.2, 0.7], [0.8, 0.1], [5.0, 0.4]])
    fig = plot.scatter(points, BOX)
    image = plot.render(fig)
    (ax,) = fig.axes
    for x, y in points[:2].tolist():
        assert close(colour_at(image, *plot.pixel_of(ax, x, y)), rgb(plot.POINT_COLOUR))
    x1 = ax.get_xlim()[1]
    assert 1.0 < x1 < 1.6  # the view reaches half the bounds' width beyond them, not to x = 5
    assert close(colour_at(image, *plot.pixel_of(ax, x1, 0.4)), rgb(plot.BOUNDS_COLOUR))
    assert not close(colour_at(image, *plot.pixel_of(ax, 0.5, 0.5)), rgb(plot.POINT_COLOUR))  # empty: white
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "samples",
        "data bounds",
        "1 beyond the view (drawn on its edge)",
    ]
    assert ax.get_title() == "3 samples" and ax.get_xlabel() and ax.get_ylabel()
    assert all(t.get_fontsize() >= 9 for t in texts(fig))
    # without bounds the view spans the points and nothing is beyond it
    fig = plot.scatter(points)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["samples"]
    plot.render(fig)
    assert close(colour_at(plot.render(fig), *plot.pixel_of(fig.axes[0], 5.0, 0.4)), rgb(plot.POINT_COLOUR))


def test_embedding_colours_points_by_class_with_a_legend():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(300) % 10
    angle = labels.float() * 2 * torch.pi / 10
    points = 3 * torch.stack([angle.cos(), angle.sin()], 1) + 0.1 * torch.randn(300, 2, generator=generator)
    fig = plot.embedding(points, labels, "title", "PCA", size=400)
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
    many = plot.embedding(points, torch.arange(300) % 30, "title", "t-SNE")
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


def test_the_pca_embedding_keeps_every_distance_of_points_on_a_plane():
    """Points on a 2-D plane of R^6 (offset from 0): their first two principal components are an
    isometry of the plane, so every pairwise distance survives; an embedding that kept two raw
    coordinates would not."""
    from eblvm_metrics.probes import embedded

    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(6, 2, generator=generator, dtype=torch.float64))[0]
    points = torch.randn(40, 2, generator=generator, dtype=torch.float64) @ basis.T + 3.0
    flat = embedded(points, "pca")
    assert flat.shape == (40, 2)
    assert torch.allclose(torch.cdist(flat, flat), torch.cdist(points, points), atol=1e-6)


# ---- learning curves and comparisons ----------------------------------------------------------


def test_learning_curves_clip_to_the_axis_with_triangles_and_name_the_methods():
    from matplotlib.lines import Line2D

    curves = {"A": [(0, 0.0), (10, 5.0), (20, 0.5)], "B": [(0, -4.0), (10, 0.2), (20, 0.4)]}
    fig = plot.comparison([], curves, "eval/x/loss", (-1.0, 1.0))
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
    image = plot.render(fig)
    tab_blue = torch.tensor([31, 119, 180]) / 255
    column, row = plot.pixel_of(ax, 20, 0.5)  # A's last point, in range: a dot of its colour
    assert close(colour_at(image, column, row), tab_blue)
    assert all(t.get_fontsize() >= 9 for t in texts(fig))


def test_comparison_shows_panels_at_their_own_resolution():
    """A 300-pixel panel is copied pixel for pixel under its title; a 40-pixel one is upscaled by 4."""
    generator = torch.Generator().manual_seed(0)
    big = (torch.rand(300, 280, 3, generator=generator) * 255).to(torch.uint8).numpy()
    small = (torch.rand(40, 30, 3, generator=generator) * 255).to(torch.uint8).numpy()
    fig = plot.comparison([("big", big), ("small", small)])
    image = (plot.render(fig) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
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
    fig = plot.comparison([(str(i), image) for i in range(panels)], curves, "eval/m", (0.0, 0.5))
    plot.render(fig)
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 > ax.get_window_extent(renderer).x1
    assert legend.x1 <= fig.bbox.width and legend.y0 >= 0 and legend.y1 <= fig.bbox.height
    assert ax.get_window_extent(renderer).width >= 400


# ---- image grids ------------------------------------------------------------------------------


def test_image_grids_are_upscaled_exactly_by_repetition():
    from torchvision.utils import make_grid

    images = torch.rand(10, 1, 8, 6, generator=torch.Generator().manual_seed(0))
    raw = make_grid(images, nrow=4, padding=2, pad_value=1.0)
    for scale in (1, 3):
        grid = plot.image_grid(images, 4, 2, scale)
        assert grid.shape == (3, scale * raw.shape[1], scale * raw.shape[2])
        for dy in range(scale):
            for dx in range(scale):
                assert torch.equal(grid[:, dy::scale, dx::scale], raw)
    # by default the shorter side (6) reaches 64 pixels: 11 × 11 per pixel; tile 5 (row 1, column 1)
    grid = plot.image_grid(images, 4, 2)
    k = 11
    top, left = k * (2 + 1 * (8 + 2)), k * (2 + 1 * (6 + 2))
    assert torch.equal(grid[0, top : top + 8 * k : k, left : left + 6 * k : k], images[5, 0])
    assert (grid[:, : k * 2] == 1).all()  # the white border, upscaled too
    assert [plot.grid_scale(s) for s in ((8, 8), (28, 28), (1, 28, 20), (32, 32), (64, 64), (3, 100, 80))] == [
        8,
        3,
        4,
        2,
        1,
        1,
    ]


def test_sample_scale_multiplies_the_grid(cli, write_recipe, tmp_path):
    from PIL import Image

    from tests.e2e.test_eval_compare import FREY_GRID
    from tests.plugins.images.test_images import frey_images, write_frey

    write_frey(tmp_path / "frey", frey_images(40))
    out = tmp_path / "runs"
    recipe = write_recipe(FREY_GRID.replace("ROOT", str(tmp_path / "frey")))
    assert cli(["run", recipe, "--out", out, "--device", "cpu"]).exit_code == 0
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    raw = (2 * 20 + 3 * 2, 2 * 28 + 3 * 2)  # 4 faces, 2 to a row, 2-pixel borders: (width, height)
    for scale, expected in (([], 4), (["--scale", "1"], 1), (["--scale", "6"], 6)):
        result = cli(["sample", run_dir, "-n", "4", "--out", tmp_path / "s.png", *scale])
        assert result.exit_code == 0, result.output
        assert Image.open(tmp_path / "s.png").size == (expected * raw[0], expected * raw[1])
    assert cli(["sample", run_dir, "--scale", "0"]).exit_code == 2


@pytest.mark.slow
def test_matplotlib_is_imported_only_to_draw():
    """Loading the CLI, the plugins and the plotting module leaves matplotlib (and the other slow
    imports that only some commands need: scipy.io for Frey face, scikit-learn for the probes)
    unimported; drawing uses the Agg canvas and never pyplot."""
    code = (
        "import sys\n"
        "import eblvm_core.cli, eblvm_core.plot, eblvm_core.evaluate\n"
        "from eblvm_core.plugins import load\n"
        "load(warn=False)\n"
        "for name in ('matplotlib', 'scipy.io', 'sklearn'):\n"
        "    assert name not in sys.modules, f'{name} imported at start-up'\n"
        "import torch\n"
        "from eblvm_core import plot\n"
        "plot.render(plot.scatter(torch.rand(10, 2)))\n"
        "assert 'matplotlib' in sys.modules and 'matplotlib.pyplot' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=None)
    assert result.returncode == 0, result.stderr
