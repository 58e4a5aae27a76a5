#!/usr/bin/env bash
# On a machine with a CUDA GPU: builds (nvcc, for sm_90 unless GRADSYNC_CUDA_ARCH says otherwise)
# and runs every GPU test, the CUDA example, the GPU benchmark and, where python3 has PyTorch, the
# libtorch adapter's GPU test against that PyTorch's libtorch, each part under its own time limit,
# and leaves at most four files in the results folder (first argument, default gpu-check-results):
# summary.txt, environment.txt, logs.tar.gz (every part's output) and bench_cuda.txt. The summary
# is printed last. Every part runs even when an earlier one failed; the exit status is 1 when any
# part failed. Fits a 10-minute call on a 16-core machine.
#
#   bash bench/gpu-check.sh [results-folder]   build and run everything
#   bash bench/gpu-check.sh --dry-run [folder]  find the tools, plan every part, run none
#   bash bench/gpu-check.sh --bundle            stage the headers of doctest, nlohmann/json and
#                                               NCCL into build/gpu-check/third_party/include, to
#                                               carry to a GPU machine that lacks them (no network)
#
# Without a GPU, the parts that need one are reported as skipped and count as failures (set
# GRADSYNC_GPU_CHECK_NO_GPU_OK=1 to check the rest of the script on a machine without one).
# Finds NCCL's library under NCCL_HOME, in the nvidia-nccl-cu13 Python wheel (only libnccl.so.2
# there: linked by that name, with an rpath), or in the CUDA toolkit; NCCL's header beside the
# library or, where the wheel has none, in build/gpu-check/third_party/include; doctest's header
# (and nlohmann/json's, which checkpoints use) under DOCTEST_INCLUDE, in
# build/gpu-check/third_party/include, or in the system's include folder (GRADSYNC_SYSTEM_INCLUDE,
# /usr/include unless set).
set -uo pipefail
cd "$(dirname "$0")/.."

build=${GRADSYNC_GPU_CHECK_BUILD:-build/gpu-check}  # where it builds, and finds what --bundle staged
staged=$build/third_party/include
cuda=${CUDA_HOME:-/usr/local/cuda}
system_include=${GRADSYNC_SYSTEM_INCLUDE:-/usr/include}

dry_run=0
case "${1:-}" in
--bundle)
    mkdir -p "$staged"
    cp -r "$system_include/doctest" "$staged/" || { echo "no doctest header in $system_include (apt-get install doctest-dev)"; exit 1; }
    cp -r "$system_include/nlohmann" "$staged/" ||
        { echo "no nlohmann/json header in $system_include (apt-get install nlohmann-json3-dev)"; exit 1; }
    cp "$cuda/include/nccl.h" "$staged/" || { echo "no nccl.h in $cuda/include"; exit 1; }
    echo "the headers of doctest, nlohmann/json and NCCL are in $staged: carry $build/third_party"
    exit 0
    ;;
--dry-run) dry_run=1; shift ;;
esac
results=${1:-gpu-check-results}
mkdir -p "$results" "$build"
results=$(cd "$results" && pwd)
logs=$build/logs
rm -rf "$logs" && mkdir -p "$logs"
summary="$results/summary.txt"
: > "$summary"
export CUDA_MODULE_LOADING=EAGER  # a lazily loaded kernel would synchronize, and tests check a stream is still busy

nvcc=${NVCC:-$(command -v nvcc || echo "$cuda/bin/nvcc")}
cxx=${CXX:-g++}
arch=${GRADSYNC_CUDA_ARCH:-90}

# NCCL: the library's folder and how to link it, then its header.
nccl_lib="" nccl_include=""
if [ -n "${NCCL_HOME:-}" ]; then
    nccl_lib=$NCCL_HOME/lib
    [ -d "$nccl_lib" ] || nccl_lib=$NCCL_HOME/lib64
    nccl_include=$NCCL_HOME/include
    nccl_from="NCCL_HOME"
