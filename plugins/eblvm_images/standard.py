"""The image data sets of the deep-EBLVM experiments: MNIST, CIFAR-10 and CelebA from a folder
(MNIST and CIFAR-10 downloaded through torchvision when the recipe allows it), and scikit-learn's
8×8 digits, which ship with scikit-learn and need no file: the built-in set for small runs.

MNIST, CIFAR-10 and digits are held in memory as uint8 images; CelebA is read from its JPEG
files by DataLoader workers. All are scaled to [0, 1] (or [−1, 1]) on the device, with optional
dequantisation noise and flips during training (``eblvm_core.data.ImageOptions``).

Every file is read inside ``data_file``: a truncated or damaged one (an interrupted download) is
one line naming it and what to do, as is a download through torchvision that fails.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, DataError, DataSplits, Parts, non_negative, option, positive
from eblvm.tools import ImageOptions, image_pipeline, reading
from eblvm_images.folder import ImageFiles

# What to do about a damaged file: one a data set downloads, and one it does not.
REFETCH = "delete it and download it again (-o data.download=true), or point data.root at a good copy"
REPLACE = "replace it with a good copy, or point data.root at a folder that holds one (-o data.root=/path)"


@contextlib.contextmanager
def data_file(path: Path, what: str, fix: str = REFETCH, also: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Within the block, what a truncated, damaged or unreadable ``path`` raises is one DataError
    naming it, the reader's reason and ``fix`` (``eblvm.tools.reading``, on [data] root). ``also``:
    errors of the file's format that ``reading`` does not catch (MATLAB's, torchvision's), handed to it as a ValueError with their message so that it words them alike."""
    with reading(path, what, fix=fix):
        try:
            yield
        except also as exc:
            lines = str(exc).strip().splitlines()
            raise ValueError(lines[0].rstrip(":") if lines else type(exc).__name__) from exc  # reading words it


def download(what: str, folder: Path, fetch: Callable[[], object]) -> None:
    """``fetch()``: torchvision downloading ``what`` into ``folder`` (and reading it back). A
    download that fails (no network, a file that fails its checksum) or a damaged file it reads (a
    half-downloaded archive) is one line naming the folder."""
    fix = f"delete what an interrupted download left in {folder} and try again, or put the files there yourself"
    with data_file(folder, f"{what} files torchvision downloads", fix, also=(RuntimeError,)):
        fetch()


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


@functools.cache
def _digits_read() -> tuple[Tensor, Tensor]:
    """scikit-learn's digits as images (1797, 1, 8, 8) uint8 0..255 and labels (1797,) int64, read
    once a process (parsing its text file takes some 25 ms; a search worker builds many runs)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(np.round(bunch.images * 255 / 16).astype(np.uint8)).unsqueeze(1)
    return images, torch.from_numpy(bunch.target.astype(np.int64))


def digits(cfg: DigitsConfig, parts: Parts) -> DataSplits:
    """scikit-learn's 1797 handwritten digits, 8×8 grey (16 grey levels stored as uint8 0..255), no file needed."""
    images, labels = _digits_read()  # indexed below: each run gets its own copies
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
    """An idx file (gzip'd or not) as a uint8 array shaped by its header; a truncated or damaged
    file (gzip's, or one whose header and size disagree) is a DataError naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    with data_file(path, "MNIST idx file"):
        with opener(path, "rb") as fh:
            raw = fh.read()
        if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
            raise ValueError("not an idx file of unsigned bytes")
        ndim = raw[3]
        dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
        data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
        if data.size != int(np.prod(dims)):
            raise ValueError(f"its header says {dims}, it holds {data.size} bytes of pixels")
        return data.reshape(dims)


def find_file(root: Path, name: str) -> Path | None:
    for folder in (root / "MNIST" / "raw", root / "raw", root):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def found_file(root: Path, name: str) -> Path:
    """``find_file`` of a file known to be there (checked before reading)."""
    path = find_file(root, name)
    if path is None:
        raise DataError(f"{root}: {name} is missing", key="root")
    return path


def mnist(cfg: MNISTConfig, parts: Parts) -> DataSplits:
    """MNIST (60,000 train + 10,000 test, 28×28 grey, padded to 32×32 by default) from its idx files."""
    root = Path(cfg.root).expanduser()
    side = 28 + 2 * cfg.pad
    names = [n for pair in MNIST_FILES.values() for n in pair]
    if any(find_file(root, n) is None for n in names) and cfg.download and not parts.dry_run:
        from torchvision.datasets import MNIST

        def fetch() -> None:
            for train in (True, False):
                MNIST(str(root), train=train, download=True)

        download("MNIST", root / "MNIST" / "raw", fetch)
    missing = [n for n in names if find_file(root, n) is None]
    if missing:
        return stand_in_or_fail(
            parts,
            f"no {missing[0]}(.gz) under {root} (looked in MNIST/raw/, raw/ and the folder; or set download = true)",
            (1, side, side),
            cfg,
        )
    splits: dict[str, Tensor] = {}
    labels: dict[str, Tensor] = {}
    for split, (images, targets) in MNIST_FILES.items():
        x = torch.from_numpy(read_idx(found_file(root, images)).copy()).unsqueeze(1)
        labels[split] = torch.from_numpy(read_idx(found_file(root, targets)).astype(np.int64))
        splits[split] = torch.nn.functional.pad(x, [cfg.pad] * 4)
    train, train_labels, val, val_labels = split_off_val(splits["train"], labels["train"], cfg.n_val)
    labels = {"train": train_labels, "test": labels["test"]}
    if val is not None and val_labels is not None:
        labels["val"] = val_labels
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


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One of the official python batches (pickled numpy arrays, the data set's own format) as
    uint8 images (N, 3, 32, 32) and labels; a truncated or damaged one is a DataError naming it."""
    with data_file(path, "CIFAR-10 batch", also=(AttributeError, TypeError)):
        with open(path, "rb") as fh:
            batch = pickle.load(fh, encoding="latin1")
        return np.asarray(batch["data"]).reshape(-1, 3, 32, 32), np.asarray(batch["labels"])


