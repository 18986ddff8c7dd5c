#!/usr/bin/env bash
# The main job: build the benchmarks (Release, -march=native), run bench_paths, write the raw
# JSON, print a summary table and render docs/img/bench_paths.png; then the write rules'
# section (bench_write_rules) and the gradients' section (bench_gradients, a subset).
#
#   bash scripts/bench.sh            default sweep, about fifteen minutes on a 2-core machine
#   bash scripts/bench.sh --paths-only   bench_paths only (about ten minutes)
#   bash scripts/bench.sh --full     T = 256 ... 16384 in powers of two, 5 repetitions each
#   bash scripts/bench.sh --build-only   build every benchmark program, run nothing (CI)
#   bash scripts/bench.sh --smoke    every step of the main command, each row timed once briefly
#                                    (about two minutes once built; CI): proves the programs
#                                    run and the summaries read their output; its figures are
#                                    not measurements. Writes under build-bench/smoke only.
#   bash scripts/bench.sh --avx2     build for AVX2+FMA instead of the host's own instruction set
#                                    (into build-bench-avx2; the plot is not replaced)
# Where MPI is installed, the summary ends with one line from scripts/bench_mpi.sh: the
# sequence-parallel prefill (T = 65536, H = 8, d = 128) on 1 and 2 ranks, both schedules, and
# the schedule Schedule::automatic picks against the 1.7x target (about two minutes).
#
# Environment: BUILD_DIR (default build-bench), JOBS (default: number of CPUs).
set -euo pipefail

full=0
build_only=0
paths_only=0
avx2=0
smoke=0
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    --build-only) build_only=1 ;;
    --paths-only) paths_only=1 ;;
    --avx2) avx2=1 ;;
    --smoke) smoke=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
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
  "${arch[@]}" -DLINATTN_BUILD_TESTS=OFF -DLINATTN_BUILD_EXAMPLES=OFF -DLINATTN_TORCH=OFF >/dev/null
if [ "$build_only" -eq 1 ]; then
  cmake --build "$build" -j "$jobs"
  echo "bench.sh: built every benchmark in $build"
  exit 0
fi
targets=(bench_paths)
[ "$paths_only" -eq 1 ] || targets+=(bench_write_rules bench_gradients bench_rule_gradients)
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

# ---- run --------------------------------------------------------------------------------------
# `out` holds the JSON, the logs and the summary.
out="$build"
smoke_timing=(--benchmark_min_time=0.001 --benchmark_repetitions=1)
if [ "$smoke" -eq 1 ]; then
  out="$build/smoke"
  mkdir -p "$out"
fi
# With --smoke: fails unless the summary has a line containing each of the given texts. The
# figures of such short runs are not measurements, so no verdict is checked; a summary that lost
# a section (a renamed row, a summarizer reading the wrong counter) is.
check_smoke() {
  [ "$smoke" -eq 1 ] || return 0
  local text
  for text in "$@"; do
    grep -qF "$text" "$out/bench_summary.txt" ||
      { echo "bench.sh --smoke: no line with '$text' in $out/bench_summary.txt" >&2; exit 1; }
  done
}
json="$out/bench_paths.json"
args=(--benchmark_out="$json" --benchmark_out_format=json)
if [ "$smoke" -eq 1 ]; then
  args+=("${smoke_timing[@]}")
elif [ "$full" -eq 1 ]; then
  export LINATTN_BENCH_FULL=1
  args+=(--benchmark_min_time=0.2 --benchmark_repetitions=5)
else
  args+=(--benchmark_min_time=0.1 --benchmark_repetitions=5)
fi
# Repetitions are spread over the run rather than back to back, so a burst of other work on the
# machine hits one repetition of many rows instead of every repetition of one row.
args+=(--benchmark_enable_random_interleaving=true)
echo "bench.sh: running bench_paths (raw results: $json)"
"$build/bench/bench_paths" "${args[@]}" >"$out/bench_paths.log"

