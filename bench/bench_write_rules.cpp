// Cost of each write rule, parallel (chunked) and recurrent, next to the Additive rule and a
// reference GEMM, all timed in the same iterations.
//
// One call runs H heads (1 or 8) of T = 4096 tokens in float, d = dk = dv (64 or 128), chunk 64,
// each head from an empty state. Every head reads its own columns of [T, H d] Q, K, V buffers
// and writes its columns of a [T, H d] output, and its per-token inputs in place from [T, H]
// (scalar gates, beta, log_alpha) or [T, H d] (per-channel gates, GatedDelta's per-channel
// log_alpha: the `gated_delta_channel` rows, Kimi Delta Attention) buffers: a model's layout,
// distinct data per head.
//
// Each iteration times, one after the other in thread CPU time: the reference GEMM (per head,
// every 64-row block of a T x d matrix times a d x d matrix, the chunk's state read), the rule's
// call, the GEMM again, and its Additive baseline's call on the same path, inputs and sizes
// (EluPlusOne + strict read for Decay and Gated; L2Normalize + unnormalized read for Delta and
// GatedDelta, the `additive_l2` rows).
// Order: of two calls timed back to back after the GEMM, the second ran faster (at H = 8,
// d = 64 recurrent on a Zen 5 VM the rule's ratio to Additive was 0.75 to 0.82 with the rule
// first and 0.83 to 0.86 with its baseline first), so each call follows a GEMM: neither gets
// the other's warm-up.
// Counters, per repetition:
//   GFLOP/s       useful flops 4 T H d^2 per call / the rule's time (the same count for every
//                 rule, so a rule doing more arithmetic shows as slower, not busier)
//   gemm_frac     GFLOP/s / the reference GEMM's rate in the same iterations
//   vs_additive   the baseline's time / the rule's time: the rule's rate as a fraction of
//                 Additive's (1 = as fast; the delta rules' targets also count their 6 r dv
//                 flops per token, i.e. 1.5 x this)
// scripts/summarize_rules.py prints the table and the targets of issue 19 from the JSON (median
// over repetitions).
// Run: build with -DLINATTN_BUILD_BENCH=ON -DLINATTN_NATIVE=ON, then
//   ./build/bench/bench_write_rules --benchmark_repetitions=5
//       --benchmark_enable_random_interleaving=true --benchmark_out=rules.json
//   python3 scripts/summarize_rules.py rules.json

#include <linattn/linattn.hpp>

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <ctime>
#include <random>
#include <vector>

namespace {

using linattn::Index;
using Matrix = linattn::RowMatrix<float>;
using bench::random;
using bench::thread_seconds;
using HeadMap = Eigen::Map<Matrix, 0, Eigen::OuterStride<>>;
using ConstHeadMap = Eigen::Map<const Matrix, 0, Eigen::OuterStride<>>;
using TokenMap = Eigen::Map<const Eigen::VectorXf, 0, Eigen::InnerStride<>>;

constexpr Index kTokens = 4096;
constexpr Index kChunk = 64;
constexpr Index kGemmRows = 64;

// additive_l2: the Additive rule with the delta rules' feature map and read (L2Normalize,
// unnormalized), their baseline; additive (EluPlusOne, strict) is the baseline of the others.
enum class Rule {
  additive,
  additive_l2,
  decay,
  gated_scalar,
  gated_channel,
  delta,
  gated_delta,
  gated_delta_channel
};

Rule baseline(Rule rule) {
  return rule == Rule::delta || rule == Rule::gated_delta || rule == Rule::gated_delta_channel
             ? Rule::additive_l2
             : Rule::additive;
}

// H heads' inputs and output in a model's layout.
struct Problem {
  Index T, H, d;
  Matrix Q, K, V, G_scalar, G_channel, beta, log_alpha, out;
  Problem(Index T_, Index H_, Index d_)
      : T(T_), H(H_), d(d_),
        Q(random(T_, H_ * d_, 1)),
        K(random(T_, H_ * d_, 2)),
        V(random(T_, H_ * d_, 3)),
        G_scalar(random(T_, H_, 4, -0.2f, 0.0f)),
        G_channel(random(T_, H_ * d_, 5, -0.2f, 0.0f)),
        beta(random(T_, H_, 6, 0.0f, 1.0f)),
        log_alpha(random(T_, H_, 7, -0.2f, 0.0f)),
        out(Matrix::Zero(T_, H_ * d_)) {}
  ConstHeadMap head(const Matrix& m, Index h) const {
    return ConstHeadMap(m.data() + h * d, T, d, Eigen::OuterStride<>(H * d));
  }
  TokenMap token(const Matrix& m, Index h) const {
    return TokenMap(m.data() + h, T, Eigen::InnerStride<>(H));
  }
  HeadMap head_out(Index h) { return HeadMap(out.data() + h * d, T, d, Eigen::OuterStride<>(H * d)); }
};

const linattn::Options strict{{}, kChunk};
const linattn::Options raw{linattn::Normalization::unnormalized(), kChunk};

// One call of `rule` on the path over all heads, each from an empty state.
template <bool Recurrent>
void call(Rule rule, Problem& p) {
  using namespace linattn;
  const auto go = [&](const auto& attn, auto&& extra) {
    for (Index h = 0; h < p.H; ++h) {
      auto s = attn.make_state(p.d, p.d);
      extra(h, [&](const auto&... in) {
        if constexpr (Recurrent)
          attn.recurrent_into(s, p.head(p.Q, h), p.head(p.K, h), p.head(p.V, h), in...,
                              p.head_out(h));
        else
          attn.prefill_into(s, p.head(p.Q, h), p.head(p.K, h), p.head(p.V, h), in...,
                            p.head_out(h));
      });
    }
  };
  const auto none = [](Index, auto&& f) { f(); };
  switch (rule) {
    case Rule::additive:
      go(RuleAttention<EluPlusOne, Additive>(EluPlusOne{}, Additive{}, strict), none);
      break;
    case Rule::additive_l2:
      go(RuleAttention<L2Normalize, Additive>(L2Normalize{}, Additive{}, raw), none);
      break;
    case Rule::decay:
      go(RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.95), strict), none);
      break;
    case Rule::gated_scalar:
      go(RuleAttention<EluPlusOne, Gated>(EluPlusOne{}, Gated{}, strict),
         [&](Index h, auto&& f) { f(p.token(p.G_scalar, h)); });
      break;
    case Rule::gated_channel:
      go(RuleAttention<EluPlusOne, Gated>(EluPlusOne{}, Gated{}, strict),
         [&](Index h, auto&& f) { f(p.head(p.G_channel, h)); });
      break;
    case Rule::delta:
      go(RuleAttention<L2Normalize, Delta>(L2Normalize{}, Delta{}, raw),
         [&](Index h, auto&& f) { f(p.token(p.beta, h)); });
      break;
    case Rule::gated_delta:
      go(RuleAttention<L2Normalize, GatedDelta>(L2Normalize{}, GatedDelta{}, raw),
         [&](Index h, auto&& f) { f(p.token(p.beta, h), p.token(p.log_alpha, h)); });
      break;
    case Rule::gated_delta_channel:
      go(RuleAttention<L2Normalize, GatedDelta>(L2Normalize{}, GatedDelta{}, raw),
         [&](Index h, auto&& f) { f(p.token(p.beta, h), p.head(p.G_channel, h)); });
      break;
  }
  benchmark::DoNotOptimize(p.out.data());
  benchmark::ClobberMemory();
}