elif wheel=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null) &&
    [ -e "$wheel/lib/libnccl.so.2" ]; then
    nccl_lib=$wheel/lib
    nccl_include=$wheel/include
    nccl_from="the nvidia-nccl wheel"
elif [ -e "$cuda/lib64/libnccl.so" ] || [ -e "$cuda/lib64/libnccl.so.2" ]; then
    nccl_lib=$cuda/lib64
    nccl_include=$cuda/include
    nccl_from="the CUDA toolkit"
fi
if [ -z "$nccl_lib" ]; then
    echo "FAIL: NCCL not found (set NCCL_HOME, install nvidia-nccl-cu13, or the CUDA toolkit's NCCL)" | tee -a "$summary"
    exit 1
fi
if [ ! -f "$nccl_include/nccl.h" ]; then
    if [ -f "$staged/nccl.h" ]; then
        nccl_include=$staged
        nccl_from="$nccl_from (header staged in $staged)"
    else
        echo "FAIL: NCCL's library is in $nccl_lib but its header is not beside it: run 'bash bench/gpu-check.sh --bundle' where the CUDA toolkit has nccl.h and carry $build/third_party" | tee -a "$summary"
        exit 1
    fi
fi
if [ -e "$nccl_lib/libnccl.so" ]; then
    nccl_link=("-L$nccl_lib" -lnccl)
else
    nccl_link=("-L$nccl_lib" "-l:libnccl.so.2")  # a wheel has only the versioned name
fi

# doctest's header, and nlohmann/json's (the checkpoint tests).
header_folder() {
    local dir
    for dir in "${DOCTEST_INCLUDE:-}" "$staged" "$system_include"; do
        if [ -n "$dir" ] && [ -f "$dir/$1" ]; then
            echo "$dir"
            return 0
        fi
    done
    echo "FAIL: $2's header ($1) not found: put it in a folder named by DOCTEST_INCLUDE (searched for both doctest's and nlohmann/json's headers), or run 'bash bench/gpu-check.sh --bundle' where it is installed and carry $build/third_party" | tee -a "$summary" >&2
    return 1
}
doctest_include=$(header_folder doctest/doctest.h doctest) || exit 1
json_include=$(header_folder nlohmann/json.hpp nlohmann/json) || exit 1

gpus=0
if command -v nvidia-smi >/dev/null; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
failed=0

# part NAME NEEDS_GPU SECONDS COMMAND...: runs the command under its time limit, its output in
# the logs, its verdict in the summary.
part() {
    local name=$1 needs_gpu=$2 limit=$3
    shift 3
    local log="$logs/$name.txt"
    if ((dry_run)); then
        printf '%s\n' "$*" > "$log"
        printf '%-32s would run (limit %d s): %s\n' "$name" "$limit" "$*" >> "$summary"
        return 0
    fi
    if ((needs_gpu)) && ((gpus == 0)); then
        echo "skipped: no GPU" > "$log"
        printf '%-32s SKIPPED (no GPU)\n' "$name" >> "$summary"
        [ "${GRADSYNC_GPU_CHECK_NO_GPU_OK:-0}" = 1 ] || failed=1
        return 0
    fi
    echo "== $(date -u +%T) $name (limit $limit s)"
    local began=$SECONDS
    # timeout runs programs only: a function of this script runs in a bash that has it exported.
    if declare -F "$1" >/dev/null; then set -- bash -c '"$@"' "$1" "$@"; fi
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    if ((rc == 0)); then
        printf '%-32s ok (%d s)\n' "$name" $((SECONDS - began)) >> "$summary"
    else
        local why="exit $rc"
        ((rc == 124 || rc == 137)) && why="over its $limit s"
        printf '%-32s FAILED (%s, %d s): %s\n' "$name" "$why" $((SECONDS - began)) "$(tail -n 1 "$log" | cut -c1-100)" >> "$summary"
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
            "$build/train_mlp_nccl" > "$logs/example_env.$r.out" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    same_checksums "$logs"/example_env.*.out || rc=1
    return $rc
}

