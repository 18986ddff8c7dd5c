// executor.hpp: parallel_for's contract for any executor: every item once, the lowest failing
// item's exception after all items ran, and small calls kept on the calling thread.

#include <linattn/executor.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <stdexcept>
#include <vector>

namespace executor_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

namespace {
// An executor that runs the parts one after another in reverse order, counting calls: any
// order must give the same results.
struct ReverseExecutor final : Executor {
  int parts_run = 0;
  int calls = 0;
  [[nodiscard]] int concurrency() const noexcept override { return 3; }
  void run(Index n, int parts, TaskRange task) override {
    ++calls;
    for (int p = parts - 1; p >= 0; --p) {
      ++parts_run;
      task(n * p / parts, n * (p + 1) / parts);
    }
  }
};
}  // namespace

TEST_CASE("every item runs exactly once, through the executor when the work pays", "[executor]") {
  ReverseExecutor ex;
  std::vector<int> hits(100, 0);
  detail::parallel_for(100, &ex, 1e6, [&](Index i) { ++hits[static_cast<std::size_t>(i)]; });
  for (int h : hits) CHECK(h == 1);
  CHECK(ex.calls == 1);
  CHECK(ex.parts_run == 3);
  // Below the grain: the calling thread, the executor untouched.
  detail::parallel_for(100, &ex, detail::kParallelGrainFlops / 1000, [&](Index i) { ++hits[static_cast<std::size_t>(i)]; });
  CHECK(ex.calls == 1);
  for (int h : hits) CHECK(h == 2);
  // No executor: serial.
  detail::parallel_for(3, nullptr, 1e9, [&](Index i) { ++hits[static_cast<std::size_t>(i)]; });
  CHECK(hits[2] == 3);
}

TEST_CASE("the lowest failing item's exception is rethrown after every item ran", "[executor]") {
  ReverseExecutor ex;
  std::atomic<int> ran{0};
  try {
    detail::parallel_for(9, &ex, 1e6, [&](Index i) {
      ++ran;
      if (i == 7) throw std::out_of_range("seven");
      if (i == 2) throw std::invalid_argument("two");
    });
    FAIL("nothing thrown");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) == "two");
  }
  CHECK(ran == 9);
}

}  // namespace executor_test
