// LinearAttention: the articles' exact examples, parallel vs recurrent vs an independent double
// loop, carried state, strided views, and every error path.

#include <linattn/attention.hpp>
#include <linattn/random_features.hpp>
#include <linattn/reference.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace attention_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::naive_attention;
using linattn_test::random_matrix;
using linattn_test::random_qkv;
using linattn_test::worst_error_ratio;

namespace {

// Rounding bound, in units of u, for a normalized read over T keys with r features:
// each weight phi(q)^T phi(k) carries gamma_r, the sum over T keys gamma_T (recursive sums;
// blocked GEMM sums are tighter), numerator and denominator each, plus the division and the
// feature map's own few ulps; gamma_n ~ n u. Hence 2 (r + T + 4) u times sum|w||v| / |den|.
double bound_units(Index r, Index T) { return 2.0 * static_cast<double>(r + T + 4); }

}  // namespace

TEST_CASE("two-token read of the first article is exactly 10/3", "[article]") {
  // Keys (1,0), (1,1), scalar values 2 and 4, query (1,1); features are the vectors themselves.
  Eigen::MatrixXf K(2, 2), V(2, 1), Q(2, 2);
  K << 1, 0, 1, 1;
  V << 2, 4;
  Q << 1, 1, 1, 1;
  const LinearAttention<Identity> attn;

  auto state = attn.make_state(2, 1);
  const auto y1 = attn.step(state, Q.row(0), K.row(0), V.row(0));
  CHECK(state.S()(0, 0) == 2.0f);  // S1 = (2, 0)^T
  CHECK(state.S()(1, 0) == 0.0f);
  CHECK(state.z()(0) == 1.0f);  // z1 = (1, 0)
  CHECK(state.z()(1) == 0.0f);
  CHECK(y1(0) == 2.0f);
  const auto y2 = attn.step(state, Q.row(1), K.row(1), V.row(1));
  CHECK(state.S()(0, 0) == 6.0f);  // S2 = (6, 4)^T
  CHECK(state.S()(1, 0) == 4.0f);
  CHECK(state.z()(0) == 2.0f);  // z2 = (2, 1)
  CHECK(state.z()(1) == 1.0f);
  CHECK(y2(0) == 10.0f / 3.0f);  // (6 + 4) / (2 + 1), numerator and denominator exact

  // Pairwise: weights (q.k1, q.k2) = (1, 2), (1*2 + 2*4) / 3.
  const auto full = attn.parallel(Q.row(1), K, V, Mask::none);
  CHECK(full(0, 0) == 10.0f / 3.0f);
  const auto causal = attn.parallel(Q, K, V, Mask::causal);
  CHECK(causal(0, 0) == 2.0f);
  CHECK(causal(1, 0) == 10.0f / 3.0f);
  CHECK(attn.recurrent(Q, K, V)(1, 0) == 10.0f / 3.0f);

  // Softmax on the same scores (1, 2) gives (e*2 + e^2*4) / (e + e^2), not 10/3.
  const auto soft = softmax_attention(Q.row(1), K, V, Mask::none, 1.0);
  const double e = std::exp(1.0);
  CHECK(soft(0, 0) == Approx((e * 2 + e * e * 4) / (e + e * e)).epsilon(1e-6));
  CHECK(std::abs(soft(0, 0) - 10.0f / 3.0f) > 0.1f);
}

TEMPLATE_TEST_CASE("three-token example of the second article", "[article]", float, double) {
  using M = Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic>;
  M Q(3, 2), V(3, 2);
  Q << 1, 0, 0, 1, 1, 0;  // queries and (transformed) keys are the same rows
  V << 2, 0, 0, 3, 1, 1;
  const M& K = Q;
  const LinearAttention<Identity, TestType> attn;

  // Causal: y0 = v0, y1 = v1, y2 = (v0 + v2) / 2 = [1.5, 0.5]; all exact in binary.
  RowMatrix<TestType> expected_causal(3, 2);
  expected_causal << 2, 0, 0, 3, 1.5, 0.5;
  auto state = attn.make_state(2, 2);
  CHECK(attn.recurrent(state, Q, K, V) == expected_causal);
  CHECK(attn.parallel(Q, K, V, Mask::causal) == expected_causal);
  RowMatrix<TestType> S3(2, 2);
  S3 << 3, 1, 0, 3;
  CHECK(state.S() == S3);
  CHECK(state.z() == ColVector<TestType>{{2}, {1}});
  CHECK(state.tokens() == 3);

  // Figure 2, every position reads the full state: [3,1]/2, [0,3]/1, [3,1]/2.
  RowMatrix<TestType> expected_full(3, 2);
  expected_full << 1.5, 0.5, 0, 3, 1.5, 0.5;
  CHECK(attn.parallel(Q, K, V, Mask::none) == expected_full);
  CHECK(quadratic_attention(Identity{}, Q, K, V, Mask::none) == expected_full);
  CHECK(quadratic_attention(Identity{}, Q, K, V, Mask::causal) == expected_causal);
}

TEST_CASE("state size follows the article: r*dv + r scalars", "[state]") {
  const LinearAttention<EluPlusOne> attn;
  CHECK(attn.make_state(128, 128).scalar_count() == 16512);
  CHECK(attn.make_state(64, 32).scalar_count() == 64 * 32 + 64);
}

TEST_CASE("the decode block defaults to 16 exactly when S outgrows an Intel core's L1 of 48 KiB or more",
          "[state]") {
  // kAuto (Options::decode_block): deferred steps (B = 16) only where S (r x dv) is larger than
  // the L1 data cache on an Intel core whose L1 holds at least 48 KiB (the cores where
  // deferring measured faster), fused steps (0) everywhere else. The rule is checked against
  // the machine that runs, at sizes on both sides of its boundary; the states made carry the B
  // the attention reports.
  const Index l1 = detail::cache_sizes().l1d;
  const bool defers = l1 >= 48 * 1024 && detail::cpu_vendor() == detail::CpuVendor::intel;
  const auto expected = [&](Index r, Index dv, Index bytes) -> Index {
    return defers && r * dv * bytes > l1 ? 16 : 0;
  };
  const LinearAttention<EluPlusOne, float> f;
  const LinearAttention<EluPlusOne, double> d;
  const Index fits_f = l1 / (64 * Index{sizeof(float)});  // dv at which 64 x dv floats fill L1
  const Index fits_d = l1 / (64 * Index{sizeof(double)});
  for (Index dv : {Index{1}, Index{64}, fits_f, fits_f + 1, 4 * fits_f}) {
    CAPTURE(dv, l1);
    CHECK(f.decode_block(64, dv) == expected(64, dv, sizeof(float)));
    CHECK(f.make_state(64, dv).decode_block() == f.decode_block(64, dv));
  }
  for (Index dv : {Index{1}, fits_d, fits_d + 1, 4 * fits_d}) {
    CAPTURE(dv, l1);
    CHECK(d.decode_block(64, dv) == expected(64, dv, sizeof(double)));
    CHECK(d.make_state(64, dv).decode_block() == d.decode_block(64, dv));
  }
  // A state as large as 16 L1 caches defers exactly on such a core.
  CHECK(f.make_state(64, 16 * fits_f).decode_block() == (defers ? 16 : 0));
  // An explicit value is taken as it is (1 means fused: no block kept).
  CHECK(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 32, 8})
            .make_state(4, 4)
            .decode_block() == 8);
  CHECK(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 32, 1})
            .make_state(128, 128)
            .decode_block() == 0);
  CHECK(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 32, 0}).decode_block(128, 128) == 0);
  // Random features keep fused (log-scaled) steps whatever the size or option.
  using RandomFeatures = PositiveRandomFeatures<float>;
  const LinearAttention<RandomFeatures> rf(RandomFeatures(128, 256, 3));
  CHECK(rf.make_state(128, 128).decode_block() == 0);
  const LinearAttention<RandomFeatures> rf8(RandomFeatures(128, 256, 3), Options{{}, 32, 8});
  CHECK(rf8.make_state(128, 128).decode_block() == 0);
  CHECK_THROWS_AS(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 32, -2}),
                  std::invalid_argument);
}

TEST_CASE("the chunk size defaults to 32 where S fits the L1 data cache and 16 where not",
          "[options]") {
  // kAuto (Options::chunk_size), against the cache size of the machine that runs.
  const Index l1 = detail::cache_sizes().l1d;
  const LinearAttention<EluPlusOne, float> f;
  const Index fits = l1 / (64 * Index{sizeof(float)});
  CHECK(f.chunk_size(64, fits) == 32);      // exactly fills L1: fits
  CHECK(f.chunk_size(64, fits + 1) == 16);  // one row more: does not
  CHECK(LinearAttention<EluPlusOne, double>().chunk_size(64, fits) == 16);  // twice the bytes
  CHECK(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 7}).chunk_size(64, fits + 1) == 7);
  CHECK_THROWS_AS(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, -3}),
                  std::invalid_argument);
}

