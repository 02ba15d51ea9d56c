#!/usr/bin/env bash
# Before benchmarks/gpu_run.sh, on a machine with a network: the data and wheels it reads, in one
# folder to copy to the GPU machine:
#
#   bash benchmarks/gpu_prepare.sh SHARED_DATA [DATA_DIR]      # DATA_DIR: .gpudata by default
#
# SHARED_DATA holds cifar10_subset/*.npz and MNIST/raw/ (the idx files); the wheels are the
# pure-Python dependencies a GPU machine with PyTorch but no package registry lacks (Python 3.12).
# A DATA_DIR inside the repository is added to .git/info/exclude, so git ignores it.
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n '2,/^set -e/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
shared=$1 dest=${2:-.gpudata}
mkdir -p "$dest/cifar" "$dest/MNIST/raw" "$dest/whl"
cp "$shared"/cifar10_subset/*.npz "$dest/cifar/"
cp "$shared"/MNIST/raw/* "$dest/MNIST/raw/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d "$dest/whl" \
    attrs cattrs tomli-w typing-extensions
case $dest in
/*) ;;
*) grep -qxF "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >>.git/info/exclude ;;
esac
du -sh "$dest"
