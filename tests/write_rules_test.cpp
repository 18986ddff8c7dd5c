// Write-rule policies: the WriteRule concept, parameter validation, and the L2Normalize
// feature map the delta rule is used with.

#include <linattn/feature_maps.hpp>
#include <linattn/rule_attention.hpp>
#include <linattn/write_rules.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cmath>
#include <limits>
#include <string>

using namespace linattn;

namespace {
struct NoKind {
  static constexpr bool keeps_normalizer = true;
  static constexpr int token_inputs = 0;
  static constexpr const char* name = "x";
};
}  // namespace

static_assert(WriteRule<Additive> && WriteRule<Decay> && WriteRule<Gated> && WriteRule<Delta> &&
              WriteRule<GatedDelta>);
static_assert(!WriteRule<int> && !WriteRule<std::string> && !WriteRule<NoKind>);
static_assert(Additive::keeps_normalizer && Decay::keeps_normalizer && Gated::keeps_normalizer);
static_assert(!Delta::keeps_normalizer && !GatedDelta::keeps_normalizer);
static_assert(FeatureMap<L2Normalize> && FeatureMap<L2Normalize, double>);
static_assert(!L2Normalize::strictly_positive);
// Additive keeps LinearAttention's state type, so states move freely between the two classes.
static_assert(std::is_same_v<RuleAttention<EluPlusOne, Additive>::State, AttentionState<float>>);
static_assert(std::is_same_v<RuleAttention<L2Normalize, Delta, double>::State,
                             RuleState<Delta, double>>);
static_assert(!std::is_default_constructible_v<RuleAttention<EluPlusOne, Decay>>);  // needs gamma

TEST_CASE("Decay validates gamma: 0 < gamma <= 1", "[rules]") {
  CHECK(Decay(0.25).gamma() == 0.25);
  CHECK(Decay(1.0).gamma() == 1.0);
  CHECK_THROWS_AS(Decay(0.0), std::invalid_argument);
  CHECK_THROWS_AS(Decay(-0.5), std::invalid_argument);
  CHECK_THROWS_AS(Decay(1.0000001), std::invalid_argument);
  CHECK_THROWS_AS(Decay(std::numeric_limits<double>::infinity()), std::invalid_argument);
  CHECK_THROWS_WITH(Decay(std::nan("")), Catch::Matchers::Contains("gamma"));
}

TEST_CASE("parameter checks accept the closed ranges and reject everything else", "[rules]") {
  Eigen::VectorXd beta(4);
  beta << 0, 0.5, 1, 1;
  CHECK_NOTHROW(detail::check_betas(beta));
  beta(3) = std::nextafter(1.0, 2.0);
  CHECK_THROWS_WITH(detail::check_betas(beta), Catch::Matchers::Contains("token 3"));
  beta(3) = -0.0;  // negative zero is zero
  CHECK_NOTHROW(detail::check_betas(beta));
  Eigen::MatrixXd g(2, 2);
  g << 0, -1e300, -1, -0.0;
  CHECK_NOTHROW(detail::check_log_gates(g, "g"));
  g(1, 0) = std::numeric_limits<double>::denorm_min();
  CHECK_THROWS_WITH(detail::check_log_gates(g, "g"),
                    Catch::Matchers::Contains("token 1") && Catch::Matchers::Contains("channel 0"));
}

TEMPLATE_TEST_CASE("L2Normalize gives unit rows, keeps zero rows, survives extreme scales",
                   "[feature_map]", float, double) {
  using Limits = std::numeric_limits<TestType>;
  const Index d = 6;
  RowMatrix<TestType> x = linattn_test::random_matrix<TestType>(5, d, 7);
  x.row(1).setZero();
  x.row(2) *= Limits::max() / 4;     // squares overflow
  x.row(3) *= Limits::min() * 1e-2;  // squares underflow (subnormal inputs)
  x.row(4) << 3, 0, -4, 0, 0, 0;     // exact: (0.6, 0, -0.8)
  RowMatrix<TestType> out(5, d);
  Eigen::Ref<RowMatrix<TestType>> ref(out);
  L2Normalize{}.apply(x, ref);
  const double u = linattn_test::unit_roundoff<TestType>();
  for (Index t : {0, 2, 3}) {
    CAPTURE(t);
    // The norm is a sum of d squares (d u), one sqrt and one division per entry: (d + 4) u.
    CHECK(std::abs(double(out.row(t).norm()) - 1.0) <= double(d + 4) * u);
    // Reference in double, scaled by a power of two first (exact) so that its norm is in range.
    Eigen::RowVectorXd xd = x.row(t).template cast<double>();
    const int e = std::ilogb(xd.cwiseAbs().maxCoeff());  // in two steps: 2^-e may overflow
    xd *= std::ldexp(1.0, -e / 2);
    xd *= std::ldexp(1.0, -(e - e / 2));
    const Eigen::RowVectorXd expect = xd / xd.norm();
    CHECK((out.row(t).template cast<double>() - expect).cwiseAbs().maxCoeff() <=
          double(d + 4) * u);
  }
  CHECK(out.row(1).isZero(0));
  CHECK(double(out(4, 0)) == Approx(0.6).epsilon(4 * u));
  CHECK(double(out(4, 2)) == Approx(-0.8).epsilon(4 * u));
  CHECK(out(4, 1) == 0);

  x(0, 2) = Limits::quiet_NaN();
  x(2, 0) = Limits::infinity();
  L2Normalize{}.apply(x, ref);
  CHECK(out.row(0).array().isNaN().all());  // never silently zero or finite
  CHECK(out.row(2).array().isNaN().all());
}
