#!/usr/bin/env bash
# Runs the whole test suite: the dev build (unit, equivalence, compile-fail, consumer, single
# header, README, nvcc and format checks), 40 seconds of fuzzing the checkpoint reader, then the tests
# again under ThreadSanitizer and under AddressSanitizer + UndefinedBehaviorSanitizer. Installs what
# it needs on Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

ensure_packages cmake ninja-build g++ make python3 doctest-dev libbenchmark-dev clang-format \
    libopenmpi-dev openmpi-bin nlohmann-json3-dev clang-14 libtorch-dev libeigen3-dev pkgconf
export PATH="$PATH:/usr/local/cuda/bin"  # nvcc, where the CUDA toolkit is installed

for preset in dev tsan asan-ubsan; do
    step "configure and build: $preset"
    cmake --preset "$preset" >/dev/null
    cmake --build --preset "$preset"
    step "test: $preset"
    ctest --preset "$preset"
    if [ "$preset" = dev ]; then
        bash scripts/fuzz.sh 40  # the checkpoint reader under libFuzzer, 40 seconds
    fi
done
step "all tests passed"