TEMPLATE_TEST_CASE("parallel, chunked, recurrent and step agree with a double loop", "[agree]",
                   float, double) {
  struct Shape {
    Index T, dk, dv;
  };
  // The longest shape is the double loop's O(T^2): under the sanitizers (-O0) 640 rows, still
  // ten chunks of 64 and a single chunk of 4096 that holds them all.
  const Index longest = linattn_test::kSanitizedBuild ? 640 : 2500;
  const std::vector<Shape> shapes{{1, 4, 4}, {2, 1, 1}, {7, 3, 5},     {64, 16, 16},
                                  {100, 8, 3}, {257, 32, 64}, {longest, 16, 8}};
  for (const Shape& s : shapes) {
    CAPTURE(s.T, s.dk, s.dv);
    const auto Q = random_matrix<TestType>(s.T, s.dk, 1 + s.T);
    const auto K = random_matrix<TestType>(s.T, s.dk, 2 + s.T);
    const auto V = random_matrix<TestType>(s.T, s.dv, 3 + s.T);
    const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
    const double units = bound_units(s.dk, s.T);

    for (Index chunk : {1, 5, 16, 64, 4096}) {
      CAPTURE(chunk);
      const LinearAttention<EluPlusOne, TestType> attn(EluPlusOne{}, Options{{}, chunk});
      CHECK(worst_error_ratio<TestType>(attn.parallel(Q, K, V, Mask::causal), ref, units) <= 1);
    }
    const LinearAttention<EluPlusOne, TestType> attn;
    CHECK(worst_error_ratio<TestType>(attn.recurrent(Q, K, V), ref, units) <= 1);

    auto state = attn.make_state(s.dk, s.dv);
    RowMatrix<TestType> stepped(s.T, s.dv);
    for (Index t = 0; t < s.T; ++t)
      stepped.row(t) = attn.step(state, Q.row(t), K.row(t).transpose(), V.row(t));
    CHECK(worst_error_ratio<TestType>(stepped, ref, units) <= 1);
    CHECK(state.tokens() == s.T);
  }
}

TEMPLATE_TEST_CASE("full attention with Tq != Tk agrees with a double loop", "[agree]", float,
                   double) {
  const auto Q = random_matrix<TestType>(37, 12, 11);
  const auto K = random_matrix<TestType>(90, 12, 12);
  const auto V = random_matrix<TestType>(90, 7, 13);
  const LinearAttention<EluPlusOne, TestType> attn;
  const auto ref = naive_attention(Q, K, V, false, linattn_test::elu_plus_one);
  CHECK(worst_error_ratio<TestType>(attn.parallel(Q, K, V, Mask::none), ref, bound_units(12, 90)) <= 1);
  CHECK(worst_error_ratio<TestType>(quadratic_attention(EluPlusOne{}, Q, K, V, Mask::none), ref,
                                    bound_units(12, 90)) <= 1);
}

TEMPLATE_TEST_CASE("unnormalized read with signed features agrees with a double loop", "[agree]",
                   float, double) {
  // Identity features have both signs, so the bound scales with sum |w| |v| (no denominator).
  // Not a structured binding: clang 14 lambdas cannot capture those.
  const auto qkv = random_qkv<TestType>(300, 8, 4, 21);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const LinearAttention<Identity, TestType> attn(Identity{},
                                                 Options{Normalization::unnormalized(), 32});
  const auto ref = naive_attention(Q, K, V, true, linattn_test::identity, false);
  const double units = bound_units(8, 300);
  CHECK(worst_error_ratio<TestType>(attn.parallel(Q, K, V, Mask::causal), ref, units) <= 1);
  CHECK(worst_error_ratio<TestType>(attn.recurrent(Q, K, V), ref, units) <= 1);
}

TEMPLATE_TEST_CASE("a sequence in pieces equals one call: prefill then decode", "[state]", float,
                   double) {
  const Index T = 203, dk = 16, dv = 8;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 31);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const LinearAttention<EluPlusOne, TestType> attn(EluPlusOne{}, Options{{}, 32});
  const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
  const double units = bound_units(dk, T);

  auto one_shot = attn.make_state(dk, dv);
  const auto whole = attn.prefill(one_shot, Q, K, V);

  // Prefill 150 tokens in two parallel pieces (not chunk-aligned), 20 recurrent, then decode.
  auto state = attn.make_state(dk, dv);
  RowMatrix<TestType> pieces(T, dv);
  pieces.topRows(70) = attn.prefill(state, Q.topRows(70), K.topRows(70), V.topRows(70));
  pieces.middleRows(70, 80) =
      attn.prefill(state, Q.middleRows(70, 80), K.middleRows(70, 80), V.middleRows(70, 80));
  pieces.middleRows(150, 20) =
      attn.recurrent(state, Q.middleRows(150, 20), K.middleRows(150, 20), V.middleRows(150, 20));
  for (Index t = 170; t < T; ++t) pieces.row(t) = attn.step(state, Q.row(t), K.row(t), V.row(t));

  CHECK(worst_error_ratio<TestType>(whole, ref, units) <= 1);
  CHECK(worst_error_ratio<TestType>(pieces, ref, units) <= 1);
  CHECK(state.tokens() == T);
  CHECK(one_shot.tokens() == T);

  // States: S and z entries are sums of T positive-weight terms, so they agree to gamma_T
  // relative to sum |phi(k)| |v| (and sum phi(k) for z): bound 2 (T + 4) u times that scale.
  RowMatrix<double> kf(T, dk);
  for (Index t = 0; t < T; ++t)
    for (Index n = 0; n < dk; ++n) kf(t, n) = linattn_test::elu_plus_one(K(t, n));
  const RowMatrix<double> S_scale = kf.transpose() * V.template cast<double>().cwiseAbs();
  const double u = linattn_test::unit_roundoff<TestType>();
  const double s_units = 2.0 * static_cast<double>(T + 4);
  for (Index i = 0; i < dk; ++i) {
    for (Index c = 0; c < dv; ++c)
      CHECK(std::abs(double(state.S()(i, c)) - double(one_shot.S()(i, c))) <=
            s_units * u * S_scale(i, c));
    CHECK(std::abs(double(state.z()(i)) - double(one_shot.z()(i))) <=
          s_units * u * kf.col(i).sum());
  }
}

TEST_CASE("strided views and column-major inputs read in place give the copy's result",
          "[views]") {
  // One head inside a [T, H*d] row-major buffer, as a model stores it.
  const Index T = 50, H = 3, d = 8, head = 1;
  const auto buffer = random_matrix<float>(T, H * d, 41);
  const auto V = random_matrix<float>(T, d, 42);
  using StridedMap = Eigen::Map<const RowMatrix<float>, 0, Eigen::OuterStride<>>;
  const StridedMap Qh(buffer.data() + head * d, T, d, Eigen::OuterStride<>(H * d));
  const RowMatrix<float> Qcopy = Qh;
  const Eigen::MatrixXf Kcol = random_matrix<float>(T, d, 43);  // column-major
  const RowMatrix<float> Krow = Kcol;

  const LinearAttention<EluPlusOne> attn(EluPlusOne{}, Options{{}, 16});
  // Same arithmetic on the same values: identical bits, not just close.
  CHECK(attn.recurrent(Qh, Kcol, V) == attn.recurrent(Qcopy, Krow, V));
  CHECK(attn.parallel(Qh, Kcol, V, Mask::causal) == attn.parallel(Qcopy, Krow, V, Mask::causal));
  CHECK(attn.parallel(Qh, Kcol, V, Mask::none) == attn.parallel(Qcopy, Krow, V, Mask::none));

  // Output written into a strided view of a [T, H*d] output buffer.
  RowMatrix<float> out_buffer = RowMatrix<float>::Zero(T, H * d);
  Eigen::Map<RowMatrix<float>, 0, Eigen::OuterStride<>> out_head(out_buffer.data() + head * d, T,
                                                                  d, Eigen::OuterStride<>(H * d));
  attn.parallel_into(Qh, Kcol, V, Mask::causal, out_head);
  CHECK(out_head == attn.parallel(Qcopy, Krow, V, Mask::causal));
  CHECK(out_buffer.leftCols(d).isZero());  // neighbouring heads untouched

  // Expressions (a product) are evaluated once, then read like any input.
  const RowMatrix<float> Qexpr = Qcopy * 0.5f;
  CHECK(attn.parallel(Qcopy * 0.5f, Krow, V, Mask::causal) ==
        attn.parallel(Qexpr, Krow, V, Mask::causal));
}

