#!/usr/bin/env bash
# Builds linattn's tests and examples and runs every test through ctest.
#   bash scripts/test.sh              Release build in build/test
#   bash scripts/test.sh --sanitize   Debug build with AddressSanitizer + UBSan in build/asan
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
ensure_packages cmake make g++ libeigen3-dev catch2

if [ "${1:-}" = "--sanitize" ]; then
  dir=build/asan
  flags=(-DCMAKE_BUILD_TYPE=Debug -DLINATTN_SANITIZE=ON)
else
  dir=build/test
  flags=(-DCMAKE_BUILD_TYPE=Release)
fi
jobs=$(nproc)
cmake -S . -B "$dir" "${flags[@]}"
cmake --build "$dir" -j"$jobs"
ctest --test-dir "$dir" --output-on-failure -j"$jobs"