# ---- summarize and plot -------------------------------------------------------------------------
if [ "$avx2" -eq 1 ] || [ "$smoke" -eq 1 ]; then
  plot="$out/bench_paths.png"
else
  mkdir -p "$root/docs/img"
  plot="$root/docs/img/bench_paths.png"
fi
"$python" "$root/scripts/summarize_bench.py" "$json" --plot "$plot" | tee "$out/bench_summary.txt"
echo "bench.sh: summary saved to $out/bench_summary.txt, plot to $plot"
check_smoke "Targets (docs/performance.md)" "decode (heads taking turns), d = " \
  "chunk size, d = " "Time per token against T"

[ "$paths_only" -eq 1 ] && exit 0

# ---- write rules and gradients ------------------------------------------------------------------
# Three repetitions each (paired ratios, so the medians hold on a noisy machine); the gradients'
# rows are the subset the targets read: T = 2048 and 16384, one head and 8 heads on 1 and 2
# threads, the saved-forward design's paired rows (train_saved, T = 2048 to 16384), the paired
# scaling row and the memory row.
rules_timing=(--benchmark_min_time=0.05 --benchmark_repetitions=3)
rule_grad_timing=(--benchmark_repetitions=3)
if [ "$smoke" -eq 1 ]; then
  rules_timing=("${smoke_timing[@]}")
  rule_grad_timing=("${smoke_timing[@]}")
fi
summary="$out/bench_summary.txt"
rules_json="$out/bench_write_rules.json"
echo "bench.sh: running bench_write_rules (raw results: $rules_json)"
"$build/bench/bench_write_rules" --benchmark_out="$rules_json" --benchmark_out_format=json \
  "${rules_timing[@]}" --benchmark_enable_random_interleaving=true >"$out/bench_write_rules.log"
echo | tee -a "$summary"
"$python" "$root/scripts/summarize_rules.py" "$rules_json" | tee -a "$summary"

grad_json="$out/bench_gradients.json"
echo "bench.sh: running bench_gradients (raw results: $grad_json)"
"$build/bench/bench_gradients" --benchmark_out="$grad_json" --benchmark_out_format=json \
  --benchmark_filter='^(memory|scaling|train/d:(64|128)/T:(2048|16384)/|train_saved/|train_layer/)' \
  "${rules_timing[@]}" >"$out/bench_gradients.log"
echo | tee -a "$summary"
"$python" "$root/scripts/summarize_gradients.py" "$grad_json" | tee -a "$summary"

rule_grad_json="$out/bench_rule_gradients.json"
echo "bench.sh: running bench_rule_gradients (raw results: $rule_grad_json)"
"$build/bench/bench_rule_gradients" --benchmark_out="$rule_grad_json" \
  --benchmark_out_format=json "${rule_grad_timing[@]}" >"$out/bench_rule_gradients.log"
echo | tee -a "$summary"
"$python" "$root/scripts/summarize_rule_gradients.py" "$rule_grad_json" | tee -a "$summary"
check_smoke " of 36 met" "Memory, one backward" "rules backward:"

# ---- MPI (only where it is installed; bench_mpi.sh prints a "skipped" line otherwise) ----------
# Not with --avx2: bench_mpi.sh configures the build directory for the host's instruction set.
if [ "$avx2" -eq 0 ]; then
  echo | tee -a "$summary"
  if [ "$smoke" -eq 1 ]; then
    TOKENS=4096 REPEAT=1 BUILD_DIR="$build" JOBS="$jobs" bash "$root/scripts/bench_mpi.sh" \
      | tee -a "$summary"
    # The MPI line, unless MPI is not installed (then bench_mpi.sh prints a "skipped" line).
    if command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1; then
      check_smoke "mpi: prefill"
    fi
  else
    BUILD_DIR="$build" JOBS="$jobs" bash "$root/scripts/bench_mpi.sh" | tee -a "$summary"
  fi
fi
echo "bench.sh: full summary saved to $summary"
[ "$smoke" -eq 0 ] || echo "bench.sh: smoke run complete (its figures are not measurements)"
