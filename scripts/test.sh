#!/usr/bin/env bash
# Runs the whole test suite: the dev build (unit, equivalence, compile-fail, consumer, single
# header, README, nvcc and format checks, every benchmark once in its quick mode; the libtorch
# adapter against Debian's libtorch 1.13 and a current one from PyPI; checkpoints read and written
# by Python's safetensors and PyTorch; training scalars read by TensorBoard's reader), 40 seconds
# of fuzzing the checkpoint reader, then the tests again under ThreadSanitizer and under
# AddressSanitizer + UndefinedBehaviorSanitizer. Installs what it needs on Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

ensure_packages cmake ninja-build g++ make python3 doctest-dev libbenchmark-dev clang-format \
    libopenmpi-dev openmpi-bin iproute2 nlohmann-json3-dev clang-14 libtorch-dev libeigen3-dev pkgconf python3-pip python3-venv unzip python3-torch
export PATH="$PATH:/usr/local/cuda/bin"  # nvcc, where the CUDA toolkit is installed

for preset in dev tsan asan-ubsan; do
    step "configure and build: $preset"
    extra=()
    if [ "$preset" = dev ]; then  # the libtorch adapter also against a current libtorch from PyPI
        wheel="$(bash scripts/libtorch_wheel.sh)"
        extra=(-DGRADSYNC_LIBTORCH_WHEEL="$wheel" -DGRADSYNC_SAFETENSORS_PYTHON="$(safetensors_venv)"
            -DGRADSYNC_METRICS_PYTHON="$(metrics_venv)")
    fi
    cmake --preset "$preset" "${extra[@]}" >/dev/null
    cmake --build --preset "$preset"
    step "test: $preset"
    ctest --preset "$preset"
    if [ "$preset" = dev ]; then
        bash scripts/fuzz.sh 40  # the checkpoint reader under libFuzzer, 40 seconds
    fi
done
step "all tests passed"
