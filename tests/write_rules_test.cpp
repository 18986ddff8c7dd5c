// The write rules (write_rules.hpp) and RuleAttention under each of them (attention.hpp): the
// WriteRule concept and parameter validation; every rule's chunked parallel path, recurrent
// path, prefill and decode steps against independent double-precision references written from
// the formulas; carried state; reductions to Additive; beta = 0; the delta rule's exact
// overwrite; per-token inputs in every layout through every entry point; every error path.

#include <Eigen/QR>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/attention.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/multihead.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/write_rules.hpp>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "rule_reference.hpp"
#include "test_support.hpp"

namespace write_rules_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::naive_delta;
using linattn_test::naive_gated;
using linattn_test::random_matrix;
using linattn_test::random_qkv;
using linattn_test::worst_ratio;
using PhiKind = linattn_test::Phi;

// ---- the rule types ------------------------------------------------------------------------

// A rule without `kind` (in a named namespace: its members are only looked at by the concept).
namespace not_a_rule {
struct NoKind {
  static constexpr bool keeps_normalizer = true;
  static constexpr bool has_full_form = false;
  static constexpr int token_inputs = 0;
  static constexpr const char* name = "x";
  [[nodiscard]] static constexpr double parameter() noexcept { return 0; }
};
}  // namespace not_a_rule

namespace {

// The values of a Scalar vector or matrix as the library binds a per-token input.
template <class M>
detail::TokenArray<typename M::Scalar> token_array(const M& m) {
  RowMatrix<typename M::Scalar> unused;
  return detail::bind_array<typename M::Scalar>(m, m.rows(), m.cols(), unused);
}
}  // namespace

static_assert(WriteRule<Additive> && WriteRule<Decay> && WriteRule<Gated> && WriteRule<Delta> &&
              WriteRule<GatedDelta>);
static_assert(!WriteRule<int> && !WriteRule<std::string> && !WriteRule<not_a_rule::NoKind>);
static_assert(Additive::keeps_normalizer && Decay::keeps_normalizer && Gated::keeps_normalizer);
static_assert(!Delta::keeps_normalizer && !GatedDelta::keeps_normalizer);
static_assert(Additive::has_full_form && !Decay::has_full_form && !Gated::has_full_form &&
              !Delta::has_full_form && !GatedDelta::has_full_form);
static_assert(Additive::token_inputs == 0 && Decay::token_inputs == 0 && Gated::token_inputs == 1 &&
              Delta::token_inputs == 1 && GatedDelta::token_inputs == 2);
static_assert(FeatureMap<L2Normalize> && FeatureMap<L2Normalize, double>);
static_assert(!L2Normalize::strictly_positive);
// Additive is LinearAttention, with its state type.
static_assert(std::is_same_v<RuleAttention<EluPlusOne, Additive>, LinearAttention<EluPlusOne>>);
static_assert(std::is_same_v<RuleAttention<EluPlusOne, Additive>::State, AttentionState<float>>);
static_assert(
    std::is_same_v<RuleAttention<L2Normalize, Delta, double>::State, RuleState<Delta, double>>);
static_assert(!std::is_default_constructible_v<RuleAttention<EluPlusOne, Decay>>);  // needs gamma

TEST_CASE("Decay validates gamma: 0 < gamma <= 1", "[rules]") {
  CHECK(Decay(0.25).gamma() == 0.25);
  CHECK(Decay(1.0).gamma() == 1.0);
  CHECK(Decay(0.25).parameter() == 0.25);
  CHECK_THROWS_AS(Decay(0.0), std::invalid_argument);
  CHECK_THROWS_AS(Decay(-0.5), std::invalid_argument);
  CHECK_THROWS_AS(Decay(1.0000001), std::invalid_argument);
  CHECK_THROWS_AS(Decay(std::numeric_limits<double>::infinity()), std::invalid_argument);
  CHECK_THROWS_WITH(Decay(std::nan("")), Catch::Matchers::Contains("gamma"));
}

