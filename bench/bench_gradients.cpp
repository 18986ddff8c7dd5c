// What training costs: the chunked causal backward (linattn/gradients.hpp) against the forward
// it differentiates, its memory, and a quadratic-attention backward of the same shapes.
//
// float, ELU + 1, strict normalization, Options' default chunk (32), d = dk = dv. Rows:
//   train/d:D/T:T/heads:H/threads:N
//       every iteration runs the forward of each head (parallel_into, Mask::causal), then the
//       backward of each head (parallel_backward_into), and times the two phases separately, so
//       their ratio is measured in the same moments (this VM's speed drifts between rows).
//       Heads read distinct data in a model's layout: Q, K, V, dY are [T, H d] with head h in
//       columns [h d, (h + 1) d), the output and dQ, dK, dV likewise (buffers reused across
//       iterations, as a training loop would). threads:2 splits the heads over two threads
//       (timed in wall-clock time; one thread in thread CPU time).
//       Counters: fwd_ms, bwd_ms (per iteration), bwd_over_fwd (sum of backward time over sum
//       of forward time), step_over_fwd ((forward + backward) / forward), scratch_B/token (what
//       the backward allocates for itself per token, causal_backward_bytes / T).
//   train_saved/d:D/T:T
//       the saved-forward design (linattn/saved_forward.hpp), one head, in every iteration:
//       the plain forward (parallel_into), the saving forward (parallel_saving_into), the
//       backward from its saved states, and the recomputing backward (parallel_backward_into),
//       each timed separately in thread CPU time, so all ratios are measured in the same
//       moments. Counters: fwd_ms, save_fwd_ms, bwd_ms (from the saved forward), recompute_ms,
//       bwd_over_fwd (saved backward / plain forward: the target's ratio), save_over_fwd
//       (saving / plain forward), step_over_fwd ((saving forward + saved backward) / plain
//       forward), recompute_over_fwd, recompute_step_over_fwd ((forward + recomputing backward)
//       / forward), saved_B/token (saved_forward_bytes / T) and scratch_B/token
//       (saved_backward_bytes / T).
//   train_layer/d:D/T:T
//       the same four phases through the multi-head layer (linattn/multihead_saved_forward.hpp):
//       MultiHeadAttention with 8 heads (H_q = H_kv) over [1, T, 8, d] token-major views of the
//       [T, 8 d] buffers, one thread: layer.parallel_into, parallel_saving_into(layer, ...), the
//       layer's backward from the LayerSavedForward and the layer's recomputing backward.
//       Counters as train_saved (saved_B/token: LayerSavedForward::bytes() / T, all heads).
//   quadratic_bwd/d:D/T:T  the gradients of the same read through the T x T masked form in
//       Eigen (scores, their gradient and the products, all T x T), from the same inputs: the
//       comparison for the crossover T. Counter bwd_ms.
//   memory/d:128/T:65536   one backward in a child process with every large block mapped
//       fresh, its peak resident memory measured from the kernel's high-water mark (reset
//       before the call; resolution about 1 MiB): peak_MiB, gradients_MiB (the returned dQ,
//       dK, dV), own_MiB = peak - gradients, next to the computed scratch_MiB and
//       scratch_B/token (causal_backward_bytes, exact).
//   scaling/d:D  the backward at T = 2048 and at T = 16384 in every iteration: counter
//       scaling = t(16384) / t(2048), paired like the ratios above.
//
// scripts/summarize_gradients.py turns the JSON into the ratios and the crossover.

#include <linattn/gradients.hpp>
#include <linattn/multihead_saved_forward.hpp>
#include <linattn/saved_forward.hpp>

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using linattn::Index;
using linattn::Mask;
using Matrix = linattn::RowMatrix<float>;
using HeadView = Eigen::Map<Matrix, 0, Eigen::OuterStride<>>;
using ConstHeadView = Eigen::Map<const Matrix, 0, Eigen::OuterStride<>>;
using Attention = linattn::LinearAttention<linattn::EluPlusOne, float>;
using bench::clock_seconds;
using bench::over_heads;
using bench::random;

