#!/usr/bin/env bash
# Sequence-parallel prefill over MPI (bench/mpi/bench_mpi.cpp, linattn/mpi.hpp): one sequence of
# T = 65536 tokens, H = 8 heads, d = 128, in one process and split over 2 ranks under every
# schedule (summaries: even and balanced slices; pipeline and hybrid: even slices); prints one
# summary line (speed-ups, the schedule Schedule::automatic picks for even slices against issue
# 16's 1.7x target, bytes sent per rank) for the main command (scripts/bench.sh).
#
#   bash scripts/bench_mpi.sh               build, run, print the summary line
#   bash scripts/bench_mpi.sh --all-rules   also Decay, Gated, Delta and GatedDelta (one line each)
#   bash scripts/bench_mpi.sh --raw         also print the benchmark's own lines
#   bash scripts/bench_mpi.sh --backward    the layer's backward instead (every rule, one line
#                                           each: 1 process, then 2 ranks under the summaries
#                                           and pipeline schedules; T = BACKWARD_TOKENS, 8192;
#                                           with DOCUMENTS=N, N packed documents)
#
# Environment: BUILD_DIR (default build-bench, shared with scripts/bench.sh), TOKENS (65536),
# REPEAT (3: best of), RANKS (2), CARRY_COST (0.35: rank 0's extra share in the balanced split,
# see mpi::balanced_slices), DOCUMENTS (0; --backward only: > 0 packs that many documents of
# uneven lengths, bench_mpi --documents), WORKSPACE (1; --backward only: each call keeps one
# BackwardWorkspace across its calls, as a training loop would; 0: none), JOBS. Where MPI is not installed it prints a "skipped" line and
# exits 0, so the main command can call it unconditionally.
# The machine is shared: the line reports the load average (1 minute, before and after the
# rule's runs), and the speed-up is a ratio of runs made one after the other in this invocation
# (the single process before and after the split runs, the faster of the two). The speed-ups
# are of the best calls; the line also gives each process's first call, which allocates the
# memory the objects keep (a one-off prefill pays it).
set -euo pipefail

all_rules=0
raw=0
backward=0
for arg in "$@"; do
  case "$arg" in
    --all-rules) all_rules=1 ;;
    --raw) raw=1 ;;
    --backward) backward=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bench_mpi.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build-bench}"
tokens="${TOKENS:-65536}"
repeat="${REPEAT:-3}"
ranks="${RANKS:-2}"
carry_cost="${CARRY_COST:-0.35}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicxx >/dev/null 2>&1; then
  echo "mpi: skipped (MPI not installed; Debian: apt-get install openmpi-bin libopenmpi-dev)"
  exit 0
fi

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLINATTN_BUILD_BENCH=ON \
  -DLINATTN_NATIVE=ON -DLINATTN_MPI=ON -DLINATTN_BUILD_TESTS=OFF -DLINATTN_BUILD_EXAMPLES=OFF >/dev/null
targets="$(cmake --build "$build" --target help 2>/dev/null || true)"
if ! grep -q bench_mpi <<<"$targets"; then
  echo "mpi: skipped (CMake found no MPI for C++; Debian: apt-get install libopenmpi-dev)"
  exit 0
fi
cmake --build "$build" -j "$jobs" --target bench_mpi >/dev/null

flags=()
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
  [ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
  flags+=(--bind-to core)
fi
run() {  # run <ranks> <args...>: the benchmark's lines
  local n="$1"
  shift
  mpirun "${flags[@]}" -np "$n" "$build/bench_mpi" --tokens "$tokens" --repeat "$repeat" "$@"
}
field() {  # field <name> <line>
  sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"
}

if [ "$backward" -eq 1 ]; then
  # The layer's backward (bench_mpi --backward): the single process before and after the split
  # runs (the faster of the two, as below), then each schedule on $ranks ranks.
  btokens="${BACKWARD_TOKENS:-8192}"
  documents="${DOCUMENTS:-0}"
  workspace="${WORKSPACE:-1}"
  for rule in additive decay gated delta gated_delta; do
    b() {  # b <ranks> <args...>: the benchmark's lines
      mpirun "${flags[@]}" -np "$1" "$build/bench_mpi" --backward 1 --tokens "$btokens" \
        --documents "$documents" --workspace "$workspace" --repeat "$repeat" --rule "$rule" "${@:2}"
    }
    one="$(b 1 --schedule pipeline | grep call=single_process)"
    summaries="$(b "$ranks" --schedule summaries | grep call=sequence_parallel)"
    piped="$(b "$ranks" --schedule pipeline | grep call=sequence_parallel)"
    auto="$(b "$ranks" --schedule automatic | grep call=sequence_parallel)"
    again="$(b 1 --schedule pipeline | grep call=single_process)"
    [ "$raw" -eq 1 ] && printf '%s\n%s\n%s\n%s\n%s\n' "$one" "$summaries" "$piped" "$auto" "$again"
    awk -v rule="$rule" -v T="$btokens" -v N="$documents" -v P="$ranks" -v W="$workspace" \
        -v a="$(field seconds "$one")" \
        -v b="$(field seconds "$again")" -v ts="$(field seconds "$summaries")" \
        -v tp="$(field seconds "$piped")" -v ta="$(field seconds "$auto")" \
        -v picks="$(field schedule "$auto")" 'BEGIN {
      t1 = (a < b) ? a : b
      layout = (N > 0) ? sprintf(" %d documents", N) : ""
      kept = (W != 0) ? "workspace kept" : "no workspace"
      printf "mpi backward: layer T=%d%s H=8 d=128 %s (float, %s): 1 process %.3f s; %d ranks: " \
             "summaries %.3f s (%.2fx), pipeline %.3f s (%.2fx); automatic picks %s: %.3f s (%.2fx)\n",
             T, layout, rule, kept, t1, P, ts, t1 / ts, tp, t1 / tp, picks, ta, t1 / ta
    }'
  done
  exit 0
