"""CPU step time of a trained run with subnormal floats computed as IEEE numbers and flushed to
zero (what `eblvm run` does on a CPU; docs/benchmarks.md).

    python benchmarks/bench_subnormals.py RUN_DIR [--checkpoint last.pt] [--steps 20] [--rounds 2]
    python benchmarks/bench_subnormals.py RUN_DIR --steps 2 --rounds 1     # a check, in seconds

The run's recipe is built on the CPU (one thread) and its checkpoint restored before every block
of ``--steps`` estimator steps on one fixed batch, the two settings taking turns ``--rounds``
times, so both time the same steps from the same state. Flushing changes nothing but how numbers below
the smallest normal float are computed, so the difference is their slow path.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core.build import build
from eblvm_core.data import Batches
from eblvm_core.recipe import load_recipe
from eblvm_core.state import RunState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run directory (holds recipe.toml and checkpoints/)")
    parser.add_argument("--checkpoint", default="last.pt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = args.run / "checkpoints" / args.checkpoint
    state = ckpt.read_checkpoint(source)
    recipe = load_recipe(args.run / "recipe.toml", ['run.device="cpu"'])
    built = build(recipe, torch.device("cpu"))
    restored = RunState(recipe, built)
    batch = Batches(built.parts.data, recipe.run.batch_size, 0, torch.device("cpu"), built.parts.dtype).next()
    print(f"{recipe.run.name} at step {state['step']}, one CPU thread:")
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for flush in (False, True):
            restored.restore(state, source=str(source))
            torch.set_flush_denormal(flush)
            start = time.perf_counter()
            for _ in range(args.steps):
                built.parts.estimator.step(batch)
            times[flush].append(1000 * (time.perf_counter() - start) / args.steps)
    torch.set_flush_denormal(False)
    for flush, ms in times.items():
        label = "flushed to zero" if flush else "IEEE subnormals"
        print(f"  {label}: {statistics.median(ms):.1f} ms per step (blocks: {', '.join(f'{t:.1f}' for t in ms)})")
    print(f"  ratio: {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")


if __name__ == "__main__":
    main()
