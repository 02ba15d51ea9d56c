#!/usr/bin/env bash
# Every GPU check in one command, for a lent GPU machine with PyTorch but no registry:
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# Wheels of the pure-Python dependencies the machine lacks go in .whl/ beforehand
# (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl attrs cattrs tomli-w typing-extensions).
# It installs eblvm without dependencies, runs the CUDA tests, then the deep-model benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${1:-${OUT:-/tmp}}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || echo "editable install failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
echo "== CUDA tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -25
echo "== deep-model benchmark"
timeout 240 python3 benchmarks/bench_deep.py --steps 20 --warmup 5 --out "$out/bench_deep.md"
echo "== one-GPU torchrun against a plain run (cifar10_bimdsm)"
timeout 200 bash benchmarks/torchrun_check.sh