TEST_CASE("step reads q, k, v in place or from a copy with the same result, also when y is v",
          "[views]") {
  // step() reads contiguous vectors where they lie and copies the others (strided columns,
  // expressions); the arithmetic is the same, so the bits must be too.
  const Index T = 9, d = 8;
  const auto qkv = random_qkv<float>(T, d, d, 51);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const Eigen::MatrixXf Kcol = K;                    // column-major: rows are strided
  const RowMatrix<float> Vt = V.transpose();         // columns of Vt are strided
  const auto check_layouts = [&](const auto& attn) {
    // The reference: steps over the rows of row-major matrices. A fused step (decode block
    // <= 1, and every log-scaled map) also equals recurrent() bit for bit.
    auto rows = attn.make_state(d, d);
    RowMatrix<float> expected(T, d);
    for (Index t = 0; t < T; ++t) expected.row(t) = attn.step(rows, Q.row(t), K.row(t), V.row(t));
    if (rows.decode_block() <= 1) CHECK(expected == attn.recurrent(Q, K, V));
    auto mixed = attn.make_state(d, d);
    auto transposed = attn.make_state(d, d), in_place = attn.make_state(d, d);
    for (Index t = 0; t < T; ++t) {
      // A column vector, a strided row, a strided column and an expression without storage.
      const Eigen::VectorXf q_column = Q.row(t).transpose();
      CHECK(attn.step(mixed, q_column, Kcol.row(t), Vt.col(t) * 1.0f) == expected.row(t));
      // Transposed rows (column vectors over contiguous storage) are read in place.
      CHECK(attn.step(transposed, Q.row(t).transpose(), K.row(t).transpose(),
                      V.row(t).transpose()) == expected.row(t));
      // y written over v itself: the random-feature step writes y while it still reads v,
      // so a v that overlaps y is copied first.
      RowVector<float> v_then_y = V.row(t);
      attn.step_into(in_place, Q.row(t), K.row(t), v_then_y, v_then_y);
      CHECK(v_then_y == expected.row(t));
    }
  };
  check_layouts(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 32, 16}));  // 16 > T
  check_layouts(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 32, 4}));  // folds twice
  check_layouts(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 32, 1}));  // fused
  using RandomFeatures = PositiveRandomFeatures<float>;
  check_layouts(LinearAttention<RandomFeatures>(RandomFeatures(d, 16, 7)));
}

TEST_CASE("row_view reads contiguous vectors in place and copies the others", "[views]") {
  const auto M = random_matrix<float>(4, 6, 55);      // row-major: rows contiguous
  const Eigen::MatrixXf C = M;                          // column-major: rows strided
  RowMatrix<float> scratch(1, 6);
  const float* none = nullptr;
  CHECK(detail::row_view(M.row(2), scratch, "x", none, 0).data() == M.row(2).data());
  CHECK(detail::row_view(M.row(2).transpose(), scratch, "x", none, 0).data() == M.row(2).data());
  const auto copied = detail::row_view(C.row(2), scratch, "x", none, 0);
  CHECK(copied.data() == scratch.data());
  CHECK(copied == M.row(2));
  // A view that would overlap what the caller writes is a copy.
  CHECK(detail::row_view(M.row(2), scratch, "x", M.row(2).data() + 5, 1).data() == scratch.data());
  CHECK(detail::row_view(M.row(2), scratch, "x", M.row(3).data(), 6).data() == M.row(2).data());
  CHECK_THROWS_AS(detail::row_view(M.row(2).head(5), scratch, "x", none, 0), ShapeError);
}

TEST_CASE("states in a vector do not share cache lines", "[state]") {
  // Each step writes its state's token count and swaps its z buffers; states of heads that
  // different threads decode must not share a cache line (or the adjacent-line pair Intel
  // prefetches), or every token moves the line between cores.
  const LinearAttention<EluPlusOne> attn;
  const std::vector<AttentionState<float>> heads(3, attn.make_state(8, 8));
  for (const auto& h : heads) CHECK(reinterpret_cast<std::uintptr_t>(&h) % 128 == 0);
  CHECK(sizeof(AttentionState<float>) % 128 == 0);
}

TEST_CASE("T = 0 gives an empty 0 x dv result", "[shapes]") {
  const LinearAttention<EluPlusOne> attn;
  const Eigen::MatrixXf Q(0, 4), K(0, 4), V(0, 3);
  CHECK(attn.parallel(Q, K, V, Mask::causal).rows() == 0);
  CHECK(attn.parallel(Q, K, V, Mask::causal).cols() == 3);
  CHECK(attn.parallel(Q, K, V, Mask::none).cols() == 3);
  CHECK(attn.recurrent(Q, K, V).cols() == 3);
  auto state = attn.make_state(4, 3);
  CHECK(attn.prefill(state, Q, K, V).rows() == 0);
  CHECK(attn.recurrent(state, Q, K, V).cols() == 3);
  CHECK(state.tokens() == 0);
}

TEST_CASE("shape errors are ShapeError (std::invalid_argument) naming the shapes", "[errors]") {
  const LinearAttention<EluPlusOne> attn;
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Ones(5, 4), K = Q, K3 = Eigen::MatrixXf::Ones(5, 3),
                        V = Eigen::MatrixXf::Ones(5, 2), V6 = Eigen::MatrixXf::Ones(6, 2),
                        Q6 = Eigen::MatrixXf::Ones(6, 4);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(attn.parallel(Q, K3, V, Mask::none), Contains("5x4") && Contains("5x3"));
  CHECK_THROWS_AS(attn.parallel(Q, K3, V, Mask::none), std::invalid_argument);
  CHECK_THROWS_WITH(attn.parallel(Q, K, V6, Mask::none), Contains("5x4") && Contains("6x2"));
  CHECK_THROWS_AS(attn.recurrent(Q, K, V6), ShapeError);
  CHECK_THROWS_WITH(attn.parallel(Q6, K, V, Mask::causal), Contains("6x4") && Contains("5x4"));
  CHECK_THROWS_AS(attn.recurrent(Q6, K, V), ShapeError);
  CHECK_NOTHROW(attn.parallel(Q6, K, V, Mask::none));  // cross-attention may differ in T

  auto wrong = attn.make_state(4, 3);
  CHECK_THROWS_WITH(attn.recurrent(wrong, Q, K, V), Contains("dv=3") && Contains("dv=2"));
  CHECK_THROWS_AS(attn.prefill(wrong, Q, K, V), ShapeError);
  RowMatrix<float> fits(5, 2);
  CHECK_THROWS_AS(attn.prefill_into(wrong, Q, K, V, fits), std::invalid_argument);
  CHECK_THROWS_AS(attn.recurrent_into(wrong, Q, K, V, fits), ShapeError);
  CHECK(wrong.tokens() == 0);

  auto state = attn.make_state(4, 2);
  const Eigen::VectorXf q = Eigen::VectorXf::Ones(4), k3 = Eigen::VectorXf::Ones(3),
                        v = Eigen::VectorXf::Ones(2), v3 = Eigen::VectorXf::Ones(3);
  CHECK_THROWS_WITH(attn.step(state, q, k3, v), Contains("k 3x1") && Contains("dk = 4"));
  CHECK_THROWS_AS(attn.step(state, q, q, v3), ShapeError);
  CHECK_THROWS_AS(attn.step(state, Q.topRows(2), q, v), ShapeError);  // not a vector
  RowMatrix<float> out(4, 2);
  CHECK_THROWS_WITH(attn.parallel_into(Q, K, V, Mask::causal, out), Contains("4x2"));
  CHECK_THROWS_AS(LinearAttention<EluPlusOne>(EluPlusOne{}, Options{{}, 0}),
                  std::invalid_argument);
}

