"""Training speed with the step replayed from a CUDA graph, launched eagerly on the GPU, and on one
CPU thread, through the real training loop (``eblvm run``), one case after the other on one machine.

    python benchmarks/bench_cuda_graph.py [--steps 600] [--frey-steps 200] [--only adam] [--out table.md]
    python benchmarks/bench_cuda_graph.py --smoke     # grbm_bissm, 8 steps per run: a check, not a timing

Needs a CUDA device (it exits with 2 and says so without one).

Each case trains a bundled recipe without evaluators or loggers for a fixed number of steps in
the three modes, from the same seed. Reported: the median of the loop's own ``speed/steps_per_s``
over the logged intervals after the first (which holds the warm-up and the capture), the
largest difference between the graph-replayed and the eager run's final parameters, the speed
of the graph replayed back to back outside the loop, and the CUDA kernels of one eager step. Frey-face
size uses a random stand-in data file of the real format, so the real data are not needed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import scipy.io
import tomli_w
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core.session import run

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("checkerboard", "exact-score DSM", "grbm_dsm.toml", []),
    ("checkerboard", "exact-score SSM", "grbm_ssm.toml", []),
    ("checkerboard", "BiDSM (K=5, N=5, sgd)", "grbm_bidsm.toml", []),
    ("checkerboard", "BiDSM (K=5, N=5, adam)", "grbm_bidsm.toml", ['estimator.unroll="adam"']),
    ("checkerboard", "BiSSM (K=5, N=5): grbm_bissm", "grbm_bissm.toml", []),
    ("Frey size", "exact-score DSM", "freyface_dsm.toml", []),
    ("Frey size", "BiDSM (K=5, N=5, sgd)", "freyface_bidsm.toml", ['estimator.unroll="sgd"']),
    ("Frey size", "BiDSM (K=5, N=5, adam): freyface_bidsm", "freyface_bidsm.toml", []),
]
MODES = {
    "GPU, graph": ("cuda", ["run.cuda_graph=true"]),
    "GPU, eager": ("cuda", ["run.cuda_graph=false"]),
    "CPU, 1 thread": ("cpu", ["run.threads=1"]),
}


def frey_stand_in(folder: Path) -> Path:
    """A random uint8 (560, 1965) array under key 'ff', the format of frey_rawface.mat."""
    rng = np.random.default_rng(0)
    scipy.io.savemat(folder / "frey_rawface.mat", {"ff": rng.integers(0, 256, (560, 1965), dtype=np.uint8)})
    return folder


def without_evaluation(recipe: Path, folder: Path) -> Path:
    """A copy of the recipe with no evaluators and no loggers."""
    raw = tomllib.loads(recipe.read_text())
    raw.pop("eval", None)
    raw["log"] = []
    path = folder / recipe.name
    path.write_text(tomli_w.dumps(raw))
    return path


def train(recipe: Path, overrides: list[str], device: str, steps: int, out: Path) -> tuple[float, dict]:
    """(median steps/s after the first logged interval, final networks) of one run."""
    every = steps // 4
    schedule = [f"run.steps={steps}", f"run.log_every={every}", f"run.checkpoint_every={steps}", "run.eval_every=0"]
    lines: list[str] = []
    run_dir, _ = run(recipe, overrides + schedule, device=device, out=out, echo=lines.append)
    print("   ", " | ".join(line for line in lines if "CUDA graph" in line) or "(no CUDA graph line)", flush=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [row["speed/steps_per_s"] for row in rows if "speed/steps_per_s" in row]
    return statistics.median(speeds[1:]), ckpt.load(ckpt.last_checkpoint(run_dir))["networks"]


def replay_alone(recipe: Path, overrides: list[str], replays: int = 500) -> tuple[float, int]:
    """(steps/s of the captured step replayed back to back on one fixed batch, outside the training
    loop; CUDA kernels one eager step launches, counted by the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from eblvm_core.build import build
    from eblvm_core.checkpoint import seed_everything
    from eblvm_core.graphs import WARMUP_STEPS, GraphedStep
    from eblvm_core.recipe import load_recipe

    spec = load_recipe(recipe, overrides)
    seed_everything(0)
    built = build(spec, torch.device("cuda"))
    estimator, batch = built.parts.estimator, built.parts.data.tensor("train", spec.run.batch_size)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        estimator.step(batch)
        torch.cuda.synchronize()
    kernels = sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    graphed = GraphedStep(estimator.step, built.roles, print)
    for _ in range(WARMUP_STEPS + 2):
        graphed(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graphed.graph.replay()
    torch.cuda.synchronize()
    return replays / (time.perf_counter() - start), kernels


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[n][k] - b[n][k]).abs().max()) for n in a for k in a[n] if a[n][k].is_floating_point())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="training steps per run at checkerboard size")
    parser.add_argument("--frey-steps", type=int, default=200, help="training steps per run at Frey size")
    parser.add_argument("--out", type=Path, default=None, help="write a Markdown table here")
    parser.add_argument("--only", nargs="+", default=None, help="run only the cases whose label contains one of these")
    parser.add_argument("--smoke", action="store_true", help="grbm_bissm alone, 8 steps per run, 20 replays")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: it trains each case graph-replayed and eager on the GPU and on the CPU")
    replays = 500
    if args.smoke:
        args.steps, args.frey_steps, args.only, replays = 8, 8, ["grbm_bissm"], 20
    cases = [case for case in CASES if args.only is None or any(word in case[1] for word in args.only)]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    header = (
        f"{name}; host {platform.processor() or platform.machine()}, torch {torch.__version__}; "
        f"{args.steps} steps per run at checkerboard size, {args.frey_steps} at Frey size"
    )
    lines = [
        header,
        "",
        "| size | estimator | GPU, graph (steps/s) | GPU, eager (steps/s) | CPU, 1 thread (steps/s) "
        "| graph / eager | graph / CPU | max abs(graph − eager) parameter | replay alone (steps/s) "
        "| kernels per step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = frey_stand_in(folder)
        for size, label, recipe_name, overrides in cases:
            recipe = without_evaluation(ROOT / "recipes" / recipe_name, folder)
            extra = [*overrides, f'data.root="{data}"'] if size == "Frey size" else overrides
            steps = args.frey_steps if size == "Frey size" else args.steps
            speed, ends = {}, {}
            for mode, (device, flags) in MODES.items():
                print(f"{size} | {label} | {mode}", flush=True)
                speed[mode], ends[mode] = train(recipe, extra + flags, device, steps, folder / "runs")
            diff = largest_difference(ends["GPU, graph"], ends["GPU, eager"])
            alone, kernels = replay_alone(recipe, extra, replays)
            g, e, c = (speed[m] for m in MODES)
            lines.append(
                f"| {size} | {label} | {g:.0f} | {e:.0f} | {c:.0f} | {g / e:.1f}× | {g / c:.2f}× | {diff:.1e} "
                f"| {alone:.0f} | {kernels} |"
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
