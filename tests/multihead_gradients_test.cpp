// The multi-head layer's backward: both layouts, grouped-query heads (shared K/V gradients
// summed over the group), packed and padded batches (pad rows get zero gradients and their
// garbage changes nothing), thread-count independence, and shape errors.
//
// References: each head cut out of the flat buffers with explicit index formulas (independent
// of TensorView), run through the single-head parallel_backward (itself checked against finite
// differences in gradients_test.cpp), and the group's dK, dV summed here in head order; the
// layer does the same arithmetic in the same order, so the comparison is exact. One finite-
// difference check through the whole layer (double, GQA) guards the summation itself.

#include <linattn/multihead_gradients.hpp>
#include <linattn/thread_pool.hpp>

#include <catch2/catch.hpp>

#include "multihead_buffers.hpp"
#include "test_support.hpp"

#include <cmath>
#include <limits>
#include <vector>

using namespace linattn;
using linattn_test::cut;
using linattn_test::flat;
using linattn_test::Layout;
using linattn_test::random_buffer;
using linattn_test::view;

namespace {

// One multi-head problem: buffers for Q, K, V, dY and the three gradients, in one layout.
template <class Scalar>
struct Problem {
  Layout layout;
  Index B, T, Hq, Hkv, dk, dv;
  std::vector<Scalar> Q, K, V, dY, dQ, dK, dV;
  Problem(Layout l, Index B_, Index T_, Index Hq_, Index Hkv_, Index dk_, Index dv_,
          std::uint64_t seed)
      : layout(l), B(B_), T(T_), Hq(Hq_), Hkv(Hkv_), dk(dk_), dv(dv_),
        Q(random_buffer<Scalar>(B * T * Hq * dk, seed)),
        K(random_buffer<Scalar>(B * T * Hkv * dk, seed + 1)),
        V(random_buffer<Scalar>(B * T * Hkv * dv, seed + 2)),
        dY(random_buffer<Scalar>(B * T * Hq * dv, seed + 3)),
        // Poisoned so that a gradient row the layer fails to write shows as NaN.
        dQ(Q.size(), std::numeric_limits<Scalar>::quiet_NaN()),
        dK(K.size(), std::numeric_limits<Scalar>::quiet_NaN()),
        dV(V.size(), std::numeric_limits<Scalar>::quiet_NaN()) {}
  TensorView<const Scalar> q() const { return view<const Scalar>(layout, Q.data(), B, T, Hq, dk); }
  TensorView<const Scalar> k() const { return view<const Scalar>(layout, K.data(), B, T, Hkv, dk); }
  TensorView<const Scalar> v() const { return view<const Scalar>(layout, V.data(), B, T, Hkv, dv); }
  TensorView<const Scalar> dy() const { return view<const Scalar>(layout, dY.data(), B, T, Hq, dv); }
  GradientViews<Scalar> grads() {
    return {view<Scalar>(layout, dQ.data(), B, T, Hq, dk), view<Scalar>(layout, dK.data(), B, T, Hkv, dk),
            view<Scalar>(layout, dV.data(), B, T, Hkv, dv)};
  }
};

// The expected gradients of sequence rows [first, first + n) of entry b: per query head the
// single-head backward on copies, the group's dK, dV summed in head order. Compares exactly.
template <class Scalar, class Attn>
void check_sequence(const Attn& attn, const Problem<Scalar>& p, Mask mask, Index b, Index first,
                    Index n) {
  const Index G = p.Hq / p.Hkv;
  for (Index g = 0; g < p.Hkv; ++g) {
    const RowMatrix<Scalar> k = cut(p.K, p.layout, b, g, first, n, p.T, p.Hkv, p.dk);
    const RowMatrix<Scalar> v = cut(p.V, p.layout, b, g, first, n, p.T, p.Hkv, p.dv);
    RowMatrix<Scalar> dK_sum, dV_sum;
    for (Index j = 0; j < G; ++j) {
      const Index h = g * G + j;
      const RowMatrix<Scalar> q = cut(p.Q, p.layout, b, h, first, n, p.T, p.Hq, p.dk);
      const RowMatrix<Scalar> dy = cut(p.dY, p.layout, b, h, first, n, p.T, p.Hq, p.dv);
      const auto ref = parallel_backward(attn, q, k, v, mask, dy);
      INFO("sequence rows [" << first << ", " << first + n << ") of entry " << b << ", head " << h);
      CHECK(cut(p.dQ, p.layout, b, h, first, n, p.T, p.Hq, p.dk) == ref.Q);
      if (j == 0) {
        dK_sum = ref.K;
        dV_sum = ref.V;
      } else {
        dK_sum += ref.K;
        dV_sum += ref.V;
      }
    }
    INFO("key/value head " << g << " of entry " << b);
    CHECK(cut(p.dK, p.layout, b, g, first, n, p.T, p.Hkv, p.dk) == dK_sum);
    CHECK(cut(p.dV, p.layout, b, g, first, n, p.T, p.Hkv, p.dv) == dV_sum);
  }
}

template <class Scalar>
bool rows_are_zero(const std::vector<Scalar>& buf, Layout l, Index b, Index first, Index n, Index T,
                   Index H, Index d) {
  for (Index h = 0; h < H; ++h)
    if (!cut(buf, l, b, h, first, n, T, H, d).isZero(0)) return false;
  return true;
}

}  // namespace

