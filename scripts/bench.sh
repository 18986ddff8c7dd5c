#!/usr/bin/env bash
# The main job: build the benchmarks (Release, -march=native), run bench_paths, write the raw
# JSON, print a summary table and render docs/img/bench_paths.png.
#
#   bash scripts/bench.sh            default sweep, about three minutes on a 2-core machine
#   bash scripts/bench.sh --full     T = 256 ... 16384 in powers of two, 5 repetitions each
#   bash scripts/bench.sh --build-only   build every benchmark program, run nothing (CI)
#   bash scripts/bench.sh --avx2     build for AVX2+FMA instead of the host's own instruction set
#                                    (into build-bench-avx2; the plot is not replaced)
#
# Environment: BUILD_DIR (default build-bench), JOBS (default: number of CPUs).
set -euo pipefail

full=0
build_only=0
avx2=0
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    --build-only) build_only=1 ;;
    --avx2) avx2=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$avx2" -eq 1 ]; then
  build="${BUILD_DIR:-$root/build-bench-avx2}"
  arch=(-DLINATTN_NATIVE=OFF "-DCMAKE_CXX_FLAGS=-mavx2 -mfma")
else
  build="${BUILD_DIR:-$root/build-bench}"
  arch=(-DLINATTN_NATIVE=ON -DCMAKE_CXX_FLAGS=)
fi
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
python=/usr/bin/python3  # Debian's python3-matplotlib lives here, not in a pyenv python

# ---- prerequisites (Debian/Ubuntu package names) -----------------------------------------
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
[ -f /usr/include/eigen3/Eigen/Core ] || missing+=(libeigen3-dev)
[ -f /usr/include/benchmark/benchmark.h ] || missing+=(libbenchmark-dev)
if [ ! -x "$python" ] || ! "$python" -c 'import matplotlib' >/dev/null 2>&1; then
  missing+=(python3-matplotlib)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bench.sh: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  else
    echo "bench.sh: missing packages; install them with:" >&2
    echo "  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

# ---- build ------------------------------------------------------------------------------------
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLINATTN_BUILD_BENCH=ON \
  "${arch[@]}" -DLINATTN_BUILD_TESTS=OFF -DLINATTN_BUILD_EXAMPLES=OFF >/dev/null
if [ "$build_only" -eq 1 ]; then
  cmake --build "$build" -j "$jobs"
  echo "bench.sh: built every benchmark in $build"
  exit 0
fi
cmake --build "$build" -j "$jobs" --target bench_paths

# ---- run --------------------------------------------------------------------------------------
json="$build/bench_paths.json"
args=(--benchmark_out="$json" --benchmark_out_format=json)
if [ "$full" -eq 1 ]; then
  export LINATTN_BENCH_FULL=1
  args+=(--benchmark_min_time=0.2 --benchmark_repetitions=5)
else
  args+=(--benchmark_min_time=0.1 --benchmark_repetitions=5)
fi
# Repetitions are spread over the run rather than back to back, so a burst of other work on the
# machine hits one repetition of many rows instead of every repetition of one row.
args+=(--benchmark_enable_random_interleaving=true)
echo "bench.sh: running bench_paths (raw results: $json)"
"$build/bench/bench_paths" "${args[@]}" >"$build/bench_paths.log"

# ---- summarize and plot -------------------------------------------------------------------------
if [ "$avx2" -eq 1 ]; then
  plot="$build/bench_paths.png"
else
  mkdir -p "$root/docs/img"
  plot="$root/docs/img/bench_paths.png"
fi
"$python" "$root/scripts/summarize_bench.py" "$json" --plot "$plot" | tee "$build/bench_summary.txt"
echo "bench.sh: summary saved to $build/bench_summary.txt, plot to $plot"