TEST_CASE("parameter checks accept the closed ranges and reject everything else", "[rules]") {
  Eigen::VectorXd beta(4);
  beta << 0, 0.5, 1, 2;  // [0, 2]: 1 - beta, the eigenvalue along a unit key, in [-1, 1]
  CHECK_NOTHROW(detail::check_betas(token_array(beta)));
  beta(3) = std::nextafter(2.0, 3.0);
  CHECK_THROWS_WITH(detail::check_betas(token_array(beta)), Catch::Matchers::Contains("token 3"));
  beta(3) = -0.0;  // negative zero is zero
  CHECK_NOTHROW(detail::check_betas(token_array(beta)));
  Eigen::MatrixXd g(2, 2);
  g << 0, -1e300, -1, -0.0;
  CHECK_NOTHROW(detail::check_log_gates(token_array(g), "g"));
  g(1, 0) = std::numeric_limits<double>::denorm_min();
  CHECK_THROWS_WITH(detail::check_log_gates(token_array(g), "g"),
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

// ---- RuleAttention under each rule ---------------------------------------------------------

namespace {

struct Shape {
  Index T, dk, dv;
};
const std::vector<Shape> shapes{{1, 4, 4}, {7, 3, 5}, {64, 16, 16}, {150, 8, 3}, {257, 16, 8}};
const std::vector<Index> chunks{1, 5, 16, 64, 4096};

// Log-gates uniform in [lo, 0), T x cols, from the library's reproducible stream.
template <class Scalar>
RowMatrix<Scalar> log_gates(Index T, Index cols, std::uint64_t seed, double lo) {
  return linattn_test::uniform_matrix<Scalar>(T, cols, seed, lo, 0.0);
}

// Betas uniform in [0, 1), likewise.
template <class Scalar>
ColVector<Scalar> betas(Index T, std::uint64_t seed, double top = 1.0) {
  return linattn_test::uniform_matrix<Scalar>(T, 1, seed, 0.0, top).col(0);
}

Options opts(Index chunk, Normalization n = {}) { return Options{n, chunk}; }
Options raw(Index chunk) { return Options{Normalization::unnormalized(), chunk}; }

// Steps a whole sequence through step(), passing each token's inputs.
template <class Attn, class MQ, class MK, class MV, class F>
auto stepped(const Attn& attn, const MQ& Q, const MK& K, const MV& V, F&& inputs_of) {
  auto state = attn.make_state(K.cols(), V.cols());
  RowMatrix<typename Attn::scalar_type> out(Q.rows(), V.cols());
  for (Index t = 0; t < Q.rows(); ++t) out.row(t) = inputs_of(state, t);
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("Decay: chunked, recurrent and step agree with the quadratic definition",
                   "[decay][agree]", float, double) {
  for (const Shape& s : shapes) {
    for (double gamma : {0.97, 0.5}) {
      CAPTURE(s.T, s.dk, s.dv, gamma);
      const auto Q = random_matrix<TestType>(s.T, s.dk, 1 + s.T);
      const auto K = random_matrix<TestType>(s.T, s.dk, 2 + s.T);
      const auto V = random_matrix<TestType>(s.T, s.dv, 3 + s.T);
      const Eigen::MatrixXd lg = Eigen::MatrixXd::Constant(s.T, 1, std::log(gamma));
      const auto refs = naive_gated(Q, K, V, lg, PhiKind::elu_plus_one, true, chunks);
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        const Index chunk = chunks[c];
        CAPTURE(chunk);
        const auto& ref = refs[c];
        const RuleAttention<EluPlusOne, Decay, TestType> attn(EluPlusOne{}, Decay(gamma),
                                                              opts(chunk));
        CHECK(worst_ratio<TestType>(attn.parallel(Q, K, V, Mask::causal), ref) <= 1);
        if (chunk == 1) {
          CHECK(worst_ratio<TestType>(attn.recurrent(Q, K, V), ref) <= 1);
          const auto y = stepped(attn, Q, K, V, [&](auto& st, Index t) {
            return attn.step(st, Q.row(t), K.row(t), V.row(t));
          });
          CHECK(worst_ratio<TestType>(y, ref) <= 1);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("Gated, scalar and per-channel gates: paths agree with the definition",
                   "[gated][agree]", float, double) {
  for (const Shape& s : shapes) {
    for (Index cols : {Index(1), s.dk}) {
      CAPTURE(s.T, s.dk, s.dv, cols);
      const auto Q = random_matrix<TestType>(s.T, s.dk, 11 + s.T);
      const auto K = random_matrix<TestType>(s.T, s.dk, 12 + s.T);
      const auto V = random_matrix<TestType>(s.T, s.dv, 13 + s.T);
      const auto G = log_gates<TestType>(s.T, cols, 14 + s.T, -0.5);
      const auto refs = naive_gated(Q, K, V, G, PhiKind::elu_plus_one, true, chunks);
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        const Index chunk = chunks[c];
        CAPTURE(chunk);
        const auto& ref = refs[c];
        const RuleAttention<EluPlusOne, Gated, TestType> attn(EluPlusOne{}, Gated{}, opts(chunk));
        CHECK(worst_ratio<TestType>(attn.parallel(Q, K, V, G, Mask::causal), ref) <= 1);
        if (chunk == 1) {
          CHECK(worst_ratio<TestType>(attn.recurrent(Q, K, V, G), ref) <= 1);
          const auto y = stepped(attn, Q, K, V, [&](auto& st, Index t) {
            if (cols == 1) return attn.step(st, Q.row(t), K.row(t), V.row(t), G(t, 0));
            return attn.step(st, Q.row(t), K.row(t), V.row(t), G.row(t));
          });
          CHECK(worst_ratio<TestType>(y, ref) <= 1);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("Gated with very strong gates: nothing overflows, the paths still agree",
                   "[gated][range]", float, double) {
  // Log-gates down to -60 per token: cumulative log-gates over a chunk of 64 reach about -2000,
  // so any exp(+cumulative) factor (K .* exp(-b)) would overflow even in double.
  const Index T = 200, dk = 8, dv = 4;
  // Not a structured binding: clang 14 lambdas cannot capture those.
  const auto qkv = random_qkv<TestType>(T, dk, dv, 21);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  for (Index cols : {Index(1), dk}) {
    const auto G = log_gates<TestType>(T, cols, 24, -60);
    const std::vector<Index> sizes{16, 64, 200};
    const auto refs = naive_gated(Q, K, V, G, PhiKind::elu_plus_one, true, sizes);
    for (std::size_t c = 0; c < sizes.size(); ++c) {
      const Index chunk = sizes[c];
      CAPTURE(cols, chunk);
      const auto& ref = refs[c];
      const RuleAttention<EluPlusOne, Gated, TestType> attn(EluPlusOne{}, Gated{}, opts(chunk));
      const auto y = attn.parallel(Q, K, V, G, Mask::causal);
      CHECK(y.allFinite());
      CHECK(worst_ratio<TestType>(y, ref) <= 1);
      CHECK(worst_ratio<TestType>(attn.recurrent(Q, K, V, G), ref) <= 1);
    }
  }
}

TEMPLATE_TEST_CASE("Gated with signed features and the unnormalized read", "[gated][agree]",
                   float, double) {
  const Index T = 130, dk = 8, dv = 5;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 31);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const auto G = log_gates<TestType>(T, dk, 34, -1.0);
  const RuleAttention<Identity, Gated, TestType> attn(Identity{}, Gated{}, raw(32));
  const auto ref = naive_gated(Q, K, V, G, PhiKind::identity, false, 32);
  CHECK(worst_ratio<TestType>(attn.parallel(Q, K, V, G, Mask::causal), ref) <= 1);
  CHECK(worst_ratio<TestType>(attn.recurrent(Q, K, V, G), ref) <= 1);
}

TEMPLATE_TEST_CASE("Delta and GatedDelta: WY chunks, recurrent and step agree with the recurrence",
                   "[delta][agree]", float, double) {
  for (const Shape& s : shapes) {
    CAPTURE(s.T, s.dk, s.dv);
    const auto Q = random_matrix<TestType>(s.T, s.dk, 41 + s.T);
    const auto K = random_matrix<TestType>(s.T, s.dk, 42 + s.T);
    const auto V = random_matrix<TestType>(s.T, s.dv, 43 + s.T);
    const ColVector<TestType> la = log_gates<TestType>(s.T, 1, 45 + s.T, -0.3);
    const ColVector<TestType> none;
    // Betas in [0, 1], and in [0, 2] with 2 planted (negative eigenvalues 1 - beta down to -1,
    // a reflection at 2): the step map keeps 2-norm <= 1 either way (rule_reference.hpp).
    for (const double top : {1.0, 2.0}) {
      for (Index chunk : chunks) {
        CAPTURE(top, chunk);
        ColVector<TestType> beta = betas<TestType>(s.T, 44 + s.T, top);
        if (top > 1 && s.T > 1) beta(s.T / 2) = TestType(2);
        const auto ref = naive_delta(Q, K, V, beta, none, PhiKind::l2_normalize, chunk);
        const auto gref = naive_delta(Q, K, V, beta, la, PhiKind::l2_normalize, chunk);
        const RuleAttention<L2Normalize, Delta, TestType> delta(L2Normalize{}, Delta{}, raw(chunk));
        const RuleAttention<L2Normalize, GatedDelta, TestType> gdelta(L2Normalize{}, GatedDelta{},
                                                                      raw(chunk));
        CHECK(worst_ratio<TestType>(delta.parallel(Q, K, V, beta, Mask::causal), ref) <= 1);
        CHECK(worst_ratio<TestType>(gdelta.parallel(Q, K, V, beta, la, Mask::causal), gref) <= 1);
        if (chunk == 1) {
          CHECK(worst_ratio<TestType>(delta.recurrent(Q, K, V, beta), ref) <= 1);
          CHECK(worst_ratio<TestType>(gdelta.recurrent(Q, K, V, beta, la), gref) <= 1);
          const auto y = stepped(delta, Q, K, V, [&](auto& st, Index t) {
            return delta.step(st, Q.row(t), K.row(t), V.row(t), beta(t));
          });
          CHECK(worst_ratio<TestType>(y, ref) <= 1);
          const auto gy = stepped(gdelta, Q, K, V, [&](auto& st, Index t) {
            return gdelta.step(st, Q.row(t), K.row(t), V.row(t), beta(t), la(t));
          });
          CHECK(worst_ratio<TestType>(gy, gref) <= 1);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "GatedDelta with per-channel log_alpha (Kimi Delta Attention): chunks, recurrent, steps and "
    "grouped calls agree with the recurrence",
    "[delta][kda][agree]", float, double) {
  // Gates per channel in [lo, 0): mild, and strong enough that a chunk's products underflow in
  // float (exp(-40 * 16) is 0), where nothing may overflow or turn NaN.
  for (const double lo : {-0.5, -40.0}) {
    for (const Shape& s : shapes) {
      CAPTURE(lo, s.T, s.dk, s.dv);
      const auto Q = random_matrix<TestType>(s.T, s.dk, 141 + s.T);
      const auto Q2 = random_matrix<TestType>(s.T, s.dk, 146 + s.T);
      const auto K = random_matrix<TestType>(s.T, s.dk, 142 + s.T);
      const auto V = random_matrix<TestType>(s.T, s.dv, 143 + s.T);
      const RowMatrix<TestType> la = log_gates<TestType>(s.T, s.dk, 145 + s.T, lo);
      for (const double top : {1.0, 2.0}) {
        ColVector<TestType> beta = betas<TestType>(s.T, 144 + s.T, top);
        if (top > 1 && s.T > 1) beta(s.T / 2) = TestType(2);
        for (Index chunk : chunks) {
          CAPTURE(top, chunk);
          const auto ref = naive_delta(Q, K, V, beta, la, PhiKind::l2_normalize, chunk);
          const auto ref2 = naive_delta(Q2, K, V, beta, la, PhiKind::l2_normalize, chunk);
          const RuleAttention<L2Normalize, GatedDelta, TestType> kda(L2Normalize{}, GatedDelta{},
                                                                     raw(chunk));
          const RowMatrix<TestType> y = kda.parallel(Q, K, V, beta, la, Mask::causal);
          CHECK(y.allFinite());
          CHECK(worst_ratio<TestType>(y, ref) <= 1);
          // Two query heads over one state: head 0 has the single-head bits.
          RowMatrix<TestType> y0(s.T, s.dv), y1(s.T, s.dv);
          const std::vector<ConstRowsView<TestType>> heads{
              ConstRowsView<TestType>(Q.data(), s.T, s.dk, Eigen::OuterStride<>(s.dk)),
              ConstRowsView<TestType>(Q2.data(), s.T, s.dk, Eigen::OuterStride<>(s.dk))};
          const std::vector<RowsView<TestType>> outs{
              RowsView<TestType>(y0.data(), s.T, s.dv, Eigen::OuterStride<>(s.dv)),
              RowsView<TestType>(y1.data(), s.T, s.dv, Eigen::OuterStride<>(s.dv))};
          kda.parallel_into(heads, K, V, beta, la, Mask::causal, outs);
          CHECK(y0 == y);
          CHECK(worst_ratio<TestType>(y1, ref2) <= 1);
          if (chunk != 1) continue;
          // The paths that do not chunk, once per shape.
          CHECK(worst_ratio<TestType>(kda.recurrent(Q, K, V, beta, la), ref) <= 1);
          const auto ys = stepped(kda, Q, K, V, [&](auto& st, Index t) {
            return kda.step(st, Q.row(t), K.row(t), V.row(t), beta(t), la.row(t));
          });
          CHECK(worst_ratio<TestType>(ys, ref) <= 1);
          // The grouped step absorbs once, then reads each head.
          auto st = kda.make_state(s.dk, s.dv);
          RowMatrix<TestType> g0(s.T, s.dv), g1(s.T, s.dv);
          for (Index t = 0; t < s.T; ++t) {
            const std::vector<ConstRowsView<TestType>> q{
                ConstRowsView<TestType>(Q.row(t).data(), 1, s.dk, Eigen::OuterStride<>(s.dk)),
                ConstRowsView<TestType>(Q2.row(t).data(), 1, s.dk, Eigen::OuterStride<>(s.dk))};
            const std::vector<RowsView<TestType>> o{
                RowsView<TestType>(g0.row(t).data(), 1, s.dv, Eigen::OuterStride<>(s.dv)),
                RowsView<TestType>(g1.row(t).data(), 1, s.dv, Eigen::OuterStride<>(s.dv))};
            kda.step_into(st, q, K.row(t), V.row(t), beta(t), la.row(t), o);
          }
          CHECK(worst_ratio<TestType>(g0, ref) <= 1);
          CHECK(worst_ratio<TestType>(g1, ref2) <= 1);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "per-channel log_alpha: equal channels are one log_alpha per token, zeros are Delta",
    "[delta][kda][reduce]", float, double) {
  // Different kernels (the per-channel chunk against the scalar-gated one and Delta's), so the
  // results agree to rounding: each against the same reference within its allowance, and the
  // two within the sum of both allowances.
  const Index T = 97, dk = 8, dv = 6, chunk = 16;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 151);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const auto beta = betas<TestType>(T, 152, 2.0);
  const ColVector<TestType> one = log_gates<TestType>(T, 1, 153, -0.4).col(0);
  const RowMatrix<TestType> spread = one.replicate(1, dk);
  const RuleAttention<L2Normalize, GatedDelta, TestType> kda(L2Normalize{}, GatedDelta{},
                                                             raw(chunk));
  const RuleAttention<L2Normalize, Delta, TestType> delta(L2Normalize{}, Delta{}, raw(chunk));
  const auto ref = naive_delta(Q, K, V, beta, one, PhiKind::l2_normalize, chunk);
  const auto ref_channels = naive_delta(Q, K, V, beta, spread, PhiKind::l2_normalize, chunk);
  const RowMatrix<TestType> y_one = kda.parallel(Q, K, V, beta, one, Mask::causal);
  const RowMatrix<TestType> y_spread = kda.parallel(Q, K, V, beta, spread, Mask::causal);
  CHECK(worst_ratio<TestType>(y_one, ref) <= 1);
  CHECK(worst_ratio<TestType>(y_spread, ref_channels) <= 1);
  const double u = linattn_test::unit_roundoff<TestType>();
  const linattn_test::MatrixXdR allowed = (ref.allowed_units + ref_channels.allowed_units) * u;
  CHECK(((y_one.template cast<double>() - y_spread.template cast<double>()).cwiseAbs().array() <=
         allowed.array())
            .all());
  const RowMatrix<TestType> zeros = RowMatrix<TestType>::Zero(T, dk);
  const auto ref_delta = naive_delta(Q, K, V, beta, zeros, PhiKind::l2_normalize, chunk);
  CHECK(worst_ratio<TestType>(kda.parallel(Q, K, V, beta, zeros, Mask::causal), ref_delta) <= 1);
  CHECK(worst_ratio<TestType>(delta.parallel(Q, K, V, beta, Mask::causal), ref_delta) <= 1);
  CHECK(worst_ratio<TestType>(kda.recurrent(Q, K, V, beta, zeros), ref_delta) <= 1);
}

TEMPLATE_TEST_CASE("a sequence in pieces equals one call for every rule: prefill then decode",
                   "[state]", float, double) {
  const Index T = 203, dk = 16, dv = 8, chunk = 32;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 51);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const auto G = log_gates<TestType>(T, dk, 54, -0.5);
  const ColVector<TestType> la = log_gates<TestType>(T, 1, 55, -0.2);
  const auto beta = betas<TestType>(T, 56);
  // Pieces: [0, 70) and [70, 150) parallel (not chunk-aligned), [150, 170) recurrent, then steps.
  const auto pieces = [&](const auto& attn, auto&& inputs_rows, auto&& step_one) {
    auto state = attn.make_state(dk, dv);
    RowMatrix<TestType> out(T, dv);
    const auto part = [&](Index first, Index n, bool recurrent) {
      auto q = Q.middleRows(first, n);
      auto k = K.middleRows(first, n);
      auto v = V.middleRows(first, n);
      out.middleRows(first, n) = inputs_rows(state, q, k, v, first, n, recurrent);
    };
    part(0, 70, false);
    part(70, 80, false);
    part(150, 20, true);
    for (Index t = 170; t < T; ++t) out.row(t) = step_one(state, t);
    CHECK(state.tokens() == T);
    return out;
  };

  SECTION("Decay") {
    const RuleAttention<EluPlusOne, Decay, TestType> attn(EluPlusOne{}, Decay(0.9), opts(chunk));
    const Eigen::MatrixXd lg = Eigen::MatrixXd::Constant(T, 1, std::log(0.9));
    const auto ref = naive_gated(Q, K, V, lg, PhiKind::elu_plus_one, true, chunk);
    const auto y = pieces(
        attn,
        [&](auto& st, auto q, auto k, auto v, Index, Index, bool rec) {
          return rec ? attn.recurrent(st, q, k, v) : attn.prefill(st, q, k, v);
        },
        [&](auto& st, Index t) { return attn.step(st, Q.row(t), K.row(t), V.row(t)); });
    CHECK(worst_ratio<TestType>(y, ref) <= 1);
  }
  SECTION("Gated per channel") {
    const RuleAttention<EluPlusOne, Gated, TestType> attn(EluPlusOne{}, Gated{}, opts(chunk));
    const auto ref = naive_gated(Q, K, V, G, PhiKind::elu_plus_one, true, chunk);
    const auto y = pieces(
        attn,
        [&](auto& st, auto q, auto k, auto v, Index first, Index n, bool rec) {
          auto g = G.middleRows(first, n);
          return rec ? attn.recurrent(st, q, k, v, g) : attn.prefill(st, q, k, v, g);
        },
        [&](auto& st, Index t) { return attn.step(st, Q.row(t), K.row(t), V.row(t), G.row(t)); });
    CHECK(worst_ratio<TestType>(y, ref) <= 1);
  }
  SECTION("Delta") {
    const RuleAttention<L2Normalize, Delta, TestType> attn(L2Normalize{}, Delta{}, raw(chunk));
    const auto ref = naive_delta(Q, K, V, beta, ColVector<TestType>(), PhiKind::l2_normalize,
                                 chunk);
    const auto y = pieces(
        attn,
        [&](auto& st, auto q, auto k, auto v, Index first, Index n, bool rec) {
          auto b = beta.segment(first, n);
          return rec ? attn.recurrent(st, q, k, v, b) : attn.prefill(st, q, k, v, b);
        },
        [&](auto& st, Index t) { return attn.step(st, Q.row(t), K.row(t), V.row(t), beta(t)); });
    CHECK(worst_ratio<TestType>(y, ref) <= 1);
  }
  SECTION("GatedDelta") {
    const RuleAttention<L2Normalize, GatedDelta, TestType> attn(L2Normalize{}, GatedDelta{},
                                                                raw(chunk));
    const auto ref = naive_delta(Q, K, V, beta, la, PhiKind::l2_normalize, chunk);
    const auto y = pieces(
        attn,
        [&](auto& st, auto q, auto k, auto v, Index first, Index n, bool rec) {
          auto b = beta.segment(first, n);
          auto a = la.segment(first, n);
          return rec ? attn.recurrent(st, q, k, v, b, a) : attn.prefill(st, q, k, v, b, a);
        },
        [&](auto& st, Index t) {
          return attn.step(st, Q.row(t), K.row(t), V.row(t), beta(t), la(t));
        });
    CHECK(worst_ratio<TestType>(y, ref) <= 1);
  }
  SECTION("GatedDelta per channel") {
    const RuleAttention<L2Normalize, GatedDelta, TestType> attn(L2Normalize{}, GatedDelta{},
                                                                raw(chunk));
    const auto LA = log_gates<TestType>(T, dk, 57, -0.3);
    const auto ref = naive_delta(Q, K, V, beta, LA, PhiKind::l2_normalize, chunk);
    const auto y = pieces(
        attn,
        [&](auto& st, auto q, auto k, auto v, Index first, Index n, bool rec) {
          auto b = beta.segment(first, n);
          auto a = LA.middleRows(first, n);
          return rec ? attn.recurrent(st, q, k, v, b, a) : attn.prefill(st, q, k, v, b, a);
        },
        [&](auto& st, Index t) {
          // A step's per-channel gates as a column.
          const ColVector<TestType> a = LA.row(t).transpose();
          return attn.step(st, Q.row(t), K.row(t), V.row(t), beta(t), a);
        });
    CHECK(worst_ratio<TestType>(y, ref) <= 1);
  }
}

TEMPLATE_TEST_CASE("gamma = 1 and log-gates = 0 reduce to Additive, which is LinearAttention",
                   "[reduce]", float, double) {
  const Index T = 150, dk = 8, dv = 6;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 61);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  for (Index chunk : {Index(1), Index(7), Index(64)}) {
    CAPTURE(chunk);
    const LinearAttention<EluPlusOne, TestType> core(EluPlusOne{}, opts(chunk));
    const RuleAttention<EluPlusOne, Additive, TestType> additive(EluPlusOne{}, Additive{},
                                                                 opts(chunk));
    // One class: the same arithmetic, identical bits, and the same state type.
    static_assert(std::is_same_v<decltype(additive), decltype(core)>);
    CHECK(additive.parallel(Q, K, V, Mask::causal) == core.parallel(Q, K, V, Mask::causal));
    CHECK(additive.parallel(Q, K, V, Mask::none) == core.parallel(Q, K, V, Mask::none));
    CHECK(additive.recurrent(Q, K, V) == core.recurrent(Q, K, V));
    auto state = additive.make_state(dk, dv);
    (void)additive.prefill(state, Q, K, V);
    CHECK(state.z().size() == dk);
    // Steps too, with a decode block: the additive state is LinearAttention's, block included.
    Options blocked = opts(chunk);
    blocked.decode_block = 4;
    const LinearAttention<EluPlusOne, TestType> core_blocked(EluPlusOne{}, blocked);
    const RuleAttention<EluPlusOne, Additive, TestType> additive_blocked(EluPlusOne{}, Additive{},
                                                                         blocked);
    auto core_state = core_blocked.make_state(dk, dv);
    auto additive_state = additive_blocked.make_state(dk, dv);
    CHECK(additive_state.decode_block() == 4);
    for (Index t = 0; t < 10; ++t)
      CHECK(additive_blocked.step(additive_state, Q.row(t), K.row(t), V.row(t)) ==
            core_blocked.step(core_state, Q.row(t), K.row(t), V.row(t)));

    // exp(0) = 1 exactly, so gamma = 1 and zero log-gates compute the additive weights; the
    // sums are ordered differently, so they agree to the additive rounding bound.
    const Eigen::MatrixXd zero = Eigen::MatrixXd::Zero(T, 1);
    const auto ref = naive_gated(Q, K, V, zero, PhiKind::elu_plus_one, true, chunk);
    const auto y_core = core.parallel(Q, K, V, Mask::causal);
    CHECK(worst_ratio<TestType>(y_core, ref) <= 1);
    const RuleAttention<EluPlusOne, Decay, TestType> decay(EluPlusOne{}, Decay(1.0), opts(chunk));
    CHECK(worst_ratio<TestType>(decay.parallel(Q, K, V, Mask::causal), ref) <= 1);
    CHECK(worst_ratio<TestType>(decay.recurrent(Q, K, V), ref) <= 1);
    const RuleAttention<EluPlusOne, Gated, TestType> gated(EluPlusOne{}, Gated{}, opts(chunk));
    const RowMatrix<TestType> G0 = RowMatrix<TestType>::Zero(T, dk);
    CHECK(worst_ratio<TestType>(gated.parallel(Q, K, V, G0, Mask::causal), ref) <= 1);
    CHECK(worst_ratio<TestType>(gated.parallel(Q, K, V, G0.leftCols(1), Mask::causal), ref) <= 1);
    CHECK(worst_ratio<TestType>(gated.recurrent(Q, K, V, G0), ref) <= 1);
  }
}

TEMPLATE_TEST_CASE("beta = 0 leaves the delta state unchanged", "[delta][beta0]", float,
                   double) {
  const Index T = 40, dk = 8, dv = 5;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 71);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const auto beta = betas<TestType>(T, 74);
  const ColVector<TestType> zero = ColVector<TestType>::Zero(T);
  const ColVector<TestType> no_decay = ColVector<TestType>::Zero(T);
  const RuleAttention<L2Normalize, Delta, TestType> delta(L2Normalize{}, Delta{}, raw(16));
  const RuleAttention<L2Normalize, GatedDelta, TestType> gdelta(L2Normalize{}, GatedDelta{},
                                                                raw(16));
  for (bool recurrent : {false, true}) {
    CAPTURE(recurrent);
    auto state = delta.make_state(dk, dv);
    (void)delta.prefill(state, Q, K, V, beta);  // some non-trivial state
    const RowMatrix<TestType> S0 = state.S();
    const auto y = recurrent ? delta.recurrent(state, Q, K, V, zero)
                             : delta.prefill(state, Q, K, V, zero);
    // u = 0 * (...) = 0 exactly, and S + k 0^T = S: bit-for-bit unchanged.
    CHECK(state.S() == S0);
    CHECK(state.tokens() == 2 * T);
    // Each read is then phi(q)^T S0: a dot product over r = dk terms per entry, r u relative to
    // sum |phi(q)_n| |S0_nc| (and the features' own rounding): allow (dk + 4) u times that.
    RowMatrix<double> qf(T, dk);
    for (Index t = 0; t < T; ++t) qf.row(t) = linattn_test::features(Q.row(t), PhiKind::l2_normalize);
    const RowMatrix<double> expect = qf * S0.template cast<double>();
    const RowMatrix<double> scale = qf.cwiseAbs() * S0.template cast<double>().cwiseAbs();
    const double u = linattn_test::unit_roundoff<TestType>();
    CHECK(((y.template cast<double>() - expect).array().abs() <=
           double(dk + 4) * u * scale.array() + std::numeric_limits<TestType>::min())
              .all());

    auto gstate = gdelta.make_state(dk, dv);
    (void)gdelta.prefill(gstate, Q, K, V, beta, no_decay);
    const RowMatrix<TestType> G0 = gstate.S();
    (void)(recurrent ? gdelta.recurrent(gstate, Q, K, V, zero, no_decay)
                     : gdelta.prefill(gstate, Q, K, V, zero, no_decay));
    CHECK(gstate.S() == G0);
  }
  auto state = delta.make_state(dk, dv);
  (void)delta.prefill(state, Q, K, V, beta);
  const RowMatrix<TestType> S0 = state.S();
  (void)delta.step(state, Q.row(0), K.row(0), V.row(0), 0.0);
  CHECK(state.S() == S0);
}

TEMPLATE_TEST_CASE("the delta rule overwrites exactly on orthonormal keys while additive mixes",
                   "[delta][overwrite]", float, double) {
  // N = d orthonormal keys (a random orthogonal matrix), values V1, then the first half of the
  // keys again with new values V2. Reading with q = k_i must return V2_i for the rewritten keys
  // and V1_i for the others (beta = 1), to the delta reference's rounding bound; the additive
  // rule returns V1_i + V2_i instead.
  const Index d = 16, dv = 8, half = d / 2;
  const Eigen::MatrixXd gauss = random_matrix<double>(d, d, 81);
  const Eigen::MatrixXd basis = Eigen::HouseholderQR<Eigen::MatrixXd>(gauss).householderQ();
  RowMatrix<TestType> K(d + half, d), V(d + half, dv);
  K.topRows(d) = basis.transpose().template cast<TestType>();
  K.bottomRows(half) = K.topRows(half);
  V = random_matrix<TestType>(d + half, dv, 82);
  const ColVector<TestType> beta = ColVector<TestType>::Ones(d + half);
  RowMatrix<TestType> newest(d, dv);
  newest.topRows(half) = V.bottomRows(half);
  newest.bottomRows(d - half) = V.middleRows(half, d - half);

  for (Index chunk : {Index(1), Index(5), Index(64)}) {
    CAPTURE(chunk);
    const RuleAttention<Identity, Delta, TestType> delta(Identity{}, Delta{}, raw(chunk));
    auto state = delta.make_state(d, dv);
    (void)delta.prefill(state, K, K, V, beta);
    // Read: y = S^T k_i for every key (beta = 0 so reading does not write).
    const RowMatrix<TestType> y =
        delta.prefill(state, K.topRows(d), K.topRows(d), RowMatrix<TestType>::Zero(d, dv),
                      ColVector<TestType>::Zero(d));
    const auto ref = naive_delta(K, K, V, beta, ColVector<TestType>(), PhiKind::identity, chunk);
    const double u = linattn_test::unit_roundoff<TestType>();
    const double allowed = u * ref.allowed_units.maxCoeff();
    CHECK((y.template cast<double>() - newest.template cast<double>()).cwiseAbs().maxCoeff() <=
          allowed);

    const RuleAttention<Identity, Additive, TestType> additive(
        Identity{}, Additive{}, Options{Normalization::unnormalized(), chunk});
    auto astate = additive.make_state(d, dv);
    (void)additive.prefill(astate, K, K, V);
    const RowMatrix<double> ya =
        (K.topRows(d) * astate.S()).template cast<double>();  // read without writing
    RowMatrix<double> mixture = newest.template cast<double>();
    mixture.topRows(half) += V.topRows(half).template cast<double>();
    CHECK((ya - mixture).cwiseAbs().maxCoeff() <= allowed);
    CHECK((ya.topRows(half) - newest.topRows(half).template cast<double>()).cwiseAbs().maxCoeff() >
          0.1);
  }
}

TEST_CASE("the delta rules refuse the weighted average with a clear error", "[errors]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH((RuleAttention<L2Normalize, Delta>(L2Normalize{}, Delta{}, Options{})),
                    Contains("weighted average") && Contains("unnormalized"));
  CHECK_THROWS_AS((RuleAttention<L2Normalize, GatedDelta>(
                      L2Normalize{}, GatedDelta{}, Options{Normalization::clamped(1e-6), 64})),
                  std::invalid_argument);
  // Their default is the unnormalized read; decay and gating keep the strict weighted average.
  CHECK_FALSE(RuleAttention<L2Normalize, Delta>().options().normalization.divides());
  CHECK(RuleAttention<EluPlusOne, Gated>().options().normalization.kind() ==
        Normalization::Kind::strict);
  CHECK(RuleAttention<L2Normalize, Delta>().make_state(4, 3).scalar_count() == 12);  // no z
  CHECK(RuleAttention<EluPlusOne, Gated>().make_state(4, 3).scalar_count() == 16);
}

TEMPLATE_TEST_CASE("invalid rule parameters and input shapes are rejected before any write",
                   "[errors]", float, double) {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(Decay(0.0), Contains("(0, 1]"));
  CHECK_THROWS_AS(Decay(1.5), std::invalid_argument);
  CHECK_THROWS_AS(Decay(std::nan("")), std::invalid_argument);
  CHECK_NOTHROW(Decay(1.0));

  const Index T = 6, dk = 4, dv = 3;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 91);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const RuleAttention<L2Normalize, Delta, TestType> delta;
  auto state = delta.make_state(dk, dv);
  (void)delta.prefill(state, Q, K, V, ColVector<TestType>::Constant(T, 0.5));
  const RowMatrix<TestType> S0 = state.S();

  ColVector<TestType> beta = ColVector<TestType>::Constant(T, 0.5);
  beta(3) = TestType(2.5);
  CHECK_THROWS_WITH(delta.prefill(state, Q, K, V, beta), Contains("beta") && Contains("token 3"));
  CHECK_THROWS_WITH(delta.parallel(Q, K, V, beta, Mask::causal), Contains("token 3"));
  beta(3) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_AS(delta.recurrent(state, Q, K, V, beta), std::invalid_argument);
  beta(3) = TestType(-0.1);
  CHECK_THROWS_AS(delta.recurrent(state, Q, K, V, beta), std::invalid_argument);
  CHECK_THROWS_AS(delta.step(state, Q.row(0), K.row(0), V.row(0), 2.5), std::invalid_argument);
  CHECK_THROWS_AS(delta.prefill(state, Q, K, V, ColVector<TestType>::Zero(T - 1)), ShapeError);
  CHECK_THROWS_AS(delta.recurrent(state, Q, K, V, RowMatrix<TestType>::Zero(T, 2)), ShapeError);
  CHECK(state.S() == S0);  // nothing was written
  CHECK(state.tokens() == T);

  const RuleAttention<EluPlusOne, Gated, TestType> gated;
  auto gstate = gated.make_state(dk, dv);
  RowMatrix<TestType> G = RowMatrix<TestType>::Constant(T, dk, -0.1);
  G(2, 1) = TestType(0.01);
  CHECK_THROWS_WITH(gated.prefill(gstate, Q, K, V, G),
                    Contains("log-gate") && Contains("token 2") && Contains("channel 1"));
  G(2, 1) = -std::numeric_limits<TestType>::infinity();
  CHECK_THROWS_AS(gated.recurrent(gstate, Q, K, V, G), std::invalid_argument);
  G(2, 1) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_AS(gated.prefill(gstate, Q, K, V, G), std::invalid_argument);
  CHECK_THROWS_WITH(gated.prefill(gstate, Q, K, V, RowMatrix<TestType>::Zero(T, 2)),
                    Contains("6x2"));
  CHECK_THROWS_AS(gated.step(gstate, Q.row(0), K.row(0), V.row(0), 0.5), std::invalid_argument);
  CHECK_THROWS_AS(gated.step(gstate, Q.row(0), K.row(0), V.row(0), ColVector<TestType>::Zero(3)),
                  ShapeError);
  CHECK(gstate.tokens() == 0);
  CHECK(gstate.S().isZero());

  const RuleAttention<L2Normalize, GatedDelta, TestType> gdelta;
  auto dstate = gdelta.make_state(dk, dv);
  ColVector<TestType> la = ColVector<TestType>::Constant(T, -0.1);
  la(5) = TestType(0.2);
  CHECK_THROWS_WITH(gdelta.prefill(dstate, Q, K, V, ColVector<TestType>::Ones(T), la),
                    Contains("log_alpha") && Contains("token 5"));
  CHECK_THROWS_AS(gdelta.step(dstate, Q.row(0), K.row(0), V.row(0), 0.5, 0.1),
                  std::invalid_argument);
  // Per channel (T x r): a gate out of range names token and channel; a width other than 1 or
  // r, and a step's vector of another length, are shape errors.
  RowMatrix<TestType> LA = RowMatrix<TestType>::Constant(T, dk, -0.1);
  LA(4, 2) = TestType(0.3);
  CHECK_THROWS_WITH(gdelta.prefill(dstate, Q, K, V, ColVector<TestType>::Ones(T), LA),
                    Contains("log_alpha") && Contains("token 4") && Contains("channel 2"));
  LA(4, 2) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_AS(gdelta.recurrent(dstate, Q, K, V, ColVector<TestType>::Ones(T), LA),
                  std::invalid_argument);
  CHECK_THROWS_WITH(gdelta.prefill(dstate, Q, K, V, ColVector<TestType>::Ones(T),
                                   RowMatrix<TestType>::Zero(T, 2)),
                    Contains("log_alpha") && Contains("6x2"));
  CHECK_THROWS_AS(gdelta.step(dstate, Q.row(0), K.row(0), V.row(0), 0.5,
                              ColVector<TestType>::Zero(3)),
                  ShapeError);
  ColVector<TestType> step_gates = ColVector<TestType>::Constant(dk, -0.1);
  step_gates(1) = TestType(0.5);
  CHECK_THROWS_WITH(gdelta.step(dstate, Q.row(0), K.row(0), V.row(0), 0.5, step_gates),
                    Contains("log_alpha") && Contains("channel 1"));
  CHECK(dstate.S().isZero());
  CHECK(dstate.tokens() == 0);

  // Shapes: K/V rows, output, state.
  const RuleAttention<EluPlusOne, Decay, TestType> decay(EluPlusOne{}, Decay(0.9));
  CHECK_THROWS_WITH(decay.parallel(Q, K.topRows(5), V.topRows(5), Mask::causal),
                    Contains("6x4") && Contains("5x4"));
  CHECK_THROWS_WITH(decay.parallel(Q, K, V.topRows(5), Mask::causal),
                    Contains("6x4") && Contains("5x3"));
  auto wrong = decay.make_state(dk, dv + 1);
  CHECK_THROWS_AS(decay.recurrent(wrong, Q, K, V), ShapeError);
  CHECK_THROWS_AS(decay.prefill(wrong, Q, K, V), ShapeError);
  RowMatrix<TestType> out_short(T - 1, dv);
  auto right = decay.make_state(dk, dv);
  CHECK_THROWS_AS(decay.prefill_into(right, Q, K, V, out_short), ShapeError);
  CHECK(right.tokens() == 0);
  // A state of the same rule with another gamma is refused (another rule's state is another
  // type and does not compile).
  auto other_gamma =
      RuleAttention<EluPlusOne, Decay, TestType>(EluPlusOne{}, Decay(0.5)).make_state(dk, dv);
  CHECK_THROWS_AS(decay.prefill(other_gamma, Q, K, V), StateMismatchError);
  CHECK_THROWS_AS(decay.step(other_gamma, Q.row(0), K.row(0), V.row(0)), StateMismatchError);
  CHECK(other_gamma.tokens() == 0);
  CHECK_THROWS_AS((RuleAttention<EluPlusOne, Decay, TestType>(EluPlusOne{}, Decay(0.9),
                                                               Options{{}, 0})),
                  std::invalid_argument);
}

TEMPLATE_TEST_CASE("Decay reads through the Normalization policy", "[decay][errors]", float,
                   double) {
  // Identity features: keys 1 then -1 with gamma = 0.5, query 1: denominators 1, then
  // 0.5 * 1 - 1 = -0.5 (rejected by strict, row 1), numerators 3, then 0.5 * 3 - 5 = -3.5.
  using M = Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic>;
  M Q(2, 1), K(2, 1), V(2, 1);
  Q << 1, 1;
  K << 1, -1;
  V << 3, 5;
  const RuleAttention<Identity, Decay, TestType> strict(Identity{}, Decay(0.5));
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(strict.parallel(Q, K, V, Mask::causal), Contains("row 1"));
  CHECK_THROWS_AS(strict.recurrent(Q, K, V), DenominatorError);
  const RuleAttention<Identity, Decay, TestType> clamped(
      Identity{}, Decay(0.5), Options{Normalization::clamped(0.25), 64});
  // -0.5 < eps: divided by eps. gamma enters as exp(log gamma), exact to a few u: each entry
  // is a sum of two products, so 8 u relative is ample.
  const double eps8 = 8 * linattn_test::unit_roundoff<TestType>();
  for (const auto& y : {clamped.parallel(Q, K, V, Mask::causal), clamped.recurrent(Q, K, V)}) {
    CHECK(y(0, 0) == 3);
    CHECK(double(y(1, 0)) == Approx(-3.5 / 0.25).epsilon(eps8));
  }
  // Step's strong guarantee: a rejected denominator leaves the state as it was.
  auto state = strict.make_state(1, 1);
  (void)strict.step(state, Q.row(0), K.row(0), V.row(0));
  CHECK_THROWS_AS(strict.step(state, Q.row(1), K.row(1), V.row(1)), DenominatorError);
  CHECK(state.S()(0, 0) == 3);
  CHECK(state.z()(0) == 1);
  CHECK(state.tokens() == 1);
}

TEST_CASE("T = 0 gives an empty result for every rule", "[shapes]") {
  const Eigen::MatrixXf Q(0, 4), K(0, 4), V(0, 3);
  const Eigen::VectorXf none(0);
  CHECK(RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.9))
            .parallel(Q, K, V, Mask::causal)
            .cols() == 3);
  CHECK(RuleAttention<EluPlusOne, Gated>()
            .parallel(Q, K, V, Eigen::MatrixXf(0, 1), Mask::causal)
            .rows() == 0);
  CHECK(RuleAttention<L2Normalize, Delta>().recurrent(Q, K, V, none).cols() == 3);
  CHECK(
      RuleAttention<L2Normalize, GatedDelta>().parallel(Q, K, V, none, none, Mask::causal).rows() ==
      0);
  const RuleAttention<L2Normalize, Delta> delta;
  auto state = delta.make_state(4, 3);
  CHECK(delta.prefill(state, Q, K, V, none).rows() == 0);
  CHECK(delta.recurrent(state, Q, K, V, none).cols() == 3);
  CHECK(state.tokens() == 0);
}

TEST_CASE("rule states in a vector do not share cache lines", "[state]") {
  // As AttentionState: each step writes the state object, and heads on different threads
  // must not share a line (or the adjacent-line pair x86 prefetches).
  const RuleAttention<EluPlusOne, Decay, float> attn(EluPlusOne{}, Decay(0.5f));
  const std::vector<decltype(attn.make_state(8, 8))> heads(3, attn.make_state(8, 8));
  for (const auto& h : heads) CHECK(reinterpret_cast<std::uintptr_t>(&h) % 128 == 0);
}

// ---- per-token inputs: any Eigen array, read in place where it holds Scalar -----------------

namespace {

// Every entry point of `attn` over Q, K, V (the second query head Q2 for the grouped calls)
// with the per-token inputs `in` (a tuple of T-token arrays) and, per decode token t, the
// inputs step_at(t) (a tuple). Returns every output and final state S in a fixed order.
// Within one call of this, paths that are documented to share arithmetic must give the same
// bits: parallel and prefill from an empty state (and their _into forms, and the grouped
// prefill's first head), recurrent with and without a state (and recurrent_into), step and
// step_into.
template <class Attn, class Inputs, class StepAt>
std::vector<RowMatrix<typename Attn::scalar_type>> every_entry_point(
    const Attn& attn, const RowMatrix<typename Attn::scalar_type>& Q,
    const RowMatrix<typename Attn::scalar_type>& Q2, const RowMatrix<typename Attn::scalar_type>& K,
    const RowMatrix<typename Attn::scalar_type>& V, const Inputs& in, const StepAt& step_at) {
  using Scalar = typename Attn::scalar_type;
  using Mat = RowMatrix<Scalar>;
  const Index T = Q.rows(), dk = Q.cols(), dv = V.cols();
  const auto rows = [](const Mat& M) {
    return ConstRowsView<Scalar>(M.data(), M.rows(), M.cols(), Eigen::OuterStride<>(M.cols()));
  };
  const auto out_rows = [](Mat& M) {
    return RowsView<Scalar>(M.data(), M.rows(), M.cols(), Eigen::OuterStride<>(M.cols()));
  };
  std::vector<Mat> results;

  // Stateless and carried chunked passes from an empty state: one path, the same bits.
  const Mat parallel =
      std::apply([&](const auto&... x) { return attn.parallel(Q, K, V, x..., Mask::causal); }, in);
  results.push_back(parallel);
  Mat out(T, dv);
  std::apply([&](const auto&... x) { attn.parallel_into(Q, K, V, x..., Mask::causal, out); }, in);
  CHECK(out == parallel);
  auto prefilled = attn.make_state(dk, dv);
  CHECK(std::apply([&](const auto&... x) { return attn.prefill(prefilled, Q, K, V, x...); }, in) ==
        parallel);
  results.push_back(prefilled.S());
  auto prefilled_into = attn.make_state(dk, dv);
  std::apply([&](const auto&... x) { attn.prefill_into(prefilled_into, Q, K, V, x..., out); }, in);
  CHECK(out == parallel);
  CHECK(prefilled_into.S() == prefilled.S());

  // Token by token.
  const Mat recurrent =
      std::apply([&](const auto&... x) { return attn.recurrent(Q, K, V, x...); }, in);
  results.push_back(recurrent);
  auto carried = attn.make_state(dk, dv);
  CHECK(std::apply([&](const auto&... x) { return attn.recurrent(carried, Q, K, V, x...); }, in) ==
        recurrent);
  results.push_back(carried.S());
  auto carried_into = attn.make_state(dk, dv);
  std::apply([&](const auto&... x) { attn.recurrent_into(carried_into, Q, K, V, x..., out); }, in);
  CHECK(out == recurrent);
  CHECK(carried_into.S() == carried.S());

  // Grouped: two query heads over the same K, V (head 0 has the single-head bits).
  Mat out0(T, dv), out1(T, dv);
  const std::vector<ConstRowsView<Scalar>> heads{rows(Q), rows(Q2)};
  const std::vector<RowsView<Scalar>> outs{out_rows(out0), out_rows(out1)};
  std::apply([&](const auto&... x) { attn.parallel_into(heads, K, V, x..., Mask::causal, outs); },
             in);
  CHECK(out0 == parallel);
  results.push_back(out1);
  auto grouped = attn.make_state(dk, dv);
  std::apply([&](const auto&... x) { attn.prefill_into(grouped, heads, K, V, x..., outs); }, in);
  CHECK(out0 == parallel);
  results.push_back(out1);
  CHECK(grouped.S() == prefilled.S());

  // Decode, one token at a time: step, step_into and the grouped step.
  auto stepped = attn.make_state(dk, dv), stepped_into = attn.make_state(dk, dv),
       stepped_group = attn.make_state(dk, dv);
  Mat y(T, dv), y_into(T, dv), y_group(T, dv), y_group2(T, dv);
  for (Index t = 0; t < T; ++t) {
    const auto step_in = step_at(t);
    y.row(t) = std::apply(
        [&](const auto&... x) { return attn.step(stepped, Q.row(t), K.row(t), V.row(t), x...); },
        step_in);
    std::apply(
        [&](const auto&... x) {
          attn.step_into(stepped_into, Q.row(t), K.row(t), V.row(t), x..., y_into.row(t));
        },
        step_in);
    const std::vector<ConstRowsView<Scalar>> queries{
        ConstRowsView<Scalar>(Q.row(t).data(), 1, dk, Eigen::OuterStride<>(dk)),
        ConstRowsView<Scalar>(Q2.row(t).data(), 1, dk, Eigen::OuterStride<>(dk))};
    const std::vector<RowsView<Scalar>> ys{
        RowsView<Scalar>(y_group.row(t).data(), 1, dv, Eigen::OuterStride<>(dv)),
        RowsView<Scalar>(y_group2.row(t).data(), 1, dv, Eigen::OuterStride<>(dv))};
    std::apply(
        [&](const auto&... x) {
          attn.step_into(stepped_group, queries, K.row(t), V.row(t), x..., ys);
        },
        step_in);
  }
  CHECK(y_into == y);
  CHECK(stepped_into.S() == stepped.S());
  results.push_back(y);
  results.push_back(stepped.S());
  results.push_back(y_group);
  results.push_back(y_group2);
  results.push_back(stepped_group.S());
  CHECK(stepped.tokens() == T);
  CHECK(stepped_group.tokens() == T);
  return results;
}

// The same bits in every result of two runs.
template <class Scalar>
void check_same_results(const std::vector<RowMatrix<Scalar>>& actual,
                        const std::vector<RowMatrix<Scalar>>& expected) {
  REQUIRE(actual.size() == expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    CAPTURE(i);
    CHECK(actual[i] == expected[i]);
  }
}

template <class Scalar>
using OtherScalar = std::conditional_t<std::is_same_v<Scalar, float>, double, float>;

}  // namespace

TEMPLATE_TEST_CASE("every rule and entry point takes its per-token inputs in any layout",
                   "[inputs]", float, double) {
  // The rule's per-token inputs as (a) a Scalar column vector (read in place), (b) an array of
  // the other scalar type (copied once per call), (c) a strided Map: a column of a T x 3
  // row-major matrix (read in place), and for per-channel gates a column-major T x r matrix.
  // The values are floats, so the other type holds them exactly and every form must give the
  // same bits through every entry point.
  using Scalar = TestType;
  using Other = OtherScalar<Scalar>;
  using Mat = RowMatrix<Scalar>;
  using Strided = Eigen::Map<const ColVector<Scalar>, Eigen::Unaligned, Eigen::InnerStride<>>;
  const Index T = 23, dk = 6, dv = 5, r = dk;  // chunks of 8: two whole, one short
  const auto Q = random_matrix<Scalar>(T, dk, 2001), Q2 = random_matrix<Scalar>(T, dk, 2002);
  const auto K = random_matrix<Scalar>(T, dk, 2003), V = random_matrix<Scalar>(T, dv, 2004);
  // Columns: beta in [0, 1), a log-gate in [-0.5, 0), log_alpha in [-0.25, 0) (scaled by
  // powers of two: exact in float).
  RowMatrix<float> base = linattn_test::uniform_matrix<float>(T, 3, 2005, 0.0, 1.0);
  base.col(1) *= -0.5f;
  base.col(2) *= -0.25f;
  const Mat wide = base.cast<Scalar>();  // T x 3 row-major: its columns are strided
  const ColVector<Scalar> beta = wide.col(0), gate = wide.col(1), alpha = wide.col(2);
  const ColVector<Other> beta_o = base.col(0).cast<Other>(), gate_o = base.col(1).cast<Other>(),
                         alpha_o = base.col(2).cast<Other>();
  const Strided beta_s(wide.data(), T, Eigen::InnerStride<>(3)),
      gate_s(wide.data() + 1, T, Eigen::InnerStride<>(3)),
      alpha_s(wide.data() + 2, T, Eigen::InnerStride<>(3));
  const Options options{Normalization{}, 8};
  const Options raw{Normalization::unnormalized(), 8};

  SECTION("Gated, one gate per token") {
    const RuleAttention<EluPlusOne, Gated, Scalar> attn(EluPlusOne{}, options);
    const auto a = every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(gate),
                                     [&](Index t) { return std::make_tuple(gate(t)); });
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(gate_o),
                                         [&](Index t) { return std::make_tuple(gate_o(t)); }),
                       a);
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(gate_s),
                                         [&](Index t) { return std::make_tuple(gate_s(t)); }),
                       a);
  }
  SECTION("Gated, one gate per channel") {
    const RuleAttention<EluPlusOne, Gated, Scalar> attn(EluPlusOne{}, options);
    RowMatrix<float> base_r = linattn_test::uniform_matrix<float>(T, r, 2006, 0.0, 1.0);
    base_r *= -0.5f;
    const Mat G = base_r.cast<Scalar>();                                    // in place
    const RowMatrix<Other> G_o = base_r.cast<Other>();                      // copied
    const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> G_col = G;  // strided rows
    Mat padded = Mat::Zero(T, r + 3);
    padded.middleCols(1, r) = G;
    const Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>> G_s(
        padded.data() + 1, T, r, Eigen::OuterStride<>(r + 3));  // strided
    const auto a = every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(G),
                                     [&](Index t) { return std::make_tuple(G.row(t)); });
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(G_o),
                                         [&](Index t) { return std::make_tuple(G_o.row(t)); }),
                       a);
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(G_col),
                                         [&](Index t) { return std::make_tuple(G_col.row(t)); }),
                       a);
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(G_s),
                                         [&](Index t) { return std::make_tuple(G_s.row(t)); }),
                       a);
    // A step's per-channel gates may also be a column.
    check_same_results(
        every_entry_point(
            attn, Q, Q2, K, V, std::forward_as_tuple(G),
            [&](Index t) { return std::make_tuple(ColVector<Scalar>(G.row(t).transpose())); }),
        a);
  }
  SECTION("Delta") {
    const RuleAttention<L2Normalize, Delta, Scalar> attn(L2Normalize{}, Delta{}, raw);
    const auto a = every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta),
                                     [&](Index t) { return std::make_tuple(beta(t)); });
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_o),
                                         [&](Index t) { return std::make_tuple(beta_o(t)); }),
                       a);
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_s),
                                         [&](Index t) { return std::make_tuple(beta_s(t)); }),
                       a);
    // beta is a length-T vector: a row (1 x T, here a strided row of a column-major matrix)
    // is the same input.
    const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> beta_rows = wide.transpose();
    check_same_results(every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_rows.row(0)),
                                         [&](Index t) { return std::make_tuple(beta_rows(0, t)); }),
                       a);
  }
  SECTION("GatedDelta") {
    const RuleAttention<L2Normalize, GatedDelta, Scalar> attn(L2Normalize{}, GatedDelta{}, raw);
    const auto a = every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta, alpha),
                                     [&](Index t) { return std::make_tuple(beta(t), alpha(t)); });
    check_same_results(
        every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_o, alpha_o),
                          [&](Index t) { return std::make_tuple(beta_o(t), alpha_o(t)); }),
        a);
    check_same_results(
        every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_s, alpha_s),
                          [&](Index t) { return std::make_tuple(beta_s(t), alpha_s(t)); }),
        a);
    // Mixed: one input in place, the other copied.
    check_same_results(
        every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_s, alpha_o),
                          [&](Index t) { return std::make_tuple(beta_s(t), alpha_o(t)); }),
        a);
  }
  SECTION("GatedDelta, log_alpha per channel") {
    const RuleAttention<L2Normalize, GatedDelta, Scalar> attn(L2Normalize{}, GatedDelta{}, raw);
    RowMatrix<float> base_r = linattn_test::uniform_matrix<float>(T, r, 2007, 0.0, 1.0);
    base_r *= -0.25f;
    const Mat A = base_r.cast<Scalar>();                                    // in place
    const RowMatrix<Other> A_o = base_r.cast<Other>();                      // copied
    const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> A_col = A;  // strided rows
    Mat padded = Mat::Zero(T, r + 3);
    padded.middleCols(2, r) = A;
    const Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>> A_s(
        padded.data() + 2, T, r, Eigen::OuterStride<>(r + 3));  // strided
    const auto a = every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta, A),
                                     [&](Index t) { return std::make_tuple(beta(t), A.row(t)); });
    check_same_results(
        every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_o, A_o),
                          [&](Index t) { return std::make_tuple(beta_o(t), A_o.row(t)); }),
        a);
    check_same_results(
        every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta_s, A_col),
                          [&](Index t) { return std::make_tuple(beta_s(t), A_col.row(t)); }),
        a);
    check_same_results(
        every_entry_point(attn, Q, Q2, K, V, std::forward_as_tuple(beta, A_s),
                          [&](Index t) {
                            return std::make_tuple(beta(t),
                                                   ColVector<Scalar>(A_s.row(t).transpose()));
                          }),
        a);
  }
  SECTION("Decay and Additive (no per-token input)") {
    const RuleAttention<EluPlusOne, Decay, Scalar> decay(EluPlusOne{}, Decay(0.9), options);
    static_cast<void>(every_entry_point(decay, Q, Q2, K, V, std::tuple<>{},
                                        [](Index) { return std::tuple<>{}; }));
    const RuleAttention<EluPlusOne, Additive, Scalar> additive(EluPlusOne{}, options);
    static_cast<void>(every_entry_point(additive, Q, Q2, K, V, std::tuple<>{},
                                        [](Index) { return std::tuple<>{}; }));
  }
}

