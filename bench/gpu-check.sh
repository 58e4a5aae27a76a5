#!/usr/bin/env bash
# On a machine with a CUDA GPU: builds (nvcc, for sm_90 unless GRADSYNC_CUDA_ARCH says otherwise)
# and runs every GPU test, the CUDA example and the GPU benchmark, and writes what each part printed
# to its own file in a results folder (first argument, default gpu-check-results), with a summary
# (summary.txt) at the end. Every part runs even when an earlier one failed; the exit status is 1
# when any part failed. A few minutes.
#
#   bash bench/gpu-check.sh [results-folder]   build and run everything
#   bash bench/gpu-check.sh --dry-run [folder]  find the tools, print every command, run none
#   bash bench/gpu-check.sh --bundle            copy doctest's header into build/gpu-check/third_party,
#                                               to carry to a GPU machine that lacks it
#
# Without a GPU, the parts that need one are reported as skipped and count as failures (set
# GRADSYNC_GPU_CHECK_NO_GPU_OK=1 to check the rest of the script on a machine without one).
# Finds NCCL under NCCL_HOME, in the nvidia-nccl-cu13 Python wheel (only libnccl.so.2 there: linked
# by that name, with an rpath), or in the CUDA toolkit; doctest's header under DOCTEST_INCLUDE, in
# build/gpu-check/third_party, or in /usr/include.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
case "${1:-}" in
--bundle)
    mkdir -p build/gpu-check/third_party
    cp -r /usr/include/doctest build/gpu-check/third_party/ || { echo "no doctest header in /usr/include"; exit 1; }
    echo "doctest's header is in build/gpu-check/third_party (carry build/gpu-check/third_party)"
    exit 0
    ;;
--dry-run) dry_run=1; shift ;;
esac
results=${1:-gpu-check-results}
build=build/gpu-check
mkdir -p "$results" "$build"
results=$(cd "$results" && pwd)
summary="$results/summary.txt"
: > "$summary"
export CUDA_MODULE_LOADING=EAGER  # a lazily loaded kernel would synchronize, and tests check a stream is still busy

cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc=${NVCC:-$(command -v nvcc || echo "$cuda/bin/nvcc")}
cxx=${CXX:-g++}
arch=${GRADSYNC_CUDA_ARCH:-90}

# NCCL: include and library folders, and how to link it.
nccl_include="" nccl_lib=""
if [ -n "${NCCL_HOME:-}" ]; then
    nccl_include=$NCCL_HOME/include
    nccl_lib=$NCCL_HOME/lib
    [ -d "$nccl_lib" ] || nccl_lib=$NCCL_HOME/lib64
    nccl_from="NCCL_HOME"
elif wheel=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null) &&
    [ -f "$wheel/include/nccl.h" ]; then
    nccl_include=$wheel/include
    nccl_lib=$wheel/lib
    nccl_from="the nvidia-nccl wheel"
elif [ -f "$cuda/include/nccl.h" ]; then
    nccl_include=$cuda/include
    nccl_lib=$cuda/lib64
    nccl_from="the CUDA toolkit"
fi
if [ -z "$nccl_include" ]; then
    echo "FAIL: NCCL not found (set NCCL_HOME, install nvidia-nccl-cu13, or the CUDA toolkit's NCCL)" | tee -a "$summary"
    exit 1
fi
if [ -e "$nccl_lib/libnccl.so" ]; then
    nccl_link=("-L$nccl_lib" -lnccl)
else
    nccl_link=("-L$nccl_lib" "-l:libnccl.so.2")  # a wheel has only the versioned name
fi

# doctest's header.
doctest_include=""
for dir in "${DOCTEST_INCLUDE:-}" "$build/third_party" /usr/include; do
    if [ -n "$dir" ] && [ -f "$dir/doctest/doctest.h" ]; then
        doctest_include=$dir
        break
    fi
done
if [ -z "$doctest_include" ]; then
    echo "FAIL: doctest's header not found: set DOCTEST_INCLUDE, or run 'bash bench/gpu-check.sh --bundle' where it is installed and carry build/gpu-check/third_party" | tee -a "$summary"
    exit 1
fi

gpus=0
if command -v nvidia-smi >/dev/null; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
failed=0

# part NAME NEEDS_GPU COMMAND...: runs the command, its output in NAME.txt, its verdict in the summary.
part() {
    local name=$1 needs_gpu=$2
    shift 2
    local log="$results/$name.txt"
    if ((dry_run)); then
        printf '%s\n' "$*" > "$log"
        printf '%-40s would run: %s\n' "$name" "$*" >> "$summary"
        return 0
    fi
    if ((needs_gpu)) && ((gpus == 0)); then
        echo "skipped: no GPU" > "$log"
        printf '%-40s SKIPPED (no GPU)\n' "$name" | tee -a "$summary"
        [ "${GRADSYNC_GPU_CHECK_NO_GPU_OK:-0}" = 1 ] || failed=1
        return 0
    fi
    echo "== $(date -u +%T) $name"
    local began=$SECONDS
    "$@" > "$log" 2>&1
    local rc=$?
    if ((rc == 0)); then
        printf '%-40s ok (%d s)\n' "$name" $((SECONDS - began)) | tee -a "$summary"
    else
        printf '%-40s FAILED (exit %d, %d s): see %s\n' "$name" "$rc" $((SECONDS - began)) "$log" | tee -a "$summary"
        tail -n 20 "$log" | sed 's/^/    /'
        failed=1
    fi
}

