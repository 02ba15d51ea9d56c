"""The exact-loglik (GRBM) and density-plot (metrics) evaluators: values, images and refusals."""

from __future__ import annotations

import math

import pytest
import torch
from eblvm_grbm.evaluators import ExactLoglikConfig, build_exact_loglik
from eblvm_grbm.model import GRBM
from eblvm_metrics.density import DensityPlotConfig, build_density_plot, histogram
from eblvm_metrics.figures import density_layout
from torch import Tensor

from eblvm_core.contracts import DataSplits, EnergyModel, EvalResult, Parts
from eblvm_core.errors import ConfigError
from eblvm_core.plot import BOUNDS_COLOUR


def grbm(d: int, m: int, sigma: float, seed: int = 0, weight_std: float = 0.6) -> GRBM:
    torch.manual_seed(seed)
    model = GRBM(d, m, init_sigma=sigma, init_weight_std=weight_std).double()
    with torch.no_grad():
        model.c.normal_(0.0, 0.5)
    return model


def parts_for(model: EnergyModel, data: DataSplits) -> Parts:
    return Parts(dtype=torch.float64, data=data, model=model)


def splits(d: int = 1, n: int = 50, bounds=None, val: bool = False) -> DataSplits:
    gen = torch.Generator().manual_seed(5)
    make = lambda: torch.randn(n, d, generator=gen, dtype=torch.float64)  # noqa: E731
    return DataSplits(train=make(), test=make(), val=make() if val else None, bounds=bounds)


# ---- exact-loglik ----------------------------------------------------------------------------


def test_exact_loglik_equals_numerical_integral():
    """d = 1: log Z by a fine Riemann sum of exp(−F), compared with the evaluator's mean."""
    model, data = grbm(d=1, m=3, sigma=0.8), splits(d=1)
    with torch.no_grad():
        modes = model.visible_mean(torch.tensor([[0.0] * 3, [1.0] * 3], dtype=torch.float64))
        # the modes b + σWh lie between the sums of negative and positive weights
        span = float(model.sigma * model.W.abs().sum()) + 12 * float(model.sigma)
        grid = torch.linspace(-span, span, 200001, dtype=torch.float64).unsqueeze(1)
        log_z = torch.logsumexp(-model.free_energy(grid), 0) + math.log(float(grid[1] - grid[0]))
        per_point = -model.free_energy(data.test) - log_z
        expected, stderr = float(per_point.mean()), float(per_point.std() / len(per_point) ** 0.5)
    assert modes.abs().max() < span
    evaluate = build_exact_loglik(ExactLoglikConfig(batch_size=7), parts_for(model, data))
    result = evaluate(parts_for(model, data))
    assert isinstance(result, EvalResult) and set(result.scalars) == {"test_loglik", "test_loglik_stderr"}
    assert result.scalars["test_loglik"] == pytest.approx(expected, abs=1e-9)
    assert result.scalars["test_loglik_stderr"] == pytest.approx(stderr, rel=1e-9)


def test_exact_loglik_equals_a_2d_numerical_integral_on_each_split():
    """d = 2: log Z by a Riemann sum of exp(−F) over a 1001² grid, not the model's enumeration."""
    model, data = grbm(d=2, m=4, sigma=0.5), splits(d=2, val=True)
    parts = parts_for(model, data)
    with torch.no_grad():
        span = float(model.sigma * model.W.abs().sum(1).max() + model.b.abs().max()) + 12 * float(model.sigma)
        axis = torch.linspace(-span, span, 1001, dtype=torch.float64)
        grid = torch.cartesian_prod(axis, axis)
        log_z = torch.logsumexp(-model.free_energy(grid), 0) + 2 * math.log(float(axis[1] - axis[0]))
    for split in ("train", "val", "test"):
        result = build_exact_loglik(ExactLoglikConfig(split=split), parts)(parts)
        expected = float((-model.free_energy(getattr(data, split)) - log_z).detach().mean())
        assert result.scalars[f"{split}_loglik"] == pytest.approx(expected, abs=1e-9)


