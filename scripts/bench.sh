#!/usr/bin/env bash
# Runs the throughput benchmarks (LocalBackend, on the CPU) and prints a summary table of every
# figure beside the ceiling or baseline measured in the same run. Installs what it needs on
# Debian 12. Extra arguments go to Google Benchmark, e.g. --benchmark_filter=allreduce.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

ensure_packages cmake ninja-build g++ make libbenchmark-dev
step "configure and build: bench"
cmake --preset bench >/dev/null
cmake --build --preset bench
step "run (a few minutes; each line appears as its benchmark finishes)"
./build/bench/bench/gradsync_bench --benchmark_color=false "$@"
