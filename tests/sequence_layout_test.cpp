// sequence_layout.hpp: which rows form each sequence, and the layouts that do not fit a view.

#include <linattn/sequence_layout.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace sequence_layout_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("batch, packed and padded layouts name their sequences' rows", "[sequence_layout]") {
  const auto batch = SequenceLayout::batch();
  CHECK(batch.count(3) == 3);
  CHECK(batch.batch_entry(2) == 2);
  CHECK(batch.first_row(2) == 0);
  CHECK(batch.length(2, 9) == 9);
  const std::vector<Index> offsets{0, 4, 4, 9};
  const auto packed = SequenceLayout::packed(offsets);
  packed.check(1, 9);
  CHECK(packed.count(1) == 3);
  CHECK(packed.batch_entry(2) == 0);
  CHECK(packed.first_row(2) == 4);
  CHECK(packed.length(1, 9) == 0);
  CHECK(packed.length(2, 9) == 5);
  const std::vector<Index> lengths{3, 0, 9};
  const auto padded = SequenceLayout::padded(lengths);
  padded.check(3, 9);
  CHECK(padded.count(3) == 3);
  CHECK(padded.first_row(1) == 0);
  CHECK(padded.length(0, 9) == 3);
}

TEST_CASE("a layout that does not fit the view is a shape error naming why", "[sequence_layout][errors]") {
  const auto fails = [](const SequenceLayout& l, Index B, Index T, const std::string& part) {
    try {
      l.check(B, T);
      FAIL("accepted");
    } catch (const ShapeError& e) {
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
  };
  const std::vector<Index> decreasing{0, 3, 2, 4}, short_end{0, 3}, bad_start{1, 4}, lengths{4, 5};
  fails(SequenceLayout::packed(decreasing), 1, 4, "must not decrease");
  fails(SequenceLayout::packed(short_end), 1, 4, "end at T=4");
  fails(SequenceLayout::packed(bad_start), 1, 4, "start at 0");
  fails(SequenceLayout::packed(short_end), 2, 3, "batch size 1");
  fails(SequenceLayout::padded(lengths), 2, 4, "outside [0, T=4]");
  fails(SequenceLayout::padded(lengths), 3, 9, "2 lengths for batch size B=3");
}

}  // namespace sequence_layout_test
