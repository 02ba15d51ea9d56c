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
        "import eblvm_core.cli, eblvm_core.plot, eblvm_core.saved\n"
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


def test_render_refuses_a_figure_without_an_agg_canvas():
    """A matplotlib Figure made elsewhere (here on matplotlib's base canvas) cannot be rendered to
    pixels: the error names its canvas and says which ``figure()`` makes."""
    from matplotlib.figure import Figure

    from eblvm_core.plot import figure, render

    with pytest.raises(
        TypeError, match=r"^a figure made by eblvm's figure\(\) draws on an Agg canvas, not FigureCanvasBase$"
    ):
        render(Figure())
    assert render(figure(30, 20)).shape == (3, 20, 30)