TEMPLATE_TEST_CASE("the layer's backward is the single-head backward of every head, GQA summed",
                   "[multihead][gradients]", float, double) {
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Mask mask = GENERATE(Mask(Mask::none), Mask(Mask::causal));
  const Index Hkv = GENERATE(1, 2);
  INFO((layout == Layout::batch_first ? "batch-first" : "head-first")
       << (mask.is_causal() ? ", causal" : ", full") << ", H_kv = " << Hkv);
  const Index B = 2, T = 37, Hq = 4, dk = 6, dv = 5;  // T not a multiple of the chunk
  Options opt;
  opt.chunk_size = 8;
  const LinearAttention<EluPlusOne, TestType> attn(EluPlusOne{}, opt);
  const MultiHeadAttention<LinearAttention<EluPlusOne, TestType>> layer(HeadConfig{Hq, Hkv, dk, dv},
                                                                         attn);
  Problem<TestType> p(layout, B, T, Hq, Hkv, dk, dv, 71);
  parallel_backward_into(layer, p.q(), p.k(), p.v(), mask, p.dy(), p.grads());
  for (Index b = 0; b < B; ++b) check_sequence(attn, p, mask, b, 0, T);
}

TEMPLATE_TEST_CASE("packed and padded batches: each sequence alone, pad rows zero and inert",
                   "[multihead][gradients]", float, double) {
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Mask mask = GENERATE(Mask(Mask::none), Mask(Mask::causal));
  const Index Hq = 4, Hkv = 2, dk = 6, dv = 5;
  const LinearAttention<EluPlusOne, TestType> attn;
  const MultiHeadAttention<LinearAttention<EluPlusOne, TestType>> layer(HeadConfig{Hq, Hkv, dk, dv},
                                                                         attn);
  SECTION("packed: offsets like fla's cu_seqlens, one empty sequence") {
    const std::vector<Index> offsets{0, 13, 13, 40, 41};
    Problem<TestType> p(layout, 1, 41, Hq, Hkv, dk, dv, 81);
    parallel_backward_into(layer, p.q(), p.k(), p.v(), mask, p.dy(), p.grads(),
                           SequenceLayout::packed(offsets));
    for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
      if (offsets[s + 1] > offsets[s])
        check_sequence(attn, p, mask, 0, offsets[s], offsets[s + 1] - offsets[s]);
  }
  SECTION("padded: pad rows of Q, K, V and dY hold NaN and change nothing") {
    const Index B = 3, T = 30;
    const std::vector<Index> lengths{30, 17, 0};
    Problem<TestType> p(layout, B, T, Hq, Hkv, dk, dv, 91);
    const TestType nan = std::numeric_limits<TestType>::quiet_NaN();
    for (Index b = 0; b < B; ++b)
      for (Index t = lengths[static_cast<std::size_t>(b)]; t < T; ++t) {
        for (Index h = 0; h < Hq; ++h) {
          for (Index c = 0; c < dk; ++c) p.Q[std::size_t(flat(layout, b, t, h, c, T, Hq, dk))] = nan;
          for (Index c = 0; c < dv; ++c) p.dY[std::size_t(flat(layout, b, t, h, c, T, Hq, dv))] = nan;
        }
        for (Index h = 0; h < Hkv; ++h) {
          for (Index c = 0; c < dk; ++c) p.K[std::size_t(flat(layout, b, t, h, c, T, Hkv, dk))] = nan;
          for (Index c = 0; c < dv; ++c) p.V[std::size_t(flat(layout, b, t, h, c, T, Hkv, dv))] = nan;
        }
      }
    parallel_backward_into(layer, p.q(), p.k(), p.v(), mask, p.dy(), p.grads(),
                           SequenceLayout::padded(lengths));
    for (Index b = 0; b < B; ++b) {
      const Index n = lengths[static_cast<std::size_t>(b)];
      if (n > 0) check_sequence(attn, p, mask, b, 0, n);
      CHECK(rows_are_zero(p.dQ, layout, b, n, T - n, T, Hq, dk));
      CHECK(rows_are_zero(p.dK, layout, b, n, T - n, T, Hkv, dk));
      CHECK(rows_are_zero(p.dV, layout, b, n, T - n, T, Hkv, dv));
    }
  }
}

