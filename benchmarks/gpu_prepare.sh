#!/usr/bin/env bash
# Before a GPU lease, here: the data and wheels that benchmarks/gpu_results.sh reads, in one folder
# to carry (git ignores it through .git/info/exclude):
#   bash benchmarks/gpu_prepare.sh SHARED_DATA [.gpudata]
# SHARED_DATA holds cifar10_subset/*.npz and MNIST/raw/ (the development data); the wheels are the
# pure-Python dependencies a lent machine with PyTorch lacked (Python 3.12 there).
set -euo pipefail
shared=$1 dest=${2:-.gpudata}
mkdir -p "$dest/cifar" "$dest/MNIST/raw" "$dest/whl"
cp "$shared"/cifar10_subset/*.npz "$dest/cifar/"
cp "$shared"/MNIST/raw/* "$dest/MNIST/raw/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d "$dest/whl" \
    attrs cattrs tomli-w typing-extensions
grep -qxF "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
du -sh "$dest"