// [T, H d] inputs and output, one head's columns viewed in place.
struct Layer {
  Index T, d, heads;
  Matrix Q, K, V, dY, out, dQ, dK, dV;
  Layer(Index T_, Index d_, Index heads_)
      : T(T_), d(d_), heads(heads_), Q(random(T_, heads_ * d_, 1)), K(random(T_, heads_ * d_, 2)),
        V(random(T_, heads_ * d_, 3)), dY(random(T_, heads_ * d_, 4)),
        out(Matrix::Zero(T_, heads_ * d_)), dQ(Matrix::Zero(T_, heads_ * d_)),
        dK(Matrix::Zero(T_, heads_ * d_)), dV(Matrix::Zero(T_, heads_ * d_)) {}
  ConstHeadView head(const Matrix& X, Index h) const {
    return ConstHeadView(X.data() + h * d, T, d, Eigen::OuterStride<>(heads * d));
  }
  HeadView head_of(Matrix& X, Index h) {
    return HeadView(X.data() + h * d, T, d, Eigen::OuterStride<>(heads * d));
  }
};

void BM_train(benchmark::State& state) {
  const Index d = state.range(0), T = state.range(1), heads = state.range(2);
  const int threads = static_cast<int>(state.range(3));
  const Attention attn;
  Layer layer(T, d, heads);
  double fwd = 0, bwd = 0, checksum = 0;
  const auto forward = [&] {
    over_heads(heads, threads, [&](Index h) {
      attn.parallel_into(layer.head(layer.Q, h), layer.head(layer.K, h), layer.head(layer.V, h),
                         Mask::causal, layer.head_of(layer.out, h));
    });
  };
  const auto backward = [&] {
    over_heads(heads, threads, [&](Index h) {
      linattn::parallel_backward_into(
          attn, layer.head(layer.Q, h), layer.head(layer.K, h), layer.head(layer.V, h),
          Mask::causal, layer.head(layer.dY, h),
          {layer.head_of(layer.dQ, h), layer.head_of(layer.dK, h), layer.head_of(layer.dV, h)});
    });
  };
  forward();  // untimed (bench_support.hpp, "Warm-up")
  backward();
  for (auto _ : state) {
    const double t0 = clock_seconds(threads);
    forward();
    const double t1 = clock_seconds(threads);
    backward();
    const double t2 = clock_seconds(threads);
    checksum += double(layer.dQ(T - 1, 0) + layer.dK(0, 0) + layer.dV(0, 0));
    benchmark::DoNotOptimize(layer.out.data());
    benchmark::ClobberMemory();
    fwd += t1 - t0;
    bwd += t2 - t1;
    state.SetIterationTime(t2 - t0);
  }
  benchmark::DoNotOptimize(checksum);
  const double iters = static_cast<double>(state.iterations());
  state.counters["fwd_ms"] = 1e3 * fwd / iters;
  state.counters["bwd_ms"] = 1e3 * bwd / iters;
  state.counters["bwd_over_fwd"] = bwd / fwd;
  state.counters["step_over_fwd"] = (fwd + bwd) / fwd;
  state.counters["scratch_B/token"] =
      static_cast<double>(linattn::causal_backward_bytes(attn, T, d, d)) / static_cast<double>(T);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(T * heads),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["T"] = static_cast<double>(T);
  state.counters["d"] = static_cast<double>(d);
  state.counters["heads"] = static_cast<double>(heads);
  state.counters["threads"] = threads;
}

// The four phases' counters of train_saved and train_layer (times summed over the iterations).
void set_phase_counters(benchmark::State& state, double fwd, double save, double bwd,
                        double recompute) {
  const double iters = static_cast<double>(state.iterations());
  state.counters["fwd_ms"] = 1e3 * fwd / iters;
  state.counters["save_fwd_ms"] = 1e3 * save / iters;
  state.counters["bwd_ms"] = 1e3 * bwd / iters;
  state.counters["recompute_ms"] = 1e3 * recompute / iters;
  state.counters["bwd_over_fwd"] = bwd / fwd;
  state.counters["save_over_fwd"] = save / fwd;
  state.counters["step_over_fwd"] = (save + bwd) / fwd;
  state.counters["recompute_over_fwd"] = recompute / fwd;
  state.counters["recompute_step_over_fwd"] = (fwd + recompute) / fwd;
}

