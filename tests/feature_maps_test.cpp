// Feature maps: the built-ins against their definitions, and a user-written map in ten lines.

#include <linattn/attention.hpp>
#include <linattn/feature_maps.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace feature_maps_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

namespace {

// A user's feature map: phi(x) = [x^2, 1] elementwise-squared plus a constant feature, so
// r = d + 1 and every feature is >= 0 with at least one positive (the constant 1).
struct SquarePlusBias {
  static constexpr bool strictly_positive = false;  // x^2 can be 0
  Index feature_dim(Index d) const { return d + 1; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    out.leftCols(x.cols()) = x.array().square().matrix();
    out.col(x.cols()).setOnes();
  }
};

}  // namespace

static_assert(FeatureMap<SquarePlusBias>);
static_assert(FeatureMap<SquarePlusBias, double>);

TEMPLATE_TEST_CASE("EluPlusOne matches ELU(x) + 1 and stays finite and positive", "[phi]", float,
                   double) {
  RowMatrix<TestType> x(1, 7), out(1, 7);
  x << -1000, -30, -1, 0, 0.5, 30, 1000;
  Eigen::Ref<RowMatrix<TestType>> ref(out);
  EluPlusOne{}.apply(x, ref);
  for (Index j = 0; j < x.cols(); ++j) {
    const double expected = linattn_test::elu_plus_one(double(x(0, j)));
    // exp is accurate to a few ulps; x + 1 is one rounding.
    CHECK(double(out(0, j)) == Approx(expected).epsilon(4 * std::numeric_limits<TestType>::epsilon()));
    CHECK(std::isfinite(out(0, j)));
    CHECK(out(0, j) >= 0);
  }
  CHECK(out(0, 2) > 0);
  CHECK(EluPlusOne::strictly_positive);
  CHECK_FALSE(Identity::strictly_positive);
}

TEMPLATE_TEST_CASE("EluPlusOne follows exp closely over the whole non-positive range", "[phi]",
                   float, double) {
  // 100,003 points on [-105, 0] (float's exp underflows to 0 near -103.3), against std::exp in
  // long double. Bounds, with e = exp(x) and eps = machine epsilon (one ulp of e is at most
  // eps e): the portable form exp(x / 2)^2 doubles exp's ~1 ulp and adds one rounding, under
  // 4 eps e. The AVX-512 float kernel (detail::elu_plus_one_row) has a reduced argument off by
  // about an ulp of |r| <= 0.35, a Taylor remainder of 0.1 ulp and ~1 ulp of rounding in its
  // polynomial, then an exact power-of-two scaling: under 2 eps e. A subnormal result adds at
  // most one rounding to the subnormal spacing, denorm_min.
  using L = std::numeric_limits<TestType>;
  const bool kernel = detail::has_elu_kernel && std::is_same_v<TestType, float>;
  const long double bound_eps = kernel ? 2 : 4;
  const Index n = 100003;
  RowMatrix<TestType> x(1, n), out(1, n);
  for (Index j = 0; j < n; ++j)
    x(0, j) = static_cast<TestType>(-105.0 + 105.0 * static_cast<double>(j) / double(n - 1));
  Eigen::Ref<RowMatrix<TestType>> view(out);
  EluPlusOne{}.apply(x, view);
  long double worst = 0;
  for (Index j = 0; j < n; ++j) {
    const long double e = std::exp(static_cast<long double>(x(0, j)));
    const long double allowed = bound_eps * L::epsilon() * e + L::denorm_min();
    worst = std::max(worst, std::abs(static_cast<long double>(out(0, j)) - e) / allowed);
  }
  CAPTURE(kernel);
  CHECK(worst <= 1);
}

