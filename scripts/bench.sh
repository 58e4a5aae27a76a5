#!/usr/bin/env bash
# Runs the throughput benchmarks and prints every figure beside the ceiling or baseline measured
# in the same run: first what including gradsync costs a compile, then LocalBackend (threads of
# one process, the default CPU backend), DataParallel<MpiBackend> on 2 processes under mpirun (also
# beside one busy-looping thread per core) and started torchrun-style, the race with PyTorch DDP
# (gloo) on the same layouts (Debian's PyTorch 1.13, then the current one from PyPI), two machines
# played on one with slow links between them, and what the libtorch adapter costs; last, one table of every figure, with build/bench-results/results.json
# and plots. Installs what it needs on Debian 12. Extra arguments go to Google Benchmark, e.g.
# --benchmark_filter=allreduce;
# GRADSYNC_BENCH_ONLY=local skips the MPI and DDP parts.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

packages=(cmake ninja-build g++ make libbenchmark-dev nlohmann-json3-dev python3 python3-matplotlib)
[ "${GRADSYNC_BENCH_ONLY:-}" = local ] || packages+=(libopenmpi-dev openmpi-bin iproute2 python3 python3-torch libtorch-dev python3-venv python3-pip)
ensure_packages "${packages[@]}"
# Each benchmark writes its summary's figures here; bench/summary.py gathers them at the end.
export GRADSYNC_BENCH_RESULTS="$PWD/build/bench-results"
rm -rf "$GRADSYNC_BENCH_RESULTS"
mkdir -p "$GRADSYNC_BENCH_RESULTS"
summary() {
    step "Summary (the figures, results.json and plots in build/bench-results)"
    # Debian's python3, with Debian's matplotlib.
    /usr/bin/python3 bench/summary.py "$GRADSYNC_BENCH_RESULTS"
}

step "configure and build: bench"
cmake --preset bench >/dev/null
cmake --build --preset bench
step "Compile cost of including gradsync (about a minute)"
python3 bench/compile_cost.py
step "LocalBackend (a few minutes; each line appears as its benchmark finishes)"
./build/bench/bench/gradsync_bench --benchmark_color=false \
    --benchmark_out="$GRADSYNC_BENCH_RESULTS/google_benchmark_raw.json" --benchmark_out_format=json "$@"
if [ "${GRADSYNC_BENCH_ONLY:-}" = local ]; then
    summary
    exit 0
fi

# Open MPI refuses to run as root unless told; oversubscribe: more ranks than cores is allowed.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
step "MpiBackend on 2 processes (about a minute)"
mpirun --oversubscribe -np 2 ./build/bench/bench/bench_mpi
step "MpiBackend on 2 processes beside one busy-looping thread per core (under a minute)"
mpirun --oversubscribe -np 2 ./build/bench/bench/bench_mpi --in-place-only --busy --iterations 10 \
    --results-name mpi_busy
step "MpiBackend on 2 processes started torchrun-style, joined through ompi-server (TCP; under a minute)"
python3 tests/mpi/env_launch.py 2 ./build/bench/bench/bench_mpi --iterations 10 --in-place-only \
    --results-name mpi_torchrun
step "PyTorch DDP (gloo) of Debian's PyTorch 1.13 and gradsync in turn, 2 processes each (about two minutes)"
# Debian's python3-torch lives in the system interpreter, not in a virtualenv's.
/usr/bin/python3 bench/ddp_peer.py --bench-mpi ./build/bench/bench/bench_mpi
step "The same race with PyTorch $PYPI_TORCH from PyPI (installed once into build/venv-torch; about three minutes)"
pypi_python="$(torch_venv)"
# Three rounds, as for 1.13: the median of two is their mean, which one slow round drags below.
"$pypi_python" bench/ddp_peer.py --bench-mpi ./build/bench/bench/bench_mpi --rounds 3
step "Two machines of 2 ranks, played on this one: network namespaces, links slowed to 1 Gbit/s (about five minutes)"
# Two levels against the flat backend, hybrid sharding against flat sharding, bfloat16 wire and
# PowerSGD against float32, where every byte between nodes crosses a slow link; 16 MiB pieces
# (1 MiB suits shared memory, not a slow link). Needs root (namespaces); skipped, saying why, elsewhere.
nodes_rc=0
python3 scripts/nodes.py run --nodes 2 --per-node 2 --rate 1gbit -- ./build/bench/bench/bench_nodes \
    --chunk-kib 16384 --iterations 3 || nodes_rc=$?
if [ "$nodes_rc" -ne 0 ] && [ "$nodes_rc" -ne 77 ]; then exit "$nodes_rc"; fi
step "The libtorch adapter against plain buffers of the same layout, 2 ranks (seconds)"
./build/bench/bench/bench_torch
summary
