// state.hpp: AttentionState's value (S with its pending decode tokens, z, the token count, the
// log-scale of random features), its identity, its size, and ReadScratch.

#include <linattn/attention.hpp>
#include <linattn/random_features.hpp>
#include <linattn/state.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cstdint>
#include <limits>
#include <vector>

namespace state_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("a state holds r dv + r scalars, as the article counts", "[state]") {
  const LinearAttention<EluPlusOne> attn;
  const auto state = attn.make_state(128, 128);
  CHECK(state.scalar_count() == 128 * 128 + 128);  // 16,512
  CHECK(state.feature_dim() == 128);
  CHECK(state.key_dim() == 128);
  CHECK(state.value_dim() == 128);
  CHECK(state.tokens() == 0);
  CHECK(state.S().isZero(0));
  CHECK(state.z().isZero(0));
  CHECK(state.log_scale() == 0);
  CHECK_FALSE(state.log_domain());
  // Random features: r = m features of dk-dimensional keys; the empty state's M is -infinity.
  const LinearAttention<PositiveRandomFeatures<double>, double> favor(PositiveRandomFeatures<double>(8, 32, 1));
  const auto fs = favor.make_state(8, 4);
  CHECK(fs.scalar_count() == 32 * 4 + 32);
  CHECK(fs.log_domain());
  CHECK(fs.log_scale() == -std::numeric_limits<double>::infinity());
  CHECK(fs.decode_block() == 0);  // log-scaled states fold every token
}

TEST_CASE("S() includes the pending decode tokens; settle() changes no value", "[state]") {
  Options o;
  o.decode_block = 4;
  const LinearAttention<EluPlusOne, double> attn(EluPlusOne{}, o);
  auto state = attn.make_state(3, 2);
  const auto q = linattn_test::random_matrix<double>(6, 3, 5), v = linattn_test::random_matrix<double>(6, 2, 6);
  for (Index t = 0; t < 6; ++t) static_cast<void>(attn.step(state, q.row(t), q.row(t), v.row(t)));
  // The block of tokens 0-3 folded when token 4 arrived; 4 and 5 are pending.
  CHECK(state.decode_block() == 4);
  CHECK(state.pending_tokens() == 2);
  CHECK(state.pending_key_features().rows() == 2);
  CHECK(state.pending_values().rows() == 2);
  // S = sum_t phi(k_t) v_t^T in double: 6 terms, so within (6 + 4) u of the magnitudes.
  Eigen::MatrixXd S = Eigen::MatrixXd::Zero(3, 2), mag = S;
  for (Index t = 0; t < 6; ++t)
    for (Index i = 0; i < 3; ++i)
      for (Index j = 0; j < 2; ++j) {
        const double w = linattn_test::elu_plus_one(q(t, i)) * v(t, j);
        S(i, j) += w;
        mag(i, j) += std::abs(w);
      }
  const auto got = state.S();
  for (Index i = 0; i < 3; ++i)
    for (Index j = 0; j < 2; ++j) CHECK(std::abs(got(i, j) - S(i, j)) <= 10 * linattn_test::unit_roundoff<double>() * mag(i, j));
  CHECK(state.stored_S() != got);  // the stored part lacks the pending tokens
  state.settle();
  CHECK(state.pending_tokens() == 0);
  CHECK((state.stored_S() - got).cwiseAbs().maxCoeff() <= 10 * linattn_test::unit_roundoff<double>() * mag.maxCoeff());
  state.reset();
  CHECK(state.tokens() == 0);
  CHECK(state.S().isZero(0));
  CHECK(state.decode_block() == 4);  // reset keeps the block
}

TEST_CASE("a state records the identity of the attention that made it", "[state]") {
  const LinearAttention<EluPlusOne> elu;
  const auto s = elu.make_state(2, 2);
  CHECK(std::string(s.identity().map_name) == "elu_plus_one");
  CHECK(std::string(s.identity().rule_name) == "additive");
  CHECK(s.identity() == elu.state_identity());
  const LinearAttention<PositiveRandomFeatures<float>> a(PositiveRandomFeatures<float>(2, 4, 1)),
      b(PositiveRandomFeatures<float>(2, 4, 2));
  CHECK(a.make_state(2, 2).identity().map_fingerprint != 0);
  CHECK_FALSE(a.make_state(2, 2).identity() == b.make_state(2, 2).identity());
  const LinearAttention<PositiveRandomFeatures<float>> same_dims(PositiveRandomFeatures<float>(2, 2, 1));
  CHECK_THROWS_AS(s.check_like(same_dims.make_state(2, 2)), StateMismatchError);
  CHECK_THROWS_AS(s.check_like(elu.make_state(2, 3)), ShapeError);
}

