#!/usr/bin/env bash
# The main job: builds the benchmarks with -O3 -march=native and compares the parallel
# (chunked causal) path with the recurrent path over T.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
ensure_packages cmake make g++ libeigen3-dev libbenchmark-dev
cmake -S . -B build/bench -DCMAKE_BUILD_TYPE=Release -DLINATTN_BUILD_BENCH=ON -DLINATTN_NATIVE=ON \
  -DLINATTN_BUILD_TESTS=OFF -DLINATTN_BUILD_EXAMPLES=OFF
cmake --build build/bench -j"$(nproc)" --target bench_paths
./build/bench/bench/bench_paths --benchmark_counters_tabular=true "$@"
