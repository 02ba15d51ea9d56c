#!/usr/bin/env bash
# What issues 23 and 24 still need from a GPU, in one lease, packed into WORK/pack.tar.gz by a deadline:
#   bash benchmarks/gpu_prepare.sh SHARED_DATA .gpudata    # here, before the lease (data and wheels)
#   bash benchmarks/gpu_results.sh WORK SECONDS .gpudata [PHASES]   # on the GPU machine, .gpudata carried
# PHASES: "alone side" (default), or one of them per call (two calls of about 300 s each). Keep
# WORK outside the lease's $OUT and copy back only WORK/pack.tar.gz, WORK/job.log and, after
# "side", WORK/samples_*.npz (a lease returns 8 files of at most 16 MiB):
#   ... && cp /tmp/w/pack.tar.gz /tmp/w/job.log /tmp/w/samples_*.npz "$OUT"/
# DATA holds cifar/ (the CIFAR-10 subset's .npz), MNIST/raw/ and whl/ (wheels of the pure-Python
# dependencies the machine lacks, installed into /tmp/site). Every number is the programs' own
# output (logs, tables, metrics.jsonl); nothing is typed in. In order of what the issues need:
#   1. alone on the card: the measured matmul peak (bench_deep --peak); the step table of the main
#      cases, eager and graph-replayed, bf16 replays included (new), cuDNN autotuning on as always;
#      BiDVL and MNIST BiMDSM again with autotuning off; `eblvm run` of cifar10_bidvl and
#      mnist_bimdsm with [run] cudnn_benchmark on (their steps/s against the bench's step); a
#      profile of three cases' eager steps;
#   2. side by side until the deadline: cifar10_bidvl for 1,500 updates, seeds 0-2, with the
#      released code's softplus on the energy and without it (identity), for test RMSE, AUROC and a
#      live energy, then 10,000 generator samples of each seed-0 run as 8-bit images in two
#      files each, for FID here (python benchmarks/fid_offline.py score recipes/cifar10_bidvl.toml
#      samples_identity.*.npz -o data.root=...: about 40 minutes on two CPU cores);
#      benchmarks/graph_rng_check.py; tests/test_cuda.py.
set -u
work=$1 budget=$2 data=$3 phases=${4:-alone side}
start=$(date +%s)
end=$((start + budget))
mkdir -p "$work/runs" "$work/logs" "$work/recipes"
exec >>"$work/job.log" 2>&1
export PYTHONUNBUFFERED=1
say() { echo "[$(date +%T) +$(($(date +%s) - start))s] $*"; }
left() { echo $((end - $(date +%s))); }
# run LIMIT NAME COMMAND...: the command with a timeout of LIMIT s (less if the deadline is nearer), logged
run() {
    local limit=$1 name=$2
    shift 2
    local room=$(($(left) - 40))
    [ "$room" -lt "$limit" ] && limit=$room
    if [ "$limit" -lt 10 ]; then say "skipped $name (no time left)"; return; fi
    say "$name (≤ ${limit}s)"
    timeout -k 10 -s TERM "$limit" "$@" > "$work/logs/$name.log" 2>&1 || say "$name exit $?"
}

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
mnist = read("recipes/mnist_bimdsm.toml")
mnist["data"]["root"] = str(data)
mnist["run"].update(eval_every=0, checkpoint_every=100000)
mnist["eval"] = []
(work / "recipes" / "mnist_bimdsm.toml").write_text(tomli_w.dumps(mnist))
PY

bench="python3 benchmarks/bench_deep.py"
if [[ " $phases " == *" alone "* ]]; then
    run 40 peak $bench --peak --out "$work/peak.md"
    # MDSM fp32/bf16, BiMDSM fp32/bf16, VaGES-MDSM fp32/bf16, BiDVL fp32/bf16, MNIST BiMDSM fp32/bf16, MNIST MDSM
    run 180 bench $bench --steps 10 --warmup 3 --cases 0 2 3 6 5 7 8 9 11 13 12 --out "$work/bench_deep.md"
    run 50 bench_no_autotune $bench --steps 10 --warmup 3 --cases 8 11 --no-cudnn-benchmark \
        --out "$work/bench_no_autotune.md"
    run 50 run_bidvl python3 -m eblvm run "$work/recipes/cifar10_bidvl.toml" -o run.steps=600 \
        -o run.cudnn_benchmark=true -o '~eval' --out "$work/runs/speed_bidvl"
    run 50 run_mnist python3 -m eblvm run "$work/recipes/mnist_bimdsm.toml" -o run.steps=1000 \
        -o run.cudnn_benchmark=true --out "$work/runs/speed_mnist"
    run 60 profile $bench --profile --steps 3 --cases 3 8 11 --out "$work/profile.md"
fi
if [[ " $phases " == *" side "* ]]; then
    say "side by side: the BiDVL sweep, the RNG check, the CUDA tests"
    (
        for activation in softplus identity; do
            for seed in 0 1 2; do
                name=bidvl_${activation}_s$seed
                run $(($(left) - 100)) "$name" python3 -m eblvm run "$work/recipes/cifar10_bidvl.toml" \
                    -o run.seed=$seed -o "model.activation=\"$activation\"" --out "$work/runs/$name" &
            done
        done
        wait
        for activation in softplus identity; do  # FID is scored off the lease (benchmarks/fid_offline.py)
            run 40 "export_$activation" python3 benchmarks/fid_offline.py export \
                "$work/runs/bidvl_${activation}_s0/cifar10_bidvl" "$work/samples_$activation" --parts 2 --sampler generator
        done
    ) &
    run 60 graph_rng_check python3 benchmarks/graph_rng_check.py &
    run $(($(left) - 60)) cuda_tests python3 -m pytest -q -p no:cacheprovider -n 2 -rfEs --durations=12 tests/test_cuda.py &
fi
while [ "$(jobs -rp | wc -l)" -gt 0 ] && [ "$(left)" -gt 20 ]; do sleep 2; done
say "packing ($(jobs -rp | wc -l) jobs still running)"
(cd "$work" && find . -path ./runs -prune -o -type f \( -name '*.log' -o -name '*.md' \) -print > files.txt &&
    find runs -type f \( -name '*.png' -o -name 'metrics.jsonl' -o -name 'run.json' -o -name 'run.log' \
        -o -name 'recipe.toml' \) >> files.txt && tar czf pack.tar.gz -T files.txt)
touch "$work/DONE"
say "done"
