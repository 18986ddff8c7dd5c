// The saved forward (linattn/saved_forward.hpp): the saving forward against the plain forward
// (bit for bit), the backward from it against the recomputing backward (bit for bit where the
// arithmetic is the same; exact-arithmetic inputs where the forward runs on Eigen's product),
// central differences for the log-scaled maps whose forward sums in another order, segments,
// errors and the memory figures.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/random_features.hpp>
#include <linattn/saved_forward.hpp>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "test_support.hpp"

namespace saved_forward_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::MatrixXdR;
using linattn_test::random_matrix;
using linattn_test::unit_roundoff;

namespace {

template <class Attn>
using scalar_of = typename Attn::scalar_type;

template <class Scalar>
Options chunked(Index chunk, Normalization norm = Normalization{}) {
  Options o;
  o.normalization = norm;
  o.chunk_size = chunk;
  return o;
}

// Inputs a map reads well (positive scores, so strict denominators are positive): N(0, 1) for
// ELU + 1, |N(0, 1)| + 0.1 for Identity, N(0, 0.25^2) for the random maps.
template <class Scalar>
RowMatrix<Scalar> inputs_for(bool positive_shift, Index rows, Index d, std::uint64_t seed,
                             double sigma) {
  RowMatrix<Scalar> X = random_matrix<Scalar>(rows, d, seed, sigma);
  if (positive_shift) X = (X.array().abs() + Scalar(0.1)).matrix();
  return X;
}

// The saving forward's outputs and final state equal the plain forward's bit for bit, and the
// backward from it equals the recomputing backward from the same initial state bit for bit.
// `prefix` tokens are absorbed first, through step() with a decode block (pending tokens) when
// `pending`, so the forwards continue a state that has to settle.
template <class Attn>
void check_bitwise(const Attn& attn, Index T, Index d, Index dv, Index prefix, bool pending,
                   bool positive_shift, double sigma, bool final_gradient) {
  using Scalar = scalar_of<Attn>;
  CAPTURE(T, d, dv, prefix, pending, final_gradient, attn.chunk_size(attn.feature_dim(d), dv));
  const RowMatrix<Scalar> Q = inputs_for<Scalar>(positive_shift, T, d, 11, sigma);
  const RowMatrix<Scalar> K = inputs_for<Scalar>(positive_shift, T, d, 12, sigma);
  const RowMatrix<Scalar> V = random_matrix<Scalar>(T, dv, 13);
  const RowMatrix<Scalar> dY = random_matrix<Scalar>(T, dv, 14);
  auto start = attn.make_state(d, dv);
  const RowMatrix<Scalar> Pq = inputs_for<Scalar>(positive_shift, prefix, d, 15, sigma);
  const RowMatrix<Scalar> Pk = inputs_for<Scalar>(positive_shift, prefix, d, 16, sigma);
  const RowMatrix<Scalar> Pv = random_matrix<Scalar>(prefix, dv, 17);
  for (Index t = 0; t < prefix; ++t)
    static_cast<void>(attn.step(start, Pq.row(t), Pk.row(t), Pv.row(t)));
  if (pending) CHECK((prefix == 0 || start.pending_tokens() > 0));

  auto plain_state = start;
  auto saving_state = start;
  RowMatrix<Scalar> plain(T, dv), saving(T, dv);
  attn.prefill_into(plain_state, Q, K, V, plain);
  SavedForward<Scalar> saved;
  prefill_saving_into(attn, saving_state, Q, K, V, saving, saved);
  CHECK(saving == plain);
  CHECK(saving_state.S() == plain_state.S());
  CHECK(saving_state.z() == plain_state.z());
  CHECK(saving_state.tokens() == plain_state.tokens());
  CHECK(saving_state.log_scale() == plain_state.log_scale());
  CHECK(saved.tokens() == T);

  const Index r = attn.feature_dim(d);
  StateGradient<Scalar> fin{random_matrix<Scalar>(r, dv, 18), random_matrix<Scalar>(r, 1, 19)};
  const StateGradient<Scalar>* f = final_gradient ? &fin : nullptr;
  // The recomputing backward starts from the initial state as the forward read it (settled).
  auto settled = start;
  settled.settle();
  const auto expected = prefill_backward(attn, settled, Q, K, V, dY, f);
  const auto actual = prefill_backward(attn, saved, Q, K, V, dY, f);
  CHECK(actual.Q == expected.Q);
  CHECK(actual.K == expected.K);
  CHECK(actual.V == expected.V);
  CHECK(actual.initial.S == expected.initial.S);
  CHECK(actual.initial.z == expected.initial.z);
}

}  // namespace

