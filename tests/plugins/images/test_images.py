"""Frey face loading and splitting, the sample-grid evaluator and the Frey face recipes.

Every test builds a tiny stand-in ``frey_rawface.mat`` in tmp_path; only the last one reads the
real file, when ``EBLVM_DATA_ROOT`` points at a folder holding ``frey/frey_rawface.mat``.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import numpy as np
import pytest
import scipy.io
import torch
from eblvm_images.freyface import FreyFaceConfig, freyface
from eblvm_metrics.samples import SampleGridConfig, build_sample_grid

from eblvm_core.contracts import DataSplits, Parts
from eblvm_core.errors import ConfigError, DataError
from eblvm_core.plugins import registry
from tests.support import RECIPES


def frey_images(n: int) -> np.ndarray:
    """n distinct uint8 images (n, 28, 20): image i starts at 7i mod 256 and counts up pixel by pixel,
    so every image holds 0 and 255 and no two images (n <= 256) share their first pixel."""
    return ((7 * np.arange(n)[:, None] + np.arange(560)[None, :]) % 256).astype(np.uint8).reshape(n, 28, 20)


def write_frey(folder: Path, images: np.ndarray, key: str = "ff") -> Path:
    """Save images (n, 28, 20) as Roweis' file does: variable ``ff`` of shape (560, n)."""
    folder.mkdir(parents=True, exist_ok=True)
    scipy.io.savemat(folder / "frey_rawface.mat", {key: images.reshape(len(images), 560).T})
    return folder


def load(root: Path, **sizes: int | None) -> DataSplits:
    return freyface(FreyFaceConfig(root=str(root), **sizes), Parts())


@pytest.fixture
def frey_root(tmp_path: Path) -> Path:
    return write_frey(tmp_path / "frey", frey_images(30))


def test_frames_are_images_scaled_and_split_in_file_order(frey_root):
    data = load(frey_root, n_train=20, n_val=6, n_test=4)
    expected = torch.from_numpy(frey_images(30).reshape(30, 1, 28, 20).astype(np.float32) / 255)
    assert (
        data.train.shape == (20, 1, 28, 20) and data.val.shape == (6, 1, 28, 20) and data.test.shape == (4, 1, 28, 20)
    )
    assert data.image_shape == (1, 28, 20) and data.dim == 560
    assert torch.equal(torch.cat([data.train, data.val, data.test]), expected)  # sequential, as in the papers
    assert data.train.min() == 0.0 and data.train.max() == 1.0
    # ff.T.reshape(-1, 28, 20) is the image: row-major 28 rows of 20 pixels
    assert torch.equal(data.train[3, 0], torch.from_numpy(frey_images(30)[3] / np.float32(255)))


def test_val_can_be_empty_and_sizes_must_fit_the_file(frey_root):
    data = load(frey_root, n_train=25, n_val=0, n_test=5)
    assert data.val is None and len(data.train) == 25 and len(data.test) == 5
    with pytest.raises(ConfigError, match="exceeds the 30 images"):
        load(frey_root, n_train=20, n_val=6, n_test=5)


def test_seeded_split_is_a_fixed_permutation(frey_root):
    first = load(frey_root, n_train=20, n_val=6, n_test=4, split_seed=3)
    again = load(frey_root, n_train=20, n_val=6, n_test=4, split_seed=3)
    other = load(frey_root, n_train=20, n_val=6, n_test=4, split_seed=4)
    for a, b in [(first.train, again.train), (first.val, again.val), (first.test, again.test)]:
        assert torch.equal(a, b)
    assert not torch.equal(first.train, other.train)
    firsts = torch.cat([first.train, first.val, first.test]).flatten(1)[:, 0]  # the first pixel identifies the image
    assert sorted((firsts * 255).round().long().tolist()) == sorted(frey_images(30)[:, 0, 0].tolist())
    assert not torch.equal(first.train, load(frey_root, n_train=20, n_val=6, n_test=4).train)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(DataError, match="not found") as info:
        load(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / "frey_rawface.mat") in str(info.value) and "data.root" in str(info.value)


def test_wrong_key_or_shape_names_the_path(tmp_path):
    root = write_frey(tmp_path / "a", frey_images(5), key="faces")
    with pytest.raises(DataError, match="no variable 'ff'.*faces") as info:
        load(root, n_train=2, n_val=1, n_test=1)
    assert str(root / "frey_rawface.mat") in str(info.value)

    (tmp_path / "b").mkdir()
    scipy.io.savemat(tmp_path / "b" / "frey_rawface.mat", {"ff": np.zeros((28, 20), np.uint8)})
    with pytest.raises(DataError, match=r"uint8 \(560, N\)") as info:
        load(tmp_path / "b", n_train=2, n_val=1, n_test=1)
    assert str(tmp_path / "b" / "frey_rawface.mat") in str(info.value)

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "frey_rawface.mat").write_text("not a MATLAB file")
    with pytest.raises(DataError, match="not a readable MATLAB file") as info:
        load(tmp_path / "c", n_train=2, n_val=1, n_test=1)
    assert str(tmp_path / "c" / "frey_rawface.mat") in str(info.value)


# ---- sample-grid ---------------------------------------------------------------------------

needs_gibbs = pytest.mark.skipif("gibbs" not in registry("samplers"), reason="sampler 'gibbs' is not registered yet")