TEMPLATE_TEST_CASE("a non-positive, NaN or Inf denominator is a DenominatorError naming the row",
                   "[errors]", float, double) {
  using M = Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic>;
  // Keys (1,0) then (-1,0) cancel: query (1,0) sees scores 1 then 1 + (-1) = 0 at row 1.
  M Q(3, 2), K(3, 2), V(3, 1);
  Q << 1, 0, 1, 0, 1, 0;
  K << 1, 0, -1, 0, -1, 0;
  V << 1, 2, 3;
  const LinearAttention<Identity, TestType> attn;
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(attn.recurrent(Q, K, V), Contains("row 1") && Contains("= 0"));
  CHECK_THROWS_AS(attn.parallel(Q, K, V, Mask::causal), std::domain_error);
  CHECK_THROWS_WITH(quadratic_attention(Identity{}, Q, K, V, Mask::causal), Contains("row 1"));
  try {
    (void)attn.parallel(Q, K, V, Mask::causal);
    FAIL("expected a DenominatorError");
  } catch (const DenominatorError& e) {
    CHECK(e.row() == 1);
    CHECK(e.value() == 0.0);
  }
  // Negative: full attention over all three keys gives 1 - 1 - 1 = -1 for every row.
  CHECK_THROWS_WITH(attn.parallel(Q, K, V, Mask::none), Contains("row 0") && Contains("-1"));

  // Step has the strong guarantee: the failing token leaves the state as it was.
  auto state = attn.make_state(2, 1);
  (void)attn.step(state, Q.row(0), K.row(0), V.row(0));
  const auto S_before = state.S();
  CHECK_THROWS_AS(attn.step(state, Q.row(1), K.row(1), V.row(1)), DenominatorError);
  CHECK(state.S() == S_before);
  CHECK(state.tokens() == 1);

  // The recurrent path stops at the failing row with the earlier tokens absorbed.
  auto partial = attn.make_state(2, 1);
  CHECK_THROWS_AS(attn.recurrent(partial, Q, K, V), DenominatorError);
  CHECK(partial.tokens() == 1);

  // NaN and Inf inputs are caught, never passed on.
  M Qnan = Q;
  Qnan(0, 0) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_WITH(attn.recurrent(Qnan, K, V), Contains("row 0") && Contains("nan"));
  const LinearAttention<EluPlusOne, TestType> elu;
  M Kinf = K;
  Kinf(0, 0) = std::numeric_limits<TestType>::infinity();
  CHECK_THROWS_AS(elu.parallel(Q, Kinf, V, Mask::causal), DenominatorError);
  CHECK_THROWS_AS(elu.parallel(Q, Kinf, V, Mask::none), DenominatorError);
}

TEMPLATE_TEST_CASE("opt-in normalizations do what they say near zero", "[normalization]", float,
                   double) {
  using M = Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic>;
  M Q(2, 1), K(2, 1), V(2, 1);
  Q << 1, 1;
  K << 1, -1;  // denominators 1 then 0
  V << 3, 5;   // numerators 3 then 3 - 5 = -2
  const auto run = [&](Normalization n) {
    return LinearAttention<Identity, TestType>(Identity{}, Options{n, 64}).recurrent(Q, K, V);
  };
  const auto clamped = run(Normalization::clamped(0.25));
  CHECK(clamped(0, 0) == 3);                 // 1 >= eps: untouched
  CHECK(clamped(1, 0) == TestType(-2 / 0.25));  // 0 -> eps
  const auto shifted = run(Normalization::shifted(0.25));
  CHECK(shifted(0, 0) == TestType(3 / 1.25));  // eps added to every row
  CHECK(shifted(1, 0) == TestType(-2 / 0.25));
  const auto raw = run(Normalization::unnormalized());
  CHECK(raw(0, 0) == 3);
  CHECK(raw(1, 0) == -2);
  CHECK_THROWS_AS(Normalization::clamped(0), std::invalid_argument);
  CHECK_THROWS_AS(Normalization::shifted(-1), std::invalid_argument);
  CHECK_THROWS_AS(Normalization::clamped(std::nan("")), std::invalid_argument);

  // A shift cannot rescue a clearly negative denominator; a clamp still rejects NaN.
  K << 1, -3;  // second denominator -2
  CHECK_THROWS_AS(run(Normalization::shifted(0.25)), DenominatorError);
  Q(1, 0) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_AS(run(Normalization::clamped(0.25)), DenominatorError);
}

// ---- grouped query heads: G query heads read one shared state ------------------------------

namespace {

// A read-only view of the rows of a row-major matrix, block or row (rows outerStride() apart,
// each contiguous): one head of a grouped call, over the caller's memory. No copy.
template <class X>
ConstRowsView<typename X::Scalar> rows_view(const X& x) {
  static_assert(X::IsRowMajor && X::InnerStrideAtCompileTime == 1,
                "a rows view needs contiguous rows");
  return ConstRowsView<typename X::Scalar>(x.data(), x.rows(), x.cols(),
                                           Eigen::OuterStride<>(x.outerStride()));
}
// The same, writable (one output head).
template <class X>
RowsView<typename std::remove_cvref_t<X>::Scalar> output_view(X&& x) {
  using Plain = std::remove_cvref_t<X>;
  static_assert(Plain::IsRowMajor && Plain::InnerStrideAtCompileTime == 1,
                "a rows view needs contiguous rows");
  return RowsView<typename Plain::Scalar>(x.data(), x.rows(), x.cols(),
                                          Eigen::OuterStride<>(x.outerStride()));
}
// The views of G query heads, head(g) for g < G (what the lambdas of the old grouped calls
// returned), and of G outputs.
template <class HeadAt>
auto query_views(Index G, const HeadAt& head) {
  std::vector<decltype(rows_view(head(0)))> views;
  for (Index g = 0; g < G; ++g) views.push_back(rows_view(head(g)));
  return views;
}
template <class HeadAt>
auto output_views(Index G, const HeadAt& head) {
  std::vector<decltype(output_view(head(0)))> views;
  for (Index g = 0; g < G; ++g) views.push_back(output_view(head(g)));
  return views;
}

// The bits of two states: what a later call reads (S with its pending tokens, z, the count).
template <class Scalar>
void check_same_state(const AttentionState<Scalar>& actual,
                      const AttentionState<Scalar>& expected) {
  CHECK(actual.tokens() == expected.tokens());
  CHECK(actual.pending_tokens() == expected.pending_tokens());
  CHECK(actual.S() == expected.S());
  CHECK(actual.z() == expected.z());
}

// Runs the grouped prefill_into for the queries Q from `state`, and checks each head's output
// and the state against prefill_into on a copy of the state as it was before.
template <class Attn, class Scalar>
void check_group_prefill(const Attn& attn, AttentionState<Scalar>& state,
                         const std::vector<RowMatrix<Scalar>>& Q, const RowMatrix<Scalar>& K,
                         const RowMatrix<Scalar>& V) {
  using Mat = RowMatrix<Scalar>;
  const auto G = static_cast<Index>(Q.size());
  std::vector<AttentionState<Scalar>> copies(Q.size(), state);
  std::vector<Mat> out(Q.size(), Mat(K.rows(), V.cols()));
  attn.prefill_into(
      state, query_views(G, [&](Index g) -> const Mat& { return Q[static_cast<std::size_t>(g)]; }),
      K, V, output_views(G, [&](Index g) -> Mat& { return out[static_cast<std::size_t>(g)]; }));
  for (std::size_t g = 0; g < Q.size(); ++g) {
    CAPTURE(g);
    Mat y(K.rows(), V.cols());
    attn.prefill_into(copies[g], Q[g], K, V, y);
    CHECK(out[g] == y);
    check_same_state(state, copies[g]);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("grouped prefill_into gives each head the bits of prefill_into on a copy",
                   "[group]", float, double) {
  using Scalar = TestType;
  using Mat = RowMatrix<Scalar>;
  std::uint64_t seed = 600;
  // d = 16 runs the register kernel, 20 (not a multiple of the packet width) the Eigen one;
  // chunk 5 divides T = 40, chunk 16 none of the T below (a short last chunk).
  for (Index d : {16, 20})
    for (Index chunk : {16, 5})
      for (Index G : {1, 3})
        for (Index T : {1, 7, 40, 41}) {
          CAPTURE(d, chunk, G, T);
          const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, Options{{}, chunk});
          auto state = attn.make_state(d, d);
          // Two prefills: the second continues from the T tokens the first absorbed, so its
          // chunks start off the chunk grid.
          for (int call = 0; call < 2; ++call) {
            CAPTURE(call);
            const Mat K = random_matrix<Scalar>(T, d, seed++);
            const Mat V = random_matrix<Scalar>(T, d, seed++);
            std::vector<Mat> Q;
            for (Index g = 0; g < G; ++g) Q.push_back(random_matrix<Scalar>(T, d, seed++));
            check_group_prefill(attn, state, Q, K, V);
            CHECK(state.tokens() == (call + 1) * T);
          }
        }
}

TEMPLATE_TEST_CASE("stateless grouped parallel_into gives each head parallel_into's bits",
                   "[group]", float, double) {
  // Full attention with Tq != Tk (phi(K)^T V once per group) and causal from an empty state,
  // both kernels (d = 16 and 20); the mask as a run-time Mask.
  using Scalar = TestType;
  using Mat = RowMatrix<Scalar>;
  const Index G = 3;
  for (Index d : {16, 20}) {
    for (const Mask mask : {Mask(Mask::none), Mask(Mask::causal)}) {
      CAPTURE(d, mask == Mask::causal);
      const Index Tk = 23, Tq = mask == Mask::causal ? Tk : 9;
      const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, Options{{}, 8});
      const Mat K = random_matrix<Scalar>(Tk, d, 1200 + d),
                V = random_matrix<Scalar>(Tk, d, 1201 + d);
      std::vector<Mat> Q, out(static_cast<std::size_t>(G), Mat(Tq, d));
      for (Index g = 0; g < G; ++g) Q.push_back(random_matrix<Scalar>(Tq, d, 1210 + 10 * d + g));
      attn.parallel_into(
          query_views(G, [&](Index g) -> const Mat& { return Q[static_cast<std::size_t>(g)]; }), K,
          V, mask,
          output_views(G, [&](Index g) -> Mat& { return out[static_cast<std::size_t>(g)]; }));
      for (std::size_t g = 0; g < Q.size(); ++g) {
        CAPTURE(g);
        Mat y(Tq, d);
        attn.parallel_into(Q[g], K, V, mask, y);
        CHECK(out[g] == y);
      }
    }
  }
  // Shapes are checked per head: a query of another width, an output of the wrong length.
  const LinearAttention<EluPlusOne, float> attn;
  const RowMatrix<float> K = random_matrix<float>(5, 4, 1250), V = random_matrix<float>(5, 3, 1251);
  const RowMatrix<float> Q = random_matrix<float>(2, 4, 1252),
                         Q_wide = random_matrix<float>(2, 5, 1253);
  RowMatrix<float> o(2, 3), o_long(3, 3);
  CHECK_THROWS_AS(
      attn.parallel_into(
          query_views(2, [&](Index g) -> const RowMatrix<float>& { return g == 0 ? Q : Q_wide; }),
          K, V, Mask::none, output_views(2, [&](Index) -> RowMatrix<float>& { return o; })),
      ShapeError);
  CHECK_THROWS_AS(
      attn.parallel_into(
          query_views(2, [&](Index) -> const RowMatrix<float>& { return Q; }), K, V, Mask::none,
          output_views(2, [&](Index g) -> RowMatrix<float>& { return g == 0 ? o : o_long; })),
      ShapeError);
}

TEMPLATE_TEST_CASE("grouped prefill_into reads and writes heads in place in [T, G*d] buffers",
                   "[group]", float, double) {
  using Scalar = TestType;
  using Mat = RowMatrix<Scalar>;
  const Index T = 41, G = 3;
  for (Index d : {16, 20}) {
    CAPTURE(d);
    // Queries and outputs of the G heads side by side, as a model stores them; K column-major.
    const auto Qbuf = random_matrix<Scalar>(T, G * d, 700 + d);
    const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> K =
        random_matrix<Scalar>(T, d, 701 + d);
    const auto V = random_matrix<Scalar>(T, d, 702 + d);
    const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, Options{{}, 16});
    auto state = attn.make_state(d, d);
    auto tensor_state = state;
    Mat Obuf = Mat::Zero(T, G * d + 1);  // one spare column that no head owns
    Mat Otensor = Mat::Zero(T, G * d + 1);
    std::vector<AttentionState<Scalar>> copies(static_cast<std::size_t>(G), state);
    // The heads as a span of column blocks ...
    attn.prefill_into(state, query_views(G, [&](Index g) { return Qbuf.middleCols(g * d, d); }), K,
                      V, output_views(G, [&](Index g) { return Obuf.middleCols(g * d, d); }));
    // ... and as tensor views [B = 1, T, H = G, d] over the same buffers.
    const TensorView<const Scalar> Qview(Qbuf.data(), {1, T, G, d}, {T * G * d, G * d, d, 1});
    const TensorView<Scalar> Oview(Otensor.data(), {1, T, G, d},
                                   {T * (G * d + 1), G * d + 1, d, 1});
    attn.prefill_into(tensor_state, Qview, K, V, Oview);
    for (Index g = 0; g < G; ++g) {
      CAPTURE(g);
      const Mat Qg = Qbuf.middleCols(g * d, d);
      Mat y(T, d);
      attn.prefill_into(copies[g], Qg, K, V, y);
      CHECK(Obuf.middleCols(g * d, d) == y);
      CHECK(Otensor.middleCols(g * d, d) == y);
      check_same_state(state, copies[g]);
      check_same_state(tensor_state, copies[g]);
    }
    CHECK(Obuf.col(G * d).isZero(0));
    CHECK(Otensor.col(G * d).isZero(0));
  }
}

