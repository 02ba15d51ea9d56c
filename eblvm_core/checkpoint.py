"""Atomic checkpoints, safe loading, checksums, the RNG states a bit-exact resume needs, where a
run directory keeps its checkpoints, and the rule that a checkpoint belongs to its recipe.

A checkpoint is a dict saved by ``torch.save`` and loaded weights-only. ``seal`` adds
``"checksum"``: the SHA-256 of every tensor's bytes (with dtype and shape) and every plain value
of the rest, in key order; ``read_checkpoint`` recomputes it, so a flipped bit in a stored tensor
is an error rather than a silently wrong parameter. Checksumming reads the state, it changes
nothing that is trained.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eblvm_core.errors import CheckpointError
from eblvm_core.recipe import Recipe, differences, training_part

CHECKPOINT_FORMAT = 4  # 4: each role's state under "roles"; 3 (side by side) and 2 (no checksum, no recipe) still load
READABLE_FORMATS = (2, 3, 4)


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
    """Load a checkpoint with ``weights_only=True`` (no arbitrary code runs); torch's errors as they come."""
    return torch.load(path, map_location=map_location, weights_only=True)


_PLAIN = (int, float, str, bool, type(None))  # values fed as ``V<type>:<repr>``


def _feed(digest: Any, obj: Any) -> None:
    """Feed ``obj`` to a hashlib digest: tensors by dtype, shape and bytes; containers in key order."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        digest.update(f"D{len(obj)}".encode())
        for key in sorted(obj, key=lambda k: (type(k).__name__, repr(k))):
            digest.update(f"K{key!r}".encode())
            _feed(digest, obj[key])
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{type(obj).__name__}{len(obj)}".encode())
        if all(type(item) in _PLAIN for item in obj):  # Python's RNG state: 625 ints, fed as one
            digest.update("".join(f"V{type(item).__name__}:{item!r}" for item in obj).encode())
            return
        for item in obj:
            _feed(digest, item)
    else:
        digest.update(f"V{type(obj).__name__}:{obj!r}".encode())


def checksum(state: dict[str, Any]) -> str:
    """SHA-256 (hex) of a checkpoint's content, its ``"checksum"`` entry left out."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != "checksum"})
    return digest.hexdigest()


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """The state with its ``"checksum"``, ready for ``save_atomic``."""
    return {**state, "checksum": checksum(state)}


def _unreadable(exc: BaseException) -> str:
    """What a torch.load failure means, in a few words (never torch's advice to load unsafely)."""
    text = str(exc)
    if isinstance(exc, EOFError):
        return "ends too early: truncated or empty"
    if isinstance(exc, OSError) and exc.errno not in (None, errno.EINVAL):
        return f"cannot be read: {exc.strerror or exc}"
    if isinstance(exc, OSError):
        return "truncated or damaged: its zip records point past the end of the file"
    if "GLOBAL" in text:
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f" ({found.group(1)})" if found else ""
        return f"holds a pickled Python object{what}; refused, as loading it could run code"
    if "central directory" in text or "zip archive" in text:
        return "truncated or damaged: not a complete torch zip archive"
    return f"not an eblvm checkpoint (unreadable as a torch file: {type(exc).__name__})"


def read_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load and verify a checkpoint; CheckpointError (``file: what is wrong``) when it is missing,
    empty, truncated, unreadable, not a checkpoint dict, of a format this eblvm cannot read, or its
    checksum differs. Older formats come in the layout of today's (``by_role``)."""
    path = Path(path)
    file = str(path)
    if not path.is_file():
        raise CheckpointError(file, "no such checkpoint file" if not path.exists() else "not a file")
    if path.stat().st_size == 0:
        raise CheckpointError(file, "empty file (0 bytes): a write was interrupted or the disk was full")
    try:
        state = load(path, map_location)
    except (RuntimeError, EOFError, pickle.UnpicklingError, KeyError, ValueError, TypeError, OSError) as exc:
        raise CheckpointError(file, _unreadable(exc)) from None
    if not isinstance(state, dict) or "format" not in state:
        what = f"a bare {type(state).__name__}" if not isinstance(state, dict) else "a dict without 'format'"
        raise CheckpointError(file, f"not an eblvm checkpoint: it holds {what}")
    if state["format"] not in READABLE_FORMATS:
        raise CheckpointError(
            file, f"checkpoint format {state['format']!r} is not one of {READABLE_FORMATS}: written by another eblvm"
        )
    if "checksum" in state:
        if state["checksum"] != checksum(state):
            raise CheckpointError(file, "checksum mismatch: the file was changed or damaged after it was written")
    elif state["format"] != 2:
        raise CheckpointError(file, "no checksum: the file is incomplete or was not written by eblvm")
    return by_role(state)


