#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md and docs/results.md in one command on a GPU machine,
# fitted into a time budget:
#
#   bash benchmarks/gpu_prepare.sh SHARED_DATA DATA_DIR                   # first, where there is a network
#   bash benchmarks/gpu_run.sh OUT_DIR SECONDS DATA_DIR [PHASE ...]       # on the GPU machine
#
# OUT_DIR   the output folder: job.log (every step, with its time), the tables (*.md) and pack.tar.gz
#           (each run's metrics.jsonl, run.json, run.log, recipe.toml and figures, and every step's
#           log), refreshed after each phase, so a command stopped early still leaves what was done.
#           Runs and checkpoints go to $WORK (default OUT_DIR/work).
# SECONDS   the budget of the whole command: each step's timeout leaves room for the packing.
# DATA_DIR  cifar/ (the CIFAR-10 .npz files), MNIST/raw/ (the idx files) and, for a machine without
#           a package registry, whl/ (wheels of the pure-Python dependencies, from gpu_prepare.sh).
#           "-" when the phases need no data (check alone).
# PHASE     run in the order given (default: check speed bidvl mnist):
#   check   tests/e2e/test_cuda.py (the graph-replayed steps against the eager ones, bf16 tolerances)
#           and studies/graph_rng_check.py --fresh
#   speed   alone on the card: the measured matrix-product peak, the deep step table (eager and
#           graph-replayed, fp32 and bf16, cuDNN autotuning on), BiDVL and MNIST BiMDSM without
#           autotuning, cifar10_bidvl and mnist_bimdsm through `eblvm run` (their steps/s against the
#           bench's step), a profile of three cases, and cifar10_bimdsm through a one-GPU torchrun
#           against a plain run (random data)
#   bidvl   cifar10_bidvl for 1,500 updates, seeds $SEEDS (default "0 1 2 3") side by side, each read
#           by its evaluators (FID dropped) and by studies/bidvl_batchnorm.py; then FID of seed 0's
#           10,000 generator samples (`eblvm eval -e fid`, needs eblvm[fid])
#   mnist   mnist_bimdsm from step 0 until the budget nears, a checkpoint kept every $KEEP_EVERY
#           (default 10000) steps, each scored by the linear SVM probe (60,000 / 10,000 images) as it
#           appears; at the end its samples (annealed Langevin via q) and posterior embedding
# Every number is the programs' own output (logs, tables, metrics.jsonl); nothing is typed in.
set -u
if [ $# -lt 3 ]; then
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_run.sh: no CUDA device here" >&2
    exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd) budget=$2 data=$3
shift 3
phases=${*:-check speed bidvl mnist}
work=${WORK:-$out/work}
start=$(date +%s)
end=$((start + budget))
mkdir -p "$work/runs" "$work/logs" "$work/recipes"
exec >>"$out/job.log" 2>&1
export PYTHONUNBUFFERED=1
say() { echo "[$(date +%T) +$(($(date +%s) - start))s] $*"; }
left() { echo $((end - $(date +%s))); }
# run LIMIT NAME COMMAND...: the command with a timeout of LIMIT s (less if the budget's end is nearer), logged
run() {
    local limit=$1 name=$2
    shift 2
    local room=$(($(left) - 40))
    [ "$room" -lt "$limit" ] && limit=$room
    if [ "$limit" -lt 10 ]; then say "skipped $name (no time left)"; return; fi
    say "$name (≤ ${limit}s)"
    timeout -k 30 -s TERM "$limit" "$@" >"$work/logs/$name.log" 2>&1 || say "$name exit $?"
}

# pack: the logs, tables and run records into OUT_DIR/pack.tar.gz
pack() {
    (cd "$work" && find logs -type f -name '*.log' >files.txt &&
        find runs -type f \( -name '*.png' -o -name 'metrics.jsonl' -o -name 'run.json' -o -name 'run.log' \
            -o -name 'recipe.toml' \) >>files.txt && tar czf "$out/pack.tar.gz" -T files.txt)
    return 0
}

