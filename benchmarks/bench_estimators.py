"""Time one training iteration of each estimator, at checkerboard size and at Frey-face size.

    python benchmarks/bench_estimators.py [--rounds 10] [--block 10] [--threads 1 2] [--device cpu] [--sizes ...] [--out table.md]
    python benchmarks/bench_estimators.py --rounds 20 --block 10 --frey-block 2 --threads 1 2 --out table.md
    python benchmarks/bench_estimators.py --device cuda --threads 1 --out table.md     # on a GPU machine
    python benchmarks/bench_estimators.py --smoke     # every checkerboard case once, in seconds: a check, not a timing

Each case builds the estimator from a bundled recipe (with overrides) and warms up. Then the
cases take turns: in each of ``--rounds`` rounds every case runs ``--block`` timed steps
(``--frey-block`` at Frey size), so a drift in the machine's speed, which is large on a shared
virtual machine, hits every case alike. Reported: the median step time and the spread (10th
and 90th percentiles) of the per-round medians, per thread count. Frey-face size uses a random
stand-in data file of the real format (v = 560, h = 400, batch 100), so the real data are not
needed. Compare numbers only within one run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
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
    ("BiDSM (K=5, N=5, sgd)", "grbm_bidsm.toml", ['estimator.unroll="sgd"']),
    ("BiDSM (K=5, N=5, adam)", "grbm_bidsm.toml", ['estimator.unroll="adam"']),
    ("BiSSM (K=5, N=5)", "grbm_bissm.toml", []),
    ("BiSM implicit (K=5, Neumann 40)", "grbm_bism_implicit.toml", ["estimator.fixed_iterations=false"]),
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
    ("BiDSM (K=5, N=5, sgd)", "freyface_bidsm.toml", ['estimator.unroll="sgd"']),
    ("VaGES-DSM (L=2, K=5)", "freyface_vagesdsm.toml", []),
]
# between the two: Frey face data with few hidden units, where the GPU starts to pay (device = "auto")
MIDDLE = [
    ("exact-score DSM, h = 20", "freyface_dsm.toml", ["model.n_hidden=20"]),
    ("BiDSM (K=5, N=5, adam), h = 20", "freyface_bidsm.toml", ["model.n_hidden=20"]),
]
NO_EVAL = ["run.log_every=1"]


def frey_stand_in(folder: Path) -> Path:
    """A random uint8 (560, 1965) array under key 'ff', the format of frey_rawface.mat."""
    rng = np.random.default_rng(0)
    scipy.io.savemat(folder / "frey_rawface.mat", {"ff": rng.integers(0, 256, (560, 1965), dtype=np.uint8)})
    return folder


@attrs.define
class Case:
    size: str
    name: str
    step: Callable[[], Any]
    block: int
    times: list[float] = attrs.field(factory=list)
    round_medians: list[float] = attrs.field(factory=list)


def make_case(size: str, name: str, recipe: Path, overrides: list[str], block: int, device: str) -> Case:
    """Build the recipe's estimator on a fixed batch; ``step`` runs one synchronised step."""
    spec = load_recipe(recipe, overrides + NO_EVAL)
    seed_everything(0)
    built = build(spec, torch.device(device))
    estimator, batch = built.parts.estimator, built.parts.data.tensor("train", spec.run.batch_size)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        estimator.step(batch)
        sync()

    return Case(size, name, step, block)


def time_interleaved(cases: list[Case], rounds: int, warmup: int) -> None:
    """Warm every case up, then time ``rounds`` rounds of ``case.block`` steps each, in turn."""
    for case in cases:
        for _ in range(warmup):
            case.step()
    for _ in range(rounds):
        for case in cases:
            times = []
            for _ in range(case.block):
                start = time.perf_counter()
                case.step()
                times.append(time.perf_counter() - start)
            case.times += times
            case.round_medians.append(statistics.median(times))


def summary(case: Case) -> tuple[float, float, float]:
    """(median step, 10th and 90th percentile of the round medians), in ms."""
    deciles = (
        statistics.quantiles(case.round_medians, n=10, method="inclusive")
        if len(case.round_medians) > 1
        else case.round_medians * 9
    )
    return 1000 * statistics.median(case.times), 1000 * deciles[0], 1000 * deciles[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=10, help="timed steps per round at checkerboard size")
    parser.add_argument("--frey-block", type=int, default=2, help="timed steps per round at Frey size")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="write a Markdown table here")
    parser.add_argument(
        "--sizes", nargs="+", choices=["checkerboard", "middle", "frey"], default=["checkerboard", "frey"]
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each case first")
    parser.add_argument(
        "--smoke", action="store_true", help="one round of one step per case, checkerboard only, one thread, no warm-up"
    )
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.block, args.frey_block, args.warmup = 1, 1, 1, 0
        args.threads, args.sizes = [1], ["checkerboard"]

    cells: dict[tuple[str, str], list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        frey = frey_stand_in(Path(tmp))
        root = [f'data.root="{frey}"']
        specs = [("checkerboard", n, r, o, args.block) for n, r, o in CHECKERBOARD] * ("checkerboard" in args.sizes)
        specs += [("Frey data, h = 20", n, r, o + root, args.block) for n, r, o in MIDDLE] * ("middle" in args.sizes)
        specs += [("Frey size", n, r, o + root, args.frey_block) for n, r, o in FREY] * ("frey" in args.sizes)
        for threads in args.threads:
            torch.set_num_threads(threads)
            cases = [
                make_case(size, name, ROOT / "recipes" / recipe, overrides, block, args.device)
                for size, name, recipe, overrides, block in specs
            ]
            time_interleaved(cases, args.rounds, args.warmup)
            for case in cases:
                median, low, high = summary(case)
                cells.setdefault((case.size, case.name), []).append(f"{median:.2f} ({low:.2f}-{high:.2f})")
                print(f"{threads}T {case.size:13s} {case.name:28s} {cells[case.size, case.name][-1]} ms", flush=True)

    if args.out:
        head = "| size | estimator | " + " | ".join(f"{t} thread{'s' * (t > 1)} (ms)" for t in args.threads) + " |"
        lines = [head, "|" + "---|" * (2 + len(args.threads))]
        lines += [f"| {size} | {name} | " + " | ".join(row) + " |" for (size, name), row in cells.items()]
        machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
        if args.device == "cuda":
            machine += f", {torch.cuda.get_device_name()}"
        note = (
            f"Machine: {machine}. Median of one `estimator.step` over {args.rounds} interleaved rounds "
            "(in brackets: 10th-90th percentile of the round medians)."
        )
        args.out.write_text("\n".join([note, "", *lines, ""]))


if __name__ == "__main__":
    main()