void BM_train_saved(benchmark::State& state) {
  const Index d = state.range(0), T = state.range(1);
  const Attention attn;
  Layer layer(T, d, 1);
  linattn::SavedForward<float> saved;
  // Untimed first step: the saved states' pages are touched here, once, as in a training loop
  // that reuses its SavedForward (otherwise the first iteration's page faults, a few ms at
  // 33 MiB, weigh on the rows with few iterations).
  linattn::parallel_saving_into(attn, layer.Q, layer.K, layer.V, Mask::causal, layer.out, saved);
  linattn::parallel_backward_into(attn, saved, layer.Q, layer.K, layer.V, Mask::causal, layer.dY,
                                  {layer.dQ, layer.dK, layer.dV});
  double fwd = 0, save = 0, bwd = 0, recompute = 0, checksum = 0;
  for (auto _ : state) {
    const double t0 = clock_seconds(1);
    attn.parallel_into(layer.Q, layer.K, layer.V, Mask::causal, layer.out);
    benchmark::DoNotOptimize(layer.out.data());
    benchmark::ClobberMemory();
    const double t1 = clock_seconds(1);
    linattn::parallel_saving_into(attn, layer.Q, layer.K, layer.V, Mask::causal, layer.out, saved);
    benchmark::DoNotOptimize(layer.out.data());
    benchmark::ClobberMemory();
    const double t2 = clock_seconds(1);
    linattn::parallel_backward_into(attn, saved, layer.Q, layer.K, layer.V, Mask::causal,
                                    layer.dY, {layer.dQ, layer.dK, layer.dV});
    checksum += double(layer.dQ(T - 1, 0) + layer.dK(0, 0) + layer.dV(0, 0));
    benchmark::ClobberMemory();
    const double t3 = clock_seconds(1);
    linattn::parallel_backward_into(attn, layer.Q, layer.K, layer.V, Mask::causal, layer.dY,
                                    {layer.dQ, layer.dK, layer.dV});
    checksum += double(layer.dQ(T - 1, 0) + layer.dK(0, 0) + layer.dV(0, 0));
    benchmark::ClobberMemory();
    const double t4 = clock_seconds(1);
    fwd += t1 - t0;
    save += t2 - t1;
    bwd += t3 - t2;
    recompute += t4 - t3;
    state.SetIterationTime(t4 - t0);
  }
  benchmark::DoNotOptimize(checksum);
  set_phase_counters(state, fwd, save, bwd, recompute);
  state.counters["saved_B/token"] =
      static_cast<double>(linattn::saved_forward_bytes(attn, T, d, d)) / static_cast<double>(T);
  state.counters["scratch_B/token"] =
      static_cast<double>(linattn::saved_backward_bytes(attn, T, d, d)) / static_cast<double>(T);
  state.counters["T"] = static_cast<double>(T);
  state.counters["d"] = static_cast<double>(d);
}

void BM_train_layer(benchmark::State& state) {
  const Index d = state.range(0), T = state.range(1), heads = 8;
  using View = linattn::TensorView<float>;
  using ConstView = linattn::TensorView<const float>;
  const linattn::MultiHeadAttention<Attention> mha(linattn::HeadConfig{heads, heads, d, d});
  Layer layer(T, d, heads);
  const auto in = [&](const Matrix& X) { return ConstView::batch_first(X.data(), 1, T, heads, d); };
  const auto out = [&](Matrix& X) { return View::batch_first(X.data(), 1, T, heads, d); };
  const linattn::GradientViews<float> grads{out(layer.dQ), out(layer.dK), out(layer.dV)};
  linattn::LayerSavedForward<float> saved;
  // Untimed first step, as in train_saved: the saved states' pages are touched once.
  linattn::parallel_saving_into(mha, in(layer.Q), in(layer.K), in(layer.V), Mask::causal,
                                out(layer.out), saved);
  linattn::parallel_backward_into(mha, saved, in(layer.Q), in(layer.K), in(layer.V), Mask::causal,
                                  in(layer.dY), grads);
  double fwd = 0, save = 0, bwd = 0, recompute = 0, checksum = 0;
  for (auto _ : state) {
    const double t0 = clock_seconds(1);
    mha.parallel_into(in(layer.Q), in(layer.K), in(layer.V), Mask::causal, out(layer.out));
    benchmark::DoNotOptimize(layer.out.data());
    benchmark::ClobberMemory();
    const double t1 = clock_seconds(1);
    linattn::parallel_saving_into(mha, in(layer.Q), in(layer.K), in(layer.V), Mask::causal,
                                  out(layer.out), saved);
    benchmark::DoNotOptimize(layer.out.data());
    benchmark::ClobberMemory();
    const double t2 = clock_seconds(1);
    linattn::parallel_backward_into(mha, saved, in(layer.Q), in(layer.K), in(layer.V),
                                    Mask::causal, in(layer.dY), grads);
    checksum += double(layer.dQ(T - 1, 0) + layer.dK(0, 0) + layer.dV(0, 0));
    benchmark::ClobberMemory();
    const double t3 = clock_seconds(1);
    linattn::parallel_backward_into(mha, in(layer.Q), in(layer.K), in(layer.V), Mask::causal,
                                    in(layer.dY), grads);
    checksum += double(layer.dQ(T - 1, 0) + layer.dK(0, 0) + layer.dV(0, 0));
    benchmark::ClobberMemory();
    const double t4 = clock_seconds(1);
    fwd += t1 - t0;
    save += t2 - t1;
    bwd += t3 - t2;
    recompute += t4 - t3;
    state.SetIterationTime(t4 - t0);
  }
  benchmark::DoNotOptimize(checksum);
  set_phase_counters(state, fwd, save, bwd, recompute);
  state.counters["saved_B/token"] = static_cast<double>(saved.bytes()) / static_cast<double>(T);
  state.counters["T"] = static_cast<double>(T);
  state.counters["d"] = static_cast<double>(d);
  state.counters["heads"] = static_cast<double>(heads);
}

