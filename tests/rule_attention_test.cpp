// RuleAttention: every write rule's chunked parallel path, recurrent path and decode steps
// against independent double-precision references written from the formulas; carried state;
// reductions to Additive; beta = 0; the delta rule's exact overwrite; every error path.

#include <linattn/attention.hpp>
#include <linattn/rule_attention.hpp>

#include <Eigen/QR>
#include <catch2/catch.hpp>

#include "rule_reference.hpp"
#include "test_support.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace linattn;
using linattn_test::naive_delta;
using linattn_test::naive_gated;
using linattn_test::random_matrix;
using linattn_test::random_qkv;
using linattn_test::worst_ratio;
using PhiKind = linattn_test::Phi;

namespace {

struct Shape {
  Index T, dk, dv;
};
const std::vector<Shape> shapes{{1, 4, 4}, {7, 3, 5}, {64, 16, 16}, {150, 8, 3}, {257, 16, 8}};
const std::vector<Index> chunks{1, 5, 16, 64, 4096};

// Log-gates uniform in [lo, 0], T x cols, fixed seed.
template <class Scalar>
RowMatrix<Scalar> log_gates(Index T, Index cols, std::uint64_t seed, double lo) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> uni(lo, 0.0);
  RowMatrix<Scalar> g(T, cols);
  for (Index i = 0; i < g.size(); ++i) g.data()[i] = static_cast<Scalar>(uni(gen));
  return g;
}

// Betas uniform in [0, 1], fixed seed.
template <class Scalar>
ColVector<Scalar> betas(Index T, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  ColVector<Scalar> b(T);
  for (Index i = 0; i < T; ++i) b(i) = static_cast<Scalar>(uni(gen));
  return b;
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
        CHECK(worst_ratio<TestType>(attn.parallel(Q, K, V), ref) <= 1);
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
        CHECK(worst_ratio<TestType>(attn.parallel(Q, K, V, G), ref) <= 1);
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
  const auto [Q, K, V] = random_qkv<TestType>(T, dk, dv, 21);
  for (Index cols : {Index(1), dk}) {
    const auto G = log_gates<TestType>(T, cols, 24, -60);
    const std::vector<Index> sizes{16, 64, 200};
    const auto refs = naive_gated(Q, K, V, G, PhiKind::elu_plus_one, true, sizes);
    for (std::size_t c = 0; c < sizes.size(); ++c) {
      const Index chunk = sizes[c];
      CAPTURE(cols, chunk);
      const auto& ref = refs[c];
      const RuleAttention<EluPlusOne, Gated, TestType> attn(EluPlusOne{}, Gated{}, opts(chunk));
      const auto y = attn.parallel(Q, K, V, G);
      CHECK(y.allFinite());
      CHECK(worst_ratio<TestType>(y, ref) <= 1);
      CHECK(worst_ratio<TestType>(attn.recurrent(Q, K, V, G), ref) <= 1);
    }
  }
}

TEMPLATE_TEST_CASE("Gated with signed features and the unnormalized read", "[gated][agree]",
                   float, double) {
  const Index T = 130, dk = 8, dv = 5;
  const auto [Q, K, V] = random_qkv<TestType>(T, dk, dv, 31);
  const auto G = log_gates<TestType>(T, dk, 34, -1.0);
  const RuleAttention<Identity, Gated, TestType> attn(Identity{}, Gated{}, raw(32));
  const auto ref = naive_gated(Q, K, V, G, PhiKind::identity, false, 32);
  CHECK(worst_ratio<TestType>(attn.parallel(Q, K, V, G), ref) <= 1);
  CHECK(worst_ratio<TestType>(attn.recurrent(Q, K, V, G), ref) <= 1);
}