TEMPLATE_TEST_CASE("grouped prefill_into folds a state's pending decode tokens as prefill_into",
                   "[group]", float, double) {
  using Scalar = TestType;
  using Mat = RowMatrix<Scalar>;
  const Index T = 19, G = 3;
  for (Index d : {16, 20}) {
    CAPTURE(d);
    const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, Options{{}, 5, 4});
    auto state = attn.make_state(d, d);
    // Six decode tokens first: one folded block of 4 and 2 tokens pending.
    const auto qkv = random_qkv<Scalar>(6, d, d, 800 + d);
    const auto &Qd = qkv.Q, &Kd = qkv.K, &Vd = qkv.V;
    for (Index t = 0; t < 6; ++t) (void)attn.step(state, Qd.row(t), Kd.row(t), Vd.row(t));
    REQUIRE(state.pending_tokens() == 2);
    const Mat K = random_matrix<Scalar>(T, d, 810 + d), V = random_matrix<Scalar>(T, d, 811 + d);
    std::vector<Mat> Q;
    for (Index g = 0; g < G; ++g) Q.push_back(random_matrix<Scalar>(T, d, 820 + 10 * d + g));
    check_group_prefill(attn, state, Q, K, V);
    CHECK(state.tokens() == 6 + T);
  }
}

TEMPLATE_TEST_CASE("grouped step_into with a decode block has the bits of step_into per head",
                   "[group]", float, double) {
  using Scalar = TestType;
  using Mat = RowMatrix<Scalar>;
  const Index T = 40, G = 3;
  for (Index d : {16, 20}) {
    CAPTURE(d);
    const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, Options{{}, 32, 4});
    auto shared = attn.make_state(d, d);
    REQUIRE(shared.decode_block() == 4);
    std::vector<AttentionState<Scalar>> heads(static_cast<std::size_t>(G), shared);
    auto absorbed = shared;  // absorb() then read_into() per head: the stated definition
    ReadScratch<Scalar> scratch(absorbed);
    const auto K = random_matrix<Scalar>(T, d, 900 + d), V = random_matrix<Scalar>(T, d, 901 + d);
    std::vector<Mat> Q;
    for (Index g = 0; g < G; ++g) Q.push_back(random_matrix<Scalar>(T, d, 910 + 10 * d + g));
    Mat Y(G, d);
    RowVector<Scalar> y(d), y_read(d);
    for (Index t = 0; t < T; ++t) {
      CAPTURE(t);
      attn.step_into(shared, query_views(G, [&](Index g) { return Q[g].row(t); }), K.row(t),
                     V.row(t), output_views(G, [&](Index g) { return Y.row(g); }));
      attn.absorb(absorbed, K.row(t), V.row(t));
      for (Index g = 0; g < G; ++g) {
        CAPTURE(g);
        attn.step_into(heads[g], Q[g].row(t), K.row(t), V.row(t), y);
        CHECK(Y.row(g) == y);
        attn.read_into(absorbed, Q[g].row(t), y_read, scratch);
        CHECK(Y.row(g) == y_read);
      }
    }
    for (Index g = 0; g < G; ++g) check_same_state(shared, heads[g]);
    check_same_state(shared, absorbed);
    CHECK(shared.tokens() == T);
    CHECK(shared.pending_tokens() == 4);  // 40 tokens: the last block is full, not yet folded
  }
}

