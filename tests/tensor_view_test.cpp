// tensor_view.hpp: both layouts addressed through one type, heads, rows and slices as views
// (never copies), and the checks of a view's shape.

#include <linattn/tensor_view.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace tensor_view_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("TensorView addresses both layouts", "[tensor_view]") {
  std::vector<double> buf(2 * 3 * 4 * 5);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<double>(i);
  const auto bf = TensorView<const double>::batch_first(buf.data(), 2, 3, 4, 5);
  const auto hf = TensorView<const double>::head_first(buf.data(), 2, 4, 3, 5);
  CHECK(bf(1, 2, 3, 4) == static_cast<double>(((1 * 3 + 2) * 4 + 3) * 5 + 4));
  CHECK(hf(1, 2, 3, 4) == static_cast<double>(((1 * 4 + 3) * 3 + 2) * 5 + 4));
  CHECK(hf.times() == 3);
  CHECK(hf.heads() == 4);
  CHECK(bf.size() == 120);
  const auto m = bf.head_matrix(1, 2);
  CHECK(m.rows() == 3);
  CHECK(m.cols() == 5);
  CHECK(m(2, 1) == bf(1, 2, 2, 1));
  const auto n = hf.head_matrix(1, 2);
  CHECK(n(2, 1) == hf(1, 2, 2, 1));
  CHECK(n.data() == &hf(1, 0, 2, 0));  // a view, not a copy
}

TEST_CASE("head rows and slices are views of the same memory", "[tensor_view]") {
  std::vector<float> buf(2 * 6 * 4 * 3);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i);
  const auto v = TensorView<float>::batch_first(buf.data(), 2, 6, 4, 3);
  const auto rows = v.head_rows(1, 2, 3, 2);
  CHECK(rows.rows() == 2);
  CHECK(rows.data() == &v(1, 3, 2, 0));
  CHECK(rows(1, 2) == v(1, 4, 2, 2));
  const auto s = v.slice(1, 2, 3, 1, 2);  // entry 1, rows 2-4, heads 1-2
  CHECK(s.batches() == 1);
  CHECK(s.times() == 3);
  CHECK(s.heads() == 2);
  CHECK(&s(0, 0, 0, 0) == &v(1, 2, 1, 0));
  CHECK(&s(0, 2, 1, 2) == &v(1, 4, 2, 2));
  s.head_matrix(0, 1)(0, 0) = -1;
  CHECK(v(1, 2, 2, 0) == -1);
  const TensorView<const float> read_only = v;  // mutable converts to read-only
  CHECK(read_only.data() == v.data());
}

TEST_CASE("bad views are shape errors naming the view", "[tensor_view][errors]") {
  std::vector<float> out(12);
  const auto fails = [](auto&& call, const std::string& part) {
    try {
      call();
      FAIL("accepted; expected: " << part);
    } catch (const ShapeError& e) {
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
  };
  fails([&] { static_cast<void>(TensorView<float>(out.data(), {1, 2, 2, 3}, {12, 6, 3, 2})); }, "contiguous feature axis");
  fails([&] { static_cast<void>(TensorView<float>(out.data(), {1, -2, 2, 3}, {12, 6, 3, 1})); }, "negative");
  fails([] { static_cast<void>(TensorView<float>(nullptr, {1, 2, 2, 3}, {12, 6, 3, 1})); }, "null");
  const auto v = TensorView<float>::batch_first(out.data(), 1, 2, 2, 3);
  fails([&] { static_cast<void>(v.head_matrix(0, 2)); }, "outside tensor view");
  fails([&] { static_cast<void>(v.head_rows(0, 0, 1, 2)); }, "outside tensor view");
  fails([&] { static_cast<void>(v.slice(0, 0, 2, 1, 2)); }, "outside tensor view");
  fails([&] { static_cast<void>(v.head_matrix(0, 2)); }, "[B=1, T=2, H=2, d=3]");
  // An empty view may have a null pointer; its heads are empty views.
  const TensorView<const float> empty(nullptr, {2, 0, 3, 4}, {0, 0, 4, 1});
  CHECK(empty.size() == 0);
  CHECK(empty.head_matrix(1, 2).rows() == 0);
}

}  // namespace tensor_view_test
