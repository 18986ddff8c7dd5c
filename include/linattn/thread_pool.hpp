#pragma once
/// \file thread_pool.hpp
/// ThreadPool: an Executor with persistent worker threads for the multi-head layer. Link the
/// CMake target linattn::threads (linattn plus the platform's thread library) to use it.
///
/// A decode step of a batch does a few microseconds of work per head, so waking a sleeping
/// thread per step (tens of microseconds) would cost more than it saves. Workers therefore spin
/// on an atomic generation counter for a while after each job (about 50 microseconds) and
/// only then sleep (std::atomic::wait), so back-to-back calls reach them without a system
/// call: a hand-off and its completion cost about a microsecond, a few cache-line transfers
/// between the cores (bench_multihead, pool_overhead), and an idle pool costs no CPU.
///
///   linattn::ThreadPool pool(2);          // the caller plus one worker
///   layer.set_executor(&pool);            // the pool must outlive the calls
///
/// One job at a time: run() from several threads at once is serialized.

#include <linattn/executor.hpp>
#include <linattn/types.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

namespace linattn {

class ThreadPool final : public Executor {
 public:
  /// A pool of `threads` threads in all, the caller's included (threads - 1 workers). Throws
  /// std::invalid_argument unless threads >= 1.
  explicit ThreadPool(int threads) : threads_(threads) {
    if (threads < 1) throw std::invalid_argument("linattn: a thread pool needs at least 1 thread");
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    for (int w = 1; w < threads; ++w) workers_.emplace_back([this, w] { work(w); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() override {
    signal_.stop.store(true, std::memory_order_relaxed);
    signal_.generation.fetch_add(1, std::memory_order_release);
    signal_.generation.notify_all();
    for (auto& t : workers_) t.join();
  }

  [[nodiscard]] int concurrency() const noexcept override { return threads_; }

  void run(Index n, int parts, TaskRange task) override {
    const std::lock_guard<std::mutex> lock(run_mutex_);
    if (parts > threads_) parts = threads_;
    signal_.n = n;
    signal_.parts = parts;
    signal_.task.emplace(task);
    // Every worker acknowledges every job (those without a part too), so none still reads the
    // job's fields when the next run() writes them.
    done_.remaining.store(threads_ - 1, std::memory_order_relaxed);
    // A plain store, not a read-modify-write: run() is the only writer while it holds the lock
    // (the destructor runs after the last run), and a store does not wait for the line.
    const std::uint32_t next = signal_.generation.load(std::memory_order_relaxed) + 1;
    signal_.generation.store(next, std::memory_order_release);
    signal_.generation.notify_all();
    run_part(0);
    // Wait for the workers' parts: spin briefly (they usually finish together), then sleep.
    int left = done_.remaining.load(std::memory_order_acquire);
    for (int spin = 0; left != 0 && spin < kSpins; ++spin) {
      cpu_relax();
      left = done_.remaining.load(std::memory_order_acquire);
    }
    while (left != 0) {
      done_.remaining.wait(left, std::memory_order_acquire);
      left = done_.remaining.load(std::memory_order_acquire);
    }
  }

 private:
  static constexpr int kSpins = 20000;
  static constexpr auto kSpinTime = std::chrono::microseconds(50);

  // A spin-wait hint: the polling core backs off the line the other core is about to write.
  static void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  void run_part(int p) const {
    const Index begin = signal_.n * p / signal_.parts, end = signal_.n * (p + 1) / signal_.parts;
    if (begin < end) (*signal_.task)(begin, end);
  }

  void work(int w) {
    // The generation when the pool was made, not when this thread happened to start: a job or
    // the destructor may already have advanced it.
    std::uint32_t seen = 0;
    for (;;) {
      // Spin for new work, then sleep until the generation changes.
      std::uint32_t now = signal_.generation.load(std::memory_order_acquire);
      const auto until = std::chrono::steady_clock::now() + kSpinTime;
      while (now == seen) {
        for (int i = 0; i < 64 && now == seen; ++i) {
          cpu_relax();
          now = signal_.generation.load(std::memory_order_acquire);
        }
        if (now != seen || std::chrono::steady_clock::now() > until) break;
      }
      while (now == seen) {
        signal_.generation.wait(seen, std::memory_order_acquire);
        now = signal_.generation.load(std::memory_order_acquire);
      }
      seen = now;
      if (signal_.stop.load(std::memory_order_relaxed)) return;
      if (w < signal_.parts) run_part(w);
      if (done_.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) done_.remaining.notify_one();
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  // What the workers poll (the generation, with the job it announces) and what the caller polls
  // (the count of parts still running), each on a cache line of its own: a hand-off then moves
  // each line between the cores once, and a worker gets the job with the generation. With all
  // of them on one line, the workers' decrements and polls raced the caller's writes of the
  // next job: a hand-off took 1.6 us on a 2-core Zen 5 VM whose cores see each other's writes
  // 0.3 us later, 1.0 to 1.2 us since (bench_multihead, pool_overhead).
  static constexpr std::size_t kLine = 64;
  struct alignas(kLine) Signal {
    // 32 bits: the width the OS wait primitive (futex) takes directly; libstdc++ 12 waits on
    // wider atomics through a proxy that can miss a notification. Wrap-around is harmless:
    // only equality with the last generation seen matters.
    std::atomic<std::uint32_t> generation{0};
    std::atomic<bool> stop{false};
    // The current job, written before the generation is advanced (release) and read after it
    // is seen (acquire). The task is a copy, so a worker reads it from this line.
    int parts = 1;
    Index n = 0;
    std::optional<TaskRange> task;
  };
  struct alignas(kLine) Done {
    std::atomic<int> remaining{0};
  };
  Signal signal_;
  Done done_;
};

}  // namespace linattn