def test_exact_loglik_leaves_no_graph():
    model, data = grbm(d=2, m=2, sigma=1.0), splits(d=2)
    parts = parts_for(model, data)
    value = build_exact_loglik(ExactLoglikConfig(), parts)(parts).scalars["test_loglik"]
    assert isinstance(value, float)
    assert all(p.grad is None for p in model.parameters())


class NoFreeEnergy(EnergyModel):
    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        return (v**2).sum(-1)


class FreeEnergyOnly(EnergyModel):
    """A Gaussian with a free energy but no log_partition."""

    def free_energy(self, v: Tensor) -> Tensor:
        return 0.5 * (v**2).sum(-1)


def test_exact_loglik_refusals():
    data = splits(d=2)
    with pytest.raises(ConfigError, match="m=25 > max_hidden=20") as info:
        build_exact_loglik(ExactLoglikConfig(), parts_for(GRBM(2, 25), data))
    assert info.value.key == "max_hidden"
    with pytest.raises(ConfigError, match="m=5 > max_hidden=4"):
        build_exact_loglik(ExactLoglikConfig(max_hidden=4), parts_for(GRBM(2, 5), data))
    for model in (NoFreeEnergy(), FreeEnergyOnly()):
        with pytest.raises(ConfigError, match="log_partition") as info:
            build_exact_loglik(ExactLoglikConfig(), parts_for(model, data))
        assert info.value.key == "kind"
    with pytest.raises(ConfigError, match="no 'val' split") as info:
        build_exact_loglik(ExactLoglikConfig(split="val"), parts_for(GRBM(2, 3), data))
    assert info.value.key == "split"


# ---- density-plot ----------------------------------------------------------------------------

BOX = ((0.0, 1.0), (0.0, 1.0))


def test_density_plot_image_and_grid_mass():
    model = grbm(d=2, m=3, sigma=0.06, weight_std=0.5)
    with torch.no_grad():
        model.b.fill_(0.5)  # modes b + σWh stay within ~0.1 of the centre: all mass inside the box
    data = DataSplits(
        train=torch.rand(500, 2, dtype=torch.float64), test=torch.rand(300, 2, dtype=torch.float64), bounds=BOX
    )
    parts = parts_for(model, data)
    result = build_density_plot(DensityPlotConfig(grid=60, bins=20), parts)(parts)
    image = result.images["density"]
    width, height = density_layout(2, 72)[2]  # two panels of 72 cells (60 + 2 × 6 margin)
    assert image.shape == (3, height, width) and width > 2 * 216 and height > 216  # each cell 3 × 3 pixels
    assert image.min() >= 0 and image.max() <= 1
    assert set(result.scalars) == {"grid_mass"}
    assert result.scalars["grid_mass"] == pytest.approx(1.0, abs=2e-3)


