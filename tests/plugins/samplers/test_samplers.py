"""MALA, HMC and parallel tempering as registered samplers: the linear-Gaussian EBLVM's exact
marginal and joint (mean, covariance, the ESS in range), their diagnostics and the keys they
promise, what they refuse (one line naming [sampler] and the key), sample-grid's scalars, and
`eblvm sample --sampler NAME` writing samples, a figure and the diagnostics."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eblvm.plugin import ConfigError, DataSplits, EnergyModel, LatentSpec, Parts
from eblvm.testing import linear_gaussian_parts, make
from tests.plugins.samplers import checkerboard_grbm, grbm_parts

F64 = torch.float64


def joint_gaussian(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (d + m,) and covariance of (v, h) under the linear-Gaussian EBLVM: E is quadratic with
    precision [[λI, −W], [−Wᵀ, D]] and linear term (λb, c)."""
    d, m = model.W.shape
    lam, diag = model.log_lam.exp(), model.log_d.exp()
    precision = torch.cat(
        [torch.cat([lam * torch.eye(d, dtype=F64), -model.W], 1), torch.cat([-model.W.T, torch.diag(diag)], 1)]
    )
    cov = torch.linalg.inv(precision)
    return (cov @ torch.cat([lam * model.b, model.c])).detach(), cov.detach()


@pytest.mark.parametrize("name", ["mala", pytest.param("hmc", marks=pytest.mark.slow)])
@pytest.mark.parametrize("target", ["marginal", "joint"])
def test_gaussian_marginal_and_joint_are_drawn_with_their_exact_moments(name, target):
    """v's mean and covariance match the exact marginal's within 4 standard errors of the chains'
    own ESS (both targets return v; the joint one moves h too); the ESS of the energy is a fair share
    of the draws; the chains agree (R-hat < 1.05) and accept as the warm-up aimed."""
    model, _, parts = linear_gaussian_parts(d=3, m=2, seed=1)
    model.requires_grad_(False)
    mean, cov = joint_gaussian(model)
    mean, cov = mean[:3], cov[:3, :3]
    options = {"target": target, "n_chains": 100, "warmup": 200, "thin": 2, "n_projections": 3}
    if name == "hmc":
        options["leapfrog_steps"] = 3
    drawn = make("samplers", name, parts, **options).draw(model, 12_000, torch.Generator().manual_seed(0))
    samples, found = drawn.samples, drawn.diagnostics
    ess = found["ess_projections"]
    assert 0.05 * len(samples) < ess and 0.05 * len(samples) < found["ess_energy"] < 2 * len(samples)
    assert found["rhat_energy"] < 1.05 and found["rhat_projections"] < 1.05
    assert abs(found["acceptance"] - (0.574 if name == "mala" else 0.65)) < 0.15
    assert ((samples.mean(0) - mean).abs() < 4 * (cov.diagonal() / ess).sqrt()).all()
    assert (torch.cov(samples.T) - cov).abs().max() < 4 * math.sqrt(2 / ess) * float(cov.diagonal().max())


@pytest.mark.parametrize(
    "name, options",
    [
        ("mala", {"n_chains": 4, "warmup": 5}),
        ("hmc", {"n_chains": 4, "warmup": 5, "leapfrog_steps": 2}),
        ("tempering", {"n_chains": 4, "warmup": 5, "n_temps": 3}),
        ("tempering", {"n_chains": 4, "warmup": 5, "n_temps": 3, "moves": "mala"}),
        ("gibbs", {"n_chains": 4, "burn_in": 5}),
    ],
)
@pytest.mark.parametrize("n", [10, 16, 40])
def test_draw_returns_the_samples_sample_gives_and_the_keys_it_promises(name, options, n):
    """draw and sample agree for the same seed; the diagnostics' keys are diagnostics_keys(model, n)
    (ESS and R-hat from four kept states per chain on), each a finite number."""
    model = checkerboard_grbm()
    sampler = make("samplers", name, grbm_parts(model), **options)
    drawn = sampler.draw(model, n, torch.Generator().manual_seed(3))
    assert torch.equal(drawn.samples, sampler.sample(model, n, torch.Generator().manual_seed(3)))
    assert drawn.samples.shape == (n, 2)
    assert tuple(drawn.diagnostics) == sampler.diagnostics_keys(model, n)
    assert ("ess_energy" in drawn.diagnostics) == (n >= 16)
    assert all(math.isfinite(value) for value in drawn.diagnostics.values())


def test_hmc_reports_its_leapfrog_steps_and_tempering_one_swap_rate_per_pair():
    model = checkerboard_grbm()
    hmc = make("samplers", "hmc", grbm_parts(model), n_chains=4, warmup=5, leapfrog_steps=7)
    assert hmc.draw(model, 8, torch.Generator().manual_seed(0)).diagnostics["leapfrog_steps"] == 7
    tempering = make("samplers", "tempering", grbm_parts(model), n_chains=4, warmup=5, n_temps=5)
    keys = [k for k in tempering.draw(model, 8, torch.Generator().manual_seed(0)).diagnostics if "swap" in k]
    assert keys == ["swap_acceptance_0_1", "swap_acceptance_1_2", "swap_acceptance_2_3", "swap_acceptance_3_4"]


class GaussianLatentWithoutFreeEnergy(EnergyModel):
    """E(v, h) = ½‖v‖² + ½‖h‖² − vᵀh/2 with continuous h and no free energy declared."""

    latent = LatentSpec("gaussian", 2)

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones((), dtype=F64))

    def energy(self, v, h):
        return self.scale * (0.5 * (v**2).sum(-1) + 0.5 * (h**2).sum(-1) - 0.5 * (v * h).sum(-1))


