#pragma once
/// \file executor.hpp
/// Executor: how the multi-head layer runs independent work items (sequence, head) on threads,
/// supplied by the caller. linattn itself creates no thread and links nothing: without an
/// executor every call runs on the calling thread. linattn/thread_pool.hpp has one
/// (ThreadPool, CMake target linattn::threads); any other (TBB, a server's own pool) plugs in
/// by deriving from Executor.
///
/// Results are bit-identical for any executor and thread count: an item is computed start to
/// finish by one thread with the same operations; the executor only decides which thread.

#include <linattn/types.hpp>

#include <algorithm>
#include <exception>
#include <mutex>
#include <utility>

namespace linattn {

/// A non-owning reference to a callable void(Index begin, Index end): the range of items one
/// thread runs. Cheap to copy; the callable must outlive the call it is passed to.
class TaskRange {
 public:
  template <class F>
  explicit TaskRange(F& f) noexcept
      : object_(&f), call_([](void* o, Index b, Index e) { (*static_cast<F*>(o))(b, e); }) {}
  void operator()(Index begin, Index end) const { call_(object_, begin, end); }

 private:
  void* object_;
  void (*call_)(void*, Index, Index);
};

/// Runs the items [0, n) of a call split into `parts` contiguous ranges, one range per task.
class Executor {
 public:
  virtual ~Executor() = default;
  /// Threads the executor runs tasks on, the caller's included (>= 1).
  [[nodiscard]] virtual int concurrency() const noexcept = 0;
  /// Calls task(begin_p, end_p) for the `parts` ranges that split [0, n) evenly (part p is
  /// [p n / parts, (p + 1) n / parts)), each once, possibly concurrently, and returns when all
  /// have returned. The task does not throw (the layer catches inside it).
  virtual void run(Index n, int parts, TaskRange task) = 0;
};

namespace detail {

/// Flops below which a call runs on the calling thread even with an executor: handing work to
/// another thread and collecting it costs about 1 to 2 microseconds with ThreadPool's spinning
/// workers (bench_multihead, "pool_overhead"), and 2e5 flops take about 4 to 10 microseconds on
/// one core, so smaller calls lose more to the hand-off than they gain.
inline constexpr double kParallelGrainFlops = 2e5;

/// Collects the exception of the lowest-numbered failing item of a call whose items may run
/// on several threads, so what is rethrown does not depend on threads.
class FirstItemError {
 public:
  explicit FirstItemError(Index items) noexcept : first_index_(items) {}
  /// Records the exception being handled as item i's (call inside a catch block).
  void record(Index i) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (i < first_index_) {
      first_index_ = i;
      error_ = std::current_exception();
    }
  }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mutex_;
  Index first_index_;
  std::exception_ptr error_;
};

/// How many ranges parallel_ranges below splits [0, n) into: 1 without an executor, with one
/// thread or below the grain; else min(n, the executor's threads).
inline int range_count(Index n, Executor* executor, double flops_per_item) noexcept {
  const int parts =
      executor == nullptr ? 1 : static_cast<int>(std::min<Index>(n, executor->concurrency()));
  if (executor == nullptr || parts <= 1 ||
      static_cast<double>(n) * flops_per_item < kParallelGrainFlops)
    return 1;
  return parts;
}

/// Calls range(begin, end) for the contiguous ranges that split [0, n) evenly over `executor`'s
/// threads (one range [0, n) when it is null, has one thread, or the work, n * flops_per_item,
/// is below kParallelGrainFlops). `range` must not throw.
template <class F>
void parallel_ranges(Index n, Executor* executor, double flops_per_item, F& range) {
  const int parts = range_count(n, executor, flops_per_item);
  if (parts <= 1)
    range(Index{0}, n);
  else
    executor->run(n, parts, TaskRange(range));
}

/// Which of the `parts` ranges parallel_ranges splits [0, n) into starts at `begin` (a range's
/// first item): a call that keeps buffers per range (BackwardWorkspace's lanes) picks them so.
/// O(parts).
inline int range_index(Index begin, Index n, int parts) noexcept {
  for (int p = 1; p < parts; ++p)
    if (static_cast<Index>(p) * n / parts > begin) return p - 1;
  return parts - 1;
}

/// Calls f(i) for i in [0, n) on `executor` (or serially, as parallel_ranges decides). Every
/// item runs even if another throws; afterwards the exception of the lowest failing item is
/// rethrown, so what is thrown and which items completed do not depend on threads.
template <class F>
void parallel_for(Index n, Executor* executor, double flops_per_item, F&& f) {
  FirstItemError errors(n);
  auto range = [&](Index begin, Index end) {
    for (Index i = begin; i < end; ++i) {
      try {
        f(i);
      } catch (...) {
        errors.record(i);
      }
    }
  };
  parallel_ranges(n, executor, flops_per_item, range);
  errors.rethrow();
}
}  // namespace detail
}  // namespace linattn