TEST_CASE("the layer's backward is bit-identical on any number of threads",
          "[multihead][gradients][threads]") {
  // Large enough that the work passes the executor's grain and really runs on two threads.
  const Index B = 3, T = 300, Hq = 8, Hkv = 2, d = 32;
  const LinearAttention<EluPlusOne, float> attn;
  MultiHeadAttention<LinearAttention<EluPlusOne, float>> layer(HeadConfig{Hq, Hkv, d, d}, attn);
  Problem<float> serial(Layout::batch_first, B, T, Hq, Hkv, d, d, 101);
  Problem<float> threaded = serial;
  parallel_backward_into(layer, serial.q(), serial.k(), serial.v(), Mask::causal, serial.dy(),
                         serial.grads());
  ThreadPool pool(2);
  layer.set_executor(&pool);
  parallel_backward_into(layer, threaded.q(), threaded.k(), threaded.v(), Mask::causal,
                         threaded.dy(), threaded.grads());
  CHECK(threaded.dQ == serial.dQ);
  CHECK(threaded.dK == serial.dK);
  CHECK(threaded.dV == serial.dV);
}

TEST_CASE("finite differences through the layer: GQA sums every query head's share",
          "[multihead][gradients]") {
  // L = sum(dY .* out) for a fixed dY, so dL/dx is what the backward returns for that dY.
  // Central differences in double with step h: truncation O(h^2 |f'''|) and rounding
  // O(u |L| / h); h = 1e-5 puts both near 1e-10 relative to |L|; the tolerance 1e-6 relative
  // (to the largest gradient) leaves a wide margin over that and is far below any error in the
  // summation (a missing head changes dK by a whole share).
  const Index B = 1, T = 9, Hq = 4, Hkv = 2, dk = 3, dv = 2;
  const LinearAttention<EluPlusOne, double> attn;
  const MultiHeadAttention<LinearAttention<EluPlusOne, double>> layer(HeadConfig{Hq, Hkv, dk, dv},
                                                                      attn);
  Problem<double> p(Layout::batch_first, B, T, Hq, Hkv, dk, dv, 111);
  parallel_backward_into(layer, p.q(), p.k(), p.v(), Mask::causal, p.dy(), p.grads());
  const auto loss = [&](const Problem<double>& x) {
    std::vector<double> out(static_cast<std::size_t>(B * T * Hq * dv));
    layer.parallel_into(x.q(), x.k(), x.v(), Mask::causal,
                        TensorView<double>::batch_first(out.data(), B, T, Hq, dv));
    double L = 0;
    for (std::size_t i = 0; i < out.size(); ++i) L += out[i] * x.dY[i];
    return L;
  };
  const double h = 1e-5;
  const auto check_all = [&](std::vector<double> Problem<double>::*input,
                             const std::vector<double>& grad, const char* name) {
    const double scale = std::max(1.0, Eigen::Map<const Eigen::VectorXd>(
                                           grad.data(), Index(grad.size())).cwiseAbs().maxCoeff());
    for (std::size_t i = 0; i < grad.size(); ++i) {
      Problem<double> plus = p, minus = p;
      (plus.*input)[i] += h;
      (minus.*input)[i] -= h;
      const double fd = (loss(plus) - loss(minus)) / (2 * h);
      INFO(name << "[" << i << "]: backward " << grad[i] << ", finite difference " << fd);
      CHECK(std::abs(grad[i] - fd) <= 1e-6 * scale);
    }
  };
  check_all(&Problem<double>::Q, p.dQ, "dQ");
  check_all(&Problem<double>::K, p.dK, "dK");
  check_all(&Problem<double>::V, p.dV, "dV");
}

TEST_CASE("the layer's backward names views that do not fit", "[multihead][gradients][errors]") {
  const Index B = 1, T = 5, Hq = 2, Hkv = 1, d = 4;
  const LinearAttention<EluPlusOne, double> attn;
  const MultiHeadAttention<LinearAttention<EluPlusOne, double>> layer(HeadConfig{Hq, Hkv, d, d},
                                                                      attn);
  Problem<double> p(Layout::batch_first, B, T, Hq, Hkv, d, d, 121);
  auto g = p.grads();
  g.K = TensorView<double>::batch_first(p.dK.data(), B, T - 1, Hkv, d);
  CHECK_THROWS_AS(parallel_backward_into(layer, p.q(), p.k(), p.v(), Mask::causal, p.dy(), g),
                  ShapeError);
  CHECK_THROWS_WITH(parallel_backward_into(layer, p.q(), p.k(), p.v(), Mask::causal, p.dy(), g),
                    Catch::Contains("gradient view dK is [B=1, T=4"));
  // dY with the wrong number of heads is named by the shared view check.
  const auto dy = TensorView<const double>::batch_first(p.dY.data(), B, T, Hkv, d);
  CHECK_THROWS_AS(parallel_backward_into(layer, p.q(), p.k(), p.v(), Mask::causal, dy, p.grads()),
                  ShapeError);
}