// The reference GEMM for H heads at head size d: per head, every 64-row block of a T x d matrix
// times a d x d matrix, C += A B (real flops 2 T H d^2).
struct ReferenceGemm {
  Index H, d;
  Matrix A, B;
  std::vector<Matrix> C;
  ReferenceGemm(Index H_, Index d_)
      : H(H_), d(d_), A(random(kTokens, d_, 8)), B(random(d_, d_, 9)),
        C(static_cast<std::size_t>(H_), Matrix::Zero(kGemmRows, d_)) {}
  [[nodiscard]] double flops() const { return 2.0 * double(kTokens * H) * double(d * d); }
  void run() {
    for (auto& c : C)
      for (Index first = 0; first < kTokens; first += kGemmRows)
        c.noalias() += A.middleRows(first, kGemmRows) * B;
    benchmark::DoNotOptimize(C.front().data());
    benchmark::ClobberMemory();
  }
};

template <bool Recurrent>
void BM_rule(benchmark::State& state, Rule rule) {
  const Index H = state.range(0), d = state.range(1), T = kTokens;
  Problem p(T, H, d);
  ReferenceGemm gemm(H, d);
  const Rule base = baseline(rule);
  double t_rule = 0, t_base = 0, t_gemm = 0;
  // Untimed calls first (bench_support.hpp, "Warm-up"), so the first iteration does not time the
  // hypervisor mapping the buffers again.
  call<Recurrent>(rule, p);
  call<Recurrent>(base, p);
  // The GEMM, then one call of `which`, timed apart; returns the call's time (see "Order").
  const auto after_gemm = [&](Rule which) {
    double t0 = thread_seconds();
    gemm.run();
    t_gemm += thread_seconds() - t0;
    t0 = thread_seconds();
    call<Recurrent>(which, p);
    return thread_seconds() - t0;
  };
  for (auto _ : state) {
    const double t = after_gemm(rule);
    t_rule += t;
    state.SetIterationTime(t);
    t_base += after_gemm(base);
  }
  const double iters = static_cast<double>(state.iterations());
  const double useful = 4.0 * double(T * H) * double(d * d);
  const double gflops = useful * iters / t_rule * 1e-9;
  state.counters["GFLOP/s"] = gflops;
  const double gemm_gflops = 2 * gemm.flops() * iters / t_gemm * 1e-9;  // two GEMMs per iteration
  state.counters["gemm_GFLOP/s"] = gemm_gflops;
  state.counters["gemm_frac"] = gflops / gemm_gflops;
  state.counters["vs_additive"] = t_base / t_rule;
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(T * H),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["H"] = static_cast<double>(H);
  state.counters["d"] = static_cast<double>(d);
  state.counters["T"] = static_cast<double>(T);
}

void BM_parallel(benchmark::State& state, Rule rule) { BM_rule<false>(state, rule); }
void BM_recurrent(benchmark::State& state, Rule rule) { BM_rule<true>(state, rule); }

void args(benchmark::internal::Benchmark* b) {
  for (Index H : {1, 8})
    for (Index d : {64, 128}) b->Args({H, d});
  b->ArgNames({"H", "d"})->Unit(benchmark::kMillisecond)->UseManualTime();
}

}  // namespace

#define LINATTN_RULE_BENCH(rule)                                 \
  BENCHMARK_CAPTURE(BM_parallel, rule, Rule::rule)->Apply(args); \
  BENCHMARK_CAPTURE(BM_recurrent, rule, Rule::rule)->Apply(args)

LINATTN_RULE_BENCH(additive);
LINATTN_RULE_BENCH(additive_l2);
LINATTN_RULE_BENCH(decay);
LINATTN_RULE_BENCH(gated_scalar);
LINATTN_RULE_BENCH(gated_channel);
LINATTN_RULE_BENCH(delta);
LINATTN_RULE_BENCH(gated_delta);
LINATTN_RULE_BENCH(gated_delta_channel);
BENCHMARK_MAIN();
