#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer + UBSan), writes a seed corpus made
# by the library, and runs each target for a bounded time.
#   bash scripts/fuzz.sh [seconds per target]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
ensure_packages cmake make clang libclang-rt-14-dev libeigen3-dev
seconds="${1:-60}"
dir=build/fuzz
CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLINATTN_FUZZ=ON \
  -DLINATTN_BUILD_TESTS=OFF -DLINATTN_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$dir" -j"$(nproc)"
mkdir -p "$dir/corpus/blob" "$dir/corpus/api"
"$dir/tests/fuzz/make_seed_corpus" "$dir/corpus/blob" "$dir/corpus/api"
for target in fuzz_state_blob fuzz_api; do
  corpus="$dir/corpus/${target#fuzz_}"
  [ "$target" = fuzz_state_blob ] && corpus="$dir/corpus/blob"
  echo "fuzz.sh: $target for ${seconds}s"
  "$dir/tests/fuzz/$target" -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$dir/" "$corpus" 2>&1 | tail -n 12
done