TEMPLATE_TEST_CASE(
    "the saving forward is the forward, and its backward the recomputing one, "
    "bit for bit on the register kernel",
    "[saved_forward]", float, double) {
  using Scalar = TestType;
  // dv a multiple of every packet width (16 floats with AVX-512): both forwards and the
  // backward's state rebuild run on the register kernel, with the same sums in the same order.
  for (Index chunk : {1, 3, 8, 32})
    for (Index T : {0, 1, 7, 32, 45, 100}) {
      const LinearAttention<EluPlusOne, Scalar> elu(EluPlusOne{}, chunked<Scalar>(chunk));
      check_bitwise(elu, T, 8, 16, 0, false, false, 1.0, false);
      const LinearAttention<Identity, Scalar> id(
          Identity{}, chunked<Scalar>(chunk, Normalization::clamped(0.5)));
      check_bitwise(id, T, 8, 32, 0, false, true, 1.0, true);
    }
  // Continuing a state with pending decode tokens, and the automatic chunk at d = 64.
  Options decode;
  decode.decode_block = 4;
  decode.chunk_size = 16;
  const LinearAttention<EluPlusOne, Scalar> with_block(EluPlusOne{}, decode);
  check_bitwise(with_block, 50, 8, 16, 6, true, false, 1.0, true);
  // The automatic chunk at d = 64 (32) and at d = 128, where the forward's chunk may be 16 and
  // the backward's is 32: every other forward state is saved, and the recomputing backward
  // rebuilds the states at 32-row boundaries with the forward's bits.
  const LinearAttention<EluPlusOne, Scalar> automatic;
  check_bitwise(automatic, 200, 64, 64, 3, false, false, 1.0, true);
  check_bitwise(automatic, 100, 128, 128, 0, false, false, 1.0, true);
  const LinearAttention<EluPlusOne, Scalar> unnormalized(
      EluPlusOne{}, chunked<Scalar>(5, Normalization::unnormalized()));
  check_bitwise(unnormalized, 23, 8, 16, 2, false, false, 1.0, true);
}

TEMPLATE_TEST_CASE("the Eigen-product forward: exact inputs give the recomputing backward's bits",
                   "[saved_forward]", float, double) {
  using Scalar = TestType;
  // dv = 3 and 5 are not multiples of the packet width: the forward then runs
  // causal_chunked_eigen, which sums S and z in Eigen's order, not the backward's. With small
  // integers under Identity (Q, K in {1, 2, 3}, V in {-3, ..., 3}) every score, state entry and
  // sum is an integer below 2^24, exact in float and double in any order, so the saved states
  // equal the rebuilt ones and the backward from them must give the recomputing backward's bits
  // (the quotient rule's divisions then see the same operands). A wrong chunk's state, or a
  // state from before or after the wrong token, changes the gradients.
  const auto integers = [](Index rows, Index cols, std::uint64_t seed, int lo, int hi) {
    RowMatrix<Scalar> X = linattn_test::uniform_matrix<Scalar>(rows, cols, seed, lo, hi + 1);
    return RowMatrix<Scalar>(X.array().floor().matrix());
  };
  for (Index chunk : {1, 4, 16})
    for (Index dv : {3, 5})
      for (const Normalization& norm : {Normalization::strict(), Normalization::unnormalized()}) {
        const Index T = 37, d = 4;
        CAPTURE(chunk, dv, norm.divides());
        const LinearAttention<Identity, Scalar> attn(Identity{}, chunked<Scalar>(chunk, norm));
        const RowMatrix<Scalar> Q = integers(T, d, 21, 1, 3), K = integers(T, d, 22, 1, 3),
                                V = integers(T, dv, 23, -3, 3), dY = integers(T, dv, 24, -3, 3);
        RowMatrix<Scalar> plain(T, dv), saving(T, dv);
        attn.parallel_into(Q, K, V, Mask::causal, plain);
        SavedForward<Scalar> saved;
        parallel_saving_into(attn, Q, K, V, Mask::causal, saving, saved);
        CHECK(saving == plain);
        const auto expected = parallel_backward(attn, Q, K, V, Mask::causal, dY);
        const auto actual = parallel_backward(attn, saved, Q, K, V, Mask::causal, dY);
        CHECK(actual.Q == expected.Q);
        CHECK(actual.K == expected.K);
        CHECK(actual.V == expected.V);
        CHECK(actual.initial.S == expected.initial.S);
        CHECK(actual.initial.z == expected.initial.z);
      }
}

