// The detail kernels behind attention.hpp's additive paths: the chunked form
// (detail/chunked.hpp) over chunk sizes that do and do not divide T, T < C, T = 1, carried
// state and errors mid-sequence; its register kernel (detail/small_gemm.hpp) and the walk of
// the next chunk's rows that the kernel's tiles prefetch along (detail/prefetch.hpp); the fused
// recurrent sweep (detail/recurrent_sweep.hpp) over value widths that exercise its full and
// remainder column blocks in both sweep directions; the deferred decode (detail/deferred.hpp)
// and the shared reads absorb()/read_into(); and a length whose T x T matrix could not be
// allocated. References: the double loop of test_support.hpp, quadratic_attention and the
// recurrent path.

#include <linattn/attention.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/prefetch.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/detail/stream_store.hpp>
#include <linattn/reference.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

namespace kernels_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::naive_attention;
using linattn_test::random_matrix;
using linattn_test::random_qkv;
using linattn_test::unit_roundoff;
using linattn_test::worst_error_ratio;

namespace {

// Rounding bound in units of u for a normalized read over T keys with r features, as in
// attention_test.cpp: each weight phi(q)^T phi(k) carries gamma_r, the sum over T keys gamma_T
// (the chunked form sums a chunk's keys inside a GEMM and earlier chunks through S, which is a
// re-association of the same T terms, so the recursive-sum bound still covers it), numerator
// and denominator each, plus the division and the feature map's few ulps: 2 (r + T + 4) u
// times sum |w| |v| / |den|.
double bound_units(Index r, Index T) { return 2.0 * static_cast<double>(r + T + 4); }

template <class Scalar>
using Attn = LinearAttention<EluPlusOne, Scalar>;

template <class Scalar>
Attn<Scalar> with_chunk(Index chunk) {
  return Attn<Scalar>(EluPlusOne{}, Options{{}, chunk});
}

// Causal parallel over Q, K, V in pieces of 1, 40 (not a multiple of C = 16), 16, 77 and 16
// tokens (T = 150), carrying `state` across the calls; the outputs of all pieces.
template <class Scalar, class Attention, class M, class MV>
linattn::RowMatrix<Scalar> parallel_in_pieces(const Attention& attn, const M& Q, const M& K,
                                              const MV& V, AttentionState<Scalar>& state) {
  linattn::RowMatrix<Scalar> out(Q.rows(), V.cols());
  Index first = 0;
  for (Index n : {1, 40, 16, 77, 16}) {
    out.middleRows(first, n) =
        attn.prefill(state, Q.middleRows(first, n), K.middleRows(first, n), V.middleRows(first, n));
    first += n;
  }
  REQUIRE(first == Q.rows());
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("chunked causal path agrees with a double loop for every chunk size",
                   "[chunked]", float, double) {
  struct Shape {
    Index T, dk, dv;
  };
  // T = 1; T < C; C dividing T (96 = 3 * 32) and not (97, 130); dk != dv.
  const std::vector<Shape> shapes{{1, 5, 3}, {2, 4, 4}, {31, 8, 8}, {96, 16, 12}, {97, 12, 20},
                                  {130, 9, 70}};
  for (const Shape& s : shapes) {
    const auto Q = random_matrix<TestType>(s.T, s.dk, 100 + s.T);
    const auto K = random_matrix<TestType>(s.T, s.dk, 200 + s.T);
    const auto V = random_matrix<TestType>(s.T, s.dv, 300 + s.T);
    const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
    const double units = bound_units(s.dk, s.T);
    const auto quadratic = quadratic_attention(EluPlusOne{}, Q, K, V, Mask::causal);
    const auto recurrent = Attn<TestType>().recurrent(Q, K, V);
    CHECK(worst_error_ratio<TestType>(quadratic, ref, units) <= 1);
    CHECK(worst_error_ratio<TestType>(recurrent, ref, units) <= 1);
    for (Index chunk : {1, 2, 3, 7, 16, 31, 32, 33, 64, 1000}) {
      CAPTURE(s.T, s.dk, s.dv, chunk);
      auto state = with_chunk<TestType>(chunk).make_state(s.dk, s.dv);
      const auto out = with_chunk<TestType>(chunk).prefill(state, Q, K, V);
      CHECK(worst_error_ratio<TestType>(out, ref, units) <= 1);
      CHECK(state.tokens() == s.T);
      // Agreement with the other two forms follows (each is within the bound of the exact
      // value); checked directly as well, with twice the bound since both sides round.
      const double u = unit_roundoff<TestType>();
      for (Index i = 0; i < s.T; ++i)
        for (Index c = 0; c < s.dv; ++c) {
          const double allowed = 2 * units * u * ref.magnitude(i, c);
          CHECK(std::abs(double(out(i, c)) - double(quadratic(i, c))) <= allowed);
          CHECK(std::abs(double(out(i, c)) - double(recurrent(i, c))) <= allowed);
        }
    }
  }
}

TEMPLATE_TEST_CASE("chunked state equals the recurrent state and carries across calls",
                   "[chunked][state]", float, double) {
  const Index T = 150, dk = 10, dv = 6;
  // Not a structured binding: clang 14 lambdas cannot capture those.
  const auto qkv = random_qkv<TestType>(T, dk, dv, 11);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
  const double units = bound_units(dk, T);

  // S and z in double from the formula: sums of T positive-weight terms, so each entry agrees
  // to gamma_T relative to sum |phi(k)| |v| (sum phi(k) for z): bound 2 (T + 4) u times that.
  linattn::RowMatrix<double> kf(T, dk);
  for (Index t = 0; t < T; ++t)
    for (Index n = 0; n < dk; ++n) kf(t, n) = linattn_test::elu_plus_one(double(K(t, n)));
  const linattn::RowMatrix<double> S_exact = kf.transpose() * V.template cast<double>();
  const linattn::RowMatrix<double> S_scale = kf.transpose() * V.template cast<double>().cwiseAbs();
  const double u = unit_roundoff<TestType>(), s_units = 2.0 * static_cast<double>(T + 4);
  const auto check_state = [&](const AttentionState<TestType>& st) {
    REQUIRE(st.tokens() == T);
    for (Index i = 0; i < dk; ++i) {
      for (Index c = 0; c < dv; ++c)
        CHECK(std::abs(double(st.S()(i, c)) - S_exact(i, c)) <= s_units * u * S_scale(i, c));
      CHECK(std::abs(double(st.z()(i)) - kf.col(i).sum()) <= s_units * u * kf.col(i).sum());
    }
  };

  // Pieces of 1, 40 (not a multiple of C = 16), 16, 77 and 16 tokens, chunk size 16.
  const auto attn = with_chunk<TestType>(16);
  auto state = attn.make_state(dk, dv);
  const auto out = parallel_in_pieces<TestType>(attn, Q, K, V, state);
  CHECK(worst_error_ratio<TestType>(out, ref, units) <= 1);
  check_state(state);

  auto recurrent_state = attn.make_state(dk, dv);
  (void)attn.recurrent(recurrent_state, Q, K, V);
  check_state(recurrent_state);
}

TEST_CASE("a DenominatorError mid-sequence leaves the state holding the earlier chunks",
          "[chunked][errors]") {
  // Identity features: keys (1, 0) except key 45 = (-45, 0), so query (1, 0) sees the running
  // sum 1, 2, ..., 45, then 45 - 45 = 0 at row 45, inside the fourth chunk of 12 (rows 36..47).
  const Index T = 60;
  Eigen::MatrixXd Q = Eigen::MatrixXd::Zero(T, 2), K = Eigen::MatrixXd::Zero(T, 2);
  Q.col(0).setOnes();
  K.col(0).setOnes();
  K(45, 0) = -45;
  const Eigen::MatrixXd V = random_matrix<double>(T, 3, 7);
  const LinearAttention<Identity, double> attn(Identity{}, Options{{}, 12});
  auto state = attn.make_state(2, 3);
  try {
    (void)attn.prefill(state, Q, K, V);
    FAIL("expected a DenominatorError");
  } catch (const DenominatorError& e) {
    CHECK(e.row() == 45);
  }
  CHECK(state.tokens() == 36);  // three whole chunks
  // Exactly the state of the first 36 tokens: S = sum of v_t over them (keys are (1, 0)), z =
  // (36, 0); integer-valued z is exact, S to the rounding of 36 additions.
  const Eigen::RowVectorXd expected = V.topRows(36).colwise().sum();
  CHECK(state.z()(0) == 36.0);
  CHECK(state.z()(1) == 0.0);
  for (Index c = 0; c < 3; ++c)
    CHECK(std::abs(state.S()(0, c) - expected(c)) <=
          2.0 * 40 * unit_roundoff<double>() * V.col(c).head(36).cwiseAbs().sum());
  CHECK(state.S().row(1).isZero(0.0));
}

TEMPLATE_TEST_CASE("the fused sweep matches a double loop over full and remainder blocks",
                   "[recurrent]", float, double) {
  // sweep_width is four SIMD packets of this build (64 floats with AVX-512, 16 with SSE): dv
  // below, at, and between multiples of it, with and without a scalar tail.
  constexpr Index W = detail::sweep_width<TestType>;
  for (Index dv : {Index{1}, Index{5}, W - 1, W, W + 3, 2 * W, 2 * W + 2}) {
    for (Index r : {1, 7, 33}) {
      CAPTURE(dv, r);
      auto S = random_matrix<TestType>(r, dv, 5 + dv);
      const auto qf = random_matrix<TestType>(1, r, 6);
      const auto kf = random_matrix<TestType>(1, r, 7);
      const auto v = random_matrix<TestType>(1, dv, 8);
      for (bool reverse : {false, true}) {
        auto S_run = S;
        linattn::RowMatrix<TestType> y(1, dv);
        detail::update_and_read(S_run.data(), dv, r, dv, qf.data(), kf.data(), v.data(), y.data(),
                                reverse);
        // Each S entry is one fused multiply-add away from exact: |error| <= 2u |terms|.
        // y_c = sum_i qf_i S'_ic, a sum of r products: gamma_{r+1} relative to sum |qf| |S'|
        // (plus the S' error carried through qf): 2 (r + 3) u.
        const double u = unit_roundoff<TestType>();
        for (Index c = 0; c < dv; ++c) {
          double y_exact = 0, y_scale = 0;
          for (Index i = 0; i < r; ++i) {
            const double s_new = double(S(i, c)) + double(kf(0, i)) * double(v(0, c));
            const double s_scale = std::abs(double(S(i, c))) + std::abs(double(kf(0, i)) * v(0, c));
            CHECK(std::abs(double(S_run(i, c)) - s_new) <= 2 * u * s_scale);
            y_exact += double(qf(0, i)) * s_new;
            y_scale += std::abs(double(qf(0, i))) * s_scale;
          }
          CHECK(std::abs(double(y(0, c)) - y_exact) <=
                2.0 * static_cast<double>(r + 3) * u * y_scale);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("step and recurrent agree with a double loop for wide and odd value widths",
                   "[recurrent]", float, double) {
  // Odd and even token counts exercise both sweep directions; dv crosses the block widths.
  constexpr Index W = detail::sweep_width<TestType>;
  for (Index dv : {Index{3}, W, W + 6, 2 * W + 1}) {
    const Index T = 41, dk = 65;
    CAPTURE(dv);
    const auto qkv = random_qkv<TestType>(T, dk, dv, 51);
    const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
    const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
    const double units = bound_units(dk, T);
    const Attn<TestType> attn;
    CHECK(worst_error_ratio<TestType>(attn.recurrent(Q, K, V), ref, units) <= 1);
    // Column-major V: its rows are strided, so the kernel reads a contiguous copy.
    const Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic> Vcol = V;
    CHECK(worst_error_ratio<TestType>(attn.recurrent(Q, K, Vcol), ref, units) <= 1);
    auto state = attn.make_state(dk, dv);
    linattn::RowMatrix<TestType> stepped(T, dv);
    for (Index t = 0; t < T; ++t) stepped.row(t) = attn.step(state, Q.row(t), K.row(t), Vcol.row(t));
    CHECK(worst_error_ratio<TestType>(stepped, ref, units) <= 1);
    // The sweep direction depends on the token's position only: the same inputs give the same
    // bits on a second run.
    CHECK(attn.recurrent(Q, K, V) == attn.recurrent(Q, K, V));
  }
}

TEST_CASE("a length whose T x T score matrix could not be allocated runs in O(T) memory",
          "[chunked]") {
  // T = 300,000: a T x T float matrix would take 360 GB. The chunked path holds a few chunks.
  const Index T = 300000, d = 4;
  const auto qkv = random_qkv<float>(T, d, d, 61);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const Attn<float> attn;
  const auto out = attn.parallel(Q, K, V, Mask::causal);
  REQUIRE(out.rows() == T);
  // Check the last row against the formula in double: y = sum_j w_j v_j / sum_j w_j over all
  // j <= T - 1 with w_j = phi(q)^T phi(k_j) > 0, bound 2 (d + T + 4) u relative to the weighted
  // mean of |v| (all weights positive, so sum |w| |v| / |den| is that mean).
  const Index i = T - 1;
  double num[d] = {}, mag[d] = {}, den = 0;
  for (Index j = 0; j <= i; ++j) {
    double w = 0;
    for (Index n = 0; n < d; ++n)
      w += linattn_test::elu_plus_one(Q(i, n)) * linattn_test::elu_plus_one(K(j, n));
    den += w;
    for (Index c = 0; c < d; ++c) {
      num[c] += w * V(j, c);
      mag[c] += w * std::abs(double(V(j, c)));
    }
  }
  for (Index c = 0; c < d; ++c)
    CHECK(std::abs(double(out(i, c)) - num[c] / den) <=
          bound_units(d, T) * unit_roundoff<float>() * mag[c] / den);
}

// ---- the register kernel behind the chunked path (detail/small_gemm.hpp) --------------------

TEMPLATE_TEST_CASE("small_gemm matches a double loop for every tile shape and triangle",
                   "[chunked][kernel]", float, double) {
  using Tile = detail::GemmTile<TestType>;
  using detail::Triangle;
  const Index L = Tile::lanes, W = Tile::width;
  const double u = unit_roundoff<TestType>();
  // m crosses the row tile (6) and its remainders; n crosses the column panel and its packet
  // remainders; depth 0 leaves C as it was (or zero).
  for (Index m : {1, 2, 5, 6, 7, 13}) {
    for (Index n : {L, 2 * L, W, W + L, 2 * W + L}) {
      for (Index depth : {0, 1, 7, 33}) {
        for (Triangle tri : {Triangle::none, Triangle::lower_lhs, Triangle::lower_result}) {
          // Leading dimensions wider than the matrices, so strides are exercised.
          const Index lda = depth + 3, ldb = n + L, ldc = n + 2 * L;
          auto A = random_matrix<TestType>(m, lda, 71 + m);
          const auto B = random_matrix<TestType>(std::max<Index>(depth, 1), ldb, 72 + n);
          const auto C0 = random_matrix<TestType>(m, ldc, 73 + depth);
          const auto scale = random_matrix<TestType>(1, m, 74);
          if (tri == Triangle::lower_lhs)  // the contract: A(i, k) = 0 for k > i
            for (Index i = 0; i < m; ++i)
              for (Index k = i + 1; k < depth; ++k) A(i, k) = 0;
          for (bool accumulate : {false, true}) {
            for (bool scaled : {false, true}) {
              CAPTURE(m, n, depth, int(tri), accumulate, scaled);
              auto C = C0;
              const TestType* s = scaled ? scale.data() : nullptr;
              if (accumulate)
                detail::small_gemm<TestType, true>(m, n, depth, A.data(), lda, B.data(), ldb,
                                                   C.data(), ldc, tri, s);
              else
                detail::small_gemm<TestType, false>(m, n, depth, A.data(), lda, B.data(), ldb,
                                                    C.data(), ldc, tri, s);
              // Each entry is a sum of depth (+1 with C's old value) products, then one
              // multiply: |error| <= gamma_(depth + 2) times the sum of magnitudes; 2 (depth +
              // 2) u covers it.
              for (Index i = 0; i < m; ++i) {
                for (Index j = 0; j < ldc; ++j) {
                  const bool computed = j < n && (tri != Triangle::lower_result || j <= i);
                  const bool may_be_written = j < n;  // lower_result leaves the rest alone
                  if (!computed) {
                    if (!may_be_written) CHECK(C(i, j) == C0(i, j));
                    continue;
                  }
                  double exact = accumulate ? double(C0(i, j)) : 0.0;
                  double magnitude = std::abs(exact);
                  for (Index k = 0; k < depth; ++k) {
                    exact += double(A(i, k)) * double(B(k, j));
                    magnitude += std::abs(double(A(i, k)) * double(B(k, j)));
                  }
                  const double factor = scaled ? double(scale(0, i)) : 1.0;
                  CHECK(std::abs(double(C(i, j)) - exact * factor) <=
                        2.0 * double(depth + 2) * u * magnitude * std::abs(factor) +
                            std::numeric_limits<TestType>::min());
                }
              }
            }
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("transpose_into copies exactly across packet blocks and edges",
                   "[chunked][kernel]", float, double) {
  const Index L = detail::GemmTile<TestType>::lanes;
  for (Index rows : {Index{1}, L - 1, L, L + 1, 2 * L + 3}) {
    for (Index cols : {Index{1}, L, L + 2, 3 * L}) {
      CAPTURE(rows, cols);
      const Index lds = cols + 1, ldd = rows + 2;
      const auto src = random_matrix<TestType>(rows, lds, 81);
      linattn::RowMatrix<TestType> dst = linattn::RowMatrix<TestType>::Constant(cols, ldd, -7);
      detail::transpose_into(rows, cols, src.data(), lds, dst.data(), ldd);
      CHECK(dst.leftCols(rows) == src.leftCols(cols).transpose());
      CHECK((dst.rightCols(ldd - rows).array() == TestType(-7)).all());  // padding untouched
    }
  }
}

TEMPLATE_TEST_CASE("stream_copy copies exactly from every alignment and touches nothing else",
                   "[kernel]", float, double, int) {
  // Every start offset within two streaming packets, lengths around the packet: the aligned
  // middle streams, the head and the tail are copied plainly; the guard cells stay as they were.
  constexpr Index kGuard = 8;
  const Index packet = Index(64 / sizeof(TestType));
  std::vector<TestType> src(std::size_t(4 * packet + 2 * kGuard)), dst(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = TestType(int(i) * 3 + 1);
  for (Index offset = 0; offset < 2 * packet; ++offset)
    for (Index n : {Index{0}, Index{1}, packet - 1, packet, packet + 1, 2 * packet + 3}) {
      CAPTURE(offset, n);
      std::fill(dst.begin(), dst.end(), TestType(-5));
      detail::stream_copy(src.data() + kGuard, n, dst.data() + kGuard + offset);
      detail::stream_fence();
      for (Index i = 0; i < Index(dst.size()); ++i) {
        const Index j = i - kGuard - offset;  // the index into the copied run
        const TestType expected = j >= 0 && j < n ? src[std::size_t(kGuard + j)] : TestType(-5);
        if (dst[std::size_t(i)] != expected) FAIL_CHECK("cell " << i);
      }
    }
}

TEST_CASE("SpreadPrefetch walks every line of the queued rows once, in order, within each budget",
          "[chunked][kernel]") {
  // Rows of 40 floats (160 bytes: lines at +0, +64, +128) lying 48 floats apart.
  constexpr Index kCols = 40, kStride = 48, kRows = 10;
  std::vector<float> a(std::size_t(kRows * kStride)), b(a.size());
  using Strided = Eigen::Map<const linattn::RowMatrix<float>, 0, Eigen::OuterStride<>>;
  const Strided A(a.data(), kRows, kCols, Eigen::OuterStride<>(kStride));
  const Strided B(b.data(), kRows, kCols, Eigen::OuterStride<>(kStride));
  const Eigen::MatrixXf column_major(kRows, kCols);
  // What the walk must touch: each queued row's three lines, ranges in the order queued.
  std::vector<const char*> expected;
  const auto lines_of = [&](const std::vector<float>& m, Index first, Index last) {
    for (Index i = first; i < last; ++i)
      for (Index byte : {0, 64, 128})
        expected.push_back(reinterpret_cast<const char*>(m.data() + i * kStride) + byte);
  };
  lines_of(a, 2, 7);
  lines_of(b, 8, kRows);  // rows [8, 20) clipped to the matrix
  for (Index budget : {1, 2, 3, 5, 16}) {
    CAPTURE(budget);
    detail::SpreadPrefetch plan;
    plan.add(A, 2, 5);
    plan.add(column_major, 0, 4);  // not row-major: skipped
    plan.add(A, kRows, 4);         // past the end: nothing
    plan.add(B, 8, 12);
    std::vector<const char*> seen;
    while (!plan.empty()) {
      const std::size_t before = seen.size();
      plan.visit(budget, [&](const char* line) { seen.push_back(line); });
      const auto used = Index(seen.size() - before);
      // The whole budget while lines remain, never more.
      if (plan.empty()) CHECK(used <= budget);
      else CHECK(used == budget);
      REQUIRE(used > 0);
    }
    CHECK(seen == expected);
  }
  // Past the queue's capacity a range is prefetched at once instead of queued; finish() empties
  // the plan for the next chunk.
  detail::SpreadPrefetch full;
  for (int i = 0; i < 17; ++i) full.add(A, Index(i % kRows), 1);
  Index queued = 0;
  while (!full.empty()) full.visit(1, [&](const char*) { ++queued; });
  CHECK(queued == 16 * 3);
  full.add(B, 0, 2);
  CHECK_FALSE(full.empty());
  full.finish();
  CHECK(full.empty());
}

TEMPLATE_TEST_CASE("the register-kernel chunked path agrees with a double loop",
                   "[chunked][kernel]", float, double) {
  // dv a multiple of the packet width takes the register kernel; widths cross its column
  // panel. Chunk sizes cross its row tile (6) and packet widths; T = 1, T < C, C not dividing T.
  using Tile = detail::GemmTile<TestType>;
  const Index L = Tile::lanes, W = Tile::width;
  for (Index dv : {L, W, W + L}) {
    for (Index dk : {1, 7, 20}) {
      for (Index T : {1, 45, 131}) {
        const auto Q = random_matrix<TestType>(T, dk, 91 + T);
        const auto K = random_matrix<TestType>(T, dk, 92 + T);
        const auto V = random_matrix<TestType>(T, dv, 93 + T);
        const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
        const double units = bound_units(dk, T);
        for (Index chunk : {1, 5, 6, 7, 16, 33, 64, 200}) {
          CAPTURE(dv, dk, T, chunk);
          const auto attn = with_chunk<TestType>(chunk);
          CHECK(worst_error_ratio<TestType>(attn.parallel(Q, K, V, Mask::causal), ref, units) <= 1);
          // Column-major V (read through a copy of each chunk) into a strided output view.
          const Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic> Vcol = V;
          linattn::RowMatrix<TestType> wide = linattn::RowMatrix<TestType>::Zero(T, dv + 3);
          auto state = attn.make_state(dk, dv);
          attn.prefill_into(state, Q, K, Vcol, wide.leftCols(dv));
          CHECK(worst_error_ratio<TestType>(wide.leftCols(dv), ref, units) <= 1);
          CHECK(wide.rightCols(3).isZero(0));
          CHECK(state.tokens() == T);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("the register-kernel chunked path carries state across uneven calls",
                   "[chunked][kernel][state]", float, double) {
  const Index L = detail::GemmTile<TestType>::lanes;
  const Index T = 150, dk = 10, dv = 2 * L;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 21);
  const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
  const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
  const auto attn = with_chunk<TestType>(16);
  auto state = attn.make_state(dk, dv);
  const auto out = parallel_in_pieces<TestType>(attn, Q, K, V, state);
  CHECK(worst_error_ratio<TestType>(out, ref, bound_units(dk, T)) <= 1);
  // The state after the pieces equals the recurrent state to rounding: both are sums of the
  // same T terms, so each entry is within 2 gamma_T of the exact sum (relative to the sum of
  // magnitudes, which is the sum itself for z).
  auto recurrent_state = attn.make_state(dk, dv);
  (void)attn.recurrent(recurrent_state, Q, K, V);
  const double u = unit_roundoff<TestType>(), units = 4.0 * double(T + 4);
  CHECK(state.tokens() == T);
  for (Index i = 0; i < dk; ++i) {
    CHECK(std::abs(double(state.z()(i)) - double(recurrent_state.z()(i))) <=
          units * u * double(recurrent_state.z()(i)));
    for (Index c = 0; c < dv; ++c) {
      double magnitude = 0;
      for (Index t = 0; t < T; ++t)
        magnitude += linattn_test::elu_plus_one(double(K(t, i))) * std::abs(double(V(t, c)));
      CHECK(std::abs(double(state.S()(i, c)) - double(recurrent_state.S()(i, c))) <=
            units * u * magnitude);
    }
  }
}

TEST_CASE("a DenominatorError in the register-kernel path leaves the earlier chunks",
          "[chunked][kernel][errors]") {
  // As the test above with dv a multiple of the packet width: keys (1, 0) except key 45 =
  // (-45, 0), so row 45 (in the fourth chunk of 12) has denominator 0.
  const Index T = 60, dv = 2 * detail::GemmTile<double>::lanes;
  Eigen::MatrixXd Q = Eigen::MatrixXd::Zero(T, 2), K = Eigen::MatrixXd::Zero(T, 2);
  Q.col(0).setOnes();
  K.col(0).setOnes();
  K(45, 0) = -45;
  const Eigen::MatrixXd V = random_matrix<double>(T, dv, 7);
  const LinearAttention<Identity, double> attn(Identity{}, Options{{}, 12});
  auto state = attn.make_state(2, dv);
  try {
    (void)attn.prefill(state, Q, K, V);
    FAIL("expected a DenominatorError");
  } catch (const DenominatorError& e) {
    CHECK(e.row() == 45);
  }
  CHECK(state.tokens() == 36);
  CHECK(state.z()(0) == 36.0);  // integer sums are exact
  const Eigen::RowVectorXd expected = V.topRows(36).colwise().sum();
  for (Index c = 0; c < dv; ++c)
    CHECK(std::abs(state.S()(0, c) - expected(c)) <=
          2.0 * 40 * unit_roundoff<double>() * V.col(c).head(36).cwiseAbs().sum());
  CHECK(state.S().row(1).isZero(0.0));
}

TEMPLATE_TEST_CASE("a two-token sweep gives the bits of two one-token sweeps in either order",
                   "[recurrent]", float, double, long double) {
  // long double has no SIMD packet in Eigen: the kernels run as plain scalar loops.
  constexpr Index N = detail::sweep_packet_size<TestType>;
  constexpr Index W = detail::sweep_width<TestType>;
  for (Index dv : {Index{1}, Index{5}, N - 1 > 0 ? N - 1 : 2, N, N + 1, W - 1, W, W + 3, 2 * W + 2,
                   Index{70}, Index{130}}) {
    for (Index r : {1, 2, 7, 33}) {
      CAPTURE(dv, r);
      const auto S0 = random_matrix<TestType>(r, dv, 90 + dv);
      const auto qf = random_matrix<TestType>(2, r, 91);
      const auto kf = random_matrix<TestType>(2, r, 92);
      const auto v = random_matrix<TestType>(2, dv, 93);
      linattn::RowMatrix<TestType> y_single(2, dv), y_pair(2, dv);
      auto S_single = S0;
      for (Index j = 0; j < 2; ++j)
        detail::update_and_read(S_single.data(), dv, r, dv, qf.row(j).data(), kf.row(j).data(),
                                v.row(j).data(), y_single.row(j).data(), j == 1);
      for (bool reverse : {false, true}) {
        auto S_pair = S0;
        const detail::SweepToken<TestType> pair[2] = {
            {qf.row(0).data(), kf.row(0).data(), v.row(0).data(), y_pair.row(0).data(), 1},
            {qf.row(1).data(), kf.row(1).data(), v.row(1).data(), y_pair.row(1).data(), 1}};
        detail::sweep_tokens<2>(S_pair.data(), dv, r, dv, pair, false, reverse);
        CHECK(S_pair == S_single);
        CHECK(y_pair == y_single);
      }
    }
  }
}

TEST_CASE("the scalar fallback of the sweep is exact on small integers", "[recurrent]") {
  // Integer values below 2^10 keep every product and sum exact, in long double (no SIMD
  // packet, so the plain loops run) as in the double reference.
  const Index r = 9, dv = 7;
  linattn::RowMatrix<long double> S(r, dv), qf(1, r), kf(1, r), v(1, dv), y(1, dv);
  for (Index i = 0; i < r; ++i) {
    qf(0, i) = static_cast<long double>(i % 3 - 1);
    kf(0, i) = static_cast<long double>(2 - i % 4);
    for (Index c = 0; c < dv; ++c) S(i, c) = static_cast<long double>((i * 7 + c * 3) % 11 - 5);
  }
  for (Index c = 0; c < dv; ++c) v(0, c) = static_cast<long double>(c - 3);
  const auto S_before = S;
  detail::update_and_read(S.data(), dv, r, dv, qf.data(), kf.data(), v.data(), y.data(), true);
  for (Index c = 0; c < dv; ++c) {
    double y_exact = 0;
    for (Index i = 0; i < r; ++i) {
      const double s_new = double(S_before(i, c)) + double(kf(0, i)) * double(v(0, c));
      CHECK(double(S(i, c)) == s_new);
      y_exact += double(qf(0, i)) * s_new;
    }
    CHECK(double(y(0, c)) == y_exact);
  }
}

TEMPLATE_TEST_CASE("recurrent() equals the fused step() bit for bit and both agree with a double loop",
                   "[recurrent]", float, double) {
  // dv not a multiple of the sweep width (5, 70, 130), r = dk != dv, T odd and even; recurrent()
  // sweeps tokens in pairs, step() one at a time (decode block 1: each step folds its token
  // in the fused sweep), a sequence in pieces of odd lengths starts pairs at odd offsets of a
  // call.
  const Attn<TestType> attn(EluPlusOne{}, Options{{}, 32, 1});
  for (Index dv : {5, 70, 130}) {
    for (Index dk : {9, 33}) {
      for (Index T : {1, 2, 7, 40, 41}) {
        CAPTURE(dv, dk, T);
        const auto Q = random_matrix<TestType>(T, dk, 400 + T);
        const auto K = random_matrix<TestType>(T, dk, 500 + T);
        const auto V = random_matrix<TestType>(T, dv, 600 + dv);
        const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
        const double units = bound_units(dk, T);

        auto whole_state = attn.make_state(dk, dv);
        const linattn::RowMatrix<TestType> whole = attn.recurrent(whole_state, Q, K, V);
        CHECK(worst_error_ratio<TestType>(whole, ref, units) <= 1);

        auto step_state = attn.make_state(dk, dv);
        linattn::RowMatrix<TestType> stepped(T, dv);
        for (Index t = 0; t < T; ++t)
          stepped.row(t) = attn.step(step_state, Q.row(t), K.row(t), V.row(t));
        CHECK(worst_error_ratio<TestType>(stepped, ref, units) <= 1);
        CHECK(stepped == whole);
        CHECK(step_state.S() == whole_state.S());
        CHECK(step_state.z() == whole_state.z());

        // Carried state across calls of odd lengths, and a column-major V (copied per block).
        const Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic> Vcol = V;
        auto piece_state = attn.make_state(dk, dv);
        linattn::RowMatrix<TestType> pieces(T, dv);
        Index first = 0;
        for (Index n = 3; first < T; n = n == 3 ? 1 : n + 4) {
          const Index len = std::min(n, T - first);
          pieces.middleRows(first, len) =
              attn.recurrent(piece_state, Q.middleRows(first, len), K.middleRows(first, len),
                             Vcol.middleRows(first, len));
          first += len;
        }
        CHECK(pieces == whole);
        CHECK(piece_state.S() == whole_state.S());
        CHECK(piece_state.z() == whole_state.z());
        CHECK(piece_state.tokens() == T);
      }
    }
  }
}

TEMPLATE_TEST_CASE("the deferred step agrees with a double loop across blocks and other paths",
                   "[recurrent][deferred]", float, double) {
  // Decode blocks B = 2, 3 and 16 against T = 1, 7, 40, 41 (blocks that do and do not divide
  // T), dv 5, 70 and 130 (packet and scalar columns of the read), r = dk != dv. The read
  // phi(q)^T S_stored + sum of the pending (phi(q)^T phi(k_j)) v_j re-associates the same T
  // terms as the recurrence, so the double loop's bound (bound_units) covers it; z takes the
  // fused step's operations, so it equals recurrent()'s bit for bit.
  for (Index B : {2, 3, 16}) {
    const Attn<TestType> attn(EluPlusOne{}, Options{{}, 32, B});
    for (Index dv : {5, 70, 130}) {
      for (Index dk : {9, 33}) {
        for (Index T : {1, 7, 40, 41}) {
          CAPTURE(B, dv, dk, T);
          const auto qkv = random_qkv<TestType>(T, dk, dv, 700 + T + dv);
          const auto &Q = qkv.Q, &K = qkv.K, &V = qkv.V;
          const auto ref = naive_attention(Q, K, V, true, linattn_test::elu_plus_one);
          const double units = bound_units(dk, T);

          auto state = attn.make_state(dk, dv);
          REQUIRE(state.decode_block() == B);
          linattn::RowMatrix<TestType> stepped(T, dv);
          for (Index t = 0; t < T; ++t)
            stepped.row(t) = attn.step(state, Q.row(t), K.row(t), V.row(t));
          CHECK(worst_error_ratio<TestType>(stepped, ref, units) <= 1);
          CHECK(state.tokens() == T);
          CHECK(state.pending_tokens() == (T - 1) % B + 1);  // a full block folds on the next token
          auto whole_state = attn.make_state(dk, dv);
          static_cast<void>(attn.recurrent(whole_state, Q, K, V));
          CHECK(state.z() == whole_state.z());

          // S() includes the pending tokens: against sum_t phi(k_t) v_t^T in double, within
          // gamma_T of sum_t |phi(k_t)| |v_t| (a sum of T products, each rounded once).
          const auto S = state.S();
          double worst = 0;
          for (Index i = 0; i < dk; ++i)
            for (Index c = 0; c < dv; ++c) {
              double exact = 0, magnitude = 0;
              for (Index t = 0; t < T; ++t) {
                const double kf = linattn_test::elu_plus_one(double(K(t, i)));
                exact += kf * double(V(t, c));
                magnitude += std::abs(kf * double(V(t, c)));
              }
              const double allowed = 2.0 * double(T + 2) * unit_roundoff<TestType>() * magnitude +
                                     std::numeric_limits<TestType>::min();
              worst = std::max(worst, std::abs(double(S(i, c)) - exact) / allowed);
            }
          CHECK(worst <= 1);

          // Paths mixed on one state: steps leave tokens pending, recurrent() and the chunked
          // parallel path fold them first, then steps start new blocks.
          auto mixed = attn.make_state(dk, dv);
          linattn::RowMatrix<TestType> out(T, dv);
          Index first = 0;
          int turn = 0;
          for (Index n = 1; first < T; n = n % 5 + 2, ++turn) {
            const Index len = std::min(n, T - first);
            const auto rows = [&](const auto& M) { return M.middleRows(first, len); };
            if (turn % 3 == 0) {
              for (Index t = first; t < first + len; ++t)
                out.row(t) = attn.step(mixed, Q.row(t), K.row(t), V.row(t));
            } else if (turn % 3 == 1) {
              out.middleRows(first, len) = attn.recurrent(mixed, rows(Q), rows(K), rows(V));
              CHECK(mixed.pending_tokens() == 0);
            } else {
              out.middleRows(first, len) = attn.prefill(mixed, rows(Q), rows(K), rows(V));
              CHECK(mixed.pending_tokens() == 0);
            }
            first += len;
          }
          CHECK(worst_error_ratio<TestType>(out, ref, units) <= 1);
          CHECK(mixed.tokens() == T);

          // reset() drops the pending tokens with the rest.
          state.reset();
          CHECK(state.pending_tokens() == 0);
          CHECK(state.S().isZero(0));
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("a rejected deferred step changes nothing, pending tokens included",
                   "[deferred][errors]", float, double) {
  // Identity features, queries (1, 0): the denominator is the running sum of the keys' first
  // entries (integers, so exact), and key -3 after 1, 1, 1 makes it 0 at the fourth token.
  const LinearAttention<Identity, TestType> attn(Identity{}, Options{{}, 32, 8});
  auto state = attn.make_state(2, 3);
  const Eigen::Matrix<TestType, 1, 2> q(1, 0), one(1, 0), bad(-3, 0);
  const auto V = random_matrix<TestType>(5, 3, 81);
  for (Index t = 0; t < 3; ++t) static_cast<void>(attn.step(state, q, one, V.row(t)));
  REQUIRE(state.pending_tokens() == 3);
  const auto before = state;
  CHECK_THROWS_AS(attn.step(state, q, bad, V.row(3)), DenominatorError);
  CHECK(state.pending_tokens() == 3);
  CHECK(state.tokens() == 3);
  CHECK(state.S() == before.S());
  CHECK(state.z() == before.z());
  CHECK(state.stored_S() == before.stored_S());
  // It goes on exactly as a state that never saw the rejected token.
  auto twin = before;
  CHECK(attn.step(state, q, one, V.row(4)) == attn.step(twin, q, one, V.row(4)));
  CHECK(state.S() == twin.S());
}

TEMPLATE_TEST_CASE("query heads share one state through absorb() and read_into()",
                   "[deferred][shared]", float, double) {
  // Grouped-query attention: G = 3 query heads read one key/value head's state. Each head's
  // output must match stepping a state of its own: bit for bit with a decode block (absorb()
  // and read_into() are step() cut in two), and within the double loop's bound (a
  // re-association of the same T terms) with fused steps. Reads must leave the state as it was.
  const Index G = 3, T = 37, dk = 9, dv = 70;
  const auto qkv = random_qkv<TestType>(T, dk, dv, 801);
  const auto &Q0 = qkv.Q, &K = qkv.K, &V = qkv.V;
  const auto Q1 = random_matrix<TestType>(T, dk, 802), Q2 = random_matrix<TestType>(T, dk, 803);
  const linattn::RowMatrix<TestType>* Qs[G] = {&Q0, &Q1, &Q2};
  for (Index B : {1, 3, 16}) {
    CAPTURE(B);
    const Attn<TestType> attn(EluPlusOne{}, Options{{}, 32, B});
    auto shared = attn.make_state(dk, dv);
    ReadScratch<TestType> scratch(shared);
    std::vector<AttentionState<TestType>> own(G, attn.make_state(dk, dv));
    std::vector<linattn::RowMatrix<TestType>> read(G, linattn::RowMatrix<TestType>(T, dv));
    std::vector<linattn::RowMatrix<TestType>> stepped = read;
    for (Index t = 0; t < T; ++t) {
      attn.absorb(shared, K.row(t), V.row(t));
      const auto before = shared;
      for (Index g = 0; g < G; ++g) {
        RowVector<TestType> y(dv);
        attn.read_into(shared, Qs[g]->row(t), y, scratch);
        read[g].row(t) = y;
        stepped[g].row(t) = attn.step(own[g], Qs[g]->row(t), K.row(t), V.row(t));
      }
      REQUIRE(shared.S() == before.S());
      REQUIRE(shared.z() == before.z());
      REQUIRE(shared.pending_tokens() == before.pending_tokens());
    }
    CHECK(shared.tokens() == T);
    CHECK(shared.z() == own[0].z());
    for (Index g = 0; g < G; ++g) {
      const auto ref = naive_attention(*Qs[g], K, V, true, linattn_test::elu_plus_one);
      CHECK(worst_error_ratio<TestType>(read[g], ref, bound_units(dk, T)) <= 1);
      if (B > 1) CHECK(read[g] == stepped[g]);
    }
  }
  // Misuse: a scratch for other dims, a wrong output length, and a read of an empty state.
  const Attn<TestType> attn;
  auto state = attn.make_state(dk, dv);
  ReadScratch<TestType> other(attn.make_state(dk + 1, dv));
  RowVector<TestType> y(dv), short_y(dv - 1);
  const auto q = random_matrix<TestType>(1, dk, 804);
  CHECK_THROWS_AS(attn.read_into(state, q, y, other), ShapeError);
  ReadScratch<TestType> scratch(state);
  CHECK_THROWS_AS(attn.read_into(state, q, short_y, scratch), ShapeError);
  CHECK_THROWS_AS(attn.read_into(state, q, y, scratch), DenominatorError);  // z = 0
}

TEMPLATE_TEST_CASE("a rejected denominator inside a token pair absorbs exactly the tokens before it",
                   "[recurrent][errors]", float, double) {
  // Identity features, queries (1, 0): the denominator is the running sum of the keys' first
  // entries, integers here, so z is exact and the failing row is known.
  using M = Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic>;
  const LinearAttention<Identity, TestType> attn;
  using Catch::Matchers::Contains;
  const auto run = [&](std::initializer_list<TestType> keys, Index carried, Index bad_row,
                       Index absorbed) {
    CAPTURE(carried, bad_row);
    const Index T = static_cast<Index>(keys.size());
    M Q = M::Zero(T, 2), K = M::Zero(T, 2);
    Q.col(0).setOnes();
    Index t = 0;
    for (TestType k : keys) K(t++, 0) = k;
    const M V = random_matrix<TestType>(T, 3, 77);
    // `carried` tokens with key (1, 0) first, through step().
    auto state = attn.make_state(2, 3);
    auto reference = attn.make_state(2, 3);
    const Eigen::Matrix<TestType, 1, 2> one(1, 0);
    const Eigen::Matrix<TestType, 1, 3> v0(1, 2, 3);
    for (Index i = 0; i < carried; ++i) {
      (void)attn.step(state, one, one, v0);
      (void)attn.step(reference, one, one, v0);
    }
    linattn::RowMatrix<TestType> out = linattn::RowMatrix<TestType>::Zero(T, 3);
    CHECK_THROWS_WITH(attn.recurrent_into(state, Q, K, V, out),
                      Contains("row " + std::to_string(bad_row)) && Contains("= 0"));
    CHECK(state.tokens() == carried + absorbed);
    // The absorbed tokens match step() on the same tokens, bits and outputs.
    for (Index i = 0; i < absorbed; ++i) {
      const auto y = attn.step(reference, Q.row(i), K.row(i), V.row(i));
      CHECK(out.row(i) == y);
    }
    CHECK(state.S() == reference.S());
    CHECK(state.z() == reference.z());
    CHECK(out.bottomRows(T - absorbed).isZero(0));
  };
  // Fresh state: rows 0 and 1 share a sweep; row 1's denominator 1 - 1 = 0.
  run({1, -1, 1, 1}, 0, 1, 1);
  // Three tokens carried: row 0 sweeps alone (position 3), rows 1 and 2 are a pair.
  run({1, 1, -5, 1}, 3, 2, 2);  // second of the pair: z = 3 + 1 + 1 - 5 = 0
  run({1, -4, 1, 1}, 3, 1, 1);  // first of the pair: nothing of the pair absorbed
  // Even carry: rows 0 and 1 pair, rows 2 and 3 pair; the second pair's second token fails.
  run({1, 1, 1, -7, 1}, 4, 3, 3);
}

TEMPLATE_TEST_CASE("all_finite finds a NaN or an Inf at every position, in packets and tail",
                   "[kernels]", float, double) {
  // Lengths 0 to 40 cover no packet, a partial one and several (up to 10 floats of AVX-512), as
  // contiguous vectors and as a strided block; each bad value at each position must be found,
  // and large finite values (whose sum would overflow) must not be taken for Inf.
  using Scalar = TestType;
  const Scalar bad[] = {std::numeric_limits<Scalar>::quiet_NaN(),
                        std::numeric_limits<Scalar>::infinity(),
                        -std::numeric_limits<Scalar>::infinity()};
  int missed = 0, false_alarms = 0;
  for (Index n = 0; n <= 40; ++n) {
    ColVector<Scalar> x = ColVector<Scalar>::Constant(n, std::numeric_limits<Scalar>::max());
    // (n >= 1: a column of an empty matrix would offset its null data pointer)
    RowMatrix<Scalar> wide =
        RowMatrix<Scalar>::Constant(std::max<Index>(n, 1), 3, -std::numeric_limits<Scalar>::max());
    false_alarms += static_cast<int>(!detail::all_finite(x)) +
                    static_cast<int>(!detail::all_finite(wide.col(1)));
    for (Index i = 0; i < n; ++i)
      for (const Scalar b : bad) {
        ColVector<Scalar> y = x;
        y(i) = b;
        RowMatrix<Scalar> w = wide;
        w(i, 1) = b;
        missed += static_cast<int>(detail::all_finite(y)) +
                  static_cast<int>(detail::all_finite(w.col(1)));
      }
  }
  CHECK(missed == 0);
  CHECK(false_alarms == 0);
}

}  // namespace kernels_test
