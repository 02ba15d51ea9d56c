"""Continue a finished grbm_bissm run with another number of unrolled steps N, to see whether its
plateau moves (docs/results.md). Not a timing.

    python studies/bissm_continue.py RUN_DIR OUT_DIR --unroll-steps 100 [--inner-lr 1.0] [--steps 4000] [--eval-every 1000]

The run's networks, optimizers, data position and random streams are restored from its last
checkpoint; the recipe is the run's own with only ``estimator.unroll_steps`` and ``inner_lr`` (and the schedule
of steps, evaluations and checkpoints) changed, which ``eblvm run --resume`` refuses on purpose.
Metrics go to OUT_DIR/metrics.jsonl as in a run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import eblvm
from eblvm_core import checkpoint as ckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--unroll-steps", type=int, required=True)
    parser.add_argument("--inner-lr", type=float, default=None, help="the unrolled steps' size α (default: the run's)")
    parser.add_argument("--steps", type=int, default=4000, help="steps to add")
    parser.add_argument("--eval-every", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = ckpt.read_checkpoint(ckpt.last_checkpoint(args.run))
    end = int(state["step"]) + args.steps
    prepared = eblvm.prepare(
        args.run / "recipe.toml",
        overrides=[
            f"estimator.unroll_steps={args.unroll_steps}",
            *([f"estimator.inner_lr={args.inner_lr}"] if args.inner_lr else []),
            f"run.steps={end}",
            f"run.eval_every={args.eval_every}",
            f"run.log_every={args.eval_every}",
            f"run.checkpoint_every={end}",
            'run.device="cpu"',
        ],
    )
    args.out.mkdir(parents=True, exist_ok=False)
    prepared.restore(ckpt.last_checkpoint(args.run))
    print({k: round(v, 4) for k, v in prepared.fit(args.out).items()})


if __name__ == "__main__":
    main()