# same_checksums FILE...: every "checksum" line of the files ends with the same number, and there is one.
same_checksums() {
    local sums
    sums=$(cat "$@" | grep checksum | awk '{print $NF}' | sort -u)
    cat "$@"
    [ -n "$sums" ] && [ "$(echo "$sums" | wc -l)" = 1 ] || { echo "FAIL: the ranks' parameters differ (or none printed)"; return 1; }
}

# example_env N: the example as N processes, one per GPU, from torchrun's variables.
example_env() {
    local n=$1 pids=() r rc=0
    for ((r = 0; r < n; ++r)); do
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
            "$build/train_mlp_nccl" > "$results/example_env.$r.txt" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    same_checksums "$results"/example_env.*.txt || rc=1
    return $rc
}

# example_spawn: the example as one process, one thread per GPU (nccl_spawn).
example_spawn() {
    "$build/train_mlp_nccl" > "$results/example_spawn.out" 2>&1
    local rc=$?
    same_checksums "$results/example_spawn.out" || rc=1
    return $rc
}

# example_local N: N ranks of CudaLocalBackend on GPU 0.
example_local() {
    "$build/train_mlp_nccl" --local-ranks "$1" > "$results/example_local.$1.out" 2>&1
    local rc=$?
    same_checksums "$results/example_local.$1.out" || rc=1
    return $rc
}

# A GPU test binary prints "skipped: ..." without a usable device: with one, that is a failure.
gpu_suite() {
    "$build/test_cuda" --test-suite=gpu "$@" | tee "$results/.gpu-suite"
    local rc=${PIPESTATUS[0]}
    if grep -q "^skipped:" "$results/.gpu-suite"; then echo "FAIL: no usable CUDA device"; return 1; fi
    return "$rc"
}

nccl_algo() {
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV,TUNING "$build/test_cuda" --test-suite=gpu \
        --test-case="NcclBackend<Ring> and <Tree>*" 2>&1 | grep -i "NCCL_ALGO\|algorithm\|Ring\|Tree" | head -n 40
    return "${PIPESTATUS[0]}"
}

{
    echo "gradsync GPU check, $(date -u +%FT%TZ)"
    nvidia-smi -L 2>/dev/null || echo "(nvidia-smi: no GPU listed)"
    "$nvcc" --version 2>/dev/null | tail -n 2
    echo "NCCL from $nccl_from: $nccl_include, $nccl_lib (${nccl_link[*]})"
    echo "doctest from $doctest_include; sm_$arch; $gpus GPU(s)"
} | tee "$results/environment.txt"

# /usr/include is searched anyway; naming it with -isystem would reorder the C library's headers.
includes=()
for dir in "$doctest_include" "$nccl_include"; do [ "$dir" = /usr/include ] || includes+=(-isystem "$dir"); done
nvcc_flags=(-std=c++20 -O3 "-gencode=arch=compute_$arch,code=sm_$arch" -Iinclude -Ibench "${includes[@]}"
    "${nccl_link[@]}" -Xlinker "-rpath=$nccl_lib")
cxx_flags=(-std=c++20 -O2 -Iinclude -Itests "${includes[@]}" -isystem "$cuda/include"
    "${nccl_link[@]}" "-Wl,-rpath,$nccl_lib" "-L$cuda/lib64" -lcudart -pthread)

part build.test_cuda 0 "$nvcc" "${nvcc_flags[@]}" tests/cuda/test_cuda.cu -o "$build/test_cuda"
part build.bench_cuda 0 "$nvcc" "${nvcc_flags[@]}" bench/bench_cuda.cu -o "$build/bench_cuda"
part build.train_mlp_nccl 0 "$nvcc" "${nvcc_flags[@]}" -Iexamples examples/train_mlp_nccl.cu -o "$build/train_mlp_nccl" -lcublas
part build.nccl_tests 0 "$cxx" tests/main.cpp tests/cuda/test_nccl_environment.cpp tests/cuda/test_nccl_backend.cpp \
    "${cxx_flags[@]}" -o "$build/nccl_tests"

part tests.cuda_host 0 "$build/test_cuda" --test-suite=host
part tests.cuda_gpu 1 gpu_suite
part tests.nccl 0 "$build/nccl_tests"
part example.nccl_spawn 1 example_spawn
part example.one_process_per_gpu 1 example_env "$gpus"
for n in 2 3 4; do part "example.local_ranks_$n" 1 example_local "$n"; done
part nccl_algo 1 nccl_algo
part bench_cuda 1 "$build/bench_cuda"

echo
echo "== summary ($results)"
cat "$summary"
if ((dry_run)); then
    echo "GPU check: dry run, nothing was run"
    exit 0
fi
if ((failed)); then
    echo "GPU check: FAILED"
    exit 1
fi
echo "GPU check: passed"