TEST_CASE("a user-written feature map plugs into LinearAttention", "[phi]") {
  const Index T = 40, d = 5, dv = 3;
  const auto Q = linattn_test::random_matrix<double>(T, d, 51);
  const auto K = linattn_test::random_matrix<double>(T, d, 52);
  const auto V = linattn_test::random_matrix<double>(T, dv, 53);
  const LinearAttention<SquarePlusBias, double> attn;
  CHECK(attn.feature_dim(d) == d + 1);
  CHECK(attn.make_state(d, dv).S().rows() == d + 1);

  // Reference from the definition: w_ij = sum_n q_in^2 k_jn^2 + 1.
  RowMatrix<double> expected(T, dv);
  for (Index i = 0; i < T; ++i) {
    double den = 0;
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(dv);
    for (Index j = 0; j <= i; ++j) {
      const double w = (Q.row(i).array().square() * K.row(j).array().square()).sum() + 1;
      num += w * V.row(j);
      den += w;
    }
    expected.row(i) = num / den;
  }
  // Positive weights, sums of at most T + d terms: 2 (d + T + 4) u relative to max |v|.
  const double tol = 2.0 * (d + T + 4) * linattn_test::unit_roundoff<double>() * V.cwiseAbs().maxCoeff();
  CHECK((attn.recurrent(Q, K, V) - expected).cwiseAbs().maxCoeff() <= tol);
  CHECK((attn.parallel(Q, K, V, Mask::causal) - expected).cwiseAbs().maxCoeff() <= tol);
}

static_assert(DifferentiableFeatureMap<TaylorExp, float> && !TaylorExp::strictly_positive);

TEMPLATE_TEST_CASE("TaylorExp's kernel is 1 + s + s^2 / 2 with s = q^T k / sqrt(d)", "[phi]", float,
                   double) {
  using Scalar = TestType;
  using Wide = long double;
  const TaylorExp phi;
  for (const Index d : {1, 4, 16}) {
    const Index r = phi.feature_dim(d);
    CHECK(r == 1 + d + d * (d + 1) / 2);  // 153 for Based's d = 16
    const Index T = 12;
    const RowMatrix<Scalar> Q = linattn_test::random_matrix<Scalar>(T, d, 60 + d);
    const RowMatrix<Scalar> K = linattn_test::random_matrix<Scalar>(T, d, 70 + d);
    RowMatrix<Scalar> FQ(T, r), FK(T, r);
    Eigen::Ref<RowMatrix<Scalar>> fq(FQ), fk(FK);
    phi.apply(Q, fq);
    phi.apply(K, fk);
    for (Index i = 0; i < T; ++i)
      for (Index j = 0; j < T; ++j) {
        Wide s = 0, a = 0;  // q^T k and sum |q_n k_n|, from the inputs' values
        for (Index n = 0; n < d; ++n) {
          s += Wide(Q(i, n)) * Wide(K(j, n));
          a += std::abs(Wide(Q(i, n)) * Wide(K(j, n)));
        }
        s /= std::sqrt(Wide(d));
        a /= std::sqrt(Wide(d));
        // Each feature is at most 3 roundings from its value (the constant 1 / d^(1/4) is 3
        // roundings, times x one more; x_i x_j / sqrt(d): 2 for the constant, 2 products), so
        // a product of two features errs by 7 u relative, and the dot product of r of them adds
        // r u, all relative to the kernel of |q| and |k|: 1 + a + a^2 / 2 (the sum of |terms|).
        const Wide tol = Wide(r + 7) * Wide(linattn_test::unit_roundoff<Scalar>()) * (1 + a + a * a / 2);
        CHECK(std::abs(Wide(FQ.row(i).dot(FK.row(j))) - (1 + s + s * s / 2)) <= tol);
      }
  }
  // The kernel's minimum 1/2 is at s = -1: q = (1, 1, 1, 1), k = -q / 2 (d = 4, sqrt(d) = 2).
  const RowMatrix<Scalar> q = RowMatrix<Scalar>::Ones(1, 4), k = -q / Scalar(2);
  const Index r = phi.feature_dim(4);
  RowMatrix<Scalar> fq(1, r), fk(1, r);
  Eigen::Ref<RowMatrix<Scalar>> fq_ref(fq), fk_ref(fk);
  phi.apply(q, fq_ref);
  phi.apply(k, fk_ref);
  // |terms| sum to 1 + 1 + 1/2: (r + 7) u of that.
  CHECK(std::abs(fq.row(0).dot(fk.row(0)) - Scalar(0.5)) <=
        static_cast<Scalar>(r + 7) * Scalar(2.5) * linattn_test::unit_roundoff<Scalar>());
}

