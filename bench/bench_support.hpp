#pragma once
// What the benchmark programs share: reproducible inputs, the clocks they time with, and the
// split of heads over threads.
//
// Warm-up. Every timed loop is preceded by one untimed call on the same buffers. On the VMs we
// measure on (a PVM hypervisor, which shadows the guest's page tables), freeing a large block
// (munmap: the temporaries that build a benchmark's inputs) makes the next access to every
// page of the process cost about 5 us, with no page fault the guest sees: one read per 4 KiB
// page of 128 MiB of inputs took 166 to 170 ms after such a free and 1 ms without it. A row
// that runs one or two iterations (T = 16384 and up, the long_T rows) timed that instead of
// the library: 8 heads at T = 16384, d = 64 took 222 ms in a first iteration and 38 ms in the
// next ones. The call that follows setup pays it once, untimed.

#include <linattn/types.hpp>

#include <chrono>
#include <ctime>
#include <random>
#include <thread>
#include <vector>

namespace bench {

using linattn::Index;
using Matrix = linattn::RowMatrix<float>;

/// rows x cols floats from seed: N(0, 1), or uniform on [lo, hi] when lo < hi.
inline Matrix random(Index rows, Index cols, unsigned seed, float lo = 0, float hi = 0) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(lo, hi);
  Matrix m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = lo < hi ? uniform(gen) : normal(gen);
  return m;
}

/// This thread's CPU time in seconds: less disturbed by other work on the machine than wall
/// time.
inline double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// The clock for a row on `threads` threads: thread CPU time for one, wall-clock time for more
/// (the calling thread's CPU time would hide the others').
inline double clock_seconds(int threads) {
  if (threads == 1) return thread_seconds();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Calls work(h) for h in [0, heads): heads h with h % threads == i on thread i, thread 0 being
/// the caller.
template <class F>
void over_heads(Index heads, int threads, F&& work) {
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i)
    pool.emplace_back([&work, i, threads, heads] {
      for (Index h = i; h < heads; h += threads) work(h);
    });
  for (Index h = 0; h < heads; h += threads) work(h);
  for (auto& t : pool) t.join();
}

}  // namespace bench
