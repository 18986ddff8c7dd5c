// What training the write rules costs: each rule's backward (linattn/rule_gradients.hpp) next
// to its own forward and to Additive's backward, measured in the same iteration.
//
// float, one head, d = dk = dv, Options' default chunk. Maps: ELU + 1 with strict normalization
// for Additive, Decay (gamma 0.95) and Gated (log-gates in [-0.1, 0]); L2Normalize (unnormalized)
// for Delta and GatedDelta (beta in [0, 1], log-alpha in [-0.1, 0], one per token or per
// channel). Row
//   rule_bwd/rule:R/d:D/T:T  (R: 0 additive, 1 decay, 2 gated, 3 gated per channel, 4 delta,
//                              5 gated delta, 6 gated delta per channel: Kimi Delta Attention)
// runs, in every iteration, the rule's forward (parallel_into, Mask::causal), its backward
// (parallel_backward_into, with a BackwardWorkspace kept across iterations as a training loop
// keeps one) and Additive's backward on the same Q, K, V, dY, each timed in thread CPU time;
// Delta and GatedDelta also run their backward without a workspace (allocating their rebuilt
// forward data per call). Counters: fwd_ms, bwd_ms, additive_bwd_ms, bwd_over_fwd (target <= 3),
// bwd_over_additive_bwd, scratch_B/token (rule_backward_bytes / T); delta rules: fresh_bwd_ms,
// fresh_over_fwd (the backward without a workspace over the forward).
//
// The saved design (linattn/rule_saved_forward.hpp), rows
//   rule_saved_bwd/rule:R/d:D/T:T  (R: 1 decay, 2 gated, 3 gated per channel, 4 delta,
//                                    5 gated delta, 6 gated delta per channel)
// run, in every iteration, the rule's plain forward (parallel_into), its saving forward
// (parallel_saving_into) and the backward from the saved states (parallel_backward_into), each
// timed in thread CPU time. Counters: fwd_ms, saving_fwd_ms, bwd_ms, bwd_over_fwd (the backward
// from saved states over the plain forward; target <= 3), saving_over_fwd, saved_B/token
// (saved_forward_bytes / T), design = 1.
//
// scripts/summarize_rule_gradients.py turns the JSON into the summary line.

#include <linattn/gradients.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

