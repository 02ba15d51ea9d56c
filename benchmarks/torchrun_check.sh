#!/usr/bin/env bash
# A one-GPU torchrun run of cifar10_bimdsm against a plain one (docs/distributed.md), on random
# CIFAR-10-shaped data, evaluators dropped: prints each run's steps per second.
set -uo pipefail
work=$(mktemp -d)
python3 - "$work" <<'PY'
import sys, numpy as np, tomli_w
from pathlib import Path
from eblvm_core.recipe import read
work = Path(sys.argv[1])
x = np.random.default_rng(0).integers(0, 256, (2000, 32, 32, 3), dtype=np.uint8)
np.savez(work / "fake.npz", x_train=x, y_train=np.zeros(2000), x_test=x[:100], y_test=np.zeros(100))
raw = read("recipes/cifar10_bimdsm.toml")
raw["eval"], raw["log"] = [], []
raw["data"]["root"] = str(work)
raw["run"].update(steps=400, log_every=100, eval_every=0, checkpoint_every=400)
(work / "r.toml").write_text(tomli_w.dumps(raw))
PY
eblvm run "$work/r.toml" --out "$work/plain" 2>&1 | grep -E "^step"
torchrun --standalone --nproc-per-node 1 -m eblvm run "$work/r.toml" --out "$work/torchrun1" 2>&1 | grep -E "^step"
