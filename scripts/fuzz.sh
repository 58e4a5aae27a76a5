#!/usr/bin/env bash
# Fuzzes the checkpoint reader (the safetensors header parser and Checkpoint::load) with clang's
# libFuzzer under AddressSanitizer and UndefinedBehaviorSanitizer, starting from the seed corpus
# and every input that ever failed. A failing input is copied into tests/fuzz/regressions/ (keep
# it: it becomes a regression test) and the script fails.
# usage: scripts/fuzz.sh [SECONDS]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
ensure_packages clang-14 nlohmann-json3-dev

seconds="${1:-60}"
out=build/fuzz
mkdir -p "$out/corpus" "$out/artifacts"
step "build the fuzz target (clang 14, libFuzzer, ASan + UBSan)"
clang++-14 -std=c++20 -O1 -g -DGRADSYNC_LIBFUZZER -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=all -Iinclude tests/fuzz/fuzz_checkpoint.cpp -o "$out/fuzz_checkpoint" -pthread
step "fuzz for ${seconds} s"
cp tests/fuzz/corpus/* tests/fuzz/regressions/* "$out/corpus/"
if ! "$out/fuzz_checkpoint" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$out/artifacts/" "$out/corpus" 2>&1 | tail -n 40; then
    for crash in "$out"/artifacts/*; do
        [ -f "$crash" ] || continue
        cp "$crash" "tests/fuzz/regressions/found-$(basename "$crash")"
        echo "fuzz: failing input kept as tests/fuzz/regressions/found-$(basename "$crash")"
    done
    exit 1
fi
step "fuzz: no failure in ${seconds} s"