TEST_CASE("states in a vector do not share cache lines, and a ReadScratch fits its state", "[state]") {
  const LinearAttention<EluPlusOne> attn;
  std::vector<AttentionState<float>> states;
  for (int i = 0; i < 3; ++i) states.push_back(attn.make_state(4, 4));
  for (const auto& s : states) CHECK(reinterpret_cast<std::uintptr_t>(&s) % kStateAlignment == 0);
  // Readers of one state, each with its own scratch.
  Options o;
  o.decode_block = 8;
  const LinearAttention<EluPlusOne> blocked(EluPlusOne{}, o);
  auto state = blocked.make_state(4, 3);
  const RowVector<float> k = RowVector<float>::Ones(4), v = RowVector<float>::Ones(3);
  for (int t = 0; t < 5; ++t) blocked.absorb(state, k, v);
  ReadScratch<float> scratch(state);
  RowVector<float> y(3);
  blocked.read_into(state, k, y, scratch);
  CHECK(y.isApprox(v));  // every value is 1: the weighted average is 1
  ReadScratch<float> small(attn.make_state(4, 3));  // room for no pending token
  CHECK_THROWS_AS(blocked.read_into(state, k, y, small), ShapeError);
}

TEST_CASE("assign() sets a carried or learned state, checked", "[state]") {
  const LinearAttention<EluPlusOne, double> attn;
  auto state = attn.make_state(2, 3);
  RowMatrix<double> S(2, 3);
  S << 1, 2, 3, 4, 5, 6;
  ColVector<double> z(2);
  z << 2, 3;
  state.assign(S, z, 5);
  CHECK(state.S() == S);
  CHECK(state.z() == z);
  CHECK(state.tokens() == 5);
  // The next step continues from it: y = (phi(q)^T S + phi(q)^T phi(k) v) / phi(q)^T (z + phi(k)).
  const RowVector<double> q = RowVector<double>::Zero(2), v = RowVector<double>::Ones(3);
  const RowVector<double> y = attn.step(state, q, q, v);  // phi(0) = (1, 1)
  CHECK(y(0) == (1 + 4 + 2.0 * 1) / (2 + 3 + 2.0));
  CHECK_THROWS_AS(state.assign(S.leftCols(2), z), ShapeError);
  CHECK_THROWS_AS(state.assign(S, z, -1), ShapeError);
  S(0, 0) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(state.assign(S, z), std::invalid_argument);
  CHECK(state.tokens() == 6);  // unchanged by the refusals
}

TEST_CASE("assign() refuses a non-finite value wherever it is, and one beyond the state's type",
          "[state]") {
  // 5 x 7 = 35 entries: a vectorized check covers them in packets and a scalar tail, so every
  // position is tried, each with NaN, +Inf and -Inf, in S and in z.
  const LinearAttention<EluPlusOne, float> attn;
  auto state = attn.make_state(5, 7);
  const RowMatrix<float> S = RowMatrix<float>::Constant(5, 7, -2.5f);
  const ColVector<float> z = ColVector<float>::Constant(5, 1.5f);
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  auto refuses = [&](const RowMatrix<float>& S_in, const ColVector<float>& z_in) {
    try {
      state.assign(S_in, z_in);
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  int refused = 0;
  for (const float x : bad) {
    for (Index i = 0; i < S.size(); ++i) {
      RowMatrix<float> T = S;
      T.data()[i] = x;
      refused += static_cast<int>(refuses(T, z));
    }
    for (Index i = 0; i < z.size(); ++i) {
      ColVector<float> w = z;
      w(i) = x;
      refused += static_cast<int>(refuses(S, w));
    }
  }
  CHECK(refused == 3 * (35 + 5));
  CHECK(state.S().isZero());  // nothing was taken from a refused call
  // A double beyond float's largest (3.4e38) would become Inf in a float state: refused, while
  // the largest float itself is taken as it is.
  RowMatrix<double> wide = RowMatrix<double>::Zero(5, 7);
  wide(4, 6) = 1e39;
  CHECK_THROWS_AS(state.assign(wide, z), std::invalid_argument);
  wide(4, 6) = std::numeric_limits<float>::max();
  state.assign(wide, z);
  CHECK(state.S()(4, 6) == std::numeric_limits<float>::max());
}

}  // namespace state_test