namespace {

// Central differences of L = sum(G .* Y) (plus, with a final gradient, sum(dS_T .* S_T) +
// dz_T . z_T of the stored final state) in double, through the saving forward itself, against
// the backward from its saved states, for every entry of Q, K and V. The derivation is
// tests/gradients_test.cpp's check_entries: with h = 2^k near u^(1/3) max(|x|, s),
//   |L'(x) - D(h)| <= |D(2h) - D(h)| + 3 eps_L / h,
// the measured truncation plus the rounding of two evaluations of L, eps_L = units u L_mag with
// L_mag = sum |G| (max |v|) + the final state's term (y is a weighted mean of the values under
// strict normalization, so every term of y's sums is below max |v| in magnitude) and units the
// length of the longest chain of roundings, 2 (2 T + 2 r + 2 dv + d + 16), plus the random
// map's exponents: 3 (d + 2) (2 P + X2) with P = sqrt(tau) max |w_i| max |x|, X2 = tau max
// |x|^2 (tests/gradients_test.cpp's rounding_units).
template <class Phi>
void check_saved_differences(const Phi& phi, Index T, Index d, Index dv, Index chunk, double sigma,
                             bool final_gradient, Index prefix) {
  const LinearAttention<Phi, double> attn(phi, chunked<double>(chunk));
  const Index r = attn.feature_dim(d);
  CAPTURE(T, d, dv, r, chunk, final_gradient, prefix);
  const MatrixXdR Q0 = random_matrix<double>(T, d, 31, sigma);
  const MatrixXdR K0 = random_matrix<double>(T, d, 32, sigma);
  const MatrixXdR V0 = random_matrix<double>(T, dv, 33);
  const MatrixXdR G = random_matrix<double>(T, dv, 34);
  const MatrixXdR dS = random_matrix<double>(r, dv, 35);
  const MatrixXdR dz = random_matrix<double>(r, 1, 36);
  auto start = attn.make_state(d, dv);
  if (prefix > 0)
    static_cast<void>(attn.prefill(start, random_matrix<double>(prefix, d, 37, sigma),
                                   random_matrix<double>(prefix, d, 38, sigma),
                                   random_matrix<double>(prefix, dv, 39)));
  // The final-state term is taken on the true sums exp(M_T) S, scaled by exp(-M_ref) at the
  // base point, as a next segment's loss would see them (the backward's convention).
  double M_ref = 0;
  const auto loss = [&](const MatrixXdR& Q, const MatrixXdR& K, const MatrixXdR& V,
                        bool set_reference) {
    auto state = start;
    MatrixXdR Y(T, dv);
    SavedForward<double> s;
    prefill_saving_into(attn, state, Q, K, V, Y, s);
    double L = G.cwiseProduct(Y).sum();
    if (final_gradient) {
      if (set_reference) M_ref = state.log_scale();
      const double scale = std::exp(state.log_scale() - M_ref);
      L += scale * (dS.cwiseProduct(state.S()).sum() + dz.col(0).dot(state.z()));
    }
    return L;
  };
  const double L0 = loss(Q0, K0, V0, true);
  static_cast<void>(L0);
  auto state = start;
  MatrixXdR Y(T, dv);
  SavedForward<double> saved;
  prefill_saving_into(attn, state, Q0, K0, V0, Y, saved);
  const StateGradient<double> fin{dS, dz.col(0)};
  const auto g = prefill_backward(attn, saved, Q0, K0, V0, G, final_gradient ? &fin : nullptr);

  double P = 0, X2 = 0;
  if constexpr (requires { phi.projection(); }) {
    const double norm = std::max(Q0.rowwise().norm().maxCoeff(), K0.rowwise().norm().maxCoeff());
    P = std::sqrt(phi.scale()) * phi.projection().rowwise().norm().maxCoeff() * norm;
    X2 = phi.scale() * norm * norm;
  }
  const double units = 2.0 * static_cast<double>(2 * (T + prefix) + 2 * r + 2 * dv + d + 16) +
                       3.0 * static_cast<double>(d + 2) * (2 * P + X2);
  double L_mag = G.cwiseAbs().sum() * V0.cwiseAbs().maxCoeff();
  if (final_gradient)
    L_mag += dS.cwiseAbs().cwiseProduct(state.S().cwiseAbs()).sum() +
             dz.cwiseAbs().col(0).dot(state.z().cwiseAbs());
  const double eps_L = units * unit_roundoff<double>() * L_mag;

  const auto check = [&](const char* what, const MatrixXdR& X, const RowMatrix<double>& analytic,
                         int which) {
    const double u = unit_roundoff<double>();
    const double s = std::max(std::sqrt(X.squaredNorm() / std::max<double>(1, X.size())), 1e-3);
    for (Index i = 0; i < X.rows(); ++i)
      for (Index c = 0; c < X.cols(); ++c) {
        const double h =
            std::exp2(std::round(std::log2(std::cbrt(u) * std::max(std::abs(X(i, c)), s))));
        const auto D = [&](double step) {
          MatrixXdR Xp = X, Xm = X;
          Xp(i, c) += step;
          Xm(i, c) -= step;
          const auto at = [&](const MatrixXdR& Xe) {
            return which == 0   ? loss(Xe, K0, V0, false)
                   : which == 1 ? loss(Q0, Xe, V0, false)
                                : loss(Q0, K0, Xe, false);
          };
          return (at(Xp) - at(Xm)) / (2 * step);
        };
        const double d1 = D(h), d2 = D(2 * h);
        const double tolerance = std::abs(d2 - d1) + 3 * eps_L / h;
        CAPTURE(what, i, c, analytic(i, c), d1, d2, tolerance);
        CHECK(std::abs(analytic(i, c) - d1) <= tolerance);
      }
  };
  check("Q", Q0, g.Q, 0);
  check("K", K0, g.K, 1);
  check("V", V0, g.V, 2);
}

}  // namespace