# example_spawn: the example as one process, one thread per GPU (nccl_spawn).
example_spawn() {
    "$build/train_mlp_nccl" > "$logs/example_spawn.out" 2>&1
    local rc=$?
    same_checksums "$logs/example_spawn.out" || rc=1
    return $rc
}

# example_local N: N ranks of CudaLocalBackend on GPU 0.
example_local() {
    "$build/train_mlp_nccl" --local-ranks "$1" > "$logs/example_local.$1.out" 2>&1
    local rc=$?
    same_checksums "$logs/example_local.$1.out" || rc=1
    return $rc
}

# A GPU test binary prints "skipped: ..." without a usable device: with one, that is a failure.
gpu_suite() {
    "$build/test_cuda" --test-suite=gpu "$@" | tee "$logs/.gpu-suite"
    local rc=${PIPESTATUS[0]}
    if grep -q "^skipped:" "$logs/.gpu-suite"; then echo "FAIL: no usable CUDA device"; return 1; fi
    return "$rc"
}

nccl_algo() {
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV,TUNING "$build/test_cuda" --test-suite=gpu \
        --test-case="NcclBackend<Ring> and <Tree>*" 2>&1 | grep -i "NCCL_ALGO\|algorithm\|Ring\|Tree" | head -n 40
    return "${PIPESTATUS[0]}"
}

# The benchmark, its figures also kept beside the summary.
bench_cuda() {
    "$build/bench_cuda" | tee "$results/bench_cuda.txt"
    return "${PIPESTATUS[0]}"
}

export -f same_checksums example_env example_spawn example_local gpu_suite nccl_algo bench_cuda
export build logs results

{
    echo "gradsync GPU check, $(date -u +%FT%TZ)"
    nvidia-smi -L 2>/dev/null || echo "(nvidia-smi: no GPU listed)"
    "$nvcc" --version 2>/dev/null | tail -n 2
    echo "NCCL from $nccl_from: $nccl_include, $nccl_lib (${nccl_link[*]})"
    echo "doctest from $doctest_include; nlohmann/json from $json_include; sm_$arch; $gpus GPU(s)"
} | tee "$results/environment.txt"

# The system's include folder is searched anyway; naming it with -isystem would reorder the C
# library's headers.
includes=()
for dir in "$doctest_include" "$json_include" "$nccl_include"; do
    [ "$dir" = /usr/include ] || [[ " ${includes[*]} " == *" $dir "* ]] || includes+=(-isystem "$dir")
done
nvcc_flags=(-std=c++20 -O3 "-gencode=arch=compute_$arch,code=sm_$arch" -Iinclude -Ibench -Itests "${includes[@]}"
    "${nccl_link[@]}" -Xlinker "-rpath=$nccl_lib")
cxx_flags=(-std=c++20 -O2 -Iinclude -Itests "${includes[@]}" -isystem "$cuda/include"
    "${nccl_link[@]}" "-Wl,-rpath,$nccl_lib" "-L$cuda/lib64" -lcudart -pthread)

# PyTorch's libtorch, where python3 has torch: the adapter's GPU test is built against it beside the
# rest and run last (its build is the slowest).
torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) || torch_dir=""
torch_flags=()
if [ -n "$torch_dir" ] && [ -d "$torch_dir/include/torch" ]; then
    torch_abi=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null || echo 1)
    torch_flags=(-isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include"
        "-D_GLIBCXX_USE_CXX11_ABI=$torch_abi" -cudart shared "-L$torch_dir/lib" -Xlinker --no-as-needed
        -ltorch -ltorch_cuda -ltorch_cpu -lc10_cuda -lc10 -Xlinker "-rpath=$torch_dir/lib" -Xlinker "-rpath=$cuda/lib64")
    echo "libtorch from $torch_dir (C++11 ABI $torch_abi)" | tee -a "$results/environment.txt"
fi