def by_role(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of format 2 or 3 (each role's optimizer, gradient scaler and parameter average
    kept side by side under "optimizers", "scalers" and "ema") in the layout of format 4: one
    ``TrainingRole.state_dict`` per role under "roles". Format 4 is returned as it is."""
    if "roles" in state or "optimizers" not in state:
        return state
    state = dict(state)
    optimizers, scalers, averages = state.pop("optimizers"), state.pop("scalers", {}), state.pop("ema", {})
    state["roles"] = {
        role: {"optimizer": optimizer}
        | ({"scaler": scalers[role]} if role in scalers else {})
        | ({"ema": averages[role]} if role in averages else {})
        for role, optimizer in optimizers.items()
    }
    return state


def rng_state() -> dict[str, Any]:
    """Global RNG states of torch (CPU, CUDA), Python and NumPy, in weights-only-safe types."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # legacy=True: (kind, keys, pos, has_gauss, cached)
    kind, keys, pos, has_gauss, cached = legacy
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state()``; its tensors may come on any device (a checkpoint read with
    ``map_location="cuda"``): the generators take CPU byte tensors."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def to_device(obj: Any, device: torch.device) -> Any:
    """A checkpoint (or any nest of dicts, lists and tuples) with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {key: to_device(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(item, device) for item in obj)
    return obj


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators with ``seed``. Without an accelerator only the
    CPU generator: ``torch.manual_seed`` would also queue a lazy seed call for each accelerator
    torch knows, each with a formatted stack trace (milliseconds a call, more in a deep stack)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Delete the ``.<name>.pt.*.tmp`` files a kill during ``save_atomic`` left in checkpoints/;
    call it only while holding the run directory's lock. Returns what it removed."""
    removed = []
    for tmp in (Path(run_dir) / "checkpoints").glob(".*.pt.*.tmp"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints" / "last.pt"


def best_checkpoint(run_dir: str | Path) -> Path:
    """Where the checkpoint with the best [run] select_metric is kept."""
    return Path(run_dir) / "checkpoints" / "best.pt"


KEPT = re.compile(r"step-(\d+)\.pt")


def kept_checkpoint(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint kept at ``step`` by [run] keep_every is (``checkpoints/step-<step>.pt``)."""
    return Path(run_dir) / "checkpoints" / f"step-{step}.pt"


def kept_steps(run_dir: str | Path) -> list[int]:
    """The steps of the checkpoints kept in ``run_dir`` by [run] keep_every, in order."""
    folder = Path(run_dir) / "checkpoints"
    found = (KEPT.fullmatch(path.name) for path in folder.glob("step-*.pt")) if folder.is_dir() else ()
    return sorted(int(match.group(1)) for match in found if match)


def check_checkpoint_recipe(state: dict[str, Any], recipe: Recipe, path: str | Path) -> None:
    """Refuse a checkpoint written by another recipe (one that trains something else), naming the
    first difference. An option absent from the checkpoint's recipe and at its default here is no
    difference: the checkpoint was written before the option existed."""
    if "recipe" not in state:  # format 2
        return
    for key, theirs, ours in differences(state["recipe"], training_part(recipe.to_dict())):
        if theirs is None and ours == recipe.default_of(key):
            continue
        raise CheckpointError(
            str(path),
            f"written by another recipe: {key} is {theirs!r} there and {ours!r} in {recipe.path}",
        )
