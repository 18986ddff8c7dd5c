// types.hpp: the mask constants (two types, one run-time value), the row-major aliases and the
// row views the grouped calls take.

#include <linattn/types.hpp>

#include <catch2/catch.hpp>

#include <type_traits>

namespace types_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

namespace {
constexpr bool causal_of(Mask m) { return m.is_causal(); }
template <class M>
constexpr bool is_causal_type = std::is_same_v<std::remove_cvref_t<M>, CausalMask>;
}  // namespace

TEST_CASE("Mask::none and Mask::causal are distinct types that convert to a run-time Mask", "[types]") {
  static_assert(!std::is_same_v<decltype(Mask::none), decltype(Mask::causal)>);
  static_assert(is_causal_type<decltype(Mask::causal)> && !is_causal_type<decltype(Mask::none)>);
  static_assert(causal_of(Mask::causal) && !causal_of(Mask::none));
  Mask m = Mask::none;
  CHECK_FALSE(m.is_causal());
  m = Mask::causal;
  CHECK(m == Mask::causal);
  CHECK(m != Mask(Mask::none));
  CHECK(Mask::causal_if(true) == Mask::causal);
  CHECK(Mask::causal_if(false) == Mask::none);
  CHECK(Mask::causal_if(false).kind() == Mask::Kind::none);
}

TEST_CASE("outputs and states are row-major; row views keep a contiguous feature axis", "[types]") {
  static_assert(RowMatrix<float>::IsRowMajor);
  static_assert(RowVector<double>::RowsAtCompileTime == 1 && ColVector<double>::ColsAtCompileTime == 1);
  static_assert(SupportedScalar<float> && SupportedScalar<double> && !SupportedScalar<int> &&
                !SupportedScalar<long double>);
  // A head of a [T, H d] buffer: rows H d apart, each contiguous.
  RowMatrix<float> buf = RowMatrix<float>::Zero(3, 8);
  buf(2, 5) = 7;
  const ConstRowsView<float> head(buf.data() + 4, 3, 4, Eigen::OuterStride<>(8));
  CHECK(head(2, 1) == 7);
  RowsView<float> out(buf.data(), 3, 4, Eigen::OuterStride<>(8));
  out(1, 3) = 2;
  CHECK(buf(1, 3) == 2);
  CHECK(kStateAlignment % 64 == 0);
}

}  // namespace types_test