TEMPLATE_TEST_CASE("fused grouped step_into agrees with a double loop of the state formula",
                   "[group]", float, double) {
  using Scalar = TestType;
  using Mat = RowMatrix<Scalar>;
  const Index T = 40, G = 3;
  const double u = linattn_test::unit_roundoff<Scalar>();
  for (Index d : {16, 20}) {
    CAPTURE(d);
    // decode_block 1: no block kept, each token goes straight into S.
    const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, Options{{}, 32, 1});
    auto shared = attn.make_state(d, d);
    REQUIRE(shared.decode_block() == 0);
    std::vector<AttentionState<Scalar>> heads(static_cast<std::size_t>(G), shared);
    auto absorbed = shared;
    ReadScratch<Scalar> scratch(absorbed);
    const auto K = random_matrix<Scalar>(T, d, 950 + d), V = random_matrix<Scalar>(T, d, 951 + d);
    std::vector<Mat> Q;
    for (Index g = 0; g < G; ++g) Q.push_back(random_matrix<Scalar>(T, d, 960 + 10 * d + g));

    // The reference keeps S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j) in double, and
    // S_abs = sum_j phi(k_j) |v_j|^T, the scale rounding errors of the numerator follow.
    using linattn_test::MatrixXdR;
    MatrixXdR S = MatrixXdR::Zero(d, d), S_abs = MatrixXdR::Zero(d, d);
    Eigen::VectorXd z = Eigen::VectorXd::Zero(d), kf(d), qf(d);
    Mat Y(G, d);
    RowVector<Scalar> y(d), y_read(d);
    double worst_group = 0, worst_step = 0;
    for (Index t = 0; t < T; ++t) {
      CAPTURE(t);
      attn.step_into(shared, query_views(G, [&](Index g) { return Q[g].row(t); }), K.row(t),
                     V.row(t), output_views(G, [&](Index g) { return Y.row(g); }));
      attn.absorb(absorbed, K.row(t), V.row(t));
      for (Index n = 0; n < d; ++n) kf(n) = linattn_test::elu_plus_one(double(K(t, n)));
      for (Index n = 0; n < d; ++n)
        for (Index c = 0; c < d; ++c) {
          S(n, c) += kf(n) * double(V(t, c));
          S_abs(n, c) += kf(n) * std::abs(double(V(t, c)));
        }
      z += kf;
      // Bound: S and z are recursive sums over t + 1 tokens (gamma_{t+1} each, relative to
      // S_abs and z, whose terms are positive), the reads phi(q)^T S and phi(q)^T z dot
      // products of length r (gamma_r), plus the division and the feature map's few ulps on
      // phi(q) and phi(k). Numerator and denominator each then err by at most
      // (r + t + 5) u relative to their magnitude, so |y - y_exact| <=
      // 2 (r + (t + 1) + 4) u * (phi(q)^T S_abs) / (phi(q)^T z) = bound_units(r, t + 1) u * that.
      const double units = bound_units(d, t + 1);
      for (Index g = 0; g < G; ++g) {
        CAPTURE(g);
        for (Index n = 0; n < d; ++n) qf(n) = linattn_test::elu_plus_one(double(Q[g](t, n)));
        const double den = qf.dot(z);
        attn.step_into(heads[g], Q[g].row(t), K.row(t), V.row(t), y);
        attn.read_into(absorbed, Q[g].row(t), y_read, scratch);
        CHECK(Y.row(g) == y_read);  // absorb() then read_into(): the same bits
        for (Index c = 0; c < d; ++c) {
          const double exact = qf.dot(S.col(c)) / den;
          const double allowed =
              units * u * qf.dot(S_abs.col(c)) / den + std::numeric_limits<Scalar>::min();
          worst_group = std::max(worst_group, std::abs(double(Y(g, c)) - exact) / allowed);
          worst_step = std::max(worst_step, std::abs(double(y(c)) - exact) / allowed);
        }
      }
    }
    CHECK(worst_group <= 1);
    CHECK(worst_step <= 1);  // per-head fused step_into: the same bound, other rounding
    check_same_state(shared, absorbed);
    CHECK(shared.tokens() == T);
    for (Index g = 0; g < G; ++g) CHECK(heads[g].tokens() == T);
  }
}

TEMPLATE_TEST_CASE("grouped prefill then grouped decode equals per-head prefill and decode",
                   "[group]", float, double) {
  using Scalar = TestType;
  using Mat = RowMatrix<Scalar>;
  const Index T0 = 23, T1 = 17, G = 3;  // 23 tokens: chunks of 16 and 7; decode blocks of 4
  for (Index d : {16, 20}) {
    CAPTURE(d);
    const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, Options{{}, 16, 4});
    auto shared = attn.make_state(d, d);
    std::vector<AttentionState<Scalar>> heads(static_cast<std::size_t>(G), shared);
    const Index T = T0 + T1;
    const auto K = random_matrix<Scalar>(T, d, 1000 + d), V = random_matrix<Scalar>(T, d, 1001 + d);
    std::vector<Mat> Q, group_out(static_cast<std::size_t>(G), Mat(T, d));
    for (Index g = 0; g < G; ++g) Q.push_back(random_matrix<Scalar>(T, d, 1010 + 10 * d + g));

    attn.prefill_into(shared, query_views(G, [&](Index g) { return Q[g].topRows(T0); }),
                      K.topRows(T0), V.topRows(T0),
                      output_views(G, [&](Index g) { return group_out[g].topRows(T0); }));
    for (Index t = T0; t < T; ++t)
      attn.step_into(shared, query_views(G, [&](Index g) { return Q[g].row(t); }), K.row(t),
                     V.row(t), output_views(G, [&](Index g) { return group_out[g].row(t); }));

    for (Index g = 0; g < G; ++g) {
      CAPTURE(g);
      Mat y(T, d);
      attn.prefill_into(heads[g], Q[g].topRows(T0), K.topRows(T0), V.topRows(T0), y.topRows(T0));
      for (Index t = T0; t < T; ++t)
        attn.step_into(heads[g], Q[g].row(t), K.row(t), V.row(t), y.row(t));
      CHECK(group_out[g] == y);
      check_same_state(shared, heads[g]);
    }
    CHECK(shared.tokens() == T);
  }
}

TEST_CASE("grouped step_into leaves the state unchanged when any head's denominator fails",
          "[group]") {
  // Identity features, dk = 2: after k = (1, 0) the state has z = (1, 0), so head 0's query
  // (1, 0) reads 1 / 1 and head 1's (0, 1) divides by 0.
  RowMatrix<double> Qg(2, 2);
  Qg << 1, 0, 0, 1;
  const auto queries = query_views(2, [&](Index g) { return Qg.row(g); });
  const auto head0 = query_views(1, [&](Index g) { return Qg.row(g); });
  for (Index block : {1, 4}) {
    CAPTURE(block);
    const LinearAttention<Identity, double> attn(Identity{}, Options{{}, 32, block});
    auto state = attn.make_state(2, 2);
    RowMatrix<double> Y = RowMatrix<double>::Constant(2, 2, -7.0);
    const auto outputs = output_views(2, [&](Index g) { return Y.row(g); });
    const auto output0 = output_views(1, [&](Index g) { return Y.row(g); });
    const Eigen::RowVector2d k_bad(1, 0), v(3, 5);
    try {
      attn.step_into(state, queries, k_bad, v, outputs);
      FAIL("expected a DenominatorError");
    } catch (const DenominatorError& e) {
      CHECK(e.row() == 0);
      CHECK(e.value() == 0.0);
    }
    CHECK_THROWS_AS(attn.step_into(state, queries, k_bad, v, outputs), DenominatorError);
    CHECK(state.tokens() == 0);
    CHECK(state.pending_tokens() == 0);
    CHECK(state.z() == ColVector<double>::Zero(2));
    CHECK(state.S() == RowMatrix<double>::Zero(2, 2));
    CHECK(Y == RowMatrix<double>::Constant(2, 2, -7.0));  // no head's output written

    // A good token afterwards: k = (1, 1) gives z = (1, 1), S = k^T v, both heads read v.
    const Eigen::RowVector2d k_good(1, 1);
    attn.step_into(state, queries, k_good, v, outputs);
    CHECK(state.tokens() == 1);
    CHECK(state.z() == ColVector<double>::Ones(2));
    CHECK(Y.row(0) == v);
    CHECK(Y.row(1) == v);

    // And from a non-empty state: k = (1, -1) makes z = (2, 0); head 1 fails again.
    const auto S_before = state.S();
    const ColVector<double> z_before = state.z();
    const Index pending_before = state.pending_tokens();
    Y.setConstant(-7.0);
    const Eigen::RowVector2d k_cancel(1, -1), v2(1, 2);
    CHECK_THROWS_AS(attn.step_into(state, queries, k_cancel, v2, outputs), DenominatorError);
    CHECK(state.tokens() == 1);
    CHECK(state.pending_tokens() == pending_before);
    CHECK(state.S() == S_before);
    CHECK(state.z() == z_before);
    CHECK(Y == RowMatrix<double>::Constant(2, 2, -7.0));
    // Head 0 alone reads that token fine: (S + (1, -1)^T v2) at q = (1, 0) is (3 + 1, 5 + 2) / 2.
    attn.step_into(state, head0, k_cancel, v2, output0);
    CHECK(state.tokens() == 2);
    CHECK(Y.row(0) == Eigen::RowVector2d(2.0, 3.5));
  }
}