TEST_CASE("LinearAttention with TaylorExp is the weighted average under 1 + s + s^2 / 2", "[phi]") {
  // Rows of K anti-correlated with Q's (s near -1, where the kernel has its minimum 1/2), so the
  // features' cancellation shows; the reference weighs with the kernel itself, not features.
  const Index T = 30, d = 4, dv = 3;
  const LinearAttention<TaylorExp, double> attn;
  const Index r = attn.feature_dim(d);
  const auto Q = linattn_test::random_matrix<double>(T, d, 81);
  const RowMatrix<double> K = -0.5 * Q + 0.3 * linattn_test::random_matrix<double>(T, d, 82);
  const auto V = linattn_test::random_matrix<double>(T, dv, 83);
  RowMatrix<double> expected(T, dv);
  std::vector<double> tolerance(static_cast<std::size_t>(T));
  const double u = linattn_test::unit_roundoff<double>();
  for (Index i = 0; i < T; ++i) {
    double den = 0, magnitude = 0;
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(dv);
    for (Index j = 0; j <= i; ++j) {
      const double s = Q.row(i).dot(K.row(j)) / 2, a = (Q.row(i).cwiseAbs()).dot(K.row(j).cwiseAbs()) / 2;
      const double w = 1 + s + s * s / 2;
      num += w * V.row(j);
      den += w;
      magnitude += 1 + a + a * a / 2;
    }
    expected.row(i) = num / den;
    // Every sum the paths form (features, state, reads) errs by (T + r + 8) u relative to the
    // sum of |terms|, which is sum_j M_ij |v_j| for num and sum_j M_ij for den (M the kernel of
    // |q|, |k|); y = num / den then errs by at most (|d num| + |y| |d den|) / den, twice that
    // for the two passes (state, then read).
    tolerance[static_cast<std::size_t>(i)] = 2.0 * static_cast<double>(T + r + 8) * u * magnitude *
                                             (V.cwiseAbs().maxCoeff() + expected.row(i).cwiseAbs().maxCoeff()) / den;
  }
  for (const auto& [what, Y] : {std::pair{"parallel", attn.parallel(Q, K, V, Mask::causal)},
                               std::pair{"recurrent", attn.recurrent(Q, K, V)}}) {
    CAPTURE(what);
    for (Index i = 0; i < T; ++i)
      CHECK((Y.row(i) - expected.row(i)).cwiseAbs().maxCoeff() <= tolerance[static_cast<std::size_t>(i)]);
  }
}

TEMPLATE_TEST_CASE("EluPlusOne is exact above 0, underflows like std::exp and keeps NaN",
                   "[phi]", float, double) {
  // 40 entries: whole SIMD packets and a scalar tail, so both code paths are covered.
  using L = std::numeric_limits<TestType>;
  const std::vector<TestType> xs{TestType(1e-8), TestType(0.5), TestType(3.25), TestType(1e30),
                                 TestType(0), TestType(-0.0), TestType(-1e-6), TestType(-1),
                                 TestType(-20), TestType(-87), TestType(-90), TestType(-100),
                                 TestType(-150), TestType(-200), TestType(-700), TestType(-720),
                                 TestType(-745), TestType(-1000), L::infinity(), -L::infinity()};
  RowMatrix<TestType> x(1, 40), out(1, 40);
  for (Index j = 0; j < 40; ++j) x(0, j) = xs[static_cast<std::size_t>(j % 20)];
  x(0, 39) = L::quiet_NaN();
  x(0, 7) = L::quiet_NaN();
  Eigen::Ref<RowMatrix<TestType>> view(out);
  EluPlusOne{}.apply(x, view);
  for (Index j = 0; j < 40; ++j) {
    const TestType v = x(0, j);
    CAPTURE(j, v);
    if (std::isnan(v)) {
      CHECK(std::isnan(out(0, j)));
    } else if (v > 0) {
      CHECK(out(0, j) == v + 1);  // one rounding, as in the definition
    } else {
      // exp(x / 2)^2: exp's ~1 ulp doubled by the square plus one rounding, below 4 eps; where
      // std::exp is subnormal or 0, the square rounds to the same spacing (denorm_min).
      const TestType e = std::exp(v);
      CHECK(std::abs(out(0, j) - e) <= 4 * L::epsilon() * e + L::denorm_min());
    }
  }
}

}  // namespace feature_maps_test
