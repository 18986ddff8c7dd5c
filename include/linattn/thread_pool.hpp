#pragma once
/// \file thread_pool.hpp
/// ThreadPool: an Executor with persistent worker threads for the multi-head layer. Link the
/// CMake target linattn::threads (linattn plus the platform's thread library) to use it.
///
/// A decode step of a batch does a few microseconds of work per head, so waking a sleeping
/// thread per step (tens of microseconds) would cost more than it saves. Workers therefore spin
/// on an atomic generation counter for a while after each job (about 50 microseconds) and
/// only then sleep (std::atomic::wait), so back-to-back calls reach them in well under a
/// microsecond, and an idle pool costs no CPU.
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
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& t : workers_) t.join();
  }

  [[nodiscard]] int concurrency() const noexcept override { return threads_; }

  void run(Index n, int parts, TaskRange task) override {
    const std::lock_guard<std::mutex> lock(run_mutex_);
    if (parts > threads_) parts = threads_;
    job_n_ = n;
    job_parts_ = parts;
    job_task_ = &task;
    // Every worker acknowledges every job (those without a part too), so none still reads the
    // job's fields when the next run() writes them.
    remaining_.store(threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    run_part(0);
    // Wait for the workers' parts: spin briefly (they usually finish together), then sleep.
    int left = remaining_.load(std::memory_order_acquire);
    for (int spin = 0; left != 0 && spin < kSpins; ++spin) left = remaining_.load(std::memory_order_acquire);
    while (left != 0) {
      remaining_.wait(left, std::memory_order_acquire);
      left = remaining_.load(std::memory_order_acquire);
    }
    job_task_ = nullptr;
  }

 private:
  static constexpr int kSpins = 20000;
  static constexpr auto kSpinTime = std::chrono::microseconds(50);

  void run_part(int p) const {
    const Index begin = job_n_ * p / job_parts_, end = job_n_ * (p + 1) / job_parts_;
    if (begin < end) (*job_task_)(begin, end);
  }

  void work(int w) {
    // The generation when the pool was made, not when this thread happened to start: a job or
    // the destructor may already have advanced it.
    std::uint32_t seen = 0;
    for (;;) {
      // Spin for new work, then sleep until the generation changes.
      std::uint32_t now = generation_.load(std::memory_order_acquire);
      const auto until = std::chrono::steady_clock::now() + kSpinTime;
      while (now == seen) {
        for (int i = 0; i < 64 && now == seen; ++i) now = generation_.load(std::memory_order_acquire);
        if (now != seen || std::chrono::steady_clock::now() > until) break;
      }
      while (now == seen) {
        generation_.wait(seen, std::memory_order_acquire);
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (stop_.load(std::memory_order_relaxed)) return;
      if (w < job_parts_) run_part(w);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  // 32 bits: the width the OS wait primitive (futex) takes directly; libstdc++ 12 waits on
  // wider atomics through a proxy that can miss a notification. Wrap-around is harmless: only
  // equality with the last generation seen matters.
  std::atomic<std::uint32_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  // The current job, written before generation_ is advanced (release) and read after it is
  // seen (acquire).
  Index job_n_ = 0;
  int job_parts_ = 1;
  const TaskRange* job_task_ = nullptr;
};

}  // namespace linattn
