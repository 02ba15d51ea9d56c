"""A folder of image files as a data set, read by DataLoader workers.

The folder holds one subfolder per split (``train``, ``test``, optionally ``val``); images are
found recursively in each (class subfolders are allowed and ignored), sorted by path. Each is
decoded to uint8 (C, H, W), centre-cropped and resized as configured; scaling to [0, 1] or
[−1, 1], dequantisation noise and flips happen on the device (``eblvm_core.data``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs
import torch
from torch import Tensor
from torch.utils.data import Dataset

from eblvm_core.plugin_api import ConfigError, DataSplits, ImageOptions, Parts, image_pipeline, option, positive

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


@attrs.frozen
class ImageFolderConfig(ImageOptions):
    root: str = option(help="folder with train/ and test/ (and optionally val/) subfolders of images", kw_only=True)
    channels: Literal[1, 3] = option(3, "1 (grey) or 3 (RGB) channels")
    crop: int | None = option(None, "centre crop to this square side before resizing (CelebA: 140)", positive)
    size: int | None = option(
        None, "resize to size × size (None: the images' own size, which must then agree)", positive
    )


class ImageFiles(Dataset):
    """Image files -> uint8 (C, H, W) tensors, centre-cropped and resized."""

    def __init__(self, paths: list[Path], channels: int, crop: int | None, size: int | None):
        self.paths, self.channels, self.crop, self.size = paths, channels, crop, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tensor:
        import numpy as np
        from PIL import Image
        from torchvision.transforms.v2 import functional as TF

        with Image.open(self.paths[index]) as file:
            pixels = np.asarray(file.convert("RGB" if self.channels == 3 else "L"))
        image = torch.from_numpy(pixels.copy()).view(*pixels.shape[:2], self.channels).permute(2, 0, 1)
        if self.crop is not None:
            image = TF.center_crop(image, [self.crop, self.crop])
        if self.size is not None:
            image = TF.resize(image, [self.size, self.size], antialias=True)
        return image


def list_images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())


def image_folder(cfg: ImageFolderConfig, parts: Parts) -> DataSplits:
    """Images from a folder with train/, test/ (and val/) subfolders, read by DataLoader workers."""
    root = Path(cfg.root).expanduser()
    splits = {}
    for split in ("train", "test", "val"):
        folder = root / split
        files = list_images(folder) if folder.is_dir() else []
        if files:
            splits[split] = ImageFiles(files, cfg.channels, cfg.crop, cfg.size)
        elif split != "val":
            message = f"no images in {folder}: put the {split} images there (PNG, JPEG, ...)"
            if parts.dry_run:
                parts.warn(f"[data] root: {message}; checked with stand-in images (run needs them)")
                side = cfg.size or cfg.crop or 32
                return DataSplits.stand_in(
                    (cfg.channels, side, side), (-1.0, 1.0) if cfg.scale == "symmetric" else (0.0, 1.0)
                )
            raise ConfigError("", "root", message)
    shape = tuple(splits["train"][0].shape)
    for files in splits.values():
        if tuple(files[0].shape) != shape:
            raise ConfigError(
                "",
                "size",
                f"{files.paths[0]} is {tuple(files[0].shape)}, {splits['train'].paths[0]} is {shape}: set size",
            )
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
