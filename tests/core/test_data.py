"""The batch pipeline: image folders read by DataLoader workers, sharding by rank, determinism per
(seed, epoch, rank), resume mid-epoch, and the image transforms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eblvm.testing import check_dataset, make
from eblvm_core.contracts import DataSplits, Parts
from eblvm_core.data import Batches, EpochOrder, ImageOptions, image_pipeline
from eblvm_core.errors import ConfigError

CPU = torch.device("cpu")


def write_images(folder: Path, n: int, size: tuple[int, int] = (6, 5), seed: int = 0) -> list[np.ndarray]:
    """n random RGB PNGs (H, W) = size, named so that sorted order is creation order; returns the pixels."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    pixels = []
    for i in range(n):
        array = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
        Image.fromarray(array).save(folder / f"img{i:03d}.png")
        pixels.append(array)
    return pixels


@pytest.fixture
def image_root(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    root = tmp_path / "images"
    train = write_images(root / "train" / "class_a", 8, seed=1) + write_images(root / "train" / "class_b", 8, seed=2)
    write_images(root / "test", 4, seed=3)
    return root, train


def folder_data(root: Path, **options) -> DataSplits:
    return make("datasets", "image-folder", Parts(), root=str(root), **options)


def stream(data: DataSplits, rank: int = 0, world: int = 1, batch: int = 4, seed: int = 5) -> Batches:
    return Batches(data, batch, seed, CPU, torch.float32, rank=rank, world_size=world)


def test_image_folder_loads_through_workers_with_shapes_and_range(image_root):
    root, train = image_root
    data = folder_data(root, workers=2)
    check_dataset(data)
    assert data.shape == (3, 6, 5) and data.size("train") == 16 and data.size("test") == 4 and not data.has("val")
    batches = stream(data)
    first = batches.next()
    assert first.shape == (4, 3, 6, 5) and first.dtype == torch.float32
    assert 0.0 <= float(first.min()) and float(first.max()) <= 1.0
    # exactly the files' pixels /255, in the epoch's order (class_a's images sort before class_b's)
    order = EpochOrder(16, 5)(0)[:4]
    expected = torch.stack([torch.from_numpy(train[i]).permute(2, 0, 1) for i in order.tolist()]).float() / 255
    torch.testing.assert_close(first, expected, rtol=0, atol=1e-7)
    symmetric = stream(folder_data(root, scale="symmetric")).next()
    torch.testing.assert_close(symmetric, 2 * expected - 1, rtol=0, atol=1e-6)


def test_grey_crop_and_resize(image_root):
    root, _ = image_root
    data = folder_data(root, channels=1, crop=4, size=8)
    assert data.shape == (1, 8, 8) and stream(data).next().shape == (4, 1, 8, 8)


def take(batches: Batches, n: int) -> list[torch.Tensor]:
    return [batches.next() for _ in range(n)]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: DataLoader processes
def test_batches_are_reproducible_per_seed_epoch_rank_and_shard_the_global_batch(image_root, workers):
    root, _ = image_root
    data = folder_data(root, workers=workers, flip=True, dequantize=True)
    run = take(stream(data, rank=0, world=2), 10)  # 4 epochs of 4 batches would be 16 global batches; 10 cross epochs
    again = take(stream(data, rank=0, world=2), 10)
    other_rank = take(stream(data, rank=1, world=2), 10)
    assert all(torch.equal(a, b) for a, b in zip(run, again))
    assert all(not torch.equal(a, b) for a, b in zip(run, other_rank))
    assert all(a.shape == (2, 3, 6, 5) for a in run)
    # without augmentation, the two ranks' halves are exactly one process's batch
    plain = folder_data(root, workers=workers)
    whole = take(stream(plain, world=1), 10)
    halves = zip(take(stream(plain, rank=0, world=2), 10), take(stream(plain, rank=1, world=2), 10))
    assert all(torch.equal(torch.cat(pair), w) for pair, w in zip(halves, whole))
    assert not all(torch.equal(a, b) for a, b in zip(take(stream(plain, seed=6), 4), whole[:4]))


def test_resume_mid_epoch_continues_the_same_stream(image_root):
    root, _ = image_root
    data = folder_data(root, workers=2, flip=True, dequantize=True)
    straight = stream(data)
    reference = take(straight, 9)
    first = stream(data)
    take(first, 6)  # 4 batches per epoch: stops inside epoch 1
    resumed = stream(data)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"epoch": 1, "pos": 2}
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 3), reference[6:]))


def test_epoch_order_is_a_function_of_seed_and_epoch():
    order = EpochOrder(50, 3)
    epochs = [order(e) for e in (0, 1, 2)]
    assert torch.equal(order(1), epochs[1]) and torch.equal(EpochOrder(50, 3)(2), epochs[2])
    generator = torch.Generator().manual_seed(3)
    assert all(torch.equal(torch.randperm(50, generator=generator), e) for e in epochs)  # one stream of draws
    assert sorted(epochs[0].tolist()) == list(range(50)) and not torch.equal(epochs[0], epochs[1])


def test_in_memory_batches_stay_on_their_tensor_and_drop_the_last_partial_batch():
    data = DataSplits(train=torch.arange(10.0).view(10, 1), test=torch.zeros(2, 1))
    batches = stream(data, batch=4)
    seen = torch.cat(take(batches, 2)).view(-1)
    assert sorted(seen.tolist()) == sorted(EpochOrder(10, 5)(0)[:8].tolist())  # 2 of 10 // 4 batches: the rest dropped
    assert batches.next().shape == (4, 1) and batches.state_dict() == {"epoch": 1, "pos": 1}


def test_dequantisation_keeps_the_mean_and_flips_are_horizontal():
    x = torch.full((4000, 1, 1, 2), 100, dtype=torch.uint8)
    x[..., 1] = 200
    prepare, augment = image_pipeline(ImageOptions(dequantize=True, flip=True))
    out = augment(prepare(x), torch.Generator().manual_seed(0))
    left = out[..., 0].flatten()
    low = (left < 150 / 256).float()  # not flipped: the 100s stay left
    assert 0.45 < float(low.mean()) < 0.55
    unflipped = left[left < 150 / 256] * 256
    assert 100 <= float(unflipped.min()) and float(unflipped.max()) < 101  # (x + u)/256, u in [0, 1)
    assert abs(float(unflipped.mean()) - 100.5) < 0.02


def test_missing_folders_are_recipe_errors_and_validate_stands_in(tmp_path):
    with pytest.raises(ConfigError, match="no images in") as info:
        folder_data(tmp_path / "nowhere")
    assert info.value.key == "root"
    dry = Parts(dry_run=True)
    data = make("datasets", "image-folder", dry, root=str(tmp_path / "nowhere"), size=16)
    assert data.shape == (3, 16, 16) and "checked with stand-in images" in dry.warnings[0]
