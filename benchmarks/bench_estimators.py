"""Time one training iteration of each estimator, at checkerboard size and at Frey-face size.

    python benchmarks/bench_estimators.py [--repeats 50] [--threads 1 2] [--device cpu] [--out table.md]

Each case builds the estimator from a bundled recipe (with overrides), warms up, then reports
the median wall time of one ``estimator.step(batch)`` over ``--repeats`` steps, for each thread
count. Frey-face size uses a random stand-in data file of the real format (v = 560, h = 400,
batch 100), so the real data are not needed. Compare numbers only within one run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.io
import torch

from eblvm_core.build import build
from eblvm_core.checkpoint import seed_everything
from eblvm_core.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]

CHECKERBOARD = [
    ("exact-score DSM", "grbm_dsm.toml", []),
    ("exact-score SSM", "grbm_ssm.toml", []),
    ("BiDSM (K=5, N=5, sgd)", "grbm_bidsm.toml", ["estimator.unroll=\"sgd\""]),
    ("BiDSM (K=5, N=5, adam)", "grbm_bidsm.toml", ["estimator.unroll=\"adam\""]),
    ("BiSSM (K=5, N=5)", "grbm_bissm.toml", []),
    ("BiSM implicit (K=5, CG 10)", "grbm_bism_implicit.toml", []),
    ("VaGES-DSM (L=2, K=5)", "grbm_vagesdsm.toml", []),
    ("VaGES-KSD (L=2, K=5)", "grbm_vagesksd.toml", []),
    ("CD-1", "grbm_cd.toml", []),
    ("PCD", "grbm_pcd.toml", []),
    ("NCE", "grbm_nce.toml", []),
    ("VNCE", "grbm_vnce.toml", []),
]
FREY = [
    ("exact-score DSM", "freyface_dsm.toml", []),
    ("BiDSM (K=5, N=5, adam)", "freyface_bidsm.toml", []),
    ("BiDSM (K=5, N=5, sgd)", "freyface_bidsm.toml", ["estimator.unroll=\"sgd\""]),
    ("VaGES-DSM (L=2, K=5)", "freyface_vagesdsm.toml", []),
]
NO_EVAL = ["run.log_every=1"]


def frey_stand_in(folder: Path) -> Path:
    """A random uint8 (560, 1965) array under key 'ff', the format of frey_rawface.mat."""
    rng = np.random.default_rng(0)
    scipy.io.savemat(folder / "frey_rawface.mat", {"ff": rng.integers(0, 256, (560, 1965), dtype=np.uint8)})
    return folder


def time_step(recipe: Path, overrides: list[str], repeats: int, warmup: int, device: str = "cpu") -> float:
    """Median seconds of one estimator step on a fixed batch (the device synchronised around it)."""
    spec = load_recipe(recipe, overrides + NO_EVAL)
    seed_everything(0)
    built = build(spec, torch.device(device))
    estimator, data = built.parts.estimator, built.parts.data.train
    batch = data[: spec.run.batch_size]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        estimator.step(batch)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        estimator.step(batch)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--frey-repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="write a Markdown table here")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        frey = frey_stand_in(Path(tmp))
        cases = [("checkerboard", n, r, o, args.repeats) for n, r, o in CHECKERBOARD]
        cases += [("Frey size", n, r, o + [f"data.root=\"{frey}\""], args.frey_repeats) for n, r, o in FREY]
        for size, name, recipe, overrides, repeats in cases:
            cells = []
            for threads in args.threads:
                torch.set_num_threads(threads)
                ms = 1000 * time_step(ROOT / "recipes" / recipe, overrides, repeats, max(3, repeats // 10), args.device)
                cells.append(ms)
            rows.append((size, name, cells))
            print(f"{size:13s} {name:28s} " + "  ".join(f"{t}T {ms:8.2f} ms" for t, ms in zip(args.threads, cells)), flush=True)

    if args.out:
        head = "| size | estimator | " + " | ".join(f"{t} thread{'s' * (t > 1)} (ms)" for t in args.threads) + " |"
        lines = [head, "|" + "---|" * (2 + len(args.threads))]
        lines += [f"| {s} | {n} | " + " | ".join(f"{ms:.2f}" for ms in c) + " |" for s, n, c in rows]
        machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
        if args.device == "cuda":
            machine += f", {torch.cuda.get_device_name()}"
        args.out.write_text("\n".join([f"Machine: {machine}; median of one `estimator.step`.", "", *lines, ""]))


if __name__ == "__main__":
    main()