@pytest.mark.parametrize(
    "name, options, model, key, says",
    [
        ("mala", {"target": "joint"}, "grbm", "target", "needs continuous (gaussian) h, GRBM has bernoulli h"),
        ("hmc", {"target": "marginal"}, "latent", "target", "has latent h and no free energy: use target = 'joint'"),
        ("tempering", {"moves": "gibbs"}, "latent", "moves", "has no block-Gibbs sweep: use moves = 'mala'"),
        ("tempering", {"n_temps": 1}, "grbm", "n_temps", "must be at least 2"),
        ("tempering", {"beta_min": 1.0}, "grbm", "beta_min", "must be between 0 and 1"),
        ("mala", {"target_acceptance": 0.0}, "grbm", "target_acceptance", "must be between 0 and 1"),
        ("hmc", {"leapfrog_steps": 0}, "grbm", "leapfrog_steps", "must be > 0"),
        ("hmc", {"step_jitter": 1.0}, "grbm", "step_jitter", "must be in [0.0, 0.99]"),
        ("mala", {"step_size": -0.1}, "grbm", "step_size", "must be > 0"),
    ],
)
def test_bad_options_are_one_line_naming_the_sampler_section_and_key(name, options, model, key, says):
    parts = grbm_parts(checkerboard_grbm())
    if model == "latent":
        parts.model = GaussianLatentWithoutFreeEnergy()
    with pytest.raises(ConfigError) as refused:
        make("samplers", name, parts, **options)
    assert (refused.value.section, refused.value.key) == ("sampler", key)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_joint_target_samples_a_model_without_free_energy_and_tempering_moves_it_by_mala():
    """auto picks the joint target where h is continuous and not summed out, and MALA moves for tempering."""
    parts = grbm_parts(checkerboard_grbm())
    parts.model = model = GaussianLatentWithoutFreeEnergy()
    parts.data = DataSplits(train=torch.randn(50, 2, dtype=F64), test=torch.randn(5, 2, dtype=F64))
    # per coordinate the joint precision is [[1, −½], [−½, 1]]: Var v = 1/(1 − ¼) = 4/3
    for name, options in (("mala", {}), ("tempering", {"n_temps": 3})):
        drawn = make("samplers", name, parts, n_chains=100, warmup=100, thin=2, **options).draw(model, 6000)
        assert float(drawn.samples.var(0).mean()) == pytest.approx(4 / 3, rel=0.15)
        assert "acceptance" in drawn.diagnostics


def test_sample_grid_reports_the_samplers_diagnostics_as_scalars():
    x = torch.rand(64, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    parts = Parts(data=DataSplits(train=x, test=x))
    parts.model = make("models", "grbm", parts, n_hidden=2)
    options = {"n_chains": 4, "warmup": 20}
    grid = make("evaluators", "sample-grid", parts, n=16, nrow=4, sampler="mala", sampler_options=options)
    result = grid(parts)
    assert tuple(result.scalars) == grid.reports == ("acceptance", "step_size", *grid.reports[2:])
    assert {"ess_energy", "rhat_energy", "ess_projections", "rhat_projections"} <= set(result.scalars)
    assert 0 < result.scalars["acceptance"] <= 1 and "samples" in result.images


def test_sample_command_writes_samples_a_figure_and_the_diagnostics(cli, trained, tmp_path):
    """`eblvm sample RUN` with MALA: the image, the raw samples and a .json of the diagnostics, each
    printed; the samples and diagnostics are LoadedRun.draw's for the same seed and overrides, and
    LoadedRun.sample still returns the bare samples."""
    import eblvm

    out, overrides = tmp_path / "mala.png", ["sampler.kind=mala", "sampler.warmup=20"]
    result = cli(["sample", trained, "-n", "64", "--out", out, *[x for o in overrides for x in ("-o", o)]])
    assert result.exit_code == 0, result.output
    written = json.loads(out.with_suffix(".json").read_text())
    assert written["sampler"] == "mala ([sampler])" and written["n"] == 64 and written["step"] == 30
    assert out.is_file() and torch.load(out.with_suffix(".pt")).shape == (64, 2)
    assert set(written["diagnostics"]) >= {"acceptance", "ess_energy", "rhat_projections"}
    for key, value in written["diagnostics"].items():
        assert f"{key}: {value:.4g}" in result.output
    run = eblvm.load(trained, overrides=overrides, echo=None)
    drawn = run.draw(64)
    assert drawn.diagnostics == written["diagnostics"]
    assert torch.equal(drawn.samples, torch.load(out.with_suffix(".pt")))
    assert torch.equal(run.sample(64), drawn.samples)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hmc", "mala", "tempering"])
def test_sample_command_with_each_new_sampler_at_its_defaults(cli, trained, tmp_path, name):
    out = tmp_path / f"{name}.png"
    result = cli(["sample", trained, "--sampler", name, "-n", "64", "--out", out])
    assert result.exit_code == 0, result.output
    written = json.loads(out.with_suffix(".json").read_text())
    assert written["sampler"] == f"{name} (defaults)" and out.is_file() and out.with_suffix(".pt").is_file()
    assert {"ess_energy", "rhat_energy"} <= set(written["diagnostics"])
    assert ("leapfrog_steps: 10" in result.output) == (name == "hmc")
    assert ("swap_acceptance_6_7" in result.output) == (name == "tempering")


def test_sample_command_refuses_a_bad_sampler_option_in_one_line(cli, trained, tmp_path):
    result = cli(
        ["sample", trained, "-o", "sampler.kind=tempering", "-o", "sampler.n_temps=1", "--out", tmp_path / "s.png"]
    )
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert "[sampler] n_temps: must be at least 2" in line