TEST_CASE(
    "the backward from a saved forward matches central differences, random features "
    "included",
    "[saved_forward][finite-differences]") {
  // The log-scaled maps' forward sums its states with Eigen's product in its own order, so
  // the saved states differ from the rebuilt ones in rounding: differentiate the saving forward
  // itself. ELU + 1 as a control; chunks of 3 with T = 7 cross two boundaries.
  for (bool final_gradient : {false, true}) {
    check_saved_differences(EluPlusOne{}, 7, 3, 2, 3, 1.0, final_gradient, 0);
    check_saved_differences(PositiveRandomFeatures<double>(3, 4, 5), 7, 3, 2, 3, 0.5,
                            final_gradient, 0);
    check_saved_differences(TrigRandomFeatures<double>(3, 4, 7), 7, 3, 2, 3, 0.25, final_gradient,
                            0);
    // A carried state: the saved first state is the prefix's.
    check_saved_differences(PositiveRandomFeatures<double>(3, 4, 5), 7, 3, 2, 3, 0.5,
                            final_gradient, 4);
  }
  check_saved_differences(EluPlusOne{}, 1, 3, 2, 3, 1.0, true, 2);
}

TEST_CASE(
    "segments: saved forwards chained through the state gradient give the whole "
    "sequence's bits",
    "[saved_forward][segments]") {
  // Segments of whole chunks (16 and 32 rows with C = 8) split the whole sequence's chunks
  // exactly, so each segment's saved states are the whole forward's and the chained backward
  // (each segment's `initial` as the previous one's final gradient) gives the same bits.
  const LinearAttention<EluPlusOne, float> attn(EluPlusOne{}, chunked<float>(8));
  const Index d = 8, dv = 16, T1 = 16, T2 = 32, T = T1 + T2;
  const RowMatrix<float> Q = random_matrix<float>(T, d, 41), K = random_matrix<float>(T, d, 42),
                         V = random_matrix<float>(T, dv, 43), dY = random_matrix<float>(T, dv, 44);
  RowMatrix<float> Y(T, dv);
  SavedForward<float> whole;
  parallel_saving_into(attn, Q, K, V, Mask::causal, Y, whole);
  const auto g = parallel_backward(attn, whole, Q, K, V, Mask::causal, dY);

  auto state = attn.make_state(d, dv);
  RowMatrix<float> Y1(T1, dv), Y2(T2, dv);
  SavedForward<float> s1, s2;
  prefill_saving_into(attn, state, Q.topRows(T1), K.topRows(T1), V.topRows(T1), Y1, s1);
  prefill_saving_into(attn, state, Q.bottomRows(T2), K.bottomRows(T2), V.bottomRows(T2), Y2, s2);
  CHECK(Y1 == Y.topRows(T1));
  CHECK(Y2 == Y.bottomRows(T2));
  const auto g2 = prefill_backward(attn, s2, Q.bottomRows(T2), K.bottomRows(T2), V.bottomRows(T2),
                                   dY.bottomRows(T2));
  const auto g1 = prefill_backward(attn, s1, Q.topRows(T1), K.topRows(T1), V.topRows(T1),
                                   dY.topRows(T1), &g2.initial);
  CHECK(g1.Q == g.Q.topRows(T1));
  CHECK(g2.Q == g.Q.bottomRows(T2));
  CHECK(g1.K == g.K.topRows(T1));
  CHECK(g2.K == g.K.bottomRows(T2));
  CHECK(g1.V == g.V.topRows(T1));
  CHECK(g2.V == g.V.bottomRows(T2));
  CHECK(g1.initial.S == g.initial.S);
  CHECK(g1.initial.z == g.initial.z);

  // Segments that split chunks (23 and 25 rows): each equals the recomputing backward of that
  // segment from its initial state, bit for bit (check_bitwise's argument).
  auto s_a = attn.make_state(d, dv);
  auto before_b = s_a;
  RowMatrix<float> Ya(23, dv), Yb(25, dv);
  SavedForward<float> sa, sb;
  prefill_saving_into(attn, before_b, Q.topRows(23), K.topRows(23), V.topRows(23), Ya, sa);
  auto after_b = before_b;
  prefill_saving_into(attn, after_b, Q.bottomRows(25), K.bottomRows(25), V.bottomRows(25), Yb, sb);
  const auto hb = prefill_backward(attn, sb, Q.bottomRows(25), K.bottomRows(25), V.bottomRows(25),
                                   dY.bottomRows(25));
  const auto rb = prefill_backward(attn, before_b, Q.bottomRows(25), K.bottomRows(25),
                                   V.bottomRows(25), dY.bottomRows(25));
  const auto ha = prefill_backward(attn, sa, Q.topRows(23), K.topRows(23), V.topRows(23),
                                   dY.topRows(23), &hb.initial);
  const auto ra = prefill_backward(attn, s_a, Q.topRows(23), K.topRows(23), V.topRows(23),
                                   dY.topRows(23), &rb.initial);
  CHECK(hb.Q == rb.Q);
  CHECK(hb.K == rb.K);
  CHECK(hb.V == rb.V);
  CHECK(ha.Q == ra.Q);
  CHECK(ha.K == ra.K);
  CHECK(ha.V == ra.V);
  CHECK(ha.initial.S == ra.initial.S);
}

