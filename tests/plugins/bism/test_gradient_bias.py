"""The gradient-bias diagnostic (BiSM Fig. 1, Theorem 2) on a GRBM near its exact posterior."""

from __future__ import annotations

import attrs
import pytest
from eblvm_bism.diagnostics import GradientBias, GradientBiasConfig
from eblvm_divergences import KL
from eblvm_score.objectives import DSM, SSM

from eblvm.testing import tiny_grbm_setup
from eblvm_core.errors import ConfigError


def test_bias_decays_geometrically_with_unrolling():
    setup = tiny_grbm_setup(n=64)
    setup.perturb(0.3, seed=0)  # φ starts near, not at, the exact posterior
    parts = setup.parts.evolve(objective=DSM(0.3), divergence=KL(n_samples=16))
    cfg = GradientBiasConfig(unroll_steps=[0, 4, 8, 16], inner_steps=[0], inner_lr=3.0, n_repeats=5)
    scalars = GradientBias(cfg, parts)(parts).scalars
    bias = [scalars[f"bias_K0_N{n}"] for n in cfg.unroll_steps]
    assert all(b < a for a, b in zip(bias, bias[1:])), bias
    # roughly geometric: each doubling of N removes a comparable fraction of what is left
    assert bias[3] < 0.35 * bias[0], bias
    assert bias[1] / bias[0] < 0.8 and bias[3] / bias[2] < 0.8, bias
    # even at φ* itself the partial derivative (N = 0) is biased: φ* depends on θ (BiSM Sec. 3),
    # and unrolling recovers that dependence
    setup.reset()
    at_exact = GradientBias(attrs.evolve(cfg, unroll_steps=[0, 16]), parts)(parts).scalars
    assert at_exact["bias_K0_N0"] > 0.1 * at_exact["reference_norm"], at_exact
    assert at_exact["bias_K0_N16"] < 0.35 * at_exact["bias_K0_N0"], at_exact


def test_bias_refuses_what_it_cannot_measure():
    setup = tiny_grbm_setup()
    with pytest.raises(ConfigError, match="value-only"):
        GradientBias(GradientBiasConfig(), setup.parts.evolve(objective=SSM(), divergence=KL()))


@pytest.mark.slow
def test_the_reported_standard_error_shrinks_with_repeats_and_bounds_a_vanishing_bias():
    """At the exact posterior with N large the unrolled hypergradient is unbiased, so the norm of
    the mean's error is Monte-Carlo noise: within two reported standard errors, and the standard
    error halves when the repeats quadruple. With N = 0 the bias is real and many errors away."""
    setup = tiny_grbm_setup(n=64)
    parts = setup.parts.evolve(objective=DSM(0.3), divergence=KL(n_samples=16))
    few, many = (
        GradientBias(GradientBiasConfig(unroll_steps=[0, 64], inner_steps=[0], inner_lr=3.0, n_repeats=r), parts)(
            parts
        ).scalars
        for r in (6, 24)
    )
    assert 0.35 < many["bias_K0_N64_stderr"] / few["bias_K0_N64_stderr"] < 0.7, (few, many)
    assert many["bias_K0_N64"] < 2 * many["bias_K0_N64_stderr"], many
    assert many["bias_K0_N0"] > 10 * many["bias_K0_N0_stderr"], many
