// errors.hpp: the exception hierarchy (three channels, never mixed) and the checked size
// arithmetic every size computed from user dimensions goes through.

#include <linattn/errors.hpp>

#include <catch2/catch.hpp>

#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace errors_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("each error derives from the standard exception of its channel", "[errors]") {
  static_assert(std::is_base_of_v<std::invalid_argument, ShapeError>);
  static_assert(std::is_base_of_v<std::invalid_argument, StateMismatchError>);
  static_assert(std::is_base_of_v<std::domain_error, DenominatorError>);
  static_assert(std::is_base_of_v<std::runtime_error, StateFormatError>);
  const DenominatorError e("bad", 7, -0.5);
  CHECK(e.row() == 7);
  CHECK(e.value() == -0.5);
  const StateFormatError f(StateFormatError::Reason::bad_value, "NaN in S");
  CHECK(f.reason() == StateFormatError::Reason::bad_value);
  CHECK(std::string(f.what()) == "linattn: cannot restore state: NaN in S");
  try {
    detail::throw_shape_error("Q is ", 3, "x", 4);
  } catch (const ShapeError& s) {
    CHECK(std::string(s.what()) == "linattn: Q is 3x4");
  }
}

TEST_CASE("checked products and sums refuse what does not fit an Index", "[errors]") {
  using Index = Eigen::Index;
  const Index max = std::numeric_limits<Index>::max();
  CHECK(detail::checked_product(0, max, "x") == 0);
  CHECK(detail::checked_product(max, 1, "x") == max);
  CHECK(detail::checked_product(Index{1} << 31, Index{1} << 31, "x") == Index{1} << 62);
  CHECK_THROWS_AS(detail::checked_product(Index{1} << 32, Index{1} << 31, "x"), ShapeError);
  CHECK_THROWS_AS(detail::checked_product(-1, 2, "x"), ShapeError);
  CHECK(detail::checked_sum(max - 1, 1, "x") == max);
  CHECK_THROWS_AS(detail::checked_sum(max, 1, "x"), ShapeError);
  try {
    static_cast<void>(detail::checked_product(max, 2, "the state"));
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("the state") != std::string::npos);
  }
}

}  // namespace errors_test