TEST_CASE("a saved forward of other inputs or another attention is refused, naming the shapes",
          "[saved_forward][errors]") {
  const LinearAttention<EluPlusOne, float> attn(EluPlusOne{}, chunked<float>(4));
  const Index T = 10, d = 4, dv = 8;
  const RowMatrix<float> Q = random_matrix<float>(T, d, 51), K = random_matrix<float>(T, d, 52),
                         V = random_matrix<float>(T, dv, 53), dY = random_matrix<float>(T, dv, 54);
  RowMatrix<float> Y(T, dv);
  SavedForward<float> saved;
  // Never filled: holds 0 tokens.
  REQUIRE_THROWS_AS(parallel_backward(attn, saved, Q, K, V, Mask::causal, dY), ShapeError);
  parallel_saving_into(attn, Q, K, V, Mask::causal, Y, saved);
  CHECK(saved.tokens() == T);
  CHECK(saved.chunks() == 3);
  CHECK(saved.feature_dim() == d);
  CHECK(saved.key_dim() == d);
  CHECK(saved.value_dim() == dv);
  const auto message = [&](const auto& call) {
    try {
      call();
    } catch (const ShapeError& e) {
      return std::string(e.what());
    }
    return std::string("no ShapeError");
  };
  // Another length.
  const RowMatrix<float> Q9 = Q.topRows(9), K9 = K.topRows(9), V9 = V.topRows(9),
                         dY9 = dY.topRows(9);
  const std::string shorter = message(
      [&] { static_cast<void>(parallel_backward(attn, saved, Q9, K9, V9, Mask::causal, dY9)); });
  CAPTURE(shorter);
  CHECK(shorter.find("10 tokens") != std::string::npos);
  CHECK(shorter.find("9x4") != std::string::npos);
  // Another key or value dimension.
  const RowMatrix<float> Q6 = random_matrix<float>(T, 6, 55), K6 = random_matrix<float>(T, 6, 56);
  const std::string wider = message(
      [&] { static_cast<void>(parallel_backward(attn, saved, Q6, K6, V, Mask::causal, dY)); });
  CAPTURE(wider);
  CHECK(wider.find("key dim 4") != std::string::npos);
  CHECK(wider.find("10x6") != std::string::npos);
  const RowMatrix<float> V4 = V.leftCols(4), dY4 = dY.leftCols(4);
  CHECK_THROWS_AS(parallel_backward(attn, saved, Q, K, V4, Mask::causal, dY4), ShapeError);
  // Another attention (feature map): StateMismatchError.
  const LinearAttention<Identity, float> other(Identity{}, chunked<float>(4));
  CHECK_THROWS_AS(parallel_backward(other, saved, Q, K, V, Mask::causal, dY), StateMismatchError);
  // Mask::none: a saved forward is causal.
  CHECK_THROWS_AS(parallel_saving_into(attn, Q, K, V, Mask::none, Y, saved), std::invalid_argument);
  CHECK_THROWS_AS(parallel_backward(attn, saved, Q, K, V, Mask::none, dY), std::invalid_argument);
  // Bad forward shapes, and a final gradient of the wrong shape.
  RowMatrix<float> Y_short(T - 1, dv);
  CHECK_THROWS_AS(parallel_saving_into(attn, Q, K, V, Mask::causal, Y_short, saved), ShapeError);
  parallel_saving_into(attn, Q, K, V, Mask::causal, Y, saved);
  const StateGradient<float> bad{RowMatrix<float>::Zero(d, dv + 1), ColVector<float>::Zero(d)};
  CHECK_THROWS_AS(prefill_backward(attn, saved, Q, K, V, dY, &bad), ShapeError);
  // A forward that throws DenominatorError leaves the saved forward empty.
  const LinearAttention<Identity, float> strict(Identity{}, chunked<float>(4));
  RowMatrix<float> negative = -RowMatrix<float>::Ones(T, d);
  const RowMatrix<float> positive = RowMatrix<float>::Ones(T, d);
  SavedForward<float> failed;
  CHECK_THROWS_AS(parallel_saving_into(strict, negative, positive, V, Mask::causal, Y, failed),
                  DenominatorError);
  CHECK(failed.tokens() == 0);
}