TEMPLATE_TEST_CASE("per-token inputs holding Scalar are bound in place, others copied once",
                   "[inputs]", float, double) {
  // What the layouts above rely on, seen directly: the bound arrays point into the caller's
  // memory with its strides when the input holds Scalar with direct access, else into the
  // call's own copy.
  using Scalar = TestType;
  using Other = OtherScalar<Scalar>;
  using Mat = RowMatrix<Scalar>;
  const Index T = 7, r = 4;
  const Mat wide = linattn_test::uniform_matrix<Scalar>(T, 3, 2101, 0.0, 1.0);
  const ColVector<Scalar> beta = wide.col(0);
  {
    detail::TokenInputs<Scalar> in;
    detail::bind_token_inputs<Scalar>(Delta{}, std::forward_as_tuple(beta), T, r, in);
    CHECK(in.beta.data == beta.data());
    CHECK(in.copies[0].size() == 0);
  }
  {
    const Eigen::Map<const ColVector<Scalar>, Eigen::Unaligned, Eigen::InnerStride<>> column(
        wide.data() + 1, T, Eigen::InnerStride<>(3));
    detail::TokenInputs<Scalar> in;
    detail::bind_token_inputs<Scalar>(Delta{}, std::forward_as_tuple(column), T, r, in);
    CHECK(in.beta.data == wide.data() + 1);
    CHECK(in.beta.row_stride == 3);
    for (Index t = 0; t < T; ++t) CHECK(in.beta(t) == wide(t, 1));
    CHECK(in.copies[0].size() == 0);
  }
  {
    const ColVector<Other> other = beta.template cast<Other>();
    detail::TokenInputs<Scalar> in;
    detail::bind_token_inputs<Scalar>(Delta{}, std::forward_as_tuple(other), T, r, in);
    CHECK(in.beta.data == in.copies[0].data());
    for (Index t = 0; t < T; ++t) CHECK(in.beta(t) == static_cast<Scalar>(other(t)));
  }
  {
    // An expression without storage is evaluated into the copy.
    detail::TokenInputs<Scalar> in;
    detail::bind_token_inputs<Scalar>(Delta{}, std::forward_as_tuple(beta * Scalar(0.5)), T, r, in);
    CHECK(in.beta.data == in.copies[0].data());
    for (Index t = 0; t < T; ++t) CHECK(in.beta(t) == beta(t) * Scalar(0.5));
  }
  {
    // Per-channel gates: the kernels read each token's r gates as one contiguous row, so
    // row-major gates are bound in place and column-major ones copied once into rows.
    const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> G =
        -linattn_test::uniform_matrix<Scalar>(T, r, 2102, 0.0, 1.0);
    detail::TokenInputs<Scalar> in;
    detail::bind_token_inputs<Scalar>(Gated{}, std::forward_as_tuple(G), T, r, in);
    CHECK(in.log_gate.data == in.copies[0].data());
    CHECK(in.log_gate.cols == r);
    CHECK(in.log_gate.col_stride == 1);
    for (Index t = 0; t < T; ++t)
      for (Index c = 0; c < r; ++c) CHECK(in.log_gate(t, c) == G(t, c));
    const RowMatrix<Scalar> rows = G;
    detail::TokenInputs<Scalar> in_rows;
    detail::bind_token_inputs<Scalar>(Gated{}, std::forward_as_tuple(rows), T, r, in_rows);
    CHECK(in_rows.log_gate.data == rows.data());
    CHECK(in_rows.copies[0].size() == 0);
  }
  {
    // GatedDelta: each of its two inputs bound on its own (one in place, one copied).
    const ColVector<Other> log_alpha = (-beta).template cast<Other>();
    detail::TokenInputs<Scalar> in;
    detail::bind_token_inputs<Scalar>(GatedDelta{}, std::forward_as_tuple(beta, log_alpha), T, r,
                                      in);
    CHECK(in.beta.data == beta.data());
    CHECK(in.log_alpha.data == in.copies[1].data());
  }
}

TEST_CASE("one log-gate per token may be a column or a row", "[gated][inputs]") {
  const auto X = linattn_test::random_matrix<float>(6, 3, 77);
  const RowMatrix<float> col = RowMatrix<float>::Constant(6, 1, -0.3f);
  const RowMatrix<float> row = col.transpose();
  const RuleAttention<EluPlusOne, Gated> gated;
  CHECK(gated.parallel(X, X, X, col, Mask::causal) == gated.parallel(X, X, X, row, Mask::causal));
  CHECK_THROWS_AS(gated.parallel(X, X, X, RowMatrix<float>::Constant(2, 3, -0.3f), Mask::causal), ShapeError);
}

}  // namespace write_rules_test