TEST_CASE("grouped prefill_into keeps the chunks before a failing denominator", "[group]") {
  // T = 6 in chunks of 2, identity features. Keys: z after row t has second component
  // 1, 1, 1, 0, 0, 0; head 0 queries (1, 0) everywhere (denominators t + 1), head 1 the same
  // but (0, 1) at row 3, whose denominator is 0: the failure is in chunk [2, 4), head 1 only.
  const Index T = 6;
  RowMatrix<double> K(T, 2), Q0(T, 2), Q1(T, 2);
  K << 1, 1, 1, 0, 1, 0, 1, -1, 1, 0, 1, 0;
  Q0 << 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0;
  Q1 = Q0;
  Q1.row(3) << 0, 1;
  const LinearAttention<Identity, double> attn(Identity{}, Options{{}, 2});
  for (Index dv : {1, 16}) {  // the Eigen kernel and (16: whole packets) the register kernel
    CAPTURE(dv);
    RowMatrix<double> V(T, dv);
    for (Index t = 0; t < T; ++t)
      for (Index c = 0; c < dv; ++c) V(t, c) = double(t + 2 * c + 1);  // integers: exact sums
    auto state = attn.make_state(2, dv);
    std::vector<RowMatrix<double>> out(2, RowMatrix<double>::Zero(T, dv));
    const auto queries =
        query_views(2, [&](Index g) -> const RowMatrix<double>& { return g == 0 ? Q0 : Q1; });
    try {
      attn.prefill_into(state, queries, K, V,
                        output_views(2, [&](Index g) -> RowMatrix<double>& { return out[g]; }));
      FAIL("expected a DenominatorError");
    } catch (const DenominatorError& e) {
      CHECK(e.row() == 3);
      CHECK(e.value() == 0.0);
    }
    CHECK(state.tokens() == 2);
    // The first chunk only: S = k0^T v0 + k1^T v1 = [v0 + v1; v0], z = (2, 1).
    RowMatrix<double> S(2, dv);
    S.row(0) = V.row(0) + V.row(1);
    S.row(1) = V.row(0);
    CHECK(state.S() == S);
    CHECK(state.z() == ColVector<double>{{2}, {1}});
    // Head 0 came before the failing head: its rows through the failing chunk are written.
    const RowMatrix<double> head0 = attn.parallel(Q0, K, V, Mask::causal);
    CHECK(out[0].topRows(4) == head0.topRows(4));
  }
}

TEST_CASE("grouped calls reject bad groups and shapes with ShapeError", "[group]") {
  // (The old calls also took a head count, which could be negative; a span's size cannot.)
  const Index T = 5, dk = 4, dv = 3;
  const LinearAttention<EluPlusOne> attn;
  const auto qkv = random_qkv<float>(T, dk, dv, 1100);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const RowMatrix<float> Q_wide = random_matrix<float>(T, dk + 1, 1103);
  auto state = attn.make_state(dk, dv);
  RowMatrix<float> out0(T, dv), out1(T, dv), out_long(T, dv + 1), out_short(T - 1, dv);
  const auto queries = query_views(2, [&](Index) -> const RowMatrix<float>& { return Q; });
  const auto outputs =
      output_views(2, [&](Index g) -> RowMatrix<float>& { return g == 0 ? out0 : out1; });
  const std::vector<ConstRowsView<float>> no_queries;
  const std::vector<RowsView<float>> no_outputs;

  // Prefill.
  CHECK_THROWS_AS(attn.prefill_into(state, no_queries, K, V, no_outputs), ShapeError);
  CHECK_THROWS_AS(attn.prefill_into(state, no_queries, K, V, no_outputs), std::invalid_argument);
  CHECK_THROWS_AS(attn.prefill_into(state, queries, K, V,
                                    output_views(1, [&](Index) { return out0.topRows(T); })),
                  ShapeError);  // fewer outputs than queries
  CHECK_THROWS_AS(
      attn.prefill_into(
          state, queries, K, V,
          output_views(2, [&](Index g) -> RowMatrix<float>& { return g == 0 ? out0 : out_long; })),
      ShapeError);
  CHECK_THROWS_AS(
      attn.prefill_into(
          state, queries, K, V,
          output_views(2, [&](Index g) -> RowMatrix<float>& { return g == 0 ? out0 : out_short; })),
      ShapeError);
  CHECK_THROWS_AS(
      attn.prefill_into(
          state,
          query_views(2, [&](Index g) -> const RowMatrix<float>& { return g == 0 ? Q : Q_wide; }),
          K, V, outputs),
      ShapeError);
  CHECK_THROWS_AS(attn.prefill_into(state, queries, K.topRows(T - 1), V.topRows(T - 1), outputs),
                  ShapeError);  // queries longer than the keys
  CHECK(state.tokens() == 0);

  // Decode.
  RowMatrix<float> Y(2, dv), Y_long(2, dv + 1);
  const auto q_at = query_views(2, [&](Index) { return Q.row(0); });
  const auto y_at = output_views(2, [&](Index g) { return Y.row(g); });
  CHECK_THROWS_AS(attn.step_into(state, no_queries, K.row(0), V.row(0), no_outputs), ShapeError);
  CHECK_THROWS_AS(attn.step_into(state, q_at, K.row(0), V.row(0),
                                 output_views(1, [&](Index g) { return Y.row(g); })),
                  ShapeError);
  CHECK_THROWS_AS(attn.step_into(state, q_at, K.row(0), V.row(0),
                                 output_views(2, [&](Index g) { return Y_long.row(g); })),
                  ShapeError);
  RowVector<float> y_short(dv - 1);
  const std::vector<RowsView<float>> one_short{output_view(Y.row(0)), output_view(y_short)};
  CHECK_THROWS_AS(attn.step_into(state, q_at, K.row(0), V.row(0), one_short), ShapeError);
  const std::vector<ConstRowsView<float>> one_wide{rows_view(Q.row(0)), rows_view(Q_wide.row(0))};
  CHECK_THROWS_AS(attn.step_into(state, one_wide, K.row(0), V.row(0), y_at), ShapeError);
  CHECK(state.tokens() == 0);
  // A wrong query shape is caught before the token is absorbed under every normalization,
  // including one that checks no denominator.
  const LinearAttention<EluPlusOne> raw(EluPlusOne{}, Options{Normalization::unnormalized()});
  auto raw_state = raw.make_state(dk, dv);
  Y.setConstant(-3.0f);
  CHECK_THROWS_AS(raw.step_into(raw_state, one_wide, K.row(0), V.row(0), y_at), ShapeError);
  CHECK(raw_state.tokens() == 0);
  CHECK(raw_state.z().isZero(0));
  CHECK((Y.array() == -3.0f).all());
  // A state made by another attention is refused before anything changes.
  const LinearAttention<Identity> other;
  auto other_state = other.make_state(dk, dv);
  CHECK_THROWS_AS(attn.step_into(other_state, q_at, K.row(0), V.row(0), y_at), StateMismatchError);
  CHECK_THROWS_AS(attn.prefill_into(other_state, queries, K, V, outputs), StateMismatchError);
  CHECK(other_state.tokens() == 0);
  // And the calls work once the shapes fit.
  CHECK_NOTHROW(attn.prefill_into(state, queries, K, V, outputs));
  CHECK_NOTHROW(attn.step_into(state, q_at, K.row(0), V.row(0), y_at));
  CHECK(state.tokens() == T + 1);
}

// ---- grouped calls read the caller's query heads in place -----------------------------------

namespace {

// Where one input handed to a feature map lay: its first element, rows, columns and the
// distance between its rows.
struct MapInput {
  const void* data;
  Index rows, cols, outer_stride;
};

// ELU + 1 that records every input it is given (the library's grouped calls hand the map each
// query head's rows; read in place, those lie inside the caller's query buffer).
struct RecordingEluPlusOne {
  static constexpr bool strictly_positive = true;
  std::vector<MapInput>* inputs = nullptr;
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    if constexpr ((In::Flags & Eigen::DirectAccessBit) != 0)
      inputs->push_back(
          {x.data(), x.rows(), x.cols(), x.rows() > 1 ? Index(x.outerStride()) : x.cols()});
    else
      inputs->push_back({nullptr, x.rows(), x.cols(), 0});
    EluPlusOne{}.apply(x, out);
  }
};
static_assert(FeatureMap<RecordingEluPlusOne>);

// For a [T, G*d] row-major query buffer: which (head, row) pairs the recorded inputs took from
// inside the buffer. An input inside the buffer must be rows of exactly one head (d columns,
// the buffer's row stride), or it was not that head read in place.
std::vector<std::vector<bool>> rows_read_in_place(const std::vector<MapInput>& inputs,
                                                  const RowMatrix<float>& buffer, Index G,
                                                  Index d) {
  const Index T = buffer.rows();
  std::vector<std::vector<bool>> seen(static_cast<std::size_t>(G),
                                      std::vector<bool>(static_cast<std::size_t>(T), false));
  const auto begin = reinterpret_cast<std::uintptr_t>(buffer.data());
  const auto end = begin + sizeof(float) * static_cast<std::size_t>(buffer.size());
  for (const MapInput& in : inputs) {
    const auto p = reinterpret_cast<std::uintptr_t>(in.data);
    if (in.data == nullptr || p < begin || p >= end) continue;
    const auto offset = static_cast<Index>((p - begin) / sizeof(float));
    const Index row = offset / (G * d), col = offset % (G * d);
    CAPTURE(row, col, in.rows, in.cols, in.outer_stride);
    CHECK(col % d == 0);
    CHECK(in.cols == d);
    CHECK((in.rows == 1 || in.outer_stride == G * d));
    REQUIRE(row + in.rows <= T);
    for (Index i = row; i < row + in.rows; ++i)
      seen[static_cast<std::size_t>(col / d)][static_cast<std::size_t>(i)] = true;
  }
  return seen;
}