TEST_CASE("the saved forward's memory", "[saved_forward][memory]") {
  for (Index chunk : {1, 5, 16, 32})
    for (Index T : {0, 1, 31, 100}) {
      CAPTURE(chunk, T);
      const LinearAttention<EluPlusOne, float> attn(EluPlusOne{}, chunked<float>(chunk));
      const RowMatrix<float> Q = random_matrix<float>(T, 8, 61), K = random_matrix<float>(T, 8, 62),
                             V = random_matrix<float>(T, 16, 63);
      RowMatrix<float> Y(T, 16);
      SavedForward<float> saved;
      parallel_saving_into(attn, Q, K, V, Mask::causal, Y, saved);
      CHECK(saved.bytes() == saved_forward_bytes(attn, T, 8, 16));
      CHECK(saved.chunks() == (T + chunk - 1) / chunk);
      const detail::BackwardScratch<float> w(std::min(T, chunk), chunk, 8, 16, false, false, false,
                                             false);
      CHECK(w.bytes() == saved_backward_bytes(attn, T, 8, 16));
    }
  // The figures of docs/gradients.md: T = 65,536, r = dv = 128, float, one head:
  // ceil(T / C) (r dv + r) scalars = 4,096 x 16,512 x 4 = 270,532,608 bytes (258 MiB) with
  // C = 16 and half that with C = 32, under 1 GiB either way. Chunks set explicitly (kAuto
  // depends on the machine's L1).
  const LinearAttention<EluPlusOne, float> c16(EluPlusOne{}, chunked<float>(16));
  const LinearAttention<EluPlusOne, float> c32(EluPlusOne{}, chunked<float>(32));
  CHECK(saved_forward_bytes(c16, 65536, 128, 128) == 270532608u);
  CHECK(saved_forward_bytes(c32, 65536, 128, 128) == 135266304u);
  CHECK(saved_forward_bytes(c16, 65536, 128, 128) < (std::size_t{1} << 30));
  // Log-scaled maps keep one more scalar per chunk (the log-scale M).
  const LinearAttention<PositiveRandomFeatures<float>, float> prf(
      PositiveRandomFeatures<float>(8, 16, 3), chunked<float>(4));
  CHECK(saved_forward_bytes(prf, 10, 8, 16) == 3 * (16 * 16 + 16 + 1) * sizeof(float));
}


