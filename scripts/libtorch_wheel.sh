#!/usr/bin/env bash
# Fetches a current libtorch as PyPI's torch wheel ships it (its C++ headers and shared libraries,
# plus the CUDA runtime and CUPTI libraries libtorch_cpu loads, from their own wheels) into
# build/downloads/, once, and prints the directory: the libtorch adapter is tested against it
# beside Debian's libtorch 1.13. Needs python3-pip and unzip, and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

torch="$PYPI_TORCH"
cupti=13.5.25     # nvidia-cuda-cupti: libcupti.so.13
runtime=13.5.37   # nvidia-cuda-runtime: libcudart.so.13
dest="$PWD/build/downloads/libtorch-$torch"

if [ ! -f "$dest/complete" ]; then
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT
    echo "fetching torch $torch from PyPI (about 540 MB)" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$wheels" \
        "torch==$torch" "nvidia-cuda-cupti==$cupti" "nvidia-cuda-runtime==$runtime" >&2
    rm -rf "$dest"
    mkdir -p "$dest"
    unzip -q "$wheels"/torch-*.whl 'torch/include/*' 'torch/lib/libtorch_cpu.so' 'torch/lib/libc10.so' \
        'torch/lib/libgomp.so.1' -d "$dest"
    unzip -q "$wheels"/nvidia_cuda_cupti-*.whl 'nvidia/cu13/lib/libcupti.so.13' -d "$dest"
    unzip -q "$wheels"/nvidia_cuda_runtime-*.whl 'nvidia/cu13/lib/libcudart.so.13' -d "$dest"
    touch "$dest/complete"
fi
echo "$dest"
