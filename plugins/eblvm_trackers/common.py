"""What the trackers share: the run directory's resolved recipe, images as arrays, the run's
label, and a small JSON file that remembers a tracker's run id across sessions."""

from __future__ import annotations

import json
import os
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from eblvm.tools import RECIPE


def log_section(run_dir: Path, kind: str) -> str:
    """The label of the recipe's first [[log]] section of ``kind`` (``log.1``), for error messages."""
    logs = resolved_recipe(run_dir).get("log", [])
    index = next((i for i, table in enumerate(logs) if table.get("kind") == kind), None)
    return "log" if index is None else f"log.{index}"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def resolved_recipe(run_dir: Path) -> dict[str, Any]:
    """The run directory's recipe.toml as a dict ({} when there is none, as in a bare test folder).
    The session writes it, for this session, before it builds the loggers."""
    path = Path(run_dir) / RECIPE
    if not path.is_file():
        return {}
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def run_label(run_dir: Path) -> str:
    """``<run name>/<timestamp>``: the run directory's last two parts, the default tracker run name."""
    run_dir = Path(run_dir).resolve()
    return f"{run_dir.parent.name}/{run_dir.name}"


def image_array(image: Tensor) -> np.ndarray:
    """An image (C, H, W) in [0, 1] as uint8 pixels: (H, W) for one channel, (H, W, C) otherwise."""
    pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return pixels[0] if pixels.shape[0] == 1 else np.ascontiguousarray(pixels.transpose(1, 2, 0))


class RunFile:
    """``<folder>/eblvm-run.json``: what a tracker needs to continue its run in a later session of
    the same run directory (its run id, where it lives). Written atomically."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / "eblvm-run.json"

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def write(self, **data: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)


class Guard:
    """Runs a tracker's recording calls so that a failure (a server gone, a refused value) never
    stops training: the first one is said on stderr, later ones are not."""

    def __init__(self, tracker: str):
        self.tracker, self.failed = tracker, False

    def __call__(self, what: str, work: Callable[[], Any]) -> None:
        try:
            work()
        except Exception as exc:
            if not self.failed:
                print(
                    f"{self.tracker}: {what} failed ({first_line(exc)}); training goes on, later failures are not shown",
                    file=sys.stderr,
                    flush=True,
                )
            self.failed = True