# The builds, side by side (nvcc is slow; the machine has the cores).
if ((${#torch_flags[@]})); then
    if ((dry_run)); then
        part build.torch_cuda 0 420 "$nvcc" "${nvcc_flags[@]}" tests/cuda/test_torch_cuda.cu -o "$build/test_torch_cuda" "${torch_flags[@]}"
    else
        (part build.torch_cuda 0 420 "$nvcc" "${nvcc_flags[@]}" tests/cuda/test_torch_cuda.cu -o "$build/test_torch_cuda" \
            "${torch_flags[@]}"; exit $failed) &
        torch_build=$!
    fi
fi
if ((dry_run)); then
    part build.test_cuda 0 300 "$nvcc" "${nvcc_flags[@]}" tests/cuda/test_cuda.cu tests/cuda/test_sharded_on_device.cu tests/cuda/test_hooks_on_device.cu tests/cuda/test_powersgd_on_device.cu -o "$build/test_cuda"
    part build.bench_cuda 0 300 "$nvcc" "${nvcc_flags[@]}" bench/bench_cuda.cu -o "$build/bench_cuda"
    part build.train_mlp_nccl 0 300 "$nvcc" "${nvcc_flags[@]}" -Iexamples examples/train_mlp_nccl.cu -o "$build/train_mlp_nccl" -lcublas
    part build.nccl_tests 0 300 "$cxx" tests/main.cpp tests/cuda/test_nccl_environment.cpp tests/cuda/test_nccl_backend.cpp \
        "${cxx_flags[@]}" -o "$build/nccl_tests"
else
    (part build.test_cuda 0 300 "$nvcc" "${nvcc_flags[@]}" tests/cuda/test_cuda.cu tests/cuda/test_sharded_on_device.cu tests/cuda/test_hooks_on_device.cu tests/cuda/test_powersgd_on_device.cu -o "$build/test_cuda"; exit $failed) &
    b1=$!
    (part build.bench_cuda 0 300 "$nvcc" "${nvcc_flags[@]}" bench/bench_cuda.cu -o "$build/bench_cuda"; exit $failed) &
    b2=$!
    (part build.train_mlp_nccl 0 300 "$nvcc" "${nvcc_flags[@]}" -Iexamples examples/train_mlp_nccl.cu -o "$build/train_mlp_nccl" -lcublas; exit $failed) &
    b3=$!
    (part build.nccl_tests 0 300 "$cxx" tests/main.cpp tests/cuda/test_nccl_environment.cpp tests/cuda/test_nccl_backend.cpp \
        "${cxx_flags[@]}" -o "$build/nccl_tests"; exit $failed) &
    b4=$!
    for pid in $b1 $b2 $b3 $b4; do wait "$pid" || failed=1; done
fi

part tests.cuda_host 0 60 "$build/test_cuda" --test-suite=host
part tests.cuda_gpu 1 180 gpu_suite
part tests.nccl 0 60 "$build/nccl_tests"
part example.nccl_spawn 1 60 example_spawn
part example.one_process_per_gpu 1 60 example_env "$gpus"
for n in 2 3 4; do part "example.local_ranks_$n" 1 60 example_local "$n"; done
part nccl_algo 1 60 nccl_algo
part bench_cuda 1 120 bench_cuda
if ((${#torch_flags[@]})); then
    if ((!dry_run)); then wait "$torch_build" || failed=1; fi
    [ -x "$build/test_torch_cuda" ] || ((dry_run)) || echo "(no test_torch_cuda: its build failed)" > "$logs/tests.torch_cuda.txt"
    part tests.torch_cuda 1 120 "$build/test_torch_cuda"
else
    printf '%-32s SKIPPED (python3 has no PyTorch to take libtorch from)\n' tests.torch_cuda >> "$summary"
fi

tar -czf "$results/logs.tar.gz" -C "$logs" . 2>/dev/null
echo
echo "== summary ($results: summary.txt, environment.txt, logs.tar.gz, bench_cuda.txt)"
cat "$results/environment.txt"
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
