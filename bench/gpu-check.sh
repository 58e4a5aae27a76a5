#!/usr/bin/env bash
# On a machine with a CUDA GPU: builds the CUDA tests and GPU benchmarks with nvcc (sm_90, the
# H200, unless GRADSYNC_CUDA_ARCH says otherwise), runs them, and writes everything to a results
# file (first argument, default gpu-check-results.txt). A few minutes. Without a GPU the "gpu"
# suite and the benchmarks would only say "skipped": here that is a failure.
# Needs nvcc, NCCL (the CUDA toolkit's, or under NCCL_HOME) and doctest's header (Debian's
# doctest-dev, or the folder holding doctest/ in DOCTEST_INCLUDE).
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
arch=${GRADSYNC_CUDA_ARCH:-90}
results=${1:-gpu-check-results.txt}
build=build/gpu-check
mkdir -p "$build"
flags=(-std=c++20 -O3 "-gencode=arch=compute_$arch,code=sm_$arch" -Iinclude -Ibench)
[ -z "${DOCTEST_INCLUDE:-}" ] || flags+=(-isystem "$DOCTEST_INCLUDE")
[ -z "${NCCL_HOME:-}" ] || flags+=(-isystem "$NCCL_HOME/include" -L"$NCCL_HOME/lib")
flags+=(-lnccl)
{
    echo "== $(date -u +%FT%TZ) gradsync GPU check"
    nvidia-smi -L || true
    "$nvcc" --version | tail -n 2
    echo "== build (sm_$arch)"
    "$nvcc" "${flags[@]}" tests/cuda/test_cuda.cu -o "$build/test_cuda"
    "$nvcc" "${flags[@]}" bench/bench_cuda.cu -o "$build/bench_cuda"
    "$nvcc" "${flags[@]}" -Iexamples examples/train_mlp_nccl.cu -o "$build/train_mlp_nccl" -lcublas
    echo "== tests: host"
    "$build/test_cuda" --test-suite=host
    echo "== tests: gpu"
    "$build/test_cuda" --test-suite=gpu | tee "$build/gpu-tests.txt"
    ! grep -q "^skipped:" "$build/gpu-tests.txt" || { echo "FAIL: no usable CUDA device"; exit 1; }
    echo "== example: train_mlp_nccl, one thread per GPU (nccl_spawn)"
    "$build/train_mlp_nccl" | tee "$build/spawn.txt"
    [ "$(grep checksum "$build/spawn.txt" | awk '{print $NF}' | sort -u | wc -l)" = 1 ] ||
        { echo "FAIL: the ranks' parameters differ"; exit 1; }
    gpus=$(nvidia-smi -L | wc -l)
    echo "== example: train_mlp_nccl, one process per GPU from torchrun's variables ($gpus processes)"
    pids=()
    for ((r = 0; r < gpus; ++r)); do
        RANK=$r WORLD_SIZE=$gpus LOCAL_RANK=$r LOCAL_WORLD_SIZE=$gpus MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
            "$build/train_mlp_nccl" > "$build/env.$r.txt" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    cat "$build"/env.*.txt
    [ "$(cat "$build"/env.*.txt | grep checksum | awk '{print $NF}' | sort -u | wc -l)" = 1 ] ||
        { echo "FAIL: the ranks' parameters differ"; exit 1; }
    echo "== NCCL_ALGO per communicator: what NCCL says it read while tuning each one"
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV,TUNING "$build/test_cuda" --test-suite=gpu \
        --test-case="NcclBackend<Ring> and <Tree>*" 2>&1 | grep -i "NCCL_ALGO" || echo "(NCCL printed nothing about NCCL_ALGO)"
    echo "== benchmarks"
    "$build/bench_cuda"
} 2>&1 | tee "$results"