TEMPLATE_TEST_CASE("Delta and GatedDelta: WY chunks, recurrent and step agree with the recurrence",
                   "[delta][agree]", float, double) {
  for (const Shape& s : shapes) {
    CAPTURE(s.T, s.dk, s.dv);
    const auto Q = random_matrix<TestType>(s.T, s.dk, 41 + s.T);
    const auto K = random_matrix<TestType>(s.T, s.dk, 42 + s.T);
    const auto V = random_matrix<TestType>(s.T, s.dv, 43 + s.T);
    const auto beta = betas<TestType>(s.T, 44 + s.T);
    const ColVector<TestType> la = log_gates<TestType>(s.T, 1, 45 + s.T, -0.3);
    const ColVector<TestType> none;
    for (Index chunk : chunks) {
      CAPTURE(chunk);
      const auto ref = naive_delta(Q, K, V, beta, none, PhiKind::l2_normalize, chunk);
      const auto gref = naive_delta(Q, K, V, beta, la, PhiKind::l2_normalize, chunk);
      const RuleAttention<L2Normalize, Delta, TestType> delta(L2Normalize{}, Delta{}, raw(chunk));
      const RuleAttention<L2Normalize, GatedDelta, TestType> gdelta(L2Normalize{}, GatedDelta{},
                                                                    raw(chunk));
      CHECK(worst_ratio<TestType>(delta.parallel(Q, K, V, beta), ref) <= 1);
      CHECK(worst_ratio<TestType>(gdelta.parallel(Q, K, V, beta, la), gref) <= 1);
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

TEMPLATE_TEST_CASE("a sequence in pieces equals one call for every rule: prefill then decode",
                   "[state]", float, double) {
  const Index T = 203, dk = 16, dv = 8, chunk = 32;
  const auto [Q, K, V] = random_qkv<TestType>(T, dk, dv, 51);
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
          return rec ? attn.recurrent(q, k, v, st) : attn.parallel(q, k, v, st);
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
          return rec ? attn.recurrent(q, k, v, st, g) : attn.parallel(q, k, v, st, g);
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
          return rec ? attn.recurrent(q, k, v, st, b) : attn.parallel(q, k, v, st, b);
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
          return rec ? attn.recurrent(q, k, v, st, b, a) : attn.parallel(q, k, v, st, b, a);
        },
        [&](auto& st, Index t) {
          return attn.step(st, Q.row(t), K.row(t), V.row(t), beta(t), la(t));
        });
    CHECK(worst_ratio<TestType>(y, ref) <= 1);
  }
}

TEMPLATE_TEST_CASE("gamma = 1 and log-gates = 0 reduce to Additive, which is LinearAttention",
                   "[reduce]", float, double) {
  const Index T = 150, dk = 8, dv = 6;
  const auto [Q, K, V] = random_qkv<TestType>(T, dk, dv, 61);
  for (Index chunk : {Index(1), Index(7), Index(64)}) {
    CAPTURE(chunk);
    const LinearAttention<EluPlusOne, TestType> core(EluPlusOne{}, opts(chunk));
    const RuleAttention<EluPlusOne, Additive, TestType> additive(EluPlusOne{}, Additive{},
                                                                 opts(chunk));
    // Delegation: the same arithmetic, identical bits, and the same state type.
    CHECK(additive.parallel(Q, K, V) == core.parallel(Q, K, V, Mask::causal));
    CHECK(additive.recurrent(Q, K, V) == core.recurrent(Q, K, V));
    auto state = additive.make_state(dk, dv);
    (void)additive.parallel(Q, K, V, state);
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
    CHECK(worst_ratio<TestType>(decay.parallel(Q, K, V), ref) <= 1);
    CHECK(worst_ratio<TestType>(decay.recurrent(Q, K, V), ref) <= 1);
    const RuleAttention<EluPlusOne, Gated, TestType> gated(EluPlusOne{}, Gated{}, opts(chunk));
    const RowMatrix<TestType> G0 = RowMatrix<TestType>::Zero(T, dk);
    CHECK(worst_ratio<TestType>(gated.parallel(Q, K, V, G0), ref) <= 1);
    CHECK(worst_ratio<TestType>(gated.parallel(Q, K, V, G0.leftCols(1)), ref) <= 1);
    CHECK(worst_ratio<TestType>(gated.recurrent(Q, K, V, G0), ref) <= 1);
  }
}