bool all_read(const std::vector<std::vector<bool>>& seen) {
  for (const auto& head : seen)
    for (bool row : head)
      if (!row) return false;
  return true;
}

}  // namespace

TEST_CASE("grouped calls hand the feature map each query head in place", "[group][views]") {
  // G = 3 heads of d = 8 side by side in one [T, G*d] buffer, as a model stores them. Every
  // grouped entry point, with the heads given as a vector of row views and as a tensor view,
  // must give the map each head's rows where they lie: every (head, row) of the buffer seen
  // by the map inside that head's columns. The outputs are those of ELU + 1 itself.
  const Index T = 21, G = 3, d = 8;
  const auto Qbuf = random_matrix<float>(T, G * d, 1300);
  const auto K = random_matrix<float>(T, d, 1301), V = random_matrix<float>(T, d, 1302);
  std::vector<MapInput> inputs;
  const RecordingEluPlusOne spy{&inputs};
  const LinearAttention<RecordingEluPlusOne> attn(spy, Options{{}, 8});
  const LinearAttention<EluPlusOne> plain(EluPlusOne{}, Options{{}, 8});
  const RuleAttention<RecordingEluPlusOne, Decay> decay(spy, Decay(0.9), Options{{}, 8});
  const RuleAttention<EluPlusOne, Decay> plain_decay(EluPlusOne{}, Decay(0.9), Options{{}, 8});
  const auto span_of = [&](const RowMatrix<float>& buffer) {
    return query_views(G, [&](Index g) { return buffer.middleCols(g * d, d); });
  };
  const auto tensor_of = [&](const RowMatrix<float>& buffer) {
    return TensorView<const float>::batch_first(buffer.data(), 1, buffer.rows(), G, d);
  };
  RowMatrix<float> Obuf(T, G * d);
  const auto outputs = output_views(G, [&](Index g) { return Obuf.middleCols(g * d, d); });
  const auto check_outputs = [&](const auto& reference, auto&& per_head) {
    for (Index g = 0; g < G; ++g) {
      CAPTURE(g);
      const RowMatrix<float> Qg = Qbuf.middleCols(g * d, d);
      CHECK(Obuf.middleCols(g * d, d) == per_head(reference, Qg));
    }
  };

  for (bool as_tensor : {false, true}) {
    CAPTURE(as_tensor);
    {  // stateless, full and causal
      for (const Mask mask : {Mask(Mask::none), Mask(Mask::causal)}) {
        CAPTURE(mask == Mask::causal);
        inputs.clear();
        if (as_tensor)
          attn.parallel_into(tensor_of(Qbuf), K, V, mask, outputs);
        else
          attn.parallel_into(span_of(Qbuf), K, V, mask, outputs);
        CHECK(all_read(rows_read_in_place(inputs, Qbuf, G, d)));
        check_outputs(plain, [&](const auto& a, const RowMatrix<float>& Qg) {
          return a.parallel(Qg, K, V, mask);
        });
      }
      inputs.clear();
      if (as_tensor)
        decay.parallel_into(tensor_of(Qbuf), K, V, Mask::causal, outputs);
      else
        decay.parallel_into(span_of(Qbuf), K, V, Mask::causal, outputs);
      CHECK(all_read(rows_read_in_place(inputs, Qbuf, G, d)));
      check_outputs(plain_decay, [&](const auto& a, const RowMatrix<float>& Qg) {
        return a.parallel(Qg, K, V, Mask::causal);
      });
    }
    {  // prefill, then one decode token
      auto state = attn.make_state(d, d);
      auto decay_state = decay.make_state(d, d);
      inputs.clear();
      if (as_tensor)
        attn.prefill_into(state, tensor_of(Qbuf), K, V, outputs);
      else
        attn.prefill_into(state, span_of(Qbuf), K, V, outputs);
      CHECK(all_read(rows_read_in_place(inputs, Qbuf, G, d)));
      check_outputs(plain, [&](const auto& a, const RowMatrix<float>& Qg) {
        return a.parallel(Qg, K, V, Mask::causal);
      });
      inputs.clear();
      if (as_tensor)
        decay.prefill_into(decay_state, tensor_of(Qbuf), K, V, outputs);
      else
        decay.prefill_into(decay_state, span_of(Qbuf), K, V, outputs);
      CHECK(all_read(rows_read_in_place(inputs, Qbuf, G, d)));
      check_outputs(plain_decay, [&](const auto& a, const RowMatrix<float>& Qg) {
        return a.parallel(Qg, K, V, Mask::causal);
      });

      // One decode token: the G queries side by side in one [1, G*d] row.
      const auto q = random_matrix<float>(1, G * d, 1303);
      const auto k = random_matrix<float>(1, d, 1304), v = random_matrix<float>(1, d, 1305);
      RowMatrix<float> Y(1, G * d);
      const auto y_heads = output_views(G, [&](Index g) { return Y.middleCols(g * d, d); });
      for (int rule = 0; rule < 2; ++rule) {
        CAPTURE(rule);
        inputs.clear();
        if (rule == 0 && as_tensor) attn.step_into(state, tensor_of(q), k, v, y_heads);
        if (rule == 0 && !as_tensor) attn.step_into(state, span_of(q), k, v, y_heads);
        if (rule == 1 && as_tensor) decay.step_into(decay_state, tensor_of(q), k, v, y_heads);
        if (rule == 1 && !as_tensor) decay.step_into(decay_state, span_of(q), k, v, y_heads);
        CHECK(all_read(rows_read_in_place(inputs, q, G, d)));
      }
      CHECK(state.tokens() == T + 1);
      CHECK(decay_state.tokens() == T + 1);
    }
  }
}

// ---- the one attention class --------------------------------------------------------------

TEMPLATE_TEST_CASE(
    "RuleAttention<Phi, Additive> is LinearAttention and Mask::none is the full read", "[rules]",
    float, double) {
  // The old trap: RuleAttention::parallel(Q, K, V) without a mask was causal while
  // LinearAttention's was full. Now both are one type and the mask is always spelled out.
  static_assert(std::is_same_v<RuleAttention<EluPlusOne, Additive, float>,
                               LinearAttention<EluPlusOne, float>>);
  static_assert(std::is_same_v<RuleAttention<EluPlusOne, Additive, TestType>,
                               LinearAttention<EluPlusOne, TestType>>);
  static_assert(std::is_same_v<RuleAttention<Identity>, LinearAttention<Identity>>);
  const Index T = 90, dk = 12, dv = 7;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 1400);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const RuleAttention<EluPlusOne, Additive, TestType> rule(EluPlusOne{}, Additive{}, Options{});
  const LinearAttention<EluPlusOne, TestType> linear;
  const auto full_ref = naive_attention(Q, K, V, false, linattn_test::elu_plus_one);
  const auto causal_ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
  const double units = bound_units(dk, T);

  const RowMatrix<TestType> full = rule.parallel(Q, K, V, Mask::none);
  CHECK(full == linear.parallel(Q, K, V, Mask::none));
  CHECK(worst_error_ratio<TestType>(full, full_ref, units) <= 1);
  // The causal read is a different answer: it does not pass for the full one.
  const RowMatrix<TestType> causal = rule.parallel(Q, K, V, Mask::causal);
  CHECK(causal == linear.parallel(Q, K, V, Mask::causal));
  CHECK(worst_error_ratio<TestType>(causal, causal_ref, units) <= 1);
  CHECK(worst_error_ratio<TestType>(causal, full_ref, units) > 1);
  // A run-time Mask picks the same paths.
  CHECK(rule.parallel(Q, K, V, Mask(Mask::none)) == full);
  CHECK(rule.parallel(Q, K, V, Mask(Mask::causal)) == causal);
  // And the states are one type: a state of either serves the other.
  auto state = rule.make_state(dk, dv);
  static_assert(std::is_same_v<decltype(state), AttentionState<TestType>>);
  CHECK(linear.prefill(state, Q, K, V) == causal);
  CHECK(state.tokens() == T);
}

}  // namespace attention_test
