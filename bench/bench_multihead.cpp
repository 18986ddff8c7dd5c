// Multi-head linear attention over raw buffers: causal prefill of B sequences x 8 heads and
// batched decode (one token for each of B sequences), on 1 and 2 threads, float, ELU+1.
// kv = 8: every query head has its own key/value head; kv = 2: grouped-query attention, 4
// query heads per key/value head reading one shared state (the same useful flops, counted
// per query head; the keys are absorbed once per group).
//
// Counters: tokens/s (B T per prefill call, B per decode step), GFLOP/s for prefill (useful
// flops 4 T dk dv per head, as in bench_paths.cpp), and for threads > 1 parallel_efficiency
// = t(1 thread) / (threads * t(threads)), where t(1 thread) is the wall time per iteration of
// the same configuration measured just before in this run (benchmarks run in registration
// order; the 1-thread run is registered first). Times are wall-clock (UseRealTime), since
// CPU time of the main thread alone would hide the other threads.
//
// Reproduce: cmake -S . -B build-bench -DCMAKE_BUILD_TYPE=Release -DLINATTN_BUILD_BENCH=ON
//            -DLINATTN_NATIVE=ON && cmake --build build-bench --target bench_multihead &&
//            build-bench/bench/bench_multihead
// (--benchmark_filter=decode for the decode part only.)

#include <linattn/detail/random.hpp>
#include <linattn/multihead.hpp>
#include <linattn/thread_pool.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace {

using linattn::Index;
using Layer = linattn::MultiHeadAttention<linattn::LinearAttention<linattn::EluPlusOne>>;
using CView = linattn::TensorView<const float>;
using View = linattn::TensorView<float>;

constexpr Index kHeads = 8;

std::vector<float> random_buffer(Index n, unsigned seed) {
  linattn::detail::GaussianStream normal(seed);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(normal.next());
  return v;
}

// Wall seconds per iteration of the 1-thread run of each configuration, keyed by
// (kind, B, d, T, kv).
using Key = std::tuple<int, Index, Index, Index, Index>;
std::map<Key, double>& single_thread_times() {
  static std::map<Key, double> times;
  return times;
}

template <class Body>
void timed_loop(benchmark::State& state, const Key& key, int threads, Body&& body) {
  body();  // untimed (bench_support.hpp, "Warm-up")
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) body();
  const double per_iter =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
      static_cast<double>(state.iterations());
  auto& times = single_thread_times();
  if (threads == 1) {
    times[key] = per_iter;
  } else if (const auto it = times.find(key); it != times.end()) {
    state.counters["parallel_efficiency"] = it->second / (threads * per_iter);
  }
}

