// reference.hpp: the quadratic references against plain loops written here from the formulas.

#include <linattn/reference.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cmath>

namespace reference_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("softmax_attention is the softmax-weighted average, causal or full", "[reference]") {
  const auto Q = linattn_test::random_matrix<double>(5, 3, 1), K = linattn_test::random_matrix<double>(5, 3, 2),
             V = linattn_test::random_matrix<double>(5, 2, 3);
  for (const bool causal : {false, true}) {
    const auto y = softmax_attention(Q, K, V, Mask::causal_if(causal), 0.5);
    for (Index i = 0; i < 5; ++i) {
      double den = 0, num[2] = {0, 0};
      for (Index j = 0; j < (causal ? i + 1 : 5); ++j) {
        const double w = std::exp(0.5 * Q.row(i).dot(K.row(j)));
        den += w;
        for (Index c = 0; c < 2; ++c) num[c] += w * V(j, c);
      }
      // 5 terms of exp and sums: well within 64 u.
      for (Index c = 0; c < 2; ++c) CHECK(std::abs(y(i, c) - num[c] / den) <= 64 * linattn_test::unit_roundoff<double>() * (std::abs(num[c] / den) + 1));
    }
  }
}

TEST_CASE("quadratic_attention equals the double loop of the definition", "[reference]") {
  const auto Q = linattn_test::random_matrix<double>(6, 4, 4), K = linattn_test::random_matrix<double>(6, 4, 5),
             V = linattn_test::random_matrix<double>(6, 3, 6);
  for (const bool causal : {false, true}) {
    const auto ref = linattn_test::naive_attention(Q, K, V, causal, linattn_test::elu_plus_one);
    CHECK(linattn_test::worst_error_ratio<double>(quadratic_attention(EluPlusOne{}, Q, K, V, Mask::causal_if(causal)), ref,
                                                 linattn_test::bound_units(4, 6)) <= 1);
  }
  CHECK_THROWS_AS(quadratic_attention(EluPlusOne{}, Q, K.leftCols(3), V, Mask::none), ShapeError);
  CHECK_THROWS_AS(softmax_attention(Q.topRows(2), K, V, Mask::causal), ShapeError);
}

}  // namespace reference_test