def read_batches(folder: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of several batches, concatenated."""
    read = [read_batch(folder / name) for name in names]
    return np.concatenate([x for x, _ in read]), np.concatenate([y for _, y in read])


def read_npz(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x_train, y_train (images (N, 3, 32, 32)), x_test, y_test from an .npz of (N, 32, 32, 3)
    uint8 images; a truncated or damaged archive is a DataError naming it."""
    with data_file(path, "CIFAR-10 .npz file", REPLACE), np.load(path) as archive:
        return (
            archive["x_train"].transpose(0, 3, 1, 2),
            archive["y_train"],
            archive["x_test"].transpose(0, 3, 1, 2),
            archive["y_test"],
        )


def cifar10(cfg: CIFAR10Config, parts: Parts) -> DataSplits:
    """CIFAR-10 (50,000 train + 10,000 test colour 32×32 images) from the official python batches or an npz file."""
    root = Path(cfg.root).expanduser()
    batches = root / "cifar-10-batches-py"
    if not batches.is_dir() and cfg.download and not parts.dry_run:
        from torchvision.datasets import CIFAR10

        download("CIFAR-10", root, lambda: CIFAR10(str(root), train=True, download=True))
    npz = sorted(root.glob("*.npz")) if root.is_dir() else []
    if batches.is_dir():
        x_train, y_train = read_batches(batches, [f"data_batch_{i}" for i in range(1, 6)])
        x_test, y_test = read_batches(batches, ["test_batch"])
    elif npz:
        x_train, y_train, x_test, y_test = read_npz(npz[0])
    else:
        return stand_in_or_fail(
            parts, f"no cifar-10-batches-py/ or .npz in {root} (or set download = true)", (3, 32, 32), cfg
        )
    train, train_labels, val, val_labels = split_off_val(
        torch.from_numpy(np.ascontiguousarray(x_train)), torch.from_numpy(y_train.astype(np.int64)).flatten(), cfg.n_val
    )
    labels = {"train": train_labels, "test": torch.from_numpy(y_test.astype(np.int64)).flatten()}
    if val is not None and val_labels is not None:
        labels["val"] = val_labels
    return in_memory(train, torch.from_numpy(np.ascontiguousarray(x_test)), labels, cfg, val)


# ---- SVHN --------------------------------------------------------------------------------------


@attrs.frozen
class SVHNConfig(ImageOptions):
    root: str = option(
        help="folder holding train_32x32.mat and test_32x32.mat (the cropped-digits format)", kw_only=True
    )
    download: bool = option(False, "download the files into root with torchvision when absent")


def read_svhn(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) and labels 0..9 (the file labels 0 as 10) of an SVHN .mat file; a
    truncated, damaged or other file is a DataError naming it."""
    import scipy.io

    with data_file(path, "SVHN .mat file", also=(scipy.io.matlab.MatReadError, TypeError)):
        content = scipy.io.loadmat(str(path))
        if "X" not in content or "y" not in content or content["X"].shape[:3] != (32, 32, 3):
            raise ValueError("expected variables X of shape (32, 32, 3, N) and y of the N labels")
        return content["X"].transpose(3, 2, 0, 1), content["y"].astype(np.int64).flatten() % 10


def svhn(cfg: SVHNConfig, parts: Parts) -> DataSplits:
    """SVHN cropped digits (73,257 train + 26,032 test colour 32×32 images) from its .mat files (an OOD set for CIFAR-10)."""
    root = Path(cfg.root).expanduser()
    files = {split: root / f"{split}_32x32.mat" for split in ("train", "test")}
    if not all(f.is_file() for f in files.values()) and cfg.download and not parts.dry_run:
        from torchvision.datasets import SVHN

        def fetch() -> None:
            for split in files:
                SVHN(str(root), split=split, download=True)

        download("SVHN", root, fetch)
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        return stand_in_or_fail(parts, f"{missing[0]} not found (or set download = true)", (3, 32, 32), cfg)
    splits, labels = {}, {}
    for split, path in files.items():
        x, y = read_svhn(path)
        splits[split], labels[split] = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
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


def read_partition(path: Path) -> dict[str, str]:
    """list_eval_partition.txt: each file name's split code (0 train, 1 val, 2 test); a damaged
    file is a DataError naming it."""
    fix = "replace it with CelebA's own, or remove it to split 80/10/10 in file order"
    with data_file(path, "CelebA partition file", fix):
        return dict(line.split() for line in path.read_text().splitlines() if line.strip())


def celeba(cfg: CelebAConfig, parts: Parts) -> DataSplits:
    """CelebA from its aligned JPEGs: centre-cropped, resized, split by list_eval_partition.txt (else 80/10/10 in file order)."""
    root = Path(cfg.root).expanduser()
    folder = root / "img_align_celeba"
    files = sorted(folder.glob("*.jpg")) if folder.is_dir() else []
    if not files:
        return stand_in_or_fail(parts, f"no JPEG files in {folder}", (3, cfg.size, cfg.size), cfg)
    partition = root / "list_eval_partition.txt"
    if partition.is_file():
        which = read_partition(partition)
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