void BM_prefill(benchmark::State& state) {
  const Index B = state.range(0), d = state.range(1), T = state.range(2);
  const int threads = static_cast<int>(state.range(3));
  const Index kv = state.range(4);
  const auto q = random_buffer(B * T * kHeads * d, 1), k = random_buffer(B * T * kv * d, 2),
             v = random_buffer(B * T * kv * d, 3);
  std::vector<float> out(q.size());
  Layer layer({kHeads, kv, d, d});
  linattn::ThreadPool pool(threads);
  layer.set_executor(&pool);
  auto st = layer.make_state(B);
  timed_loop(state, {0, B, d, T, kv}, threads, [&] {
    for (Index s = 0; s < B; ++s) st.sequence(s).reset();
    layer.prefill_into(st, CView::batch_first(q.data(), B, T, kHeads, d),
                       CView::batch_first(k.data(), B, T, kv, d),
                       CView::batch_first(v.data(), B, T, kv, d),
                       View::batch_first(out.data(), B, T, kHeads, d));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  });
  const double flops = 4.0 * static_cast<double>(B * T * kHeads) * static_cast<double>(d * d);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(B * T),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_decode(benchmark::State& state) {
  const Index B = state.range(0), d = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const Index kv = state.range(3);
  const auto q = random_buffer(B * kHeads * d, 4), k = random_buffer(B * kv * d, 5),
             v = random_buffer(B * kv * d, 6);
  std::vector<float> out(q.size());
  Layer layer({kHeads, kv, d, d});
  linattn::ThreadPool pool(threads);
  layer.set_executor(&pool);
  auto st = layer.make_state(B);
  timed_loop(state, {1, B, d, 1, kv}, threads, [&] {
    layer.step_into(st, CView::batch_first(q.data(), B, 1, kHeads, d),
                    CView::batch_first(k.data(), B, 1, kv, d),
                    CView::batch_first(v.data(), B, 1, kv, d),
                    View::batch_first(out.data(), B, 1, kHeads, d));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  });
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(B),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// The memory system's ceiling for a decode step: read and write, once, as many bytes as the
// batch's states (B x kv states of d x (d + 1) floats), split over the pool's threads as the
// layer splits a decode step (one item per sequence and state head). A decode step also does
// 4 d^2 flops per state, so when this row's 2-thread speed-up is low, the decode's is bounded
// by it: the states stream from a memory that two cores do not read twice as fast as one.
void BM_state_stream(benchmark::State& state) {
  const Index B = state.range(0), d = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const Index kv = state.range(3), items = B * kv, per_item = d * (d + 1);
  auto states = random_buffer(items * per_item, 9);
  linattn::ThreadPool pool(threads);
  timed_loop(state, {2, B, d, 1, kv}, threads, [&] {
    linattn::detail::parallel_for(items, &pool, 1e9, [&](Index item) {
      float* s = states.data() + item * per_item;
      for (Index i = 0; i < per_item; ++i) s[i] = s[i] * 0.999f + 1e-3f;
    });
    benchmark::DoNotOptimize(states.data());
    benchmark::ClobberMemory();
  });
  state.counters["GB/s"] = benchmark::Counter(
      2.0 * static_cast<double>(items * per_item) * sizeof(float) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate);
}

// The machine's ceiling for the same kind of work: one float GEMM (T x d) * (d x d).
void BM_gemm_reference(benchmark::State& state) {
  const Index T = state.range(0), d = state.range(1);
  const auto a = random_buffer(T * d, 7), b = random_buffer(d * d, 8);
  const Eigen::Map<const linattn::RowMatrix<float>> A(a.data(), T, d), Bm(b.data(), d, d);
  linattn::RowMatrix<float> C(T, d);
  for (auto _ : state) {
    C.noalias() = A * Bm;
    benchmark::DoNotOptimize(C.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(T * d * d) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// What handing work to the pool costs: parallel_for over two items of no work, forced through
// the executor (flops far above the grain), back to back as decode steps arrive.
void BM_pool_overhead(benchmark::State& state) {
  linattn::ThreadPool pool(static_cast<int>(state.range(0)));
  std::vector<int> sink(2);
  for (auto _ : state) {
    linattn::detail::parallel_for(2, &pool, 1e9, [&](Index i) { ++sink[static_cast<std::size_t>(i)]; });
    benchmark::DoNotOptimize(sink.data());
  }
}

void prefill_args(benchmark::internal::Benchmark* b) {
  for (Index B : {1, 4})
    for (Index d : {64, 128})
      for (Index T : {512, 2048, 8192})
        for (Index kv : {8, 2}) {
          if (kv != kHeads && T != 2048) continue;  // grouped heads at one length
          for (Index threads : {1, 2}) b->Args({B, d, T, threads, kv});
        }
  b->ArgNames({"B", "d", "T", "threads", "kv"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

void decode_args(benchmark::internal::Benchmark* b) {
  for (Index B : {1, 4, 16, 64})
    for (Index d : {64, 128})
      for (Index kv : {8, 2})
        for (Index threads : {1, 2}) b->Args({B, d, threads, kv});
  b->ArgNames({"B", "d", "threads", "kv"})->Unit(benchmark::kMicrosecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_gemm_reference)->Name("gemm_reference")->Args({4096, 128})->ArgNames({"T", "d"});
BENCHMARK(BM_prefill)->Name("prefill")->Apply(prefill_args);
BENCHMARK(BM_decode)->Name("decode")->Apply(decode_args);
BENCHMARK(BM_state_stream)->Name("state_stream")->Apply(decode_args);
BENCHMARK(BM_pool_overhead)->Name("pool_overhead")->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime();
BENCHMARK_MAIN();