if [ "$data" != "-" ] && compgen -G "$data/whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$data"/whl/*.whl &&
        export PYTHONPATH=/tmp/site
fi
python3 -c "import eblvm_core" 2>/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$work/logs/install.log" 2>&1 ||
    say "editable install failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, eblvm_core; print('torch', torch.__version__, torch.cuda.get_device_name(), eblvm_core.__file__)"

# the recipes as the phases run them: data from DATA_DIR, evaluation where each phase says
python3 - "$work" "$data" <<'PY'
import sys
from pathlib import Path
import tomli_w
from eblvm_core.recipe import read
work, data = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
bidvl = read("recipes/cifar10_bidvl.toml")
bidvl["data"]["root"] = str(data / "cifar")
bidvl["run"].update(steps=1500, eval_every=0, checkpoint_every=1500)
bidvl["eval"] = [e for e in bidvl["eval"] if e["kind"] != "fid"]  # scored afterwards, for seed 0 only
(work / "recipes" / "cifar10_bidvl.toml").write_text(tomli_w.dumps(bidvl))
mnist = read("recipes/mnist_bimdsm.toml")
mnist["data"]["root"] = str(data)
mnist["run"].update(eval_every=0, checkpoint_every=100000)  # kept every KEEP_EVERY steps; SIGTERM checkpoints
mnist["eval"] = []  # evaluated by `eblvm eval` on the kept checkpoints and at the end
(work / "recipes" / "mnist_bimdsm.toml").write_text(tomli_w.dumps(mnist))
PY

# torchrun_check: cifar10_bimdsm on random CIFAR-10-shaped data, 400 steps, plainly and through a one-GPU torchrun
torchrun_check() {
    local dir="$work/torchrun"
    mkdir -p "$dir"
    python3 - "$dir" <<'PY'
import sys
from pathlib import Path
import numpy as np
import tomli_w
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
    echo "== plain"
    python3 -m eblvm run "$dir/r.toml" --out "$dir/plain" 2>&1 | grep -E "^step"
    echo "== one-GPU torchrun"
    torchrun --standalone --nproc-per-node 1 -m eblvm run "$dir/r.toml" --out "$dir/torchrun1" 2>&1 | grep -E "^step"
}

export work
export -f torchrun_check
bench="python3 benchmarks/bench_deep.py"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 2")
for phase in $phases; do
    case $phase in
    check)
        run 90 graph_rng_fresh python3 studies/graph_rng_check.py --fresh &
        run 300 cuda_tests python3 -m pytest -q -p no:cacheprovider $xdist -rfEs --durations=12 tests/e2e/test_cuda.py
        wait
        ;;
    speed)
        run 20 peak $bench --peak --out "$out/peak.md"
        # MDSM fp32/bf16, BiMDSM fp32/bf16, VaGES-MDSM fp32/bf16, BiDVL fp32/bf16, MNIST BiMDSM fp32/bf16, MNIST MDSM
        run 120 bench $bench --steps 10 --warmup 3 --cases 0 2 3 6 5 7 8 9 11 13 12 --out "$out/bench_deep.md"
        run 25 bench_no_autotune $bench --steps 10 --warmup 3 --cases 8 11 --no-cudnn-benchmark \
            --out "$out/bench_no_autotune.md"
        run 45 run_bidvl python3 -m eblvm run "$work/recipes/cifar10_bidvl.toml" -o run.steps=600 -o '~eval' \
            --out "$work/runs/speed_bidvl"
        run 45 run_mnist python3 -m eblvm run "$work/recipes/mnist_bimdsm.toml" -o run.steps=1000 \
            --out "$work/runs/speed_mnist"
        run 30 profile $bench --profile --steps 3 --cases 3 8 11 --out "$out/profile.md"
        run 200 torchrun bash -c torchrun_check
        ;;
    bidvl)
        for seed in ${SEEDS:-0 1 2 3}; do
            (
                run 300 "bidvl_s$seed" python3 -m eblvm run "$work/recipes/cifar10_bidvl.toml" -o run.seed="$seed" \
                    --out "$work/runs/bidvl_s$seed"
                run 90 "batchnorm_s$seed" python3 studies/bidvl_batchnorm.py "$work/runs/bidvl_s$seed/cifar10_bidvl" \
                    --device cuda
            ) &
        done
        wait
        first=$(set -- ${SEEDS:-0}; echo "$1")
        run 600 "fid_s$first" python3 -m eblvm eval "$work/runs/bidvl_s$first/cifar10_bidvl" -e fid \
            -o 'eval.0.sampler="generator"'
        ;;
    mnist)
        (
            run $(($(left) - 150)) mnist_bimdsm python3 -m eblvm run "$work/recipes/mnist_bimdsm.toml" \
                -o run.keep_every="${KEEP_EVERY:-10000}" --out "$work/runs/mnist"
            touch "$work/runs/mnist.done"
            run 60 mnist_final_svm python3 -m eblvm eval "$work/runs/mnist/mnist_bimdsm" -e svm-probe \
                -o eval.0.n_train=60000
            run 60 mnist_final_figures python3 -m eblvm eval "$work/runs/mnist/mnist_bimdsm" -e sample-grid \
                -o 'eval.0.sampler="annealed-langevin"' -e posterior-embedding
        ) &
        # each checkpoint kept every KEEP_EVERY steps, as it appears: the linear SVM on its posterior means
        mkdir -p "$work/kept"
        while [ "$(left)" -gt 150 ] && [ ! -e "$work/runs/mnist.done" ]; do
            for kept in "$work"/runs/mnist/mnist_bimdsm/*/checkpoints/step-*.pt; do
                [ -e "$kept" ] || continue
                step=$(basename "$kept" .pt)
                [ -e "$work/kept/$step" ] && continue
                touch "$work/kept/$step"
                run 150 "svm_$step" python3 -m eblvm eval "$work/runs/mnist/mnist_bimdsm" \
                    --checkpoint "step:${step#step-}" -e svm-probe -o eval.0.n_train=60000 -o eval.0.raw=false &
            done
            sleep 10
        done
        wait
        ;;
    *) say "unknown phase $phase (check, speed, bidvl, mnist)" ;;
    esac
    pack
done
say "done"