// The gradients of the causal ELU + 1 read by its quadratic form: P = tril(phi(Q) phi(K)^T),
// y = P V / rowsum(P), then by the quotient rule G = dY / den, g = -(dY . y) / den per row,
// dP = tril(G V^T + g 1^T), dphi(Q) = dP phi(K), dphi(K) = dP^T phi(Q), dV = P^T G, and the
// chain through ELU + 1. T x T matrices throughout.
struct QuadraticGradients {
  Matrix dQ, dK, dV;
};
QuadraticGradients quadratic_backward(const Matrix& Q, const Matrix& K, const Matrix& V,
                                      const Matrix& dY) {
  const auto elu = [](const Matrix& X) -> Matrix {
    return (X.array() > 0).select(X.array() + 1, X.array().exp()).matrix();
  };
  const auto elu_chain = [](const Matrix& X, const Matrix& F, const Matrix& dF) -> Matrix {
    return (X.array() > 0).select(dF.array(), dF.array() * F.array()).matrix();
  };
  const Matrix qf = elu(Q), kf = elu(K);
  Matrix P = qf * kf.transpose();
  P.triangularView<Eigen::StrictlyUpper>().setZero();
  const Eigen::VectorXf den = P.rowwise().sum();
  const Matrix y = den.cwiseInverse().asDiagonal() * (P * V);
  const Matrix G = den.cwiseInverse().asDiagonal() * dY;
  const Eigen::VectorXf g = -(dY.cwiseProduct(y).rowwise().sum()).cwiseQuotient(den);
  Matrix dP = G * V.transpose();
  dP.colwise() += g;
  dP.triangularView<Eigen::StrictlyUpper>().setZero();
  QuadraticGradients out;
  out.dQ = elu_chain(Q, qf, dP * kf);
  out.dK = elu_chain(K, kf, dP.transpose() * qf);
  out.dV = P.transpose() * G;
  return out;
}

void BM_quadratic_bwd(benchmark::State& state) {
  const Index d = state.range(0), T = state.range(1);
  const Matrix Q = random(T, d, 1), K = random(T, d, 2), V = random(T, d, 3), dY = random(T, d, 4);
  double seconds = 0;
  for (auto _ : state) {
    const double t0 = clock_seconds(1);
    const QuadraticGradients g = quadratic_backward(Q, K, V, dY);
    benchmark::DoNotOptimize(g.dQ.data());
    seconds += clock_seconds(1) - t0;
    state.SetIterationTime(clock_seconds(1) - t0);
  }
  state.counters["bwd_ms"] = 1e3 * seconds / static_cast<double>(state.iterations());
  state.counters["T"] = static_cast<double>(T);
  state.counters["d"] = static_cast<double>(d);
}

// The scaling target read from one row: every iteration runs the backward at T = 2048 and at
// T = 16384 (one head each), so t(16384) / t(2048) compares moments a few hundred ms apart
// rather than rows measured minutes apart. Counter scaling (sum over iterations of each).
void BM_scaling(benchmark::State& state) {
  const Index d = state.range(0);
  const Attention attn;
  Layer small(2048, d, 1), big(16384, d, 1);
  double t_small = 0, t_big = 0;
  const auto backward = [&](Layer& layer) {
    linattn::parallel_backward_into(attn, layer.Q, layer.K, layer.V, Mask::causal, layer.dY,
                                    {layer.dQ, layer.dK, layer.dV});
    benchmark::DoNotOptimize(layer.dQ.data());
    benchmark::ClobberMemory();
  };
  backward(small);  // untimed (bench_support.hpp, "Warm-up")
  backward(big);
  for (auto _ : state) {
    const double t0 = clock_seconds(1);
    backward(small);
    const double t1 = clock_seconds(1);
    backward(big);
    const double t2 = clock_seconds(1);
    t_small += t1 - t0;
    t_big += t2 - t1;
    state.SetIterationTime(t2 - t0);
  }
  state.counters["scaling"] = t_big / t_small;
  state.counters["d"] = static_cast<double>(d);
}

