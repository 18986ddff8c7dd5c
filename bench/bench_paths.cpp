// Parallel (causal, chunked) vs recurrent linear attention over T, one head, float.
// Counters: tokens/s and useful GFLOP/s (4 T dk dv flops per call).

#include <linattn/linattn.hpp>

#include <benchmark/benchmark.h>

#include <random>

namespace {

using linattn::Index;
using Matrix = linattn::RowMatrix<float>;

Matrix random(Index rows, Index cols, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Matrix m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = normal(gen);
  return m;
}

void set_counters(benchmark::State& state, Index T, Index d) {
  const double flops = 4.0 * static_cast<double>(T) * static_cast<double>(d * d);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(T),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

template <bool Recurrent>
void BM_causal(benchmark::State& state) {
  const Index T = state.range(0), d = state.range(1);
  const Matrix Q = random(T, d, 1), K = random(T, d, 2), V = random(T, d, 3);
  const linattn::LinearAttention<linattn::EluPlusOne> attn;
  Matrix out(T, d);
  for (auto _ : state) {
    auto s = attn.make_state(d, d);
    if constexpr (Recurrent)
      attn.recurrent_into(Q, K, V, s, out);
    else
      attn.parallel_into(Q, K, V, linattn::Mask::causal, s, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, T, d);
}

void args(benchmark::internal::Benchmark* b) {
  for (Index d : {64, 128})
    for (Index T : {256, 1024, 4096}) b->Args({T, d});
  b->ArgNames({"T", "d"})->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_causal<false>)->Name("parallel_causal")->Apply(args);
BENCHMARK(BM_causal<true>)->Name("recurrent")->Apply(args);
BENCHMARK_MAIN();
