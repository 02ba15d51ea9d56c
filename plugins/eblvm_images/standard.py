"""The image data sets of the deep-EBLVM experiments: MNIST, CIFAR-10 and CelebA from a folder
(MNIST and CIFAR-10 downloaded through torchvision when the recipe allows it), and scikit-learn's
8×8 digits, which ship with scikit-learn and need no file: the built-in set for small runs.

MNIST, CIFAR-10 and digits are held in memory as uint8 images; CelebA is read from its JPEG
files by DataLoader workers. All are scaled to [0, 1] (or [−1, 1]) on the device, with optional
dequantisation noise and flips during training (``eblvm_core.data.ImageOptions``).
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import attrs
import numpy as np
import torch
from torch import Tensor

from eblvm_core.plugin_api import (
    ConfigError,
    DataSplits,
    ImageOptions,
    Parts,
    image_pipeline,
    non_negative,
    option,
    positive,
)
from eblvm_images.folder import ImageFiles


def in_memory(
    train: Tensor, test: Tensor, labels: dict[str, Tensor], options: ImageOptions, val: Tensor | None = None
) -> DataSplits:
    """uint8 image splits (N, C, H, W) with labels, scaled on the device by ``options``."""
    prepare, augment = image_pipeline(options)
    low, high = (-1.0, 1.0) if options.scale == "symmetric" else (0.0, 1.0)
    return DataSplits(
        train=train,
        test=test,
        val=val,
        bounds=((low, high),) * train[0].numel(),
        prepare=prepare,
        augment=augment,
        labels=labels,
    )


def stand_in_or_fail(parts: Parts, message: str, shape: tuple[int, int, int], options: ImageOptions) -> DataSplits:
    """Under ``validate`` a warning and stand-in images; else a recipe error on [data] root."""
    if not parts.dry_run:
        raise ConfigError("", "root", message)
    parts.warn(f"[data] root: {message}; checked with stand-in images (run needs the files)")
    return DataSplits.stand_in(shape, (-1.0, 1.0) if options.scale == "symmetric" else (0.0, 1.0))


def split_off_val(train: Tensor, labels: Tensor, n_val: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The last ``n_val`` training examples as the validation split (the released code's MNIST/CIFAR split)."""
    if n_val == 0:
        return train, labels, None, None
    return train[:-n_val], labels[:-n_val], train[-n_val:], labels[-n_val:]


# ---- digits ------------------------------------------------------------------------------------


@attrs.frozen
class DigitsConfig(ImageOptions):
    n_test: int = option(360, "test images (the rest, of 1797, train)", positive)
    split_seed: int = option(0, "seed of the fixed permutation that splits the images")