fi

rules=(additive)
[ "$all_rules" -eq 1 ] && rules=(additive decay gated delta gated_delta)
for rule in "${rules[@]}"; do
  load="$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?')"
  one="$(run 1 --rule "$rule")"
  even="$(run "$ranks" --rule "$rule" --split even --schedule summaries)"
  balanced="$(run "$ranks" --rule "$rule" --split balanced --carry-cost "$carry_cost" --schedule summaries)"
  piped="$(run "$ranks" --rule "$rule" --split even --schedule pipeline)"
  hybrid="$(run "$ranks" --rule "$rule" --split even --schedule hybrid)"
  # The single process once more, after the split runs: a VM's cores change speed from minute
  # to minute (seen: one core 30% slower for a while), so the baseline is the faster of two
  # runs that bracket the others, which can only lower the speed-ups reported.
  again="$(run 1 --rule "$rule")"
  [ "$raw" -eq 1 ] && printf '%s\n%s\n%s\n%s\n%s\n%s\n' "$one" "$even" "$balanced" "$piped" "$hybrid" "$again"
  t1a="$(field seconds "$(grep 'call=single_process' <<<"$one")")"
  t1b="$(field seconds "$(grep 'call=single_process' <<<"$again")")"
  t1="$(awk -v a="$t1a" -v b="$t1b" 'BEGIN { print (a < b) ? a : b }')"
  te="$(field seconds "$even")"
  tb="$(field seconds "$balanced")"
  tp="$(field seconds "$piped")"
  th="$(field seconds "$hybrid")"
  ran_h="$(field schedule "$hybrid")"  # pipeline for the delta rules (no fills)
  picks="$(field automatic "$piped")"  # automatic's choice for even slices
  sent="$(field sent_bytes "$balanced")"
  summary="$(field summary_bytes "$balanced")"
  sent_p="$(field sent_bytes "$piped")"
  # The first call of each process, which allocates (and faults in) what the object keeps:
  # the single process's and that of the schedule automatic picks.
  first() { field call_seconds "$1" | cut -d, -f1; }
  f1="$(first "$(grep 'call=single_process' <<<"$one")")"
  case "$picks" in
    pipeline) fa="$(first "$piped")" ;;
    hybrid) fa="$(first "$hybrid")" ;;
    *) fa="$(first "$even")" ;;
  esac
  load="$load to $(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?')"  # before and after
  awk -v rule="$rule" -v T="$tokens" -v P="$ranks" -v t1="$t1" -v te="$te" -v tb="$tb" \
      -v tp="$tp" -v th="$th" -v ran_h="$ran_h" -v picks="$picks" -v c="$carry_cost" \
      -v sent="$sent" -v summary="$summary" -v sent_p="$sent_p" -v load="$load" -v f1="$f1" -v fa="$fa" 'BEGIN {
    ta = (picks == "pipeline") ? tp : (picks == "hybrid") ? th : te
    verdict = (t1 / ta >= 1.7) ? "met" : "not met"
    hnote = (ran_h == "hybrid") ? "" : " (ran as the pipeline)"
    printf "mpi: prefill T=%d H=8 d=128 %s (float): 1 process %.3f s; %d ranks: summaries %.3f s " \
           "even (%.2fx), %.3f s balanced c=%s (%.2fx); pipeline %.3f s (%.2fx); hybrid %.3f s " \
           "(%.2fx)%s; automatic picks %s: %.2fx (target 1.7x: %s); sent per rank %.1f KiB " \
           "summaries (%.1f KiB of them), %.1f KiB pipeline, independent of T; first call of a process " \
           "(it allocates what the object keeps): 1 process %.3f s, %s %.3f s; load %s\n", T, rule,
           t1, P, te, t1 / te, tb, c, t1 / tb, tp, t1 / tp, th, t1 / th, hnote, picks, t1 / ta,
           verdict, sent / 1024, summary / 1024, sent_p / 1024, f1, picks, fa, load
  }'
done
