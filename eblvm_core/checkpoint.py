"""Atomic checkpoints, safe loading, and the RNG states a bit-exact resume needs."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch


def save_atomic(obj: Any, path: str | Path) -> None:
    """Write ``obj`` with torch.save to a temp file beside ``path``, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (no arbitrary code runs)."""
    return torch.load(path, map_location=map_location, weights_only=True)


def rng_state() -> dict[str, Any]:
    """Global RNG states of torch (CPU, CUDA), Python and NumPy, in weights-only-safe types."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def new_run_dir(out: str | Path, name: str) -> Path:
    """``<out>/<name>/<YYYYmmdd-HHMMSS>`` (suffixed if taken), created."""
    import time

    base = Path(out) / name / time.strftime("%Y%m%d-%H%M%S")
    path, i = base, 1
    while path.exists():
        path, i = Path(f"{base}-{i}"), i + 1
    (path / "checkpoints").mkdir(parents=True)
    return path


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints" / "last.pt"