def digits(cfg: DigitsConfig, parts: Parts) -> DataSplits:
    """scikit-learn's 1797 handwritten digits, 8×8 grey (16 grey levels stored as uint8 0..255), no file needed."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(np.round(bunch.images * 255 / 16).astype(np.uint8)).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    if cfg.n_test >= len(images):
        raise ConfigError("", "n_test", f"must leave training images: there are {len(images)}")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(cfg.split_seed))
    test, train = order[: cfg.n_test], order[cfg.n_test :]
    return in_memory(images[train], images[test], {"train": labels[train], "test": labels[test]}, cfg)


# ---- MNIST -------------------------------------------------------------------------------------

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@attrs.frozen
class MNISTConfig(ImageOptions):
    root: str = option(
        help="folder holding MNIST/raw/ (or raw/, or the files themselves): the four idx files, gzip'd or not",
        kw_only=True,
    )
    pad: int = option(2, "zero pixels added on each side (2: 32×32, as the papers)", non_negative)
    n_val: int = option(
        0, "validation images taken from the end of the training set (the released code: 10,000)", non_negative
    )
    download: bool = option(False, "download the files into root with torchvision when they are absent")


def read_idx(path: Path) -> np.ndarray:
    """An idx file (gzip'd or not) as a uint8 array shaped by its header."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path} is not an idx file of unsigned bytes")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, the file holds {data.size} bytes")
    return data.reshape(dims)


def find_file(root: Path, name: str) -> Path | None:
    for folder in (root / "MNIST" / "raw", root / "raw", root):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def mnist(cfg: MNISTConfig, parts: Parts) -> DataSplits:
    """MNIST (60,000 train + 10,000 test, 28×28 grey, padded to 32×32 by default) from its idx files."""
    root = Path(cfg.root).expanduser()
    side = 28 + 2 * cfg.pad
    names = [n for pair in MNIST_FILES.values() for n in pair]
    if any(find_file(root, n) is None for n in names) and cfg.download and not parts.dry_run:
        from torchvision.datasets import MNIST

        MNIST(str(root), train=True, download=True)
        MNIST(str(root), train=False, download=True)
    missing = [n for n in names if find_file(root, n) is None]
    if missing:
        return stand_in_or_fail(
            parts,
            f"no {missing[0]}(.gz) under {root} (looked in MNIST/raw/, raw/ and the folder; or set download = true)",
            (1, side, side),
            cfg,
        )
    splits, labels = {}, {}
    for split, (images, targets) in MNIST_FILES.items():
        try:
            x = torch.from_numpy(read_idx(find_file(root, images)).copy()).unsqueeze(1)
            labels[split] = torch.from_numpy(read_idx(find_file(root, targets)).astype(np.int64))
        except ValueError as exc:
            raise ConfigError("", "root", str(exc)) from None
        splits[split] = torch.nn.functional.pad(x, [cfg.pad] * 4)
    train, train_labels, val, val_labels = split_off_val(splits["train"], labels["train"], cfg.n_val)
    labels = {"train": train_labels, "test": labels["test"], **({"val": val_labels} if val is not None else {})}
    return in_memory(train, splits["test"], labels, cfg, val)


# ---- CIFAR-10 ----------------------------------------------------------------------------------


@attrs.frozen
class CIFAR10Config(ImageOptions):
    root: str = option(
        help="folder holding cifar-10-batches-py/ (the official python version) or an .npz with x_train, y_train, "
        "x_test, y_test (N, 32, 32, 3) uint8",
        kw_only=True,
    )
    n_val: int = option(
        0, "validation images taken from the end of the training set (the released code: 10,000)", non_negative
    )
    download: bool = option(False, "download cifar-10-batches-py into root with torchvision when absent")


def cifar10(cfg: CIFAR10Config, parts: Parts) -> DataSplits:
    """CIFAR-10 (50,000 train + 10,000 test colour 32×32 images) from the official python batches or an npz file."""
    root = Path(cfg.root).expanduser()
    batches = root / "cifar-10-batches-py"
    if not batches.is_dir() and cfg.download and not parts.dry_run:
        from torchvision.datasets import CIFAR10

        CIFAR10(str(root), train=True, download=True)
    npz = sorted(root.glob("*.npz")) if root.is_dir() else []
    if batches.is_dir():

        def load(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
            parts_ = []
            for name in names:
                with open(batches / name, "rb") as fh:  # the data set's own format: pickled numpy arrays
                    parts_.append(pickle.load(fh, encoding="latin1"))
            x = np.concatenate([p["data"] for p in parts_]).reshape(-1, 3, 32, 32)
            return x, np.concatenate([p["labels"] for p in parts_])

        x_train, y_train = load([f"data_batch_{i}" for i in range(1, 6)])
        x_test, y_test = load(["test_batch"])
    elif npz:
        with np.load(npz[0]) as archive:
            x_train, y_train = archive["x_train"].transpose(0, 3, 1, 2), archive["y_train"]
            x_test, y_test = archive["x_test"].transpose(0, 3, 1, 2), archive["y_test"]
    else:
        return stand_in_or_fail(
            parts, f"no cifar-10-batches-py/ or .npz in {root} (or set download = true)", (3, 32, 32), cfg
        )
    train, train_labels, val, val_labels = split_off_val(
        torch.from_numpy(np.ascontiguousarray(x_train)), torch.from_numpy(y_train.astype(np.int64)).flatten(), cfg.n_val
    )
    labels = {"train": train_labels, "test": torch.from_numpy(y_test.astype(np.int64)).flatten()}
    if val is not None:
        labels["val"] = val_labels
    return in_memory(train, torch.from_numpy(np.ascontiguousarray(x_test)), labels, cfg, val)


# ---- SVHN --------------------------------------------------------------------------------------


@attrs.frozen
class SVHNConfig(ImageOptions):
    root: str = option(
        help="folder holding train_32x32.mat and test_32x32.mat (the cropped-digits format)", kw_only=True
    )
    download: bool = option(False, "download the files into root with torchvision when absent")


def svhn(cfg: SVHNConfig, parts: Parts) -> DataSplits:
    """SVHN cropped digits (73,257 train + 26,032 test colour 32×32 images) from its .mat files (an OOD set for CIFAR-10)."""
    import scipy.io

    root = Path(cfg.root).expanduser()
    files = {split: root / f"{split}_32x32.mat" for split in ("train", "test")}
    if not all(f.is_file() for f in files.values()) and cfg.download and not parts.dry_run:
        from torchvision.datasets import SVHN

        for split in files:
            SVHN(str(root), split=split, download=True)
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        return stand_in_or_fail(parts, f"{missing[0]} not found (or set download = true)", (3, 32, 32), cfg)
    splits, labels = {}, {}
    for split, path in files.items():
        content = scipy.io.loadmat(str(path))
        if "X" not in content or content["X"].shape[:3] != (32, 32, 3):
            raise ConfigError("", "root", f"{path}: expected a variable X of shape (32, 32, 3, N)")
        splits[split] = torch.from_numpy(np.ascontiguousarray(content["X"].transpose(3, 2, 0, 1)))
        labels[split] = torch.from_numpy(content["y"].astype(np.int64).flatten() % 10)  # the file labels 0 as 10
    return in_memory(splits["train"], splits["test"], labels, cfg)


# ---- CelebA ------------------------------------------------------------------------------------


@attrs.frozen
class CelebAConfig(ImageOptions):
    root: str = option(
        help="folder holding img_align_celeba/ (the aligned JPEGs) and, optionally, list_eval_partition.txt",
        kw_only=True,
    )
    size: int = option(64, "side after the centre crop and resize (the papers: 32 or 64)", positive)
    crop: int = option(140, "side of the centre crop of the 178×218 aligned images", positive)


def celeba(cfg: CelebAConfig, parts: Parts) -> DataSplits:
    """CelebA from its aligned JPEGs: centre-cropped, resized, split by list_eval_partition.txt (else 80/10/10 in file order)."""
    root = Path(cfg.root).expanduser()
    folder = root / "img_align_celeba"
    files = sorted(folder.glob("*.jpg")) if folder.is_dir() else []
    if not files:
        return stand_in_or_fail(parts, f"no JPEG files in {folder}", (3, cfg.size, cfg.size), cfg)
    partition = root / "list_eval_partition.txt"
    if partition.is_file():
        which = dict(line.split() for line in partition.read_text().splitlines() if line.strip())
        groups = {
            s: [f for f in files if which.get(f.name) == code]
            for s, code in (("train", "0"), ("val", "1"), ("test", "2"))
        }
    else:
        a, b = int(0.8 * len(files)), int(0.9 * len(files))
        groups = {"train": files[:a], "val": files[a:b], "test": files[b:]}
    if not groups["train"] or not groups["test"]:
        raise ConfigError(
            "", "root", f"{partition if partition.is_file() else folder} leaves no train or no test images"
        )
    splits = {s: ImageFiles(fs, 3, cfg.crop, cfg.size) if fs else None for s, fs in groups.items()}
    prepare, augment = image_pipeline(cfg)
    low, high = (-1.0, 1.0) if cfg.scale == "symmetric" else (0.0, 1.0)
    return DataSplits(
        train=splits["train"],
        test=splits["test"],
        val=splits["val"],
        event_shape=(3, cfg.size, cfg.size),
        bounds=((low, high),) * (3 * cfg.size * cfg.size),
        prepare=prepare,
        augment=augment,
        workers=cfg.workers,
    )
