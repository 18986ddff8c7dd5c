// normalization.hpp: what each policy divides by, and what it rejects.

#include <linattn/normalization.hpp>

#include <catch2/catch.hpp>

#include <limits>
#include <string>

namespace normalization_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using Catch::Matchers::Contains;

TEMPLATE_TEST_CASE("each policy's divisor follows its definition", "[normalization]", float, double) {
  using S = TestType;
  const S inf = std::numeric_limits<S>::infinity(), nan = std::numeric_limits<S>::quiet_NaN();
  const S tiny = std::numeric_limits<S>::denorm_min();
  const auto strict = Normalization::strict();
  CHECK(strict.divisor(S(2), 0) == S(2));
  CHECK(strict.divisor(tiny, 0) == tiny);  // positive and finite: accepted, as every path divides
  for (const S bad : {S(0), S(-1), inf, nan}) CHECK_THROWS_AS(strict.divisor(bad, 3), DenominatorError);
  CHECK_THROWS_WITH(strict.divisor(S(0), 3), Contains("query row 3"));
  const auto clamped = Normalization::clamped(0.5);
  CHECK(clamped.divisor(S(2), 0) == S(2));
  CHECK(clamped.divisor(S(0.25), 0) == S(0.5));
  CHECK(clamped.divisor(S(-4), 0) == S(0.5));
  CHECK_THROWS_AS(clamped.divisor(nan, 0), DenominatorError);
  CHECK_THROWS_AS(clamped.divisor(inf, 0), DenominatorError);
  const auto shifted = Normalization::shifted(0.5);
  CHECK(shifted.divisor(S(2), 0) == S(2.5));
  CHECK_THROWS_AS(shifted.divisor(S(-0.5), 0), DenominatorError);  // den + eps = 0
  const auto raw = Normalization::unnormalized();
  CHECK_FALSE(raw.divides());
  CHECK(raw.divisor(nan, 0) == S(1));
  CHECK(strict.divides());
}

TEST_CASE("an epsilon must be positive and finite", "[normalization]") {
  CHECK_THROWS_AS(Normalization::clamped(0), std::invalid_argument);
  CHECK_THROWS_AS(Normalization::shifted(-1e-6), std::invalid_argument);
  CHECK_THROWS_AS(Normalization::clamped(std::numeric_limits<double>::infinity()), std::invalid_argument);
  CHECK(Normalization::clamped(1e-6).epsilon() == 1e-6);
  CHECK(Normalization::shifted(1e-6).kind() == Normalization::Kind::shifted);
}

}  // namespace normalization_test
