// Cost of each write rule, parallel (chunked) and recurrent, next to the Additive rule.
// One head, float, dk = dv = d, T tokens, chunk size 64.
//
// Counters:
//   tokens/s      T per call / time per call.
//   x_additive    this rule's time / the Additive rule's time on the same path, inputs, sizes,
//                 feature map and read (EluPlusOne + strict for Decay/Gated, L2Normalize +
//                 unnormalized for Delta/GatedDelta), the two calls alternating inside the same
//                 benchmark, so each rule's cost reads as a ratio from one run.
// Run: build with -DLINATTN_BUILD_BENCH=ON -DLINATTN_NATIVE=ON, then
//   ./build-bench/bench/bench_write_rules --benchmark_min_time=0.2

#include <linattn/linattn.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <random>

namespace {

using linattn::ColVector;
using linattn::Index;
using Matrix = linattn::RowMatrix<float>;

Matrix random(Index rows, Index cols, unsigned seed, float lo = 0, float hi = 0) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(lo, hi);
  Matrix m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = lo < hi ? uni(gen) : normal(gen);
  return m;
}

// additive_l2: the Additive rule with the delta rules' feature map and read (L2Normalize,
// unnormalized), their baseline; additive (EluPlusOne, strict) is the baseline of the others.
enum class Rule { additive, additive_l2, decay, gated_scalar, gated_channel, delta, gated_delta };

Rule baseline(Rule rule) {
  return rule == Rule::delta || rule == Rule::gated_delta ? Rule::additive_l2 : Rule::additive;
}

struct Inputs {
  Matrix Q, K, V, G_scalar, G_channel;
  ColVector<float> beta, log_alpha;
  Inputs(Index T, Index d)
      : Q(random(T, d, 1)),
        K(random(T, d, 2)),
        V(random(T, d, 3)),
        G_scalar(random(T, 1, 4, -0.2f, 0.0f)),
        G_channel(random(T, d, 5, -0.2f, 0.0f)),
        beta(random(T, 1, 6, 0.0f, 1.0f)),
        log_alpha(random(T, 1, 7, -0.2f, 0.0f)) {}
};

const linattn::Options strict{{}, 64};
const linattn::Options raw{linattn::Normalization::unnormalized(), 64};

// One call of `rule` on `path` into `out`.
template <bool Recurrent>
void call(Rule rule, const Inputs& in, Matrix& out) {
  using namespace linattn;
  const Index d = in.K.cols();
  const auto go = [&](const auto& attn, const auto&... extra) {
    auto s = attn.make_state(d, d);
    if constexpr (Recurrent)
      attn.recurrent_into(in.Q, in.K, in.V, s, out, extra...);
    else
      attn.parallel_into(in.Q, in.K, in.V, s, out, extra...);
  };
  switch (rule) {
    case Rule::additive:
      go(RuleAttention<EluPlusOne, Additive>(EluPlusOne{}, Additive{}, strict));
      break;
    case Rule::additive_l2:
      go(RuleAttention<L2Normalize, Additive>(L2Normalize{}, Additive{}, raw));
      break;
    case Rule::decay:
      go(RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.95), strict));
      break;
    case Rule::gated_scalar:
      go(RuleAttention<EluPlusOne, Gated>(EluPlusOne{}, Gated{}, strict), in.G_scalar);
      break;
    case Rule::gated_channel:
      go(RuleAttention<EluPlusOne, Gated>(EluPlusOne{}, Gated{}, strict), in.G_channel);
      break;
    case Rule::delta:
      go(RuleAttention<L2Normalize, Delta>(L2Normalize{}, Delta{}, raw), in.beta);
      break;
    case Rule::gated_delta:
      go(RuleAttention<L2Normalize, GatedDelta>(L2Normalize{}, GatedDelta{}, raw), in.beta,
         in.log_alpha);
      break;
  }
  benchmark::DoNotOptimize(out.data());
  benchmark::ClobberMemory();
}

template <bool Recurrent>
void BM_rule(benchmark::State& state, Rule rule) {
  const Index T = state.range(0), d = state.range(1);
  const Inputs in(T, d);
  Matrix out(T, d);
  // The baseline runs before every timed call, outside Google Benchmark's timer, and both are
  // timed here too: alternating them makes the ratio robust to load that drifts during a run.
  using Clock = std::chrono::steady_clock;
  double t_rule = 0, t_base = 0;
  const Rule base = baseline(rule);
  for (auto _ : state) {
    state.PauseTiming();
    auto t0 = Clock::now();
    call<Recurrent>(base, in, out);
    t_base += std::chrono::duration<double>(Clock::now() - t0).count();
    state.ResumeTiming();
    t0 = Clock::now();
    call<Recurrent>(rule, in, out);
    t_rule += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["x_additive"] = t_rule / t_base;
}

void BM_parallel(benchmark::State& state, Rule rule) { BM_rule<false>(state, rule); }
void BM_recurrent(benchmark::State& state, Rule rule) { BM_rule<true>(state, rule); }

void args(benchmark::internal::Benchmark* b) {
  for (Index d : {64, 128})
    for (Index T : {512, 2048, 8192}) b->Args({T, d});
  b->ArgNames({"T", "d"})->Unit(benchmark::kMillisecond);
}

}  // namespace

#define LINATTN_RULE_BENCH(rule)                                       \
  BENCHMARK_CAPTURE(BM_parallel, rule, Rule::rule)->Apply(args); \
  BENCHMARK_CAPTURE(BM_recurrent, rule, Rule::rule)->Apply(args)

LINATTN_RULE_BENCH(additive);
LINATTN_RULE_BENCH(additive_l2);
LINATTN_RULE_BENCH(decay);
LINATTN_RULE_BENCH(gated_scalar);
LINATTN_RULE_BENCH(gated_channel);
LINATTN_RULE_BENCH(delta);
LINATTN_RULE_BENCH(gated_delta);
BENCHMARK_MAIN();
