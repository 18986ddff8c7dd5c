// thread_pool.hpp: a pool runs each part once on its threads, back to back calls included,
// and is destroyed cleanly whether or not it ever ran a job.

#include <linattn/executor.hpp>
#include <linattn/thread_pool.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace thread_pool_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("a pool runs every part once and uses its threads", "[thread_pool]") {
  ThreadPool pool(3);
  CHECK(pool.concurrency() == 3);
  std::vector<std::atomic<int>> hits(1000);
  std::mutex m;
  std::set<std::thread::id> threads;
  auto task = [&](Index begin, Index end) {
    {
      const std::lock_guard<std::mutex> lock(m);
      threads.insert(std::this_thread::get_id());
    }
    for (Index i = begin; i < end; ++i) ++hits[static_cast<std::size_t>(i)];
  };
  // Many jobs back to back, the way decode steps arrive; some with fewer parts than threads.
  for (int job = 0; job < 200; ++job) pool.run(1000, 1 + job % 3, TaskRange(task));
  for (const auto& h : hits) CHECK(h.load() == 200);
  CHECK(threads.size() == 3);  // the caller and both workers took parts
}

TEST_CASE("pools are destroyed cleanly, idle or used, and one thread means no worker", "[thread_pool]") {
  for (int i = 0; i < 20; ++i) {
    ThreadPool idle(2);  // destroyed before any job: no worker may miss the stop
  }
  ThreadPool single(1);
  std::thread::id ran_on;
  auto task = [&](Index, Index) { ran_on = std::this_thread::get_id(); };
  single.run(5, 1, TaskRange(task));
  CHECK(ran_on == std::this_thread::get_id());
  CHECK_THROWS_AS(ThreadPool(0), std::invalid_argument);
  // parallel_for through a pool: every item once.
  ThreadPool pool(2);
  std::vector<int> hits(64, 0);
  detail::parallel_for(64, &pool, 1e6, [&](Index i) { ++hits[static_cast<std::size_t>(i)]; });
  for (int h : hits) CHECK(h == 1);
}

}  // namespace thread_pool_test
