#!/usr/bin/env bash
# bench/gpu-check.sh, run dry against NCCL laid out as the nvidia-nccl-cu13 wheel lays it out
# (nvidia/nccl/include/nccl.h and only lib/libnccl.so.2): it must find NCCL there, link the
# versioned library by name with an rpath, and plan every part. Arguments: NCCL's include folder
# and library, to copy into the fake wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=$work/site/nvidia/nccl
mkdir -p "$wheel/include" "$wheel/lib"
touch "$wheel/__init__.py"
cp "$1/nccl.h" "$wheel/include/"
cp -L "$2" "$wheel/lib/libnccl.so.2"
out=$(PYTHONPATH=$work/site NCCL_HOME= bash bench/gpu-check.sh --dry-run "$work/results")
echo "$out"
fail() { echo "FAIL: $*"; exit 1; }
grep -q "NCCL from the nvidia-nccl wheel: $wheel/include" <<<"$out" || fail "NCCL not found in the wheel"
grep -q -- "-l:libnccl.so.2 -Xlinker -rpath=$wheel/lib" <<<"$out" || fail "not linked by the versioned name with an rpath"
for part in build.test_cuda build.bench_cuda build.train_mlp_nccl build.nccl_tests tests.cuda_host tests.cuda_gpu \
    tests.nccl example.nccl_spawn example.one_process_per_gpu example.local_ranks_4 nccl_algo bench_cuda; do
    grep -q "^$part " "$work/results/summary.txt" || fail "part $part not planned"
done
grep -q "GPU check: dry run, nothing was run" <<<"$out" || fail "no closing line"
echo "gpu-check dry run ok"