TEST_CASE("a BackwardWorkspace kept across calls gives the bits of calls without it",
          "[gradients][workspace]") {
  // The workspace keeps the chunk scratch (zeroed again where a new one is zero) and grows the
  // per-token buffers; whatever ran before, a call must return exactly the bits it returns
  // without one. Lengths 9, 14, 9, 3, 9 in chunks of 4: a short last chunk, growth, a longer
  // per-token buffer reused, another chunk shape (T = 3 < 4: C = 3) and back. Before each call a
  // call whose query holds NaN leaves NaN in the buffers. Every path that keeps scratch: the
  // recomputing backward (stateless and carried), the saved forward's, for an ordinary map
  // and a log-scaled one (its per-token log-scales).
  const auto run = [](const auto& attn) {
    using Scalar = scalar_of<std::decay_t<decltype(attn)>>;
    constexpr Index dk = 8, dv = 16;
    BackwardWorkspace<Scalar> workspace;
    CHECK(workspace.bytes() == 0);
    linattn_test::WorkspaceGrowth growth(14);  // the longest of kWorkspaceLengths
    std::uint64_t seed = 700;
    for (const Index T : linattn_test::kWorkspaceLengths) {
      INFO("T = " << T);
      const RowMatrix<Scalar> Q = random_matrix<Scalar>(T, dk, seed),
                              K = random_matrix<Scalar>(T, dk, seed + 1),
                              V = random_matrix<Scalar>(T, dv, seed + 2),
                              dY = random_matrix<Scalar>(T, dv, seed + 3);
      seed += 10;
      RowMatrix<Scalar> dQ(T, dk), dK(T, dk), dV(T, dv), Y(T, dv);
      GradientsRef<Scalar> out{dQ, dK, dV};
      StateGradient<Scalar> initial;
      const auto poison = [&] {
        RowMatrix<Scalar> bad = Q;
        bad(T - 1, 0) = std::numeric_limits<Scalar>::quiet_NaN();
        try {
          parallel_backward_into(attn, bad, K, V, Mask::causal, dY, out, &initial, &workspace);
        } catch (const std::exception&) {  // a NaN denominator may throw: the buffers stay used
        }
      };
      poison();
      const auto stateless = parallel_backward(attn, Q, K, V, Mask::causal, dY);
      parallel_backward_into(attn, Q, K, V, Mask::causal, dY, out, &initial, &workspace);
      CHECK(dQ == stateless.Q);
      CHECK(dK == stateless.K);
      CHECK(dV == stateless.V);
      CHECK(initial.S == stateless.initial.S);
      CHECK(initial.z == stateless.initial.z);

      auto state = attn.make_state(dk, dv);
      static_cast<void>(attn.prefill(state, K, Q, V));
      const Index r = attn.feature_map().feature_dim(dk);
      const StateGradient<Scalar> final_gradient{random_matrix<Scalar>(r, dv, seed + 4),
                                                 random_matrix<Scalar>(r, 1, seed + 5).col(0)};
      poison();
      const auto carried = prefill_backward(attn, state, Q, K, V, dY, &final_gradient);
      prefill_backward_into(attn, state, Q, K, V, dY, &final_gradient, out, initial, &workspace);
      CHECK(dQ == carried.Q);
      CHECK(dK == carried.K);
      CHECK(dV == carried.V);
      CHECK(initial.S == carried.initial.S);
      CHECK(initial.z == carried.initial.z);

      SavedForward<Scalar> saved;
      parallel_saving_into(attn, Q, K, V, Mask::causal, Y, saved);
      poison();
      const auto from_saved = parallel_backward(attn, saved, Q, K, V, Mask::causal, dY);
      parallel_backward_into(attn, saved, Q, K, V, Mask::causal, dY, out, &initial, &workspace);
      CHECK(dQ == from_saved.Q);
      CHECK(dK == from_saved.K);
      CHECK(dV == from_saved.V);
      CHECK(initial.S == from_saved.initial.S);

      // Per-token buffers grow and never shrink: after the longest call, a shorter one of the
      // same chunk shape allocates nothing new.
      CHECK(growth.holds(T, workspace.bytes()));
    }
    workspace.release();
    CHECK(workspace.bytes() == 0);
  };
  SECTION("EluPlusOne, double") {
    run(LinearAttention<EluPlusOne, double>(EluPlusOne{}, chunked<double>(4)));
  }
  SECTION("EluPlusOne, float, strict") {
    run(LinearAttention<EluPlusOne, float>(EluPlusOne{},
                                           chunked<float>(4, Normalization::strict())));
  }
  SECTION("PositiveRandomFeatures (log-scaled), double") {
    run(LinearAttention<PositiveRandomFeatures<double>, double>(
        PositiveRandomFeatures<double>(8, 12, 3), chunked<double>(4)));
  }
}

}  // namespace saved_forward_test
