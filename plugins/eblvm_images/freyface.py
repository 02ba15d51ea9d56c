"""The Frey face data set: 1965 grey 28×20 frames of one face (Roweis' ``frey_rawface.mat``).

The split follows the papers' released code (baofff/BiSM, ``datasets/freyface.py``), which is
sequential: the first 1400 frames in file order train, the next 300 validate, the last 265
test (with it the training pixels have mean 0.6049 and std 0.1763, the values that code
records). The frames are consecutive video frames, so a sequential split tests on later
frames rather than on neighbours of training ones; ``split_seed`` instead shuffles the
frames with a fixed permutation before splitting.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import torch

from eblvm.plugin import ConfigError, DataError, DataSplits, Parts, non_negative, option, positive

FILE = "frey_rawface.mat"
URL = "https://cs.nyu.edu/~roweis/data/frey_rawface.mat"
HEIGHT, WIDTH = 28, 20


@attrs.frozen
class FreyFaceConfig:
    root: str = option(help=f"folder holding {FILE} (relative paths start at the current directory)")
    n_train: int = option(1400, "training images (the papers: 1400)", positive)
    n_val: int = option(300, "validation images, after the training ones (the papers: 300); 0 for none", non_negative)
    n_test: int = option(265, "test images, after the validation ones (the papers: 265)", positive)
    split_seed: int | None = option(
        None,
        "None keeps file order (the papers' sequential split); an integer shuffles the frames with that seed first",
    )


def load_frey(path: Path) -> np.ndarray:
    """The frames of ``frey_rawface.mat`` as uint8 (N, 28, 20); DataError if absent, truncated or
    malformed, naming the file and what to do."""
    fix = f"download {URL} into that folder, or point [data] root at the folder that holds it (-o data.root=/path)"
    if not path.is_file():
        raise DataError(f"{path}: Frey face file not found; {fix}", key="root")
    import scipy.io  # half a second to import: only when a Frey face file is read

    try:
        content = scipy.io.loadmat(str(path))
    except Exception as exc:  # scipy raises several types for truncated, corrupt or non-MATLAB files
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        again = f"delete it and download {URL} again, or point [data] root at a good copy (-o data.root=/path)"
        raise DataError(f"{path}: not a readable MATLAB file ({reason}); {again}", key="root") from None
    if "ff" not in content:
        found = ", ".join(k for k in content if not k.startswith("__")) or "none"
        raise DataError(f"{path}: no variable 'ff' (found: {found}); expected Roweis' {FILE}: {fix}", key="root")
    ff = content["ff"]
    if ff.ndim != 2 or ff.shape[0] != HEIGHT * WIDTH or ff.dtype != np.uint8:
        raise DataError(
            f"{path}: 'ff' must be uint8 ({HEIGHT * WIDTH}, N), got {ff.dtype} {ff.shape}; expected Roweis' {FILE}: {fix}",
            key="root",
        )
    return ff.T.reshape(-1, HEIGHT, WIDTH)


def freyface(cfg: FreyFaceConfig, parts: Parts) -> DataSplits:
    """Frey face (1965 faces (1, 28, 20), pixels / 255), split 1400/300/265 in file order as in the papers."""
    path = Path(cfg.root).expanduser() / FILE
    if parts.dry_run and not path.is_file():
        parts.warn(f"[data] root: {path} not found; checked with stand-in images (run needs the file)")
        return DataSplits.stand_in((1, HEIGHT, WIDTH))
    frames = torch.from_numpy(load_frey(path).astype(np.float32) / 255.0).reshape(-1, 1, HEIGHT, WIDTH)
    total = cfg.n_train + cfg.n_val + cfg.n_test
    if total > len(frames):
        raise ConfigError(
            "", "n_train", f"n_train + n_val + n_test = {total} exceeds the {len(frames)} images in {path}"
        )
    if cfg.split_seed is not None:
        frames = frames[torch.randperm(len(frames), generator=torch.Generator().manual_seed(cfg.split_seed))]
    train, val, test = frames[:total].split([cfg.n_train, cfg.n_val, cfg.n_test])
    return DataSplits(
        train=train,
        test=test,
        val=val if cfg.n_val else None,
        bounds=((0.0, 1.0),) * (HEIGHT * WIDTH),
    )