TEMPLATE_TEST_CASE("beta = 0 leaves the delta state unchanged", "[delta][beta0]", float,
                   double) {
  const Index T = 40, dk = 8, dv = 5;
  const auto [Q, K, V] = random_qkv<TestType>(T, dk, dv, 71);
  const auto beta = betas<TestType>(T, 74);
  const ColVector<TestType> zero = ColVector<TestType>::Zero(T);
  const ColVector<TestType> no_decay = ColVector<TestType>::Zero(T);
  const RuleAttention<L2Normalize, Delta, TestType> delta(L2Normalize{}, Delta{}, raw(16));
  const RuleAttention<L2Normalize, GatedDelta, TestType> gdelta(L2Normalize{}, GatedDelta{},
                                                                raw(16));
  for (bool recurrent : {false, true}) {
    CAPTURE(recurrent);
    auto state = delta.make_state(dk, dv);
    (void)delta.parallel(Q, K, V, state, beta);  // some non-trivial state
    const RowMatrix<TestType> S0 = state.S();
    const auto y = recurrent ? delta.recurrent(Q, K, V, state, zero)
                             : delta.parallel(Q, K, V, state, zero);
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
    (void)gdelta.parallel(Q, K, V, gstate, beta, no_decay);
    const RowMatrix<TestType> G0 = gstate.S();
    (void)(recurrent ? gdelta.recurrent(Q, K, V, gstate, zero, no_decay)
                     : gdelta.parallel(Q, K, V, gstate, zero, no_decay));
    CHECK(gstate.S() == G0);
  }
  auto state = delta.make_state(dk, dv);
  (void)delta.parallel(Q, K, V, state, beta);
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
    (void)delta.parallel(K, K, V, state, beta);
    // Read: y = S^T k_i for every key (beta = 0 so reading does not write).
    const RowMatrix<TestType> y =
        delta.parallel(K.topRows(d), K.topRows(d), RowMatrix<TestType>::Zero(d, dv), state,
                       ColVector<TestType>::Zero(d));
    const auto ref = naive_delta(K, K, V, beta, ColVector<TestType>(), PhiKind::identity, chunk);
    const double u = linattn_test::unit_roundoff<TestType>();
    const double allowed = u * ref.allowed_units.maxCoeff();
    CHECK((y.template cast<double>() - newest.template cast<double>()).cwiseAbs().maxCoeff() <=
          allowed);

    const RuleAttention<Identity, Additive, TestType> additive(
        Identity{}, Additive{}, Options{Normalization::unnormalized(), chunk});
    auto astate = additive.make_state(d, dv);
    (void)additive.parallel(K, K, V, astate);
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
  const auto [Q, K, V] = random_qkv<TestType>(T, dk, dv, 91);
  const RuleAttention<L2Normalize, Delta, TestType> delta;
  auto state = delta.make_state(dk, dv);
  (void)delta.parallel(Q, K, V, state, ColVector<TestType>::Constant(T, 0.5));
  const RowMatrix<TestType> S0 = state.S();

  ColVector<TestType> beta = ColVector<TestType>::Constant(T, 0.5);
  beta(3) = TestType(1.5);
  CHECK_THROWS_WITH(delta.parallel(Q, K, V, state, beta), Contains("beta") && Contains("token 3"));
  beta(3) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_AS(delta.recurrent(Q, K, V, state, beta), std::invalid_argument);
  beta(3) = TestType(-0.1);
  CHECK_THROWS_AS(delta.recurrent(Q, K, V, state, beta), std::invalid_argument);
  CHECK_THROWS_AS(delta.step(state, Q.row(0), K.row(0), V.row(0), 2.0), std::invalid_argument);
  CHECK_THROWS_AS(delta.parallel(Q, K, V, state, ColVector<TestType>::Zero(T - 1)), ShapeError);
  CHECK(state.S() == S0);  // nothing was written
  CHECK(state.tokens() == T);

  const RuleAttention<EluPlusOne, Gated, TestType> gated;
  auto gstate = gated.make_state(dk, dv);
  RowMatrix<TestType> G = RowMatrix<TestType>::Constant(T, dk, -0.1);
  G(2, 1) = TestType(0.01);
  CHECK_THROWS_WITH(gated.parallel(Q, K, V, gstate, G),
                    Contains("log-gate") && Contains("token 2") && Contains("channel 1"));
  G(2, 1) = -std::numeric_limits<TestType>::infinity();
  CHECK_THROWS_AS(gated.recurrent(Q, K, V, gstate, G), std::invalid_argument);
  G(2, 1) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_AS(gated.parallel(Q, K, V, gstate, G), std::invalid_argument);
  CHECK_THROWS_WITH(gated.parallel(Q, K, V, gstate, RowMatrix<TestType>::Zero(T, 2)),
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
  CHECK_THROWS_WITH(gdelta.parallel(Q, K, V, dstate, ColVector<TestType>::Ones(T), la),
                    Contains("log_alpha") && Contains("token 5"));
  CHECK_THROWS_AS(gdelta.step(dstate, Q.row(0), K.row(0), V.row(0), 0.5, 0.1),
                  std::invalid_argument);
  CHECK(dstate.S().isZero());

  // Shapes: K/V rows, output, state.
  const RuleAttention<EluPlusOne, Decay, TestType> decay(EluPlusOne{}, Decay(0.9));
  CHECK_THROWS_WITH(decay.parallel(Q, K.topRows(5), V), Contains("6x4") && Contains("5x4"));
  auto wrong = decay.make_state(dk, dv + 1);
  CHECK_THROWS_AS(decay.recurrent(Q, K, V, wrong), ShapeError);
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
  CHECK_THROWS_WITH(strict.parallel(Q, K, V), Contains("row 1"));
  CHECK_THROWS_AS(strict.recurrent(Q, K, V), DenominatorError);
  const RuleAttention<Identity, Decay, TestType> clamped(
      Identity{}, Decay(0.5), Options{Normalization::clamped(0.25), 64});
  // -0.5 < eps: divided by eps. gamma enters as exp(log gamma), exact to a few u: each entry
  // is a sum of two products, so 8 u relative is ample.
  const double eps8 = 8 * linattn_test::unit_roundoff<TestType>();
  for (const auto& y : {clamped.parallel(Q, K, V), clamped.recurrent(Q, K, V)}) {
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
  CHECK(RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.9)).parallel(Q, K, V).cols() == 3);
  CHECK(RuleAttention<EluPlusOne, Gated>().parallel(Q, K, V, Eigen::MatrixXf(0, 1)).rows() == 0);
  CHECK(RuleAttention<L2Normalize, Delta>().recurrent(Q, K, V, none).cols() == 3);
  CHECK(RuleAttention<L2Normalize, GatedDelta>().parallel(Q, K, V, none, none).rows() == 0);
}

TEST_CASE("rule states in a vector do not share cache lines", "[state]") {
  // As AttentionState: each step writes the state object, and heads on different threads
  // must not share a line (or the adjacent-line pair x86 prefetches).
  const RuleAttention<EluPlusOne, Decay, float> attn(EluPlusOne{}, Decay(0.5f));
  const std::vector<decltype(attn.make_state(8, 8))> heads(3, attn.make_state(8, 8));
  for (const auto& h : heads) CHECK(reinterpret_cast<std::uintptr_t>(&h) % 128 == 0);
}