namespace {

using linattn::Index;
using linattn::Mask;
using Matrix = linattn::RowMatrix<float>;
using Vector = linattn::ColVector<float>;
using bench::random;

struct Inputs {
  Matrix Q, K, V, dY, out, dQ, dK, dV, scalar_gates, channel_gates, channel_alpha;
  Vector beta, log_alpha;
  Inputs(Index T, Index d)
      : Q(random(T, d, 1)), K(random(T, d, 2)), V(random(T, d, 3)), dY(random(T, d, 4)),
        out(T, d), dQ(T, d), dK(T, d), dV(T, d), scalar_gates(random(T, 1, 5, -0.1f, 0.0f)),
        channel_gates(random(T, d, 6, -0.1f, 0.0f)), channel_alpha(random(T, d, 9, -0.1f, 0.0f)),
        beta(random(T, 1, 7, 0.0f, 1.0f)),
        log_alpha(random(T, 1, 8, -0.1f, 0.0f)) {}
};

struct Times {
  double fwd = 0, bwd = 0, fresh_bwd = 0;
};

// Times the forward and backward (with `workspace`) of `attn` with per-token inputs `in...` on
// x, and for the delta rules also the backward without a workspace.
template <class Attn, class... In>
void time_rule(const Attn& attn, Inputs& x, linattn::BackwardWorkspace<float>& workspace,
               Times& t, const In&... in) {
  linattn::RuleInputGradients<float> d_in;
  const double t0 = bench::thread_seconds();
  attn.parallel_into(x.Q, x.K, x.V, in..., Mask::causal, x.out);
  const double t1 = bench::thread_seconds();
  constexpr auto kind = Attn::rule_type::kind;
  if constexpr (kind == linattn::WriteKind::additive)
    linattn::parallel_backward_into(attn, x.Q, x.K, x.V, Mask::causal, x.dY,
                                    {x.dQ, x.dK, x.dV});
  else
    linattn::parallel_backward_into(attn, x.Q, x.K, x.V, in..., Mask::causal, x.dY,
                                    linattn::GradientsRef<float>{x.dQ, x.dK, x.dV}, d_in,
                                    nullptr, &workspace);
  const double t2 = bench::thread_seconds();
  double t3 = t2;
  if constexpr (kind == linattn::WriteKind::delta || kind == linattn::WriteKind::gated_delta) {
    linattn::parallel_backward_into(attn, x.Q, x.K, x.V, in..., Mask::causal, x.dY,
                                    linattn::GradientsRef<float>{x.dQ, x.dK, x.dV}, d_in);
    t3 = bench::thread_seconds();
  }
  benchmark::DoNotOptimize(x.out.data());
  benchmark::DoNotOptimize(x.dQ.data());
  benchmark::ClobberMemory();
  t.fwd += t1 - t0;
  t.bwd += t2 - t1;
  t.fresh_bwd += t3 - t2;
}

void BM_rule_bwd(benchmark::State& state) {
  const int rule = static_cast<int>(state.range(0));
  const Index d = state.range(1), T = state.range(2);
  Inputs x(T, d);
  const linattn::LinearAttention<linattn::EluPlusOne, float> additive;
  const linattn::RuleAttention<linattn::EluPlusOne, linattn::Decay, float> decay(
      linattn::EluPlusOne{}, linattn::Decay(0.95));
  const linattn::RuleAttention<linattn::EluPlusOne, linattn::Gated, float> gated;
  const linattn::RuleAttention<linattn::L2Normalize, linattn::Delta, float> delta;
  const linattn::RuleAttention<linattn::L2Normalize, linattn::GatedDelta, float> gated_delta;
  linattn::BackwardWorkspace<float> workspace;
  Times times, additive_times;
  std::size_t scratch = 0;
  const auto iteration = [&](Times& t, Times& at) {
    switch (rule) {
      case 0: time_rule(additive, x, workspace, t); break;
      case 1: time_rule(decay, x, workspace, t); break;
      case 2: time_rule(gated, x, workspace, t, x.scalar_gates); break;
      case 3: time_rule(gated, x, workspace, t, x.channel_gates); break;
      case 4: time_rule(delta, x, workspace, t, x.beta); break;
      case 5: time_rule(gated_delta, x, workspace, t, x.beta, x.log_alpha); break;
      default: time_rule(gated_delta, x, workspace, t, x.beta, x.channel_alpha); break;
    }
    time_rule(additive, x, workspace, at);
  };
  Times untimed[2];
  iteration(untimed[0], untimed[1]);  // bench_support.hpp, "Warm-up"
  for (auto _ : state) {
    const double t0 = bench::thread_seconds();
    iteration(times, additive_times);
    state.SetIterationTime(bench::thread_seconds() - t0);
  }
  const double fwd = times.fwd, bwd = times.bwd, add_bwd = additive_times.bwd;
  switch (rule) {
    case 0: scratch = linattn::causal_backward_bytes(additive, T, d, d); break;
    case 1: scratch = linattn::rule_backward_bytes(decay, T, d, d); break;
    case 2: scratch = linattn::rule_backward_bytes(gated, T, d, d); break;
    case 3: scratch = linattn::rule_backward_bytes(gated, T, d, d, true); break;
    case 4: scratch = linattn::rule_backward_bytes(delta, T, d, d); break;
    case 5: scratch = linattn::rule_backward_bytes(gated_delta, T, d, d); break;
    default: scratch = linattn::rule_backward_bytes(gated_delta, T, d, d, true); break;
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["fwd_ms"] = 1e3 * fwd / iters;
  state.counters["bwd_ms"] = 1e3 * bwd / iters;
  state.counters["additive_bwd_ms"] = 1e3 * add_bwd / iters;
  state.counters["bwd_over_fwd"] = bwd / fwd;
  state.counters["bwd_over_additive_bwd"] = bwd / add_bwd;
  if (rule >= 4) {
    state.counters["fresh_bwd_ms"] = 1e3 * times.fresh_bwd / iters;
    state.counters["fresh_over_fwd"] = times.fresh_bwd / fwd;
  }
  state.counters["scratch_B/token"] = static_cast<double>(scratch) / static_cast<double>(T);
  state.counters["rule"] = rule;
  state.counters["T"] = static_cast<double>(T);
  state.counters["d"] = static_cast<double>(d);
}

void rule_args(benchmark::internal::Benchmark* b) {
  for (int rule = 0; rule <= 6; ++rule)
    for (const Index d : {64, 128})
      for (const Index T : {2048, 8192}) b->Args({rule, d, T});
  b->ArgNames({"rule", "d", "T"});
}

// ---- the saved design ------------------------------------------------------------------------

// Times the plain forward, the saving forward and the backward from its states on x.
template <class Attn, class... In>
void time_saved(const Attn& attn, Inputs& x, linattn::SavedForward<float>& saved, double& fwd,
                double& saving, double& bwd, const In&... in) {
  linattn::RuleInputGradients<float> d_in;
  const double t0 = bench::thread_seconds();
  attn.parallel_into(x.Q, x.K, x.V, in..., Mask::causal, x.out);
  const double t1 = bench::thread_seconds();
  linattn::parallel_saving_into(attn, x.Q, x.K, x.V, in..., Mask::causal, x.out, saved);
  const double t2 = bench::thread_seconds();
  linattn::parallel_backward_into(attn, saved, x.Q, x.K, x.V, in..., Mask::causal, x.dY,
                                  linattn::GradientsRef<float>{x.dQ, x.dK, x.dV}, d_in);
  const double t3 = bench::thread_seconds();
  benchmark::DoNotOptimize(x.out.data());
  benchmark::DoNotOptimize(x.dQ.data());
  benchmark::ClobberMemory();
  fwd += t1 - t0;
  saving += t2 - t1;
  bwd += t3 - t2;
}

void BM_rule_saved_bwd(benchmark::State& state) {
  const int rule = static_cast<int>(state.range(0));
  const Index d = state.range(1), T = state.range(2);
  Inputs x(T, d);
  const linattn::RuleAttention<linattn::EluPlusOne, linattn::Decay, float> decay(
      linattn::EluPlusOne{}, linattn::Decay(0.95));
  const linattn::RuleAttention<linattn::EluPlusOne, linattn::Gated, float> gated;
  const linattn::RuleAttention<linattn::L2Normalize, linattn::Delta, float> delta;
  const linattn::RuleAttention<linattn::L2Normalize, linattn::GatedDelta, float> gated_delta;
  linattn::SavedForward<float> saved;
  double fwd = 0, saving = 0, bwd = 0;
  const auto iteration = [&](double& f, double& s, double& b) {
    switch (rule) {
      case 1: time_saved(decay, x, saved, f, s, b); break;
      case 2: time_saved(gated, x, saved, f, s, b, x.scalar_gates); break;
      case 3: time_saved(gated, x, saved, f, s, b, x.channel_gates); break;
      case 4: time_saved(delta, x, saved, f, s, b, x.beta); break;
      case 5: time_saved(gated_delta, x, saved, f, s, b, x.beta, x.log_alpha); break;
      default: time_saved(gated_delta, x, saved, f, s, b, x.beta, x.channel_alpha); break;
    }
  };
  double untimed[3] = {};
  iteration(untimed[0], untimed[1], untimed[2]);  // bench_support.hpp, "Warm-up"
  for (auto _ : state) {
    const double t0 = bench::thread_seconds();
    iteration(fwd, saving, bwd);
    state.SetIterationTime(bench::thread_seconds() - t0);
  }
  std::size_t saved_bytes = 0;
  switch (rule) {
    case 1: saved_bytes = linattn::saved_forward_bytes(decay, T, d, d); break;
    case 2:
    case 3: saved_bytes = linattn::saved_forward_bytes(gated, T, d, d); break;
    case 4: saved_bytes = linattn::saved_forward_bytes(delta, T, d, d); break;
    case 5: saved_bytes = linattn::saved_forward_bytes(gated_delta, T, d, d); break;
    default: saved_bytes = linattn::saved_forward_bytes(gated_delta, T, d, d, true); break;
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["fwd_ms"] = 1e3 * fwd / iters;
  state.counters["saving_fwd_ms"] = 1e3 * saving / iters;
  state.counters["bwd_ms"] = 1e3 * bwd / iters;
  state.counters["bwd_over_fwd"] = bwd / fwd;
  state.counters["saving_over_fwd"] = saving / fwd;
  state.counters["saved_B/token"] = static_cast<double>(saved_bytes) / static_cast<double>(T);
  state.counters["design"] = 1;
  state.counters["rule"] = rule;
  state.counters["T"] = static_cast<double>(T);
  state.counters["d"] = static_cast<double>(d);
}

void saved_args(benchmark::internal::Benchmark* b) {
  for (int rule = 1; rule <= 6; ++rule)
    for (const Index d : {64, 128})
      for (const Index T : {2048, 8192}) b->Args({rule, d, T});
  b->ArgNames({"rule", "d", "T"});
}

}  // namespace

BENCHMARK(BM_rule_saved_bwd)->Apply(saved_args)->UseManualTime()->Iterations(2)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_rule_bwd)->Apply(rule_args)->UseManualTime()->Iterations(2)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
