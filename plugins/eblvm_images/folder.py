"""A folder of image files as a data set, read by DataLoader workers.

The folder holds one subfolder per split (``train``, ``test``, optionally ``val``); images are
found recursively in each (class subfolders are allowed and ignored), sorted by path. Each is
decoded to uint8 (C, H, W), centre-cropped and resized as configured; scaling to [0, 1] or
[−1, 1], dequantisation noise and flips happen on the device (``eblvm_core.data``).

Before the first step every file's header is read (its size, not its pixels: about 50 µs a small
PNG whose file is in the page cache, a quarter of a second for 5,000), so a file that is not an
image, or images of different sizes without ``size``, are one line naming the file then, not a
failure inside a worker mid-run; the first training image is decoded too. A file damaged past its
header is named when a worker decodes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs
import torch
from torch import Tensor
from torch.utils.data import Dataset

from eblvm.plugin import ConfigError, DataError, DataSplits, Parts, option, positive
from eblvm.tools import ImageOptions, image_pipeline, reading

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}
DAMAGED = "copy it again or remove it"  # what to do about an image file that cannot be decoded


@attrs.frozen
class ImageFolderConfig(ImageOptions):
    root: str = option(help="folder with train/ and test/ (and optionally val/) subfolders of images", kw_only=True)
    channels: Literal[1, 3] = option(3, "1 (grey) or 3 (RGB) channels")
    crop: int | None = option(None, "centre crop to this square side before resizing (CelebA: 140)", positive)
    size: int | None = option(
        None, "resize to size × size (None: the images' own size, which must then agree)", positive
    )
    skip_unreadable: bool = option(
        False,
        "leave out files whose header cannot be read (not an image, cut short before its size), with a warning "
        "that counts them; false: the first such file is an error",
    )


class ImageFiles(Dataset):
    """Image files -> uint8 (C, H, W) tensors, centre-cropped and resized; a file that cannot be
    decoded is a DataError naming it (raised in the DataLoader worker that reads it)."""

    def __init__(self, paths: list[Path], channels: int, crop: int | None, size: int | None):
        self.paths, self.channels, self.crop, self.size = paths, channels, crop, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tensor:
        import numpy as np
        from PIL import Image
        from torchvision.transforms.v2 import functional as TF

        path = self.paths[index]
        with reading(path, "image", fix=DAMAGED), Image.open(path) as file:
            pixels = np.asarray(file.convert("RGB" if self.channels == 3 else "L"))
        image = torch.from_numpy(pixels.copy()).view(*pixels.shape[:2], self.channels).permute(2, 0, 1)
        if self.crop is not None:
            image = TF.center_crop(image, [self.crop, self.crop])
        if self.size is not None:
            image = TF.resize(image, [self.size, self.size], antialias=True)
        return image


def list_images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())


def header_size(path: Path, fix: str) -> tuple[int, int]:
    """(width, height) of an image file from its header alone (the pixels are not decoded)."""
    from PIL import Image

    with reading(path, "image", fix=fix), Image.open(path) as image:
        return image.size


def readable(listed: dict[str, list[Path]], skip: bool, parts: Parts) -> dict[str, list[tuple[Path, tuple[int, int]]]]:
    """Each split's files with their (width, height) read from their headers. A file whose header
    cannot be read is the error, or with ``skip`` left out, the warning counting them and
    naming the first."""
    fix = "" if skip else "replace or remove it, or set skip_unreadable = true to leave such files out"
    found: dict[str, list[tuple[Path, tuple[int, int]]]] = {}
    left_out: list[DataError] = []
    for split, paths in listed.items():
        found[split] = []
        for path in paths:
            try:
                found[split].append((path, header_size(path, fix)))
            except DataError as exc:
                if not skip:
                    raise
                left_out.append(exc)
    if left_out:
        total = sum(len(paths) for paths in listed.values())
        parts.warn(f"[data] skip_unreadable: left out {len(left_out)} of {total} files, the first: {left_out[0]}")
    return found


def check_sizes(found: dict[str, list[tuple[Path, tuple[int, int]]]]) -> None:
    """Every image of every split the size of the first training image (as a batch needs them
    without ``size``), else a recipe error on [data] size naming the first that is not."""
    first, (width, height) = found["train"][0]
    for files in found.values():
        for path, (w, h) in files:
            if (w, h) != (width, height):
                raise ConfigError(
                    "",
                    "size",
                    f"{path} is {w}×{h} pixels but {first} is {width}×{height}: images of one size are needed; "
                    "set [data] size to resize them all to size × size",
                )


def stand_in(cfg: ImageFolderConfig, parts: Parts, message: str) -> DataSplits:
    """Under ``validate``: the warning that the folder is missing, and stand-in images."""
    parts.warn(f"[data] root: {message}; checked with stand-in images (run needs them)")
    side = cfg.size or cfg.crop or 32
    return DataSplits.stand_in((cfg.channels, side, side), (-1.0, 1.0) if cfg.scale == "symmetric" else (0.0, 1.0))


def image_folder(cfg: ImageFolderConfig, parts: Parts) -> DataSplits:
    """Images from a folder with train/, test/ (and val/) subfolders, read by DataLoader workers;
    every file's header is checked first (``readable``, ``check_sizes``)."""
    root = Path(cfg.root).expanduser()
    listed = {}
    for split in ("train", "test", "val"):
        folder = root / split
        files = list_images(folder) if folder.is_dir() else []
        if files:
            listed[split] = files
        elif split != "val":
            message = f"no images in {folder}: put the {split} images there (PNG, JPEG, ...)"
            if parts.dry_run:
                return stand_in(cfg, parts, message)
            raise ConfigError("", "root", message)
    found = {split: files for split, files in readable(listed, cfg.skip_unreadable, parts).items() if files}
    for split in ("train", "test"):
        if split not in found:
            raise ConfigError("", "root", f"no readable images in {root / split}: every file there was left out")
    if cfg.size is None and cfg.crop is None:
        check_sizes(found)
    splits = {
        split: ImageFiles([path for path, _ in files], cfg.channels, cfg.crop, cfg.size)
        for split, files in found.items()
    }
    shape = tuple(splits["train"][0].shape)  # decoded: a first image damaged past its header is named here
    prepare, augment = image_pipeline(cfg)
    low, high = (-1.0, 1.0) if cfg.scale == "symmetric" else (0.0, 1.0)
    return DataSplits(
        train=splits["train"],
        test=splits["test"],
        val=splits.get("val"),
        event_shape=shape,
        bounds=((low, high),) * (shape[0] * shape[1] * shape[2]),
        prepare=prepare,
        augment=augment,
        workers=cfg.workers,
    )
