#!/usr/bin/env bash
# bench/gpu-check.sh, run dry against NCCL laid out as the nvidia-nccl-cu13 wheel lays it out
# (nvidia/nccl/lib/libnccl.so.2, with or without include/nccl.h), on a machine with and without
# doctest: it must find NCCL in the wheel, link the versioned library by name with an rpath, take
# a header --bundle staged where the wheel has none, say what to do where nothing was staged, and
# plan every part. Arguments: NCCL's include folder and library, to copy into the fake wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=$work/site/nvidia/nccl
mkdir -p "$wheel/include" "$wheel/lib"
touch "$wheel/__init__.py"
cp "$1/nccl.h" "$wheel/include/"
cp -L "$2" "$wheel/lib/libnccl.so.2"
fail() { echo "FAIL: $*"; exit 1; }
# check NAME [VAR=VALUE...]: a dry run in its own build folder, with the environment given.
check() {
    local name=$1
    shift
    env PYTHONPATH="$work/site" NCCL_HOME= GRADSYNC_GPU_CHECK_BUILD="$work/build.$name" "$@" \
        bash bench/gpu-check.sh --dry-run "$work/results.$name" 2>&1 || true
}
plans_every_part() {
    for part in build.test_cuda build.bench_cuda build.train_mlp_nccl build.nccl_tests tests.cuda_host tests.cuda_gpu \
        tests.nccl example.nccl_spawn example.one_process_per_gpu example.local_ranks_4 nccl_algo bench_cuda tests.torch_cuda; do
        grep -q "^$part " "$work/results.$1/summary.txt" || fail "$1: part $part not planned"
    done
}

out=$(check wheel)
echo "$out"
grep -q "NCCL from the nvidia-nccl wheel: $wheel/include" <<<"$out" || fail "NCCL not found in the wheel"
grep -q -- "-l:libnccl.so.2 -Xlinker -rpath=$wheel/lib" <<<"$out" || fail "not linked by the versioned name with an rpath"
grep -q "GPU check: dry run, nothing was run" <<<"$out" || fail "no closing line"
plans_every_part wheel

# A wheel without its header, on a machine without doctest: nothing staged, then staged.
rm "$wheel/include/nccl.h"
out=$(check bare GRADSYNC_SYSTEM_INCLUDE="$work/no-include")
grep -q "FAIL: NCCL's library is in $wheel/lib but its header is not beside it: run 'bash bench/gpu-check.sh --bundle'" \
    <<<"$out" || fail "a wheel without a header, nothing staged: $out"
mkdir -p "$work/build.staged/third_party/include"
cp "$1/nccl.h" "$work/build.staged/third_party/include/"
out=$(check staged GRADSYNC_SYSTEM_INCLUDE="$work/no-include")
grep -q "FAIL: doctest's header (doctest/doctest.h) not found" <<<"$out" || fail "no doctest anywhere: $out"
GRADSYNC_GPU_CHECK_BUILD="$work/build.staged" bash bench/gpu-check.sh --bundle | grep -q "carry" || fail "--bundle"
out=$(check staged GRADSYNC_SYSTEM_INCLUDE="$work/no-include")
echo "$out"
grep -q "NCCL from the nvidia-nccl wheel (header staged in $work/build.staged/third_party/include)" <<<"$out" ||
    fail "the staged NCCL header not taken"
grep -q "doctest from $work/build.staged/third_party/include" <<<"$out" || fail "the staged doctest not taken"
grep -q "nlohmann/json from $work/build.staged/third_party/include" <<<"$out" || fail "the staged nlohmann/json not taken"
plans_every_part staged
echo "gpu-check dry run ok"