def panel(image: Tensor, n: int, i: int = 0, centres: bool = True) -> tuple[Tensor, int]:
    """The i-th panel of a density figure of n × n cells (figures.density_layout), and the side k of
    a cell in pixels; with ``centres``, one pixel per cell, at its centre: (3, n, n)."""
    left, top, side, _ = density_layout(2, n)[0][i]
    k = side // n
    if centres:
        return image[:, top + k // 2 : top + side : k, left + k // 2 : left + side : k], k
    return image[:, top : top + side, left : left + side], k


def viridis(value: float) -> Tensor:
    import matplotlib

    return torch.tensor(matplotlib.colormaps["viridis"](value)[:3], dtype=torch.float32)


def test_density_plot_shows_the_data_beyond_its_bounds_on_one_colour_scale():
    """The view reaches margin × width beyond the bounds: data points there appear in the data panel
    (not dropped); the bounds are a red box; the colour bar runs from 0 (bottom) up, with a
    triangle on top for the data above the model's highest density."""
    model = GRBM(2, 1, init_sigma=0.3).double()
    test = torch.full((100, 2), 0.5, dtype=torch.float64)
    test[:10] = torch.tensor([1.15, 0.5], dtype=torch.float64)  # outside the unit box, inside the 20% margin
    data = DataSplits(train=test, test=test, bounds=BOX)
    parts = parts_for(model, data)
    image = build_density_plot(DensityPlotConfig(grid=50, bins=50, margin=0.2), parts)(parts).images["density"]
    n = 70  # 50 cells over the box and 10 beyond it on each side
    hist, k = panel(image, n, 1)
    lit = (hist - viridis(0.0)[:, None, None]).abs().sum(0) > 0.1
    found = {(int(r), int(c)) for r, c in lit.nonzero()}
    assert found == {(34, 67), (34, 35)}  # x = 1.15 (cell 67) and the centre (cell 35), y = 0.5 (row 34)
    whole, _ = panel(image, n, 1, centres=False)
    red = torch.tensor(BOUNDS_COLOUR) / 255
    box = ((whole - red[:, None, None]).abs().max(0).values < 2 / 255).nonzero() // k
    assert box[:, 1].min() in (9, 10) and box[:, 1].max() in (59, 60)  # the bounds: cells 10..59
    assert box[:, 0].min() in (9, 10) and box[:, 0].max() in (59, 60)
    left, top, width, height = density_layout(2, n)[1]
    bar = image[:, top : top + height, left + width // 2]
    assert torch.allclose(bar[:, -3], viridis(0.0), atol=0.02)  # bottom: 0
    tip = (bar - viridis(1.0)[:, None]).abs().max(0).values < 0.02
    assert tip[: height // 10].any() and not tip[height // 2 :].any()  # top: the highest, and above it
    assert torch.allclose(hist[:, 34, 35], viridis(1.0), atol=0.02)  # the data at the centre, above the scale


def test_density_plot_grid_mass_is_the_mass_inside_the_box():
    """A GRBM with W = 0 is N(b, σ²I): its mass in the unit box is a product of normal CDFs."""
    model = GRBM(2, 2, init_sigma=0.4).double()
    with torch.no_grad():
        model.W.zero_()
        model.b.copy_(torch.tensor([0.3, 0.9], dtype=torch.float64))
    normal = torch.distributions.Normal(model.b.detach(), model.sigma.detach())
    expected = float(
        (normal.cdf(torch.ones(2, dtype=torch.float64)) - normal.cdf(torch.zeros(2, dtype=torch.float64))).prod()
    )
    data = DataSplits(
        train=torch.rand(10, 2, dtype=torch.float64), test=torch.rand(10, 2, dtype=torch.float64), bounds=BOX
    )
    parts = parts_for(model, data)
    result = build_density_plot(DensityPlotConfig(grid=200), parts)(parts)
    assert result.scalars["grid_mass"] == pytest.approx(expected, abs=1e-5)


def test_density_plot_draws_y_upwards():
    """A model peaked near the top-left corner lights up the top-left of the left panel."""
    model = GRBM(2, 1, init_sigma=0.1).double()
    with torch.no_grad():
        model.W.zero_()
        model.b.copy_(torch.tensor([0.125, 0.875], dtype=torch.float64))  # centre of pixel (row 2, col 2)
    data = DataSplits(
        train=torch.rand(10, 2, dtype=torch.float64), test=torch.rand(10, 2, dtype=torch.float64), bounds=BOX
    )
    parts = parts_for(model, data)
    image = build_density_plot(DensityPlotConfig(grid=20, margin=0.1), parts)(parts).images["density"]
    cells, _ = panel(image, 24)  # 20 cells over the box, 2 beyond it on each side
    brightness = cells.sum(0)
    row, col = divmod(int(brightness.argmax()), 24)
    assert (row, col) == (2 + 2, 2 + 2)
    assert torch.allclose(cells[:, 4, 4], viridis(1.0), atol=0.02)  # the peak: the top colour


def test_density_plot_omits_grid_mass_without_log_partition():
    data = DataSplits(
        train=torch.rand(10, 2, dtype=torch.float64), test=torch.rand(10, 2, dtype=torch.float64), bounds=BOX
    )
    parts = parts_for(FreeEnergyOnly(), data)
    result = build_density_plot(DensityPlotConfig(grid=16), parts)(parts)
    width, height = density_layout(2, 20)[2]
    assert result.scalars == {} and result.images["density"].shape == (3, height, width)


def test_histogram_is_a_density():
    points = torch.rand(4000, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    hist = histogram(points, BOX, bins=10, n=10)
    assert float(hist.sum() / 100) == pytest.approx(1.0, abs=1e-12)
    # sampled at more pixels than bins, each bin is repeated
    assert torch.equal(histogram(points, BOX, bins=10, n=40)[::4, ::4], hist)


def test_density_plot_refusals():
    box3 = ((0.0, 1.0),) * 3
    with pytest.raises(ConfigError, match="free energy"):
        build_density_plot(DensityPlotConfig(), parts_for(NoFreeEnergy(), splits(d=2, bounds=BOX)))
    with pytest.raises(ConfigError, match="d=3"):
        build_density_plot(DensityPlotConfig(), parts_for(GRBM(3, 2), splits(d=3, bounds=box3)))
    with pytest.raises(ConfigError, match="no bounds"):
        build_density_plot(DensityPlotConfig(), parts_for(GRBM(2, 2), splits(d=2)))
    with pytest.raises(ConfigError, match="no 'val' split"):
        build_density_plot(DensityPlotConfig(split="val"), parts_for(GRBM(2, 2), splits(d=2, bounds=BOX)))


def test_evaluators_are_registered():
    from eblvm_core.plugins import load

    names = load(warn=False)["evaluators"].names()
    assert {"exact-loglik", "density-plot"} <= set(names)


def test_posterior_kl_against_enumeration():
    """The factorised closed form equals Σ_h q(h|v)[log q(h|v) + E(v, h)] + log Σ_h exp(−E(v, h)),
    computed over all 2^m hidden states; it is 0 at the exact posterior and positive elsewhere."""
    import itertools

    from eblvm.testing import make, tiny_grbm_setup

    setup = tiny_grbm_setup(d=2, m=3, coupling="plain")
    parts = setup.parts
    evaluate = make("evaluators", "posterior-kl", parts, n=16)
    assert abs(evaluate(parts).scalars["test_posterior_kl"]) < 1e-12
    setup.perturb(0.5, seed=1)
    got = evaluate(parts).scalars["test_posterior_kl"]
    v = parts.data.tensor("test", 16)
    hs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=3)), dtype=torch.float64)  # (8, 3)
    with torch.no_grad():
        log_q = setup.posterior.log_prob(hs[:, None].expand(-1, 16, -1), v)  # (8, 16)
        energy = setup.model.energy(v.repeat(8, 1), hs.repeat_interleave(16, 0)).view(8, 16)
        kl = (log_q.exp() * (log_q + energy)).sum(0) + torch.logsumexp(-energy, 0)
    assert got == pytest.approx(float(kl.mean()), rel=1e-9) and got > 1e-3


def test_posterior_kl_stays_exact_where_float32_probabilities_round_to_one():
    """Σ_j KL(Bern(σ(a_j)) ‖ Bern(σ(b_j))) from float32 logits equals the same KL computed from the
    probabilities in 50-digit decimal arithmetic, also at logits of 20-40, where σ rounds to 1 in
    float32 (the scaled-coupling GRBM's posterior logits grow there; the KL used to come out nan)."""
    from decimal import Decimal, localcontext

    from eblvm_grbm.evaluators import bernoulli_kl

    a = torch.tensor([[20.0, -25.0, 40.0, 3.0], [0.5, 30.0, -2.0, 17.5]])
    b = torch.tensor([[18.0, -30.0, 41.0, 3.001], [0.5, 33.0, -1.0, 18.0]])

    def exact(x: float, y: float) -> float:
        with localcontext(prec=50):
            q, p = 1 / (1 + (-Decimal(x)).exp()), 1 / (1 + (-Decimal(y)).exp())
            return float(q * (q / p).ln() + (1 - q) * ((1 - q) / (1 - p)).ln())

    want = [sum(exact(x, y) for x, y in zip(row_a.tolist(), row_b.tolist())) for row_a, row_b in zip(a, b)]
    got = bernoulli_kl(a, b)
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-24)
    assert got.dtype == torch.float64 and bool((got > 0).all())
