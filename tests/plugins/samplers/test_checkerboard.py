"""Each sampler's histogram on the checkerboard GRBM against its exact density, and parallel
tempering finding both modes of a two-mode GRBM that Gibbs sampling, started in one, never leaves."""

from __future__ import annotations

import pytest
import torch
from eblvm_grbm.model import GRBM

from eblvm.testing import make
from tests.plugins.samplers import checkerboard_grbm, exact_draws, grbm_parts, total_variation

N = 40_000
# 40,000 independent draws of the checkerboard GRBM land within TV 0.020-0.021 of its exact cell masses on
# the 20 × 20 grid (seeds 0-2); a sampler whose draws are right but correlated lands a little further.
MAX_TV = 0.035

SAMPLERS = [
    pytest.param("gibbs", {"burn_in": 200, "n_chains": 2000, "n_steps": 5}, id="gibbs"),
    pytest.param("mala", {"n_chains": 2000, "warmup": 200, "thin": 5}, id="mala"),
    pytest.param(
        "hmc", {"n_chains": 2000, "warmup": 200, "thin": 2, "leapfrog_steps": 5}, id="hmc", marks=pytest.mark.slow
    ),
    pytest.param(
        "tempering",
        {"n_chains": 2000, "warmup": 200, "thin": 5, "n_temps": 4},
        id="tempering-gibbs",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "tempering",
        {"n_chains": 2000, "warmup": 200, "thin": 5, "n_temps": 4, "moves": "mala"},
        id="tempering-mala",
        marks=pytest.mark.slow,
    ),
]


def test_independent_draws_set_the_noise_floor_the_threshold_stands_on():
    """The threshold's basis, and its bite: exact draws are within it; draws of a GRBM with σ 10% off are not."""
    model = checkerboard_grbm()
    assert total_variation(exact_draws(model, N, seed=0), model) < 0.022
    wider = checkerboard_grbm()
    with torch.no_grad():
        wider.log_sigma += 0.1
    assert total_variation(exact_draws(wider, N, seed=0), model) > 2 * MAX_TV


@pytest.mark.parametrize("name, options", SAMPLERS)
def test_histogram_matches_the_exact_checkerboard_density(name, options):
    """40,000 samples within total variation 0.035 of the exact cell masses of a 20 × 20 grid."""
    model = checkerboard_grbm()
    sampler = make("samplers", name, grbm_parts(model), **options)
    samples = sampler.sample(model, N, torch.Generator().manual_seed(0))
    assert samples.shape == (N, 2)
    assert total_variation(samples, model) < MAX_TV


def two_mode_grbm() -> GRBM:
    """d = 1, one hidden unit: p(v) = ½ N(−6, 1) + ½ N(6, 1) (b = −6, U = 12, c = −bU − ½U² = 0, σ = 1).
    From the left mode h turns on only where v nears 0, six standard deviations out (p(h = 1 | v = −6)
    = sigmoid(−72)): about once in 10⁹ sweeps, so a Gibbs chain keeps to its mode."""
    model = GRBM(1, 1, coupling="plain").double()
    with torch.no_grad():
        model.W.fill_(12.0)
        model.b.fill_(-6.0)
        model.c.fill_(0.0)
        model.log_sigma.fill_(0.0)
    return model.requires_grad_(False).eval()


def test_tempering_recovers_both_modes_where_gibbs_keeps_to_the_one_it_starts_in():
    """Every chain starts at v = −6 (the data are that point). Gibbs: no sample reaches v > 0. Parallel
    tempering with Gibbs moves over 8 temperatures down to β = 0.01: half the samples (±0.05) in the
    right mode, split R-hat near 1, and each neighbouring pair swapping often enough to carry them."""
    model = two_mode_grbm()
    parts = grbm_parts(model)
    parts.data = type(parts.data)(train=torch.full((10, 1), -6.0, dtype=torch.float64), test=parts.data.test[:, :1])
    generator = torch.Generator().manual_seed(0)
    gibbs = make("samplers", "gibbs", parts, burn_in=200, n_chains=200, n_steps=2, init="data")
    assert (gibbs.sample(model, 4000, generator) > 0).sum() == 0
    tempering = make(
        "samplers", "tempering", parts, n_temps=8, beta_min=0.01, n_chains=200, warmup=300, thin=5, init="data"
    )
    drawn = tempering.draw(model, 4000, generator)
    assert float((drawn.samples > 0).double().mean()) == pytest.approx(0.5, abs=0.05)
    assert drawn.diagnostics["rhat_projections"] < 1.1
    swaps = [value for key, value in drawn.diagnostics.items() if key.startswith("swap_acceptance_")]
    assert len(swaps) == 7 and min(swaps) > 0.2
