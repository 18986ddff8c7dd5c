#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer + UBSan), writes a seed corpus made
# by the library, and runs each target for a bounded time.
#   bash scripts/fuzz.sh [seconds per target]   (default 60)
# LINATTN_FUZZ_DIR=build/asan reuses the sanitizer build of `scripts/test.sh --sanitize` (clang,
# Debug, ASan + UBSan) instead of configuring build/fuzz: CI does, to save a configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
ensure_packages cmake make clang libclang-rt-14-dev libeigen3-dev
seconds="${1:-60}"
dir="${LINATTN_FUZZ_DIR:-build/fuzz}"
if [ -f "$dir/CMakeCache.txt" ]; then
  cmake -S . -B "$dir" -DLINATTN_FUZZ=ON >/dev/null  # keeps that build's compiler and flags
else
  CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLINATTN_FUZZ=ON \
    -DLINATTN_BUILD_TESTS=OFF -DLINATTN_BUILD_EXAMPLES=OFF >/dev/null
fi
cmake --build "$dir" -j"$(nproc)" --target fuzz_state_blob fuzz_api fuzz_layer make_seed_corpus
mkdir -p "$dir/corpus/blob" "$dir/corpus/api" "$dir/corpus/layer"
"$dir/tests/fuzz/make_seed_corpus" "$dir/corpus/blob" "$dir/corpus/api" "$dir/corpus/layer"
for target in fuzz_state_blob fuzz_api fuzz_layer; do
  corpus="$dir/corpus/${target#fuzz_}"
  [ "$target" = fuzz_state_blob ] && corpus="$dir/corpus/blob"
  echo "fuzz.sh: $target for ${seconds}s"
  "$dir/tests/fuzz/$target" -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$dir/" "$corpus" 2>&1 | tail -n 12
done