// Resident memory in kB from /proc/self/status ("VmRSS" or the high-water mark "VmHWM").
long status_kb(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::size_t n = std::strlen(field);
  while (std::getline(status, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':')
      return std::stol(line.substr(n + 1));
  return -1;
}

// Peak resident bytes of one backward (with its returned gradients), in a child process: large
// blocks are then mapped fresh and unmapped on free (mallopt), and the high-water mark is reset
// just before the call, so the peak is the call's own. Returns -1 if the kernel lacks the reset.
double backward_peak_bytes(Index T, Index d) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    mallopt(M_MMAP_THRESHOLD, 64 * 1024);
    double peak = -1;
    {
      const Attention attn;
      const Matrix Q = random(T, d, 1), K = random(T, d, 2), V = random(T, d, 3),
                   dY = random(T, d, 4);
      std::ofstream("/proc/self/clear_refs") << "5";
      const long before = status_kb("VmRSS");
      const long reset = status_kb("VmHWM");
      // The reset took effect: the mark is now about the current RSS (reading the status
      // files itself moves it by some 100 kB), not the inputs' allocation peak.
      if (reset >= 0 && reset <= before + 1024) {
        const auto g = linattn::parallel_backward(attn, Q, K, V, Mask::causal, dY);
        benchmark::DoNotOptimize(g.Q.data());
        peak = 1024.0 * static_cast<double>(status_kb("VmHWM") - before);
      }
    }
    const ssize_t written = write(fds[1], &peak, sizeof peak);
    _exit(written == static_cast<ssize_t>(sizeof peak) ? 0 : 1);
  }
  close(fds[1]);
  double peak = -1;
  if (read(fds[0], &peak, sizeof peak) != static_cast<ssize_t>(sizeof peak)) peak = -1;
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  return peak;
}

void BM_memory(benchmark::State& state) {
  const Index d = state.range(0), T = state.range(1);
  double peak = 0;
  for (auto _ : state) peak = backward_peak_bytes(T, d);
  const double gradients = 3.0 * static_cast<double>(T * d) * sizeof(float);
  const double scratch = static_cast<double>(linattn::causal_backward_bytes(Attention{}, T, d, d));
  state.counters["peak_MiB"] = peak / (1 << 20);
  state.counters["gradients_MiB"] = gradients / (1 << 20);
  state.counters["own_MiB"] = (peak - gradients) / (1 << 20);
  state.counters["scratch_MiB"] = scratch / (1 << 20);
  state.counters["scratch_B/token"] = scratch / static_cast<double>(T);
  state.counters["T"] = static_cast<double>(T);
  state.counters["d"] = static_cast<double>(d);
}

void train_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"d", "T", "heads", "threads"});
  for (Index d : {64, 128}) {
    for (Index T : {64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}) b->Args({d, T, 1, 1});
    for (Index T : {2048, 16384})
      for (int threads : {1, 2}) b->Args({d, T, 8, threads});
  }
}

void quadratic_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"d", "T"});
  for (Index d : {64, 128})
    for (Index T : {64, 128, 256, 512, 1024, 2048, 4096}) b->Args({d, T});
}

}  // namespace

BENCHMARK(BM_memory)->Name("memory")->ArgNames({"d", "T"})->Args({128, 65536})->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_train)->Name("train")->Apply(train_args)->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_train_saved)->Name("train_saved")->ArgNames({"d", "T"})
    ->ArgsProduct({{64, 128}, {2048, 4096, 8192, 16384}})->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_train_layer)->Name("train_layer")->ArgNames({"d", "T"})
    ->ArgsProduct({{64, 128}, {2048, 8192}})->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_scaling)->Name("scaling")->ArgNames({"d"})->Arg(64)->Arg(128)->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quadratic_bwd)->Name("quadratic_bwd")->Apply(quadratic_args)->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