def tiny_parts(image_shape: tuple[int, ...] | None) -> Parts:
    """A GRBM on 6 numbers in [0, 1] per example, shaped as the given image (else vectors)."""
    from eblvm_grbm.model import GRBM

    torch.manual_seed(0)
    train = torch.rand(50, *(image_shape or (6,)))
    model = GRBM(6, 3, init_sigma=0.3)
    with torch.no_grad():
        model.b.fill_(0.5)
    return Parts(data=DataSplits(train=train, test=train[:10]), model=model)


@needs_gibbs
def test_sample_grid_tiles_reproducible_samples_in_unit_range():
    parts = tiny_parts((1, 2, 3))
    cfg = SampleGridConfig(n=5, nrow=3, padding=2, scale=1, sampler_options={"burn_in": 3})
    evaluate = build_sample_grid(cfg, parts)
    grid = evaluate(parts).images["samples"]
    # 3 columns × 2 rows of 2×3 tiles with 2-pixel borders, not upscaled (scale = 1)
    assert grid.shape == (3, 2 * (2 + 2) + 2, 3 * (3 + 2) + 2)
    assert grid.min() >= 0 and grid.max() <= 1
    assert torch.equal(grid, evaluate(parts).images["samples"])  # fixed seed: the same image every time

    sampler = registry("samplers").get("gibbs")
    gibbs = sampler.factory(sampler.config(burn_in=3), parts)
    samples = gibbs.sample(parts.model, 5, torch.Generator().manual_seed(cfg.seed)).clamp(0, 1)
    assert torch.allclose(grid[:, 2:4, 2:5], samples[0].reshape(2, 3).expand(3, 2, 3))  # the first tile
    assert torch.allclose(grid[:, 6:8, 7:10], samples[4].reshape(2, 3).expand(3, 2, 3))  # row 2, column 2
    assert (grid[:, :2] == 1).all()  # white border
    # by default each pixel is repeated 32 × 32 times: the 2-pixel-high tiles become 64 pixels high
    upscaled = build_sample_grid(attrs.evolve(cfg, scale=0), parts)(parts).images["samples"]
    assert torch.equal(upscaled, grid.repeat_interleave(32, 1).repeat_interleave(32, 2))


@needs_gibbs
def test_sample_grid_refuses_bad_settings():
    with pytest.raises(ConfigError, match="no image shape"):
        build_sample_grid(SampleGridConfig(), tiny_parts(None))
    with pytest.raises(ConfigError, match="unknown sampler 'gibs'") as info:
        build_sample_grid(SampleGridConfig(sampler="gibs"), tiny_parts((1, 2, 3)))
    assert info.value.key == "sampler"
    with pytest.raises(ConfigError, match="unknown key") as info:
        build_sample_grid(SampleGridConfig(sampler_options={"burnin": 3}), tiny_parts((1, 2, 3)))
    assert info.value.key == "sampler_options.burnin"


# ---- recipes -------------------------------------------------------------------------------

TINY = [
    "run.steps=3",
    "run.batch_size=10",
    "run.log_every=1",
    "model.n_hidden=8",
    "data.n_train=20",
    "data.n_val=5",
    "data.n_test=5",
    "eval.0.n=4",
    "eval.0.sampler_options.burn_in=5",
    "eval.1.n_chains=8",
    "eval.1.n_temps=5",
]


def skip_unless_registered(name: str) -> None:
    """Skip when a component the recipe ``name`` uses is not registered yet."""
    from eblvm_core.recipe import SINGLE, read

    raw = read(RECIPES / f"{name}.toml")
    used = [(kind, raw[label]["kind"]) for label, kind in SINGLE.items() if label in raw]
    used += [("evaluators", e["kind"]) for e in raw.get("eval", [])] + [("samplers", "gibbs")]
    for kind, needed in used:
        if needed not in registry(kind):
            pytest.skip(f"{kind[:-1]} '{needed}' that {name}.toml uses is not registered yet")


@pytest.mark.parametrize("name", ["freyface_bidsm", "freyface_dsm"])
def test_freyface_recipe_runs_on_a_stand_in_file(cli, tmp_path, frey_root, name):
    skip_unless_registered(name)
    out = tmp_path / "runs"
    overrides = [a for o in [f"data.root={frey_root}", *TINY] for a in ("-o", o)]
    result = cli(["run", RECIPES / f"{name}.toml", *overrides, "--out", out, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "ais-loglik/test_loglik:" in result.output
    (run_dir,) = (out / name).iterdir()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert "eval/sample-grid/samples" in events.Tags()["images"]


def test_freyface_recipe_needs_the_file(cli, tmp_path):
    skip_unless_registered("freyface_dsm")
    result = cli(["run", RECIPES / "freyface_dsm.toml", "-o", f"data.root={tmp_path}", "--out", tmp_path / "runs"])
    assert result.exit_code == 2
    assert str(tmp_path / "frey_rawface.mat") in result.output


@pytest.mark.skipif(not os.environ.get("EBLVM_DATA_ROOT"), reason="EBLVM_DATA_ROOT is not set (real Frey face file)")
def test_real_frey_face_file():
    root = Path(os.environ["EBLVM_DATA_ROOT"]) / "frey"
    if not (root / "frey_rawface.mat").is_file():
        pytest.skip(f"{root / 'frey_rawface.mat'} is absent")
    data = load(root)
    assert (len(data.train), len(data.val), len(data.test)) == (1400, 300, 265)
    assert len(data.train) + len(data.val) + len(data.test) == 1965
    # the training statistics the papers' code records for this split
    assert data.train.mean().item() == pytest.approx(0.6049, abs=1e-4)
    assert data.train.std(unbiased=False).item() == pytest.approx(0.1763, abs=1e-4)
