// The input contract of docs/input_contract.md, case by case: which input throws which
// exception, and that every path agrees on what it accepts. Each case here failed (inf, UB,
// a confusing exception or a silent wrong result) before the contract was written down.

#include <linattn/linattn.hpp>
#include <linattn/detail/log_domain.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace input_contract_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

namespace {

template <class E, class F>
void throws_naming(F&& f, const std::string& part) {
  try {
    f();
    FAIL("no exception; expected one mentioning: " << part);
  } catch (const E& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(part) != std::string::npos);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("a subnormal denominator gives a finite result on every path",
                   "[contract][denominator]", float, double) {
  // ELU+1 of a very negative input is exp(x): for x = -45 (float) or -357 (double) with one
  // feature, phi(q)^T z is about exp(-90) or exp(-714), below the smallest normal number. The
  // weights of the keys are equal, so the weighted average of all-ones values is 1: its
  // reciprocal overflows, and a path that multiplied by it returned inf.
  // The bound: each weight p = phi(q) phi(k) is rounded to the subnormal grid (spacing s, the
  // smallest subnormal; error <= s / 2), and sums of grid values are exact there. A row over k
  // keys forms its numerator from k such products and its denominator either the same way or
  // as phi(q) times the normal-range sum of k features (k u relative, plus s / 2); paths differ
  // in which (the chunked rules read z, others the scores), so the quotient is 1 to within
  // (k + 1) s / 2 / den + (k + 2) u, den = k p, u the unit roundoff (the sum, the division).
  using Scalar = TestType;
  const Scalar x = std::is_same_v<Scalar, float> ? Scalar(-45) : Scalar(-357);
  const double p = std::exp(2.0 * double(x)), s = double(std::numeric_limits<Scalar>::denorm_min()),
               u = linattn_test::unit_roundoff<Scalar>();
  // Rows i of y, each read over keys(i) keys, are all within the bound of 1.
  const auto near_one = [&](const RowMatrix<Scalar>& y, auto keys) {
    for (Index i = 0; i < y.rows(); ++i) {
      const double k = double(keys(i)), bound = (k + 1) * s / 2 / (k * p) + (k + 2) * u;
      for (Index j = 0; j < y.cols(); ++j)
        if (!(std::abs(double(y(i, j)) - 1.0) <= bound)) return false;
    }
    return true;
  };
  const auto causal = [](Index i) { return i + 1; };
  const auto all_keys = [](Index) { return Index{2}; };
  for (const Index dv : {Index{2}, Index{4}, Index{8}}) {
    CAPTURE(dv);
    const RowMatrix<Scalar> Q = RowMatrix<Scalar>::Constant(2, 1, x);
    const RowMatrix<Scalar> V = RowMatrix<Scalar>::Ones(2, dv);
    const LinearAttention<EluPlusOne, Scalar> attn;
    CHECK(near_one(attn.parallel(Q, Q, V, Mask::causal), causal));
    CHECK(near_one(attn.parallel(Q, Q, V, Mask::none), all_keys));
    CHECK(near_one(attn.recurrent(Q, Q, V), causal));
    auto state = attn.make_state(1, dv);
    CHECK(near_one(attn.step(state, Q.row(0), Q.row(0), V.row(0)), causal));
    CHECK(near_one(attn.step(state, Q.row(1), Q.row(1), V.row(1)), [](Index) { return Index{2}; }));
    const RuleAttention<EluPlusOne, Decay, Scalar> decay(EluPlusOne{}, Decay(1.0));
    CHECK(near_one(decay.parallel(Q, Q, V, Mask::causal), causal));
    CHECK(near_one(decay.recurrent(Q, Q, V), causal));
  }
}

TEMPLATE_TEST_CASE("the log-domain read divides, so a subnormal denominator stays finite",
                   "[contract][denominator]", float, double) {
  // The random-feature kernels read num exp(L) / (den exp(L)); with den subnormal the output is
  // num / den, finite, where num * (1 / den) overflowed.
  using Scalar = TestType;
  const Scalar den = std::numeric_limits<Scalar>::denorm_min() * 8;
  RowVector<Scalar> y(3);
  y << den * 2, -den * 3, den;
  detail::log_domain_read(Normalization::strict(), den, Scalar(5), 0).apply(y);
  CHECK(y(0) == Scalar(2));
  CHECK(y(1) == Scalar(-3));
  CHECK(y(2) == Scalar(1));
  // A clamped divisor outside the numbers' range is applied in double: eps exp(-L) with eps = 1
  // and L = -100 is exp(100) = 2.69e43, beyond float, while the quotient 1e20 / exp(100) =
  // 3.72e-24 is an ordinary float; dividing by the divisor rounded to float (inf) gave 0. One
  // rounding of the quotient and two of the exponential: a few ulps.
  RowVector<Scalar> w(1);
  w << Scalar(1e20);
  detail::log_domain_read(Normalization::clamped(1.0), Scalar(0), Scalar(-100), 0).apply(w);
  const double want = 1e20 / std::exp(100.0);
  CHECK(std::abs(static_cast<double>(w(0)) - want) <= 8 * linattn_test::unit_roundoff<Scalar>() * want);
}

TEST_CASE("dk = 0 and dv = 0 are shape errors on every path, before any arithmetic",
          "[contract][shapes]") {
  const RowMatrix<float> none(4, 0), V(4, 3), K(4, 2);
  const LinearAttention<EluPlusOne> elu;
  const LinearAttention<L2Normalize> l2(L2Normalize{}, Options{Normalization::unnormalized()});
  throws_naming<ShapeError>([&] { static_cast<void>(elu.parallel(none, none, V, Mask::causal)); }, "dk >= 1");
  throws_naming<ShapeError>([&] { static_cast<void>(elu.parallel(none, none, V, Mask::none)); }, "dk >= 1");
  throws_naming<ShapeError>([&] { static_cast<void>(l2.recurrent(none, none, V)); }, "dk >= 1");
  throws_naming<ShapeError>([&] { static_cast<void>(elu.parallel(K, K, none, Mask::causal)); }, "dv >= 1");
  throws_naming<ShapeError>([&] { static_cast<void>(elu.make_state(0, 3)); }, "dk >= 1");
  throws_naming<ShapeError>([&] { static_cast<void>(elu.make_state(3, 0)); }, "dv >= 1");
  const RuleAttention<L2Normalize, Delta> delta;
  const ColVector<float> beta = ColVector<float>::Constant(4, 0.5f);
  throws_naming<ShapeError>([&] { static_cast<void>(delta.parallel(K, K, none, beta, Mask::causal)); }, "dv >= 1");
  // A subclass of std::invalid_argument, not a DenominatorError.
  CHECK_THROWS_AS(elu.parallel(none, none, V, Mask::causal), std::invalid_argument);
}

TEST_CASE("no key at all: the weighted average is undefined, the unnormalized read is 0",
          "[contract][shapes]") {
  const RowMatrix<float> Q = RowMatrix<float>::Ones(3, 2), K(0, 2), V(0, 4);
  const LinearAttention<EluPlusOne> strict;
  CHECK_THROWS_AS(strict.parallel(Q, K, V, Mask::none), DenominatorError);
  const LinearAttention<EluPlusOne> raw(EluPlusOne{}, Options{Normalization::unnormalized()});
  CHECK(raw.parallel(Q, K, V, Mask::none).isZero(0));
  // No query either: nothing to read, nothing to reject.
  CHECK(strict.parallel(RowMatrix<float>(0, 2), K, V, Mask::none).size() == 0);
  // The multi-head layer over empty buffers: no pointer arithmetic on the null data.
  const MultiHeadAttention<LinearAttention<EluPlusOne>> layer({2, 1, 2, 4});
  const auto empty = [](Index H, Index d) { return TensorView<const float>(nullptr, {2, 0, H, d}, {0, 0, d, 1}); };
  layer.parallel_into(empty(2, 2), empty(1, 2), empty(1, 4), Mask::causal,
                      TensorView<float>(nullptr, {2, 0, 2, 4}, {0, 0, 4, 1}));
  auto state = layer.make_state(2);
  layer.prefill_into(state, empty(2, 2), empty(1, 2), empty(1, 4),
                     TensorView<float>(nullptr, {2, 0, 2, 4}, {0, 0, 4, 1}));
  CHECK(state.sequence(1).tokens() == 0);
}

TEST_CASE("sizes that do not fit an Index are shape errors, not overflows", "[contract][sizes]") {
  const Index huge = Index{1} << 40;
  throws_naming<ShapeError>([&] { static_cast<void>(state_footprint(huge, 1, huge, 1, huge)); }, "does not fit an Index");
  std::vector<float> one(1);
  throws_naming<ShapeError>([&] { static_cast<void>(TensorView<float>::batch_first(one.data(), 1, huge, huge, 16)); }, "does not fit an Index");
  const Index half = std::numeric_limits<Index>::max() / 2 + 1;  // two steps of it overflow
  throws_naming<ShapeError>([&] { static_cast<void>(TensorView<float>(one.data(), {3, 1, 1, 1}, {half, 1, 1, 1})); }, "does not fit an Index");
  const LinearAttention<Identity> ident;
  throws_naming<ShapeError>([&] { static_cast<void>(ident.make_state(huge, huge)); }, "does not fit an Index");
  Options big;
  big.decode_block = huge;
  CHECK_THROWS_AS(LinearAttention<EluPlusOne>(EluPlusOne{}, big), std::invalid_argument);
  big.decode_block = kAuto;
  big.chunk_size = huge;
  CHECK_THROWS_AS(LinearAttention<EluPlusOne>(EluPlusOne{}, big), std::invalid_argument);
}

TEST_CASE("a state at the largest token count refuses one more token instead of overflowing",
          "[contract][state]") {
  // Only a restored state can hold that many tokens: build its blob from a real one.
  const LinearAttention<EluPlusOne> attn;
  auto state = attn.make_state(2, 2);
  const RowVector<float> x = RowVector<float>::Ones(2);
  static_cast<void>(attn.step(state, x, x, x));
  auto blob = save_state(state);
  blob.resize(blob.size() - 8);
  const std::size_t tokens_at = 28 + 8 + 4 + 12 + 4 + 8 + 8 + 3 * 8;
  for (std::size_t i = 0; i < 8; ++i)
    blob[tokens_at + i] = static_cast<std::byte>((static_cast<std::uint64_t>(detail::kMaxTokens) >> (8 * i)) & 0xff);
  const std::uint64_t size = blob.size() + 8;
  for (std::size_t i = 0; i < 8; ++i) blob[16 + i] = static_cast<std::byte>((size >> (8 * i)) & 0xff);
  const std::uint64_t sum = detail::fnv1a64(blob);
  for (std::size_t i = 0; i < 8; ++i) blob.push_back(static_cast<std::byte>((sum >> (8 * i)) & 0xff));
  auto full = attn.make_state(2, 2);
  restore_state(full, blob);
  REQUIRE(full.tokens() == detail::kMaxTokens);
  throws_naming<ShapeError>([&] { static_cast<void>(attn.step(full, x, x, x)); }, "cannot take 1 more");
  const RowMatrix<float> X = RowMatrix<float>::Ones(3, 2);
  throws_naming<ShapeError>([&] { static_cast<void>(attn.prefill(full, X, X, X)); }, "cannot take 3 more");
  CHECK(full.tokens() == detail::kMaxTokens);
}

TEST_CASE("a state remembers the feature map and rule that made it", "[contract][state]") {
  const RowVector<float> x = RowVector<float>::Ones(4);
  const LinearAttention<EluPlusOne> elu;
  const LinearAttention<Identity> ident;
  auto elu_state = elu.make_state(4, 4);
  throws_naming<StateMismatchError>([&] { static_cast<void>(ident.step(elu_state, x, x, x)); }, "elu_plus_one");
  // The same map of another draw is another kernel.
  const LinearAttention<PositiveRandomFeatures<float>> one(PositiveRandomFeatures<float>(4, 8, 1));
  const LinearAttention<PositiveRandomFeatures<float>> two(PositiveRandomFeatures<float>(4, 8, 2));
  auto favor_state = one.make_state(4, 4);
  throws_naming<StateMismatchError>([&] { static_cast<void>(two.step(favor_state, x, x, x)); }, "fingerprint");
  // Another rule, or another gamma.
  const RuleAttention<EluPlusOne, Decay> d9(EluPlusOne{}, Decay(0.9)), d8(EluPlusOne{}, Decay(0.8));
  auto decay_state = d9.make_state(4, 4);
  throws_naming<StateMismatchError>([&] { static_cast<void>(d8.step(decay_state, x, x, x)); }, "decay");
  const RowMatrix<float> X = RowMatrix<float>::Ones(3, 4);
  throws_naming<StateMismatchError>([&] { static_cast<void>(d8.prefill(decay_state, X, X, X)); }, "decay");
  // The refusals changed nothing.
  CHECK(elu_state.tokens() == 0);
  CHECK(decay_state.tokens() == 0);
}

TEST_CASE("invalid per-token inputs are named and change nothing", "[contract][rules]") {
  const RowMatrix<float> X = linattn_test::random_matrix<float>(5, 3, 1);
  const RuleAttention<EluPlusOne, Gated> gated;
  auto state = gated.make_state(3, 3);
  RowMatrix<float> lg = RowMatrix<float>::Constant(5, 1, -0.5f);
  lg(3, 0) = 0.25f;  // a gate above 1
  throws_naming<std::invalid_argument>([&] { static_cast<void>(gated.prefill(state, X, X, X, lg)); }, "at token 3");
  lg(3, 0) = std::numeric_limits<float>::quiet_NaN();
  throws_naming<std::invalid_argument>([&] { static_cast<void>(gated.recurrent(state, X, X, X, lg)); }, "finite and <= 0");
  CHECK(state.tokens() == 0);
  const RuleAttention<L2Normalize, GatedDelta> gdelta;
  auto gstate = gdelta.make_state(3, 3);
  throws_naming<std::invalid_argument>([&] { static_cast<void>(gdelta.step(gstate, X.row(0), X.row(0), X.row(0), 2.5, -0.1)); }, "beta must lie in [0, 2]");
  throws_naming<std::invalid_argument>([&] { static_cast<void>(gdelta.step(gstate, X.row(0), X.row(0), X.row(0), 0.5, 0.1)); }, "log_alpha");
  CHECK(gstate.tokens() == 0);
}

}  // namespace input_contract_test
