// The multi-head layer's backward: both layouts, grouped-query heads (shared K/V gradients
// summed over the group), packed and padded batches (pad rows get zero gradients and their
// garbage changes nothing), thread-count independence, and shape errors; also the layer's
// saved forward and the backward from it (multihead_saved_forward.hpp).
//
// References: each head cut out of the flat buffers with explicit index formulas (independent
// of TensorView), run through the single-head parallel_backward (itself checked against finite
// differences in gradients_test.cpp), and the group's dK, dV summed here in head order; the
// layer does the same arithmetic in the same order, so the comparison is exact. One finite-
// difference check through the whole layer (double, GQA) guards the summation itself.

#include <linattn/multihead_gradients.hpp>
#include <linattn/multihead_saved_forward.hpp>
#include <linattn/thread_pool.hpp>

#include <catch2/catch.hpp>

#include "multihead_buffers.hpp"
#include "test_support.hpp"

#include <cmath>
#include <limits>
#include <vector>

namespace multihead_gradients_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

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

// ---- every write rule, per-token inputs and carried states ---------------------------------
//
// The reference is again the single-head backward (rule_gradients.hpp, gradients.hpp: each
// checked against finite differences and an independent oracle in their own tests) on copies
// cut out of the buffers by the index formulas, with the group's shares of dK, dV, the per-token
// inputs' gradients and a shared state's gradient summed here in head order: exact comparison.

namespace {

using linattn_test::InputSpec;
using linattn_test::RuleCase;
using linattn_test::for_each_rule;

template <class View>
View rows_of(const View& full, Index t0, Index n) {
  return View(n == 0 ? full.data() : &full(0, t0, 0, 0), {full.batches(), n, full.heads(), full.dim()},
              full.strides());
}

// A Problem plus the rule's per-token inputs and, poisoned with NaN, their gradients.
template <class Attention>
struct RuleProblem : Problem<typename Attention::scalar_type> {
  using Scalar = typename Attention::scalar_type;
  static constexpr std::size_t N = Attention::rule_type::token_inputs;
  std::array<std::vector<Scalar>, N> in, d_in;
  std::array<Index, N> channels{};
  RuleProblem(const RuleCase<Attention>& c, Layout l, Index B, Index T, Index Hq, Index Hkv,
              Index dk, Index dv, std::uint64_t seed)
      : Problem<Scalar>(l, B, T, Hq, Hkv, dk, dv, seed) {
    const Index r = c.attn.feature_dim(dk);
    for (std::size_t i = 0; i < N; ++i) {
      channels[i] = c.inputs[i].per_channel ? r : 1;
      const auto m = linattn_test::uniform_matrix<Scalar>(1, B * T * Hkv * channels[i], seed + 10 + i,
                                                          c.inputs[i].lo, c.inputs[i].hi);
      in[i].assign(m.data(), m.data() + m.size());
      d_in[i].assign(in[i].size(), std::numeric_limits<Scalar>::quiet_NaN());
    }
  }
  std::array<TensorView<const Scalar>, N> ins() const {
    std::array<TensorView<const Scalar>, N> v;
    for (std::size_t i = 0; i < N; ++i)
      v[i] = view<const Scalar>(this->layout, in[i].data(), this->B, this->T, this->Hkv, channels[i]);
    return v;
  }
  std::array<TensorView<Scalar>, N> d_ins() {
    std::array<TensorView<Scalar>, N> v;
    for (std::size_t i = 0; i < N; ++i)
      v[i] = view<Scalar>(this->layout, d_in[i].data(), this->B, this->T, this->Hkv, channels[i]);
    return v;
  }
};

// The layer's stateless and carried backward on a RuleProblem (rows [t0, t0 + n) of every
// entry when n >= 0, for segments).
template <class Attention>
void layer_parallel_backward(const MultiHeadAttention<Attention>& layer, RuleProblem<Attention>& p,
                             const SequenceLayout& layout,
                             BackwardWorkspace<typename Attention::scalar_type>* workspace = nullptr) {
  const auto g = p.grads();
  std::apply(
      [&](const auto&... in) {
        std::apply(
            [&](const auto&... d) {
              parallel_backward_into(layer, p.q(), p.k(), p.v(), in..., Mask::causal, p.dy(), g,
                                     d..., layout, workspace);
            },
            p.d_ins());
      },
      p.ins());
}

template <class Attention>
void layer_prefill_backward(const MultiHeadAttention<Attention>& layer,
                            const typename MultiHeadAttention<Attention>::State& state,
                            RuleProblem<Attention>& p,
                            const BatchStateGradient<typename Attention::scalar_type>* fin,
                            BatchStateGradient<typename Attention::scalar_type>& initial,
                            const SequenceLayout& layout, std::span<const Index> slots,
                            Index t0 = 0, Index n = -1,
                            BackwardWorkspace<typename Attention::scalar_type>* workspace = nullptr) {
  if (n < 0) n = p.T;
  const auto g = p.grads();
  const GradientViews<typename Attention::scalar_type> gr{rows_of(g.Q, t0, n), rows_of(g.K, t0, n),
                                                          rows_of(g.V, t0, n)};
  auto ins = p.ins();
  auto d_ins = p.d_ins();
  for (auto& x : ins) x = rows_of(x, t0, n);
  for (auto& x : d_ins) x = rows_of(x, t0, n);
  std::apply(
      [&](const auto&... in) {
        std::apply(
            [&](const auto&... d) {
              prefill_backward_into(layer, state, rows_of(p.q(), t0, n), rows_of(p.k(), t0, n),
                                    rows_of(p.v(), t0, n), in..., rows_of(p.dy(), t0, n), fin, gr,
                                    d..., initial, layout, slots, workspace);
            },
            d_ins);
      },
      ins);
}

template <class HeadState, class Scalar = typename HeadState::scalar_type>
void fill_state(HeadState& st, std::uint64_t seed) {
  const RowMatrix<Scalar> S = linattn_test::random_matrix<Scalar>(st.feature_dim(), st.value_dim(), seed);
  if constexpr (detail::head_keeps_z<HeadState>()) {
    // z > 0: the normalized reads' denominators stay away from 0.
    const RowMatrix<Scalar> z = linattn_test::uniform_matrix<Scalar>(st.feature_dim(), 1, seed + 1, 0.5, 1.5);
    st.assign(S, z.col(0));
  } else {
    st.assign(S);
  }
}

template <class Scalar>
void fill_gradient(StateGradient<Scalar>& g, std::uint64_t seed) {
  g.S = linattn_test::random_matrix<Scalar>(g.S.rows(), g.S.cols(), seed);
  if (g.z.size() > 0) g.z = linattn_test::random_matrix<Scalar>(g.z.size(), 1, seed + 1).col(0);
}

template <class Scalar>
void poison(BatchStateGradient<Scalar>& g) {
  for (Index i = 0; i < g.size(); ++i)
    for (Index h = 0; h < g.heads(); ++h) {
      g.head(i, h).S.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      g.head(i, h).z.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    }
}

// What a single-head backward returns, the per-token inputs' gradients as T x c matrices.
template <class Scalar, std::size_t N>
struct HeadGradients {
  RowMatrix<Scalar> Q, K, V;
  std::array<RowMatrix<Scalar>, N> inputs;
  StateGradient<Scalar> initial;
};

// `from_saved`: the backward from the head's own saved forward (saved_forward.hpp,
// rule_saved_forward.hpp; continuing a copy of `state` when there is one) instead of the
// recomputing one.
template <class Attention, std::size_t N = Attention::rule_type::token_inputs>
HeadGradients<typename Attention::scalar_type, N> single_head_backward(
    const Attention& attn, const typename Attention::State* state,
    const StateGradient<typename Attention::scalar_type>* fin,
    const RowMatrix<typename Attention::scalar_type>& q, const RowMatrix<typename Attention::scalar_type>& k,
    const RowMatrix<typename Attention::scalar_type>& v, const RowMatrix<typename Attention::scalar_type>& dy,
    const std::array<RowMatrix<typename Attention::scalar_type>, N>& in, bool from_saved = false) {
  using Rule = typename Attention::rule_type;
  using Scalar = typename Attention::scalar_type;
  HeadGradients<Scalar, N> out;
  SavedForward<Scalar> saved;
  RowMatrix<Scalar> y(q.rows(), v.cols());
  std::apply(
      [&](const auto&... x) {
        if (from_saved && state != nullptr) {
          auto copy = *state;
          prefill_saving_into(attn, copy, q, k, v, x..., y, saved);
        } else if (from_saved) {
          parallel_saving_into(attn, q, k, v, x..., Mask::causal, y, saved);
        }
        if constexpr (Rule::kind == WriteKind::additive) {
          auto g = from_saved && state != nullptr ? prefill_backward(attn, saved, q, k, v, dy, fin)
                   : from_saved       ? parallel_backward(attn, saved, q, k, v, Mask::causal, dy)
                   : state != nullptr ? prefill_backward(attn, *state, q, k, v, dy, fin)
                                      : parallel_backward(attn, q, k, v, Mask::causal, dy);
          out.Q = g.Q, out.K = g.K, out.V = g.V, out.initial = g.initial;
        } else {
          auto g = from_saved && state != nullptr
                       ? prefill_backward(attn, saved, q, k, v, x..., dy, fin)
                   : from_saved       ? parallel_backward(attn, saved, q, k, v, x..., Mask::causal, dy)
                   : state != nullptr ? prefill_backward(attn, *state, q, k, v, x..., dy, fin)
                                      : parallel_backward(attn, q, k, v, x..., Mask::causal, dy);
          out.Q = g.Q, out.K = g.K, out.V = g.V, out.initial = g.initial;
          if constexpr (Rule::kind == WriteKind::gated) out.inputs[0] = g.inputs.log_gate;
          if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta)
            out.inputs[0] = g.inputs.beta;
          if constexpr (Rule::kind == WriteKind::gated_delta) out.inputs[1] = g.inputs.log_alpha;
        }
      },
      in);
  return out;
}

// Checks rows [first, first + n) of entry b (sequence at state position `position`, state null
// for the stateless backward) against the single-head backward of each head (from its own
// saved forward when `from_saved`), summed in head order over each group; exact.
template <class Attention>
void check_rule_sequence(const MultiHeadAttention<Attention>& layer, const RuleProblem<Attention>& p,
                         const typename MultiHeadAttention<Attention>::State* state,
                         const BatchStateGradient<typename Attention::scalar_type>* fin,
                         const BatchStateGradient<typename Attention::scalar_type>* initial,
                         Index position, Index b, Index first, Index n, bool from_saved = false) {
  using Scalar = typename Attention::scalar_type;
  constexpr std::size_t N = Attention::rule_type::token_inputs;
  const Index G = p.Hq / p.Hkv;
  constexpr bool shared = MultiHeadAttention<Attention>::shares_states;
  for (Index g = 0; g < p.Hkv; ++g) {
    const RowMatrix<Scalar> k = cut(p.K, p.layout, b, g, first, n, p.T, p.Hkv, p.dk);
    const RowMatrix<Scalar> v = cut(p.V, p.layout, b, g, first, n, p.T, p.Hkv, p.dv);
    std::array<RowMatrix<Scalar>, N> in;
    for (std::size_t i = 0; i < N; ++i) in[i] = cut(p.in[i], p.layout, b, g, first, n, p.T, p.Hkv, p.channels[i]);
    HeadGradients<Scalar, N> sum;
    for (Index j = 0; j < G; ++j) {
      const Index h = g * G + j, sh = shared ? g : h;
      const RowMatrix<Scalar> q = cut(p.Q, p.layout, b, h, first, n, p.T, p.Hq, p.dk);
      const RowMatrix<Scalar> dy = cut(p.dY, p.layout, b, h, first, n, p.T, p.Hq, p.dv);
      const auto* st = state != nullptr ? &state->sequence(position).head(sh) : nullptr;
      const auto* f = fin != nullptr && (!shared || j == 0) ? &fin->head(position, sh) : nullptr;
      const auto ref = single_head_backward(layer.attention(), st, f, q, k, v, dy, in, from_saved);
      INFO("rows [" << first << ", " << first + n << ") of entry " << b << ", head " << h);
      CHECK(cut(p.dQ, p.layout, b, h, first, n, p.T, p.Hq, p.dk) == ref.Q);
      if (initial != nullptr && !shared) {
        CHECK(initial->head(position, sh).S == ref.initial.S);
        CHECK(initial->head(position, sh).z == ref.initial.z);
      }
      if (j == 0) {
        sum = ref;
      } else {
        sum.K += ref.K;
        sum.V += ref.V;
        for (std::size_t i = 0; i < N; ++i) sum.inputs[i] += ref.inputs[i];
        sum.initial.S += ref.initial.S;
        if (sum.initial.z.size() > 0) sum.initial.z += ref.initial.z;
      }
    }
    INFO("key/value head " << g << " of entry " << b << ", rows [" << first << ", " << first + n << ")");
    CHECK(cut(p.dK, p.layout, b, g, first, n, p.T, p.Hkv, p.dk) == sum.K);
    CHECK(cut(p.dV, p.layout, b, g, first, n, p.T, p.Hkv, p.dv) == sum.V);
    for (std::size_t i = 0; i < N; ++i)
      CHECK(cut(p.d_in[i], p.layout, b, g, first, n, p.T, p.Hkv, p.channels[i]) == sum.inputs[i]);
    if (initial != nullptr && shared) {
      CHECK(initial->head(position, g).S == sum.initial.S);
      CHECK(initial->head(position, g).z == sum.initial.z);
    }
  }
}

// NaN in every input row past each entry's length (pad rows, which must stay unread).
template <class Attention>
void poison_pad_rows(RuleProblem<Attention>& p, const std::vector<Index>& lengths) {
  using Scalar = typename Attention::scalar_type;
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  const Layout l = p.layout;
  const Index T = p.T, Hq = p.Hq, Hkv = p.Hkv, dk = p.dk, dv = p.dv;
  for (Index b = 0; b < p.B; ++b)
    for (Index t = lengths[std::size_t(b)]; t < T; ++t) {
      for (Index h = 0; h < Hq; ++h) {
        for (Index x = 0; x < dk; ++x) p.Q[std::size_t(flat(l, b, t, h, x, T, Hq, dk))] = nan;
        for (Index x = 0; x < dv; ++x) p.dY[std::size_t(flat(l, b, t, h, x, T, Hq, dv))] = nan;
      }
      for (Index h = 0; h < Hkv; ++h) {
        for (Index x = 0; x < dk; ++x) p.K[std::size_t(flat(l, b, t, h, x, T, Hkv, dk))] = nan;
        for (Index x = 0; x < dv; ++x) p.V[std::size_t(flat(l, b, t, h, x, T, Hkv, dv))] = nan;
        for (std::size_t i = 0; i < RuleProblem<Attention>::N; ++i)
          for (Index x = 0; x < p.channels[i]; ++x)
            p.in[i][std::size_t(flat(l, b, t, h, x, T, Hkv, p.channels[i]))] = nan;
      }
    }
}

// The layer's carried saving forward (from a copy of `state`) and its backward from the saved
// forward; checks the forward's output and states against layer.prefill_into's, bit for bit.
template <class Attention>
void layer_saved_prefill_step(const MultiHeadAttention<Attention>& layer,
                              const typename MultiHeadAttention<Attention>::State& state,
                              RuleProblem<Attention>& p,
                              const BatchStateGradient<typename Attention::scalar_type>* fin,
                              BatchStateGradient<typename Attention::scalar_type>& initial,
                              const SequenceLayout& layout, std::span<const Index> slots) {
  using Scalar = typename Attention::scalar_type;
  std::vector<Scalar> plain(p.dY.size(), std::numeric_limits<Scalar>::quiet_NaN()), kept = plain;
  const auto out = [&](std::vector<Scalar>& buf) { return view<Scalar>(p.layout, buf.data(), p.B, p.T, p.Hq, p.dv); };
  auto after_plain = state, after_saved = state;
  LayerSavedForward<Scalar> saved;
  const auto g = p.grads();
  std::apply(
      [&](const auto&... in) {
        layer.prefill_into(after_plain, p.q(), p.k(), p.v(), in..., out(plain), layout, slots);
        prefill_saving_into(layer, after_saved, p.q(), p.k(), p.v(), in..., out(kept), saved, layout,
                            slots);
        std::apply(
            [&](const auto&... d) {
              prefill_backward_into(layer, saved, p.q(), p.k(), p.v(), in..., p.dy(), fin, g, d...,
                                    initial, layout, slots);
            },
            p.d_ins());
      },
      p.ins());
  INFO("the carried saving forward's output and states are the layer's prefill_into's, bit for bit");
  CHECK(kept == plain);
  for (Index i = 0; i < state.size(); ++i)
    for (Index h = 0; h < state.heads(); ++h) {
      CHECK(after_saved.sequence(i).head(h).S() == after_plain.sequence(i).head(h).S());
      if constexpr (detail::head_keeps_z<typename Attention::State>())
        CHECK(after_saved.sequence(i).head(h).z() == after_plain.sequence(i).head(h).z());
    }
}

// Runs the layer on `p` in `kind` (batch: all rows; packed: offsets with an empty sequence;
// padded: lengths with an empty sequence, pad rows poisoned with NaN) stateless or from random
// initial states at reversed slots (position 0 unused), and checks every sequence; `from_saved`
// (carried only): through the layer's carried saving forward and the backward from it.
template <class Attention>
void check_rule_layout(const RuleCase<Attention>& c, Layout l, SequenceLayout::Kind kind,
                       bool carried, Index Hkv, bool from_saved = false) {
  using Scalar = typename Attention::scalar_type;
  constexpr std::size_t N = Attention::rule_type::token_inputs;
  const Index Hq = 4, dk = 5, dv = 3, T = 19;
  const Index B = kind == SequenceLayout::Kind::padded ? 3 : kind == SequenceLayout::Kind::packed ? 1 : 2;
  const std::vector<Index> offsets{0, 7, 7, 19}, lengths{19, 8, 0};
  const SequenceLayout layout = kind == SequenceLayout::Kind::packed   ? SequenceLayout::packed(offsets)
                                : kind == SequenceLayout::Kind::padded ? SequenceLayout::padded(lengths)
                                                                       : SequenceLayout::batch();
  const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv}, c.attn);
  RuleProblem<Attention> p(c, l, B, T, Hq, Hkv, dk, dv, 301);
  const Index sequences = layout.count(B);
  const auto seq_entry = [&](Index s) { return layout.batch_entry(s); };
  const auto seq_first = [&](Index s) { return layout.first_row(s); };
  const auto seq_len = [&](Index s) { return kind == SequenceLayout::Kind::batch ? T : layout.length(s, T); };
  if (kind == SequenceLayout::Kind::padded) poison_pad_rows(p, lengths);
  if (!carried) {
    layer_parallel_backward(layer, p, layout);
    for (Index s = 0; s < sequences; ++s)
      if (seq_len(s) > 0) check_rule_sequence(layer, p, nullptr, nullptr, nullptr, 0, seq_entry(s), seq_first(s), seq_len(s));
  } else {
    auto state = layer.make_state(sequences + 1);
    for (Index i = 0; i < state.size(); ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_state(state.sequence(i).head(h), std::uint64_t(400 + 10 * i + h));
    BatchStateGradient<Scalar> fin(state), initial(state);
    for (Index i = 0; i < state.size(); ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_gradient(fin.head(i, h), std::uint64_t(600 + 10 * i + h));
    poison(initial);
    std::vector<Index> slots;
    for (Index s = 0; s < sequences; ++s) slots.push_back(sequences - s);
    if (from_saved)
      layer_saved_prefill_step(layer, state, p, &fin, initial, layout, slots);
    else
      layer_prefill_backward(layer, state, p, &fin, initial, layout, slots);
    for (Index s = 0; s < sequences; ++s) {
      const Index position = slots[std::size_t(s)];
      if (seq_len(s) > 0) {
        check_rule_sequence(layer, p, &state, &fin, &initial, position, seq_entry(s), seq_first(s),
                            seq_len(s), from_saved);
      } else {
        INFO("an empty sequence passes the final state's gradient through");
        for (Index h = 0; h < state.heads(); ++h) {
          CHECK(initial.head(position, h).S == fin.head(position, h).S);
          CHECK(initial.head(position, h).z == fin.head(position, h).z);
        }
      }
    }
    INFO("position 0 is named by no slot: its gradient is not touched");
    for (Index h = 0; h < state.heads(); ++h) CHECK(initial.head(0, h).S.array().isNaN().all());
  }
  if (kind == SequenceLayout::Kind::padded)
    for (Index b = 0; b < B; ++b) {
      const Index n = lengths[std::size_t(b)];
      INFO("pad rows of entry " << b);
      CHECK(rows_are_zero(p.dQ, l, b, n, T - n, T, Hq, dk));
      CHECK(rows_are_zero(p.dK, l, b, n, T - n, T, Hkv, dk));
      CHECK(rows_are_zero(p.dV, l, b, n, T - n, T, Hkv, dv));
      for (std::size_t i = 0; i < N; ++i) CHECK(rows_are_zero(p.d_in[i], l, b, n, T - n, T, Hkv, p.channels[i]));
    }
}

}  // namespace

TEMPLATE_TEST_CASE("every rule: each head is the single-head backward, GQA and inputs summed",
                   "[multihead][gradients][rules]", float, double) {
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const auto kind = GENERATE(SequenceLayout::Kind::batch, SequenceLayout::Kind::packed,
                             SequenceLayout::Kind::padded);
  const bool carried = GENERATE(false, true);
  const Index Hkv = GENERATE(1, 2, 4);
  for_each_rule<TestType>([&](const auto& c) {
    INFO(c.name << (layout == Layout::batch_first ? ", batch-first" : ", head-first") << ", layout "
                << int(kind) << (carried ? ", carried state" : ", stateless") << ", H_kv = " << Hkv);
    check_rule_layout(c, layout, kind, carried, Hkv);
  });
}

namespace {

// The loss of the FD test: L = sum(dY .* out) + sum over state heads of
// sum(dS_T .* S_T) + dz_T . z_T, out and the final states from the layer's prefill of `p` from
// the states in `S0`, `z0` (flat, per state head). Also returns the magnitude sum of its terms.
template <class Attention>
double prefill_loss(const MultiHeadAttention<Attention>& layer, const RuleProblem<Attention>& p,
                    const std::vector<double>& S0, const std::vector<double>& z0,
                    const BatchStateGradient<double>& fin, double* magnitude = nullptr) {
  auto state = layer.make_state(1);
  const Index H = state.heads(), r = layer.feature_dim(), dv = p.dv;
  for (Index h = 0; h < H; ++h) {
    const Eigen::Map<const RowMatrix<double>> S(S0.data() + h * r * dv, r, dv);
    if constexpr (detail::head_keeps_z<typename Attention::State>())
      state.sequence(0).head(h).assign(S, Eigen::Map<const Eigen::VectorXd>(z0.data() + h * r, r));
    else
      state.sequence(0).head(h).assign(S);
  }
  std::vector<double> out(p.dY.size());
  const auto o = view<double>(p.layout, out.data(), p.B, p.T, p.Hq, p.dv);
  std::apply([&](const auto&... in) { layer.prefill_into(state, p.q(), p.k(), p.v(), in..., o); },
             p.ins());
  double L = 0, mag = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    L += out[i] * p.dY[i];
    mag += std::abs(out[i] * p.dY[i]);
  }
  for (Index h = 0; h < H; ++h) {
    const auto& st = state.sequence(0).head(h);
    L += (st.S().array() * fin.head(0, h).S.array()).sum();
    mag += (st.S().array() * fin.head(0, h).S.array()).abs().sum();
    if constexpr (detail::head_keeps_z<typename Attention::State>()) {
      L += st.z().dot(fin.head(0, h).z);
      mag += (st.z().array() * fin.head(0, h).z.array()).abs().sum();
    }
  }
  if (magnitude != nullptr) *magnitude = mag;
  return L;
}

}  // namespace

TEST_CASE("finite differences through the layer for every rule, with carried state",
          "[multihead][gradients][rules]") {
  // Central differences in double of L (prefill_loss) along every entry of Q, K, V, the
  // per-token inputs and the initial states, against the layer's prefill_backward_into with
  // dY and the final states' gradients of L. Step and tolerance as in gradients_test.cpp's
  // check_entries: h = 2^k near u^(1/3) max(|x|, s) (s the RMS of that input, a power of two so
  // x +- h is exact), and
  //   |L'(x) - D(h)| <= |D(2h) - D(h)| + 3 eps_L / h,
  // the first term measuring the truncation h^2 L3 / 6 (D(2h) - D(h) = 3 h^2 L3 / 6 up to
  // rounding), the second bounding the rounding of the two evaluations (|e| <= eps_L each,
  // divided by 2h, at both steps). eps_L = units u Lmag with Lmag the magnitude sum of L's terms
  // (|out dY| and |S_T dS_T|, |z_T dz_T|) and units = 4 (T + r + dv + dk + 8): each output and
  // state entry is a sum over at most T tokens of r- and dv-long products, the feature maps and
  // a division add a few u; the factor 4 covers a numerator and a denominator each rounded and
  // the state being at most the size of the outputs' terms for these O(1) inputs (gates and
  // betas in (0, 1), unit keys for the delta rules).
  for_each_rule<double>([&](const auto& c) {
    using Attention = std::remove_cvref_t<decltype(c.attn)>;
    constexpr std::size_t N = Attention::rule_type::token_inputs;
    INFO(c.name);
    const Index B = 1, T = 6, Hq = 2, Hkv = 1, dk = 3, dv = 2;
    const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv}, c.attn);
    RuleProblem<Attention> p(c, Layout::batch_first, B, T, Hq, Hkv, dk, dv, 501);
    const Index H = layer.state_heads(), r = layer.feature_dim();
    constexpr bool keeps_z = detail::head_keeps_z<typename Attention::State>();
    const auto S0m = linattn_test::random_matrix<double>(1, H * r * dv, 511);
    const auto z0m = linattn_test::uniform_matrix<double>(1, H * r, 512, 0.5, 1.5);
    std::vector<double> S0(S0m.data(), S0m.data() + S0m.size()), z0(z0m.data(), z0m.data() + z0m.size());
    auto state = layer.make_state(1);
    BatchStateGradient<double> fin(state), initial(state);
    for (Index h = 0; h < H; ++h) {
      fill_gradient(fin.head(0, h), std::uint64_t(520 + h));
      const Eigen::Map<const RowMatrix<double>> S(S0.data() + h * r * dv, r, dv);
      if constexpr (keeps_z)
        state.sequence(0).head(h).assign(S, Eigen::Map<const Eigen::VectorXd>(z0.data() + h * r, r));
      else
        state.sequence(0).head(h).assign(S);
    }
    layer_prefill_backward(layer, state, p, &fin, initial, SequenceLayout::batch(), {});
    std::vector<double> dS0(S0.size()), dz0(z0.size());
    for (Index h = 0; h < H; ++h) {
      Eigen::Map<RowMatrix<double>>(dS0.data() + h * r * dv, r, dv) = initial.head(0, h).S;
      if constexpr (keeps_z) Eigen::Map<Eigen::VectorXd>(dz0.data() + h * r, r) = initial.head(0, h).z;
    }
    double L_mag = 0;
    static_cast<void>(prefill_loss(layer, p, S0, z0, fin, &L_mag));
    const double u = linattn_test::unit_roundoff<double>();
    const double eps_L = 4.0 * double(T + r + dv + dk + 8) * u * L_mag;
    double largest_tolerance = 0, largest_gradient = 0;
    // x: the input's values inside a copy of the problem (or S0, z0), grad: its gradient.
    const auto check = [&](const char* what, auto&& x_of, const std::vector<double>& grad) {
      RuleProblem<Attention> q = p;
      std::vector<double> S = S0, z = z0;
      std::vector<double>& x = x_of(q, S, z);
      const std::vector<double> x0 = x;
      const double s = std::max(
          std::sqrt(Eigen::Map<const Eigen::VectorXd>(x0.data(), Index(x0.size())).squaredNorm() /
                    std::max<double>(1.0, double(x0.size()))),
          1e-3);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double h = std::exp2(std::round(std::log2(std::cbrt(u) * std::max(std::abs(x0[i]), s))));
        const auto D = [&](double step) {
          x[i] = x0[i] + step;
          const double up = prefill_loss(layer, q, S, z, fin);
          x[i] = x0[i] - step;
          const double down = prefill_loss(layer, q, S, z, fin);
          x[i] = x0[i];
          return (up - down) / (2 * step);
        };
        const double d1 = D(h), d2 = D(2 * h);
        const double tolerance = std::abs(d2 - d1) + 3 * eps_L / h;
        CAPTURE(what, i, grad[i], d1, d2, tolerance);
        CHECK(std::abs(grad[i] - d1) <= tolerance);
        largest_tolerance = std::max(largest_tolerance, tolerance);
        largest_gradient = std::max(largest_gradient, std::abs(d1));
      }
    };
    using P = RuleProblem<Attention>;
    using Vec = std::vector<double>;
    check("dQ", [](P& q, Vec&, Vec&) -> Vec& { return q.Q; }, p.dQ);
    check("dK", [](P& q, Vec&, Vec&) -> Vec& { return q.K; }, p.dK);
    check("dV", [](P& q, Vec&, Vec&) -> Vec& { return q.V; }, p.dV);
    for (std::size_t i = 0; i < N; ++i)
      check("d input", [i](P& q, Vec&, Vec&) -> Vec& { return q.in[i]; }, p.d_in[i]);
    check("dS0", [](P&, Vec& S, Vec&) -> Vec& { return S; }, dS0);
    if (keeps_z) check("dz0", [](P&, Vec&, Vec& z) -> Vec& { return z; }, dz0);
    // The test stays sharp: an error of 1e-5 of the largest gradient would fail it.
    CHECK(largest_tolerance <= 1e-5 * largest_gradient);
  });
}

TEST_CASE("segments: the layer's carried state and its gradient between two calls",
          "[multihead][gradients][rules]") {
  // Forward over [0, split) from S0 to S1, then the backward of [split, T) from S1 with the
  // final gradients, then of [0, split) from S0 with the first call's initial gradients as its
  // final ones: the same gradients as one call over [0, T), computed with the chunk boundaries
  // and the state's sums associated differently. Bound: every gradient entry is a sum of at most
  // T + C + r + dv products (tokens, a chunk, the r- and dv-long dot products), so reassociating
  // it moves it by at most 2 (T + C + r + dv) u times the magnitude sum of its terms; each term
  // is at most one token's share and we bound the magnitude sum by T times the largest |entry|
  // of that gradient (plus 1 for entries near 0).
  for_each_rule<double>([&](const auto& c) {
    using Attention = std::remove_cvref_t<decltype(c.attn)>;
    constexpr std::size_t N = Attention::rule_type::token_inputs;
    INFO(c.name);
    const Index B = 2, T = 23, split = 9, Hq = 4, Hkv = 2, dk = 5, dv = 3;
    const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv}, c.attn);
    RuleProblem<Attention> whole(c, Layout::head_first, B, T, Hq, Hkv, dk, dv, 701);
    RuleProblem<Attention> parts = whole;
    auto S0 = layer.make_state(B);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < S0.heads(); ++h) fill_state(S0.sequence(i).head(h), std::uint64_t(710 + 10 * i + h));
    BatchStateGradient<double> fin(S0), initial_whole(S0), initial_1(S0), initial_2(S0);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < S0.heads(); ++h) fill_gradient(fin.head(i, h), std::uint64_t(750 + 10 * i + h));
    layer_prefill_backward(layer, S0, whole, &fin, initial_whole, SequenceLayout::batch(), {});
    auto S1 = S0;
    std::vector<double> out(whole.dY.size());
    const auto o = view<double>(parts.layout, out.data(), B, T, Hq, dv);
    auto ins = parts.ins();
    for (auto& x : ins) x = rows_of(x, 0, split);
    std::apply([&](const auto&... in) {
      layer.prefill_into(S1, rows_of(parts.q(), 0, split), rows_of(parts.k(), 0, split),
                         rows_of(parts.v(), 0, split), in..., rows_of(o, 0, split));
    }, ins);
    layer_prefill_backward(layer, S1, parts, &fin, initial_2, SequenceLayout::batch(), {}, split, T - split);
    layer_prefill_backward(layer, S0, parts, &initial_2, initial_1, SequenceLayout::batch(), {}, 0, split);
    // The same segments through the carried saved forward: two saving prefills continue one
    // state, then the two backwards from the saved forwards, which need neither S0 nor S1.
    RuleProblem<Attention> saved_parts = whole;
    BatchStateGradient<double> saved_initial_1(S0), saved_initial_2(S0);
    {
      auto state = S0;
      std::array<LayerSavedForward<double>, 2> saved;
      const std::array<Index, 2> t0{0, split}, len{split, T - split};
      std::vector<double> y(whole.dY.size());
      const auto yv = view<double>(saved_parts.layout, y.data(), B, T, Hq, dv);
      const auto g = saved_parts.grads();
      for (std::size_t part = 0; part < 2; ++part) {
        auto seg = saved_parts.ins();
        for (auto& x : seg) x = rows_of(x, t0[part], len[part]);
        std::apply([&](const auto&... in) {
          prefill_saving_into(layer, state, rows_of(saved_parts.q(), t0[part], len[part]),
                              rows_of(saved_parts.k(), t0[part], len[part]),
                              rows_of(saved_parts.v(), t0[part], len[part]), in...,
                              rows_of(yv, t0[part], len[part]), saved[part]);
        }, seg);
      }
      for (std::size_t part : {std::size_t(1), std::size_t(0)}) {
        auto seg = saved_parts.ins();
        auto d_seg = saved_parts.d_ins();
        for (auto& x : seg) x = rows_of(x, t0[part], len[part]);
        for (auto& x : d_seg) x = rows_of(x, t0[part], len[part]);
        const GradientViews<double> gr{rows_of(g.Q, t0[part], len[part]), rows_of(g.K, t0[part], len[part]),
                                       rows_of(g.V, t0[part], len[part])};
        std::apply([&](const auto&... in) {
          std::apply([&](const auto&... d) {
            prefill_backward_into(layer, saved[part], rows_of(saved_parts.q(), t0[part], len[part]),
                                  rows_of(saved_parts.k(), t0[part], len[part]),
                                  rows_of(saved_parts.v(), t0[part], len[part]), in...,
                                  rows_of(saved_parts.dy(), t0[part], len[part]),
                                  part == 1 ? &fin : &saved_initial_2, gr, d...,
                                  part == 1 ? saved_initial_2 : saved_initial_1);
          }, d_seg);
        }, seg);
      }
    }
    const double C = 4, r = double(layer.feature_dim());
    const double units = 2.0 * (T + C + r + dv) * T;
    const double u = linattn_test::unit_roundoff<double>();
    const auto near = [&](const std::vector<double>& a, const std::vector<double>& b) {
      const auto A = Eigen::Map<const Eigen::ArrayXd>(a.data(), Index(a.size()));
      const auto Bm = Eigen::Map<const Eigen::ArrayXd>(b.data(), Index(b.size()));
      return ((A - Bm).abs() <= units * u * (1 + Bm.abs().maxCoeff())).all();
    };
    for (const auto* pp : {&parts, &saved_parts}) {
      INFO((pp == &parts ? "recomputing segments" : "segments from carried saved forwards"));
      CHECK(near(pp->dQ, whole.dQ));
      CHECK(near(pp->dK, whole.dK));
      CHECK(near(pp->dV, whole.dV));
      for (std::size_t i = 0; i < N; ++i) CHECK(near(pp->d_in[i], whole.d_in[i]));
    }
    for (const auto* init : {&initial_1, &saved_initial_1})
      for (Index i = 0; i < B; ++i)
        for (Index h = 0; h < S0.heads(); ++h) {
          const auto& a = init->head(i, h);
          const auto& b = initial_whole.head(i, h);
          CHECK(((a.S - b.S).array().abs() <= units * u * (1 + b.S.cwiseAbs().maxCoeff())).all());
          if (b.z.size() > 0)
            CHECK(((a.z - b.z).array().abs() <= units * u * (1 + b.z.cwiseAbs().maxCoeff())).all());
        }
  });
}

TEST_CASE("every rule's layer backward is bit-identical on any number of threads",
          "[multihead][gradients][rules][threads]") {
  // Large enough that the work passes the executor's grain and really runs on two threads.
  for_each_rule<float>([&](const auto& c) {
    using Attention = std::remove_cvref_t<decltype(c.attn)>;
    constexpr std::size_t N = Attention::rule_type::token_inputs;
    INFO(c.name);
    const Index B = 3, T = 200, Hq = 8, Hkv = 2, d = 32;
    MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, d, d}, c.attn);
    RuleProblem<Attention> serial(c, Layout::batch_first, B, T, Hq, Hkv, d, d, 801);
    RuleProblem<Attention> threaded = serial;
    auto state = layer.make_state(B);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_state(state.sequence(i).head(h), std::uint64_t(810 + 10 * i + h));
    BatchStateGradient<float> fin(state), initial_serial(state), initial_threaded(state);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_gradient(fin.head(i, h), std::uint64_t(850 + 10 * i + h));
    layer_prefill_backward(layer, state, serial, &fin, initial_serial, SequenceLayout::batch(), {});
    ThreadPool pool(2);
    layer.set_executor(&pool);
    layer_prefill_backward(layer, state, threaded, &fin, initial_threaded, SequenceLayout::batch(), {});
    CHECK(threaded.dQ == serial.dQ);
    CHECK(threaded.dK == serial.dK);
    CHECK(threaded.dV == serial.dV);
    for (std::size_t i = 0; i < N; ++i) CHECK(threaded.d_in[i] == serial.d_in[i]);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) {
        CHECK(initial_threaded.head(i, h).S == initial_serial.head(i, h).S);
        CHECK(initial_threaded.head(i, h).z == initial_serial.head(i, h).z);
      }
  });
}

TEST_CASE("the layer's rule backward names what does not fit", "[multihead][gradients][errors]") {
  using Attention = RuleAttention<L2Normalize, GatedDelta, double>;
  Options opt;
  opt.normalization = Normalization::unnormalized();
  const RuleCase<Attention> c{"gated delta", Attention(L2Normalize{}, opt),
                              {InputSpec{false, 0.1, 0.9}, InputSpec{false, -0.5, -0.01}}};
  const Index B = 2, T = 5, Hq = 2, Hkv = 1, d = 3;
  const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, d, d}, c.attn);
  RuleProblem<Attention> p(c, Layout::batch_first, B, T, Hq, Hkv, d, d, 901);
  const auto state = layer.make_state(B);
  BatchStateGradient<double> initial(state), fin(state);
  const auto ins = p.ins();
  auto d_ins = p.d_ins();
  SECTION("an input's gradient view of another shape") {
    d_ins[1] = TensorView<double>::batch_first(p.d_in[1].data(), B, T - 1, Hkv, 1);
    CHECK_THROWS_WITH(parallel_backward_into(layer, p.q(), p.k(), p.v(), ins[0], ins[1], Mask::causal,
                                             p.dy(), p.grads(), d_ins[0], d_ins[1]),
                      Catch::Contains("gradient view of the second per-token input is [B=2, T=4"));
  }
  SECTION("a state gradient of another batch") {
    BatchStateGradient<double> small(layer.make_state(B - 1));
    CHECK_THROWS_AS(prefill_backward_into(layer, state, p.q(), p.k(), p.v(), ins[0], ins[1], p.dy(),
                                          nullptr, p.grads(), d_ins[0], d_ins[1], small),
                    ShapeError);
    CHECK_THROWS_WITH(prefill_backward_into(layer, state, p.q(), p.k(), p.v(), ins[0], ins[1],
                                            p.dy(), &small, p.grads(), d_ins[0], d_ins[1], initial),
                      Catch::Contains("the final states' gradient has sequences=1") &&
                          Catch::Contains("the batch state has sequences=2"));
  }
  SECTION("the final gradient written as the initial one") {
    CHECK_THROWS_AS(prefill_backward_into(layer, state, p.q(), p.k(), p.v(), ins[0], ins[1], p.dy(),
                                          &initial, p.grads(), d_ins[0], d_ins[1], initial),
                    std::invalid_argument);
  }
  SECTION("a per-token input of another shape") {
    const auto bad = TensorView<const double>::batch_first(p.in[0].data(), B, T, Hkv + 1, 1);
    CHECK_THROWS_AS(parallel_backward_into(layer, p.q(), p.k(), p.v(), bad, ins[1], Mask::causal,
                                           p.dy(), p.grads(), d_ins[0], d_ins[1]),
                    ShapeError);
  }
  SECTION("a state heads' gradient of another shape") {
    BatchStateGradient<double> wrong(B, Hkv, d + 1, d, false);
    CHECK_THROWS_WITH(prefill_backward_into(layer, state, p.q(), p.k(), p.v(), ins[0], ins[1], p.dy(),
                                            nullptr, p.grads(), d_ins[0], d_ins[1], wrong),
                      Catch::Contains("r=4"));
  }
}

// ---- the layer's saved forward (multihead_saved_forward.hpp) --------------------------------
//
// Reference: each head's single-head saving forward and backward from it on copies cut out of
// the buffers (saved_forward_test.cpp and rule_saved_forward_test.cpp check those against the
// recomputing backward and finite differences), summed in head order over each group: exact.
// The layer saves once per shared state (from the group's first head) and every head's backward
// reads that one, while each reference head saves its own: what is saved depends on K, V and
// the per-token inputs only, so the comparison is still exact, and that sharing is checked too.

namespace {

// The layer's saving forward and its backward on `p`; returns the saving forward's output and
// checks it against layer.parallel_into's, bit for bit.
template <class Attention>
void layer_saved_step(const MultiHeadAttention<Attention>& layer, RuleProblem<Attention>& p,
                      LayerSavedForward<typename Attention::scalar_type>& saved,
                      const SequenceLayout& layout,
                      BackwardWorkspace<typename Attention::scalar_type>* workspace = nullptr,
                      bool check_output = true) {
  using Scalar = typename Attention::scalar_type;
  std::vector<Scalar> plain(p.dY.size(), std::numeric_limits<Scalar>::quiet_NaN()), kept = plain;
  const auto out = [&](std::vector<Scalar>& buf) { return view<Scalar>(p.layout, buf.data(), p.B, p.T, p.Hq, p.dv); };
  const auto g = p.grads();
  std::apply(
      [&](const auto&... in) {
        layer.parallel_into(p.q(), p.k(), p.v(), in..., Mask::causal, out(plain), layout);
        parallel_saving_into(layer, p.q(), p.k(), p.v(), in..., Mask::causal, out(kept), saved, layout);
        std::apply(
            [&](const auto&... d) {
              parallel_backward_into(layer, saved, p.q(), p.k(), p.v(), in..., Mask::causal, p.dy(), g,
                                     d..., layout, workspace);
            },
            p.d_ins());
      },
      p.ins());
  INFO("the saving forward's output is the layer forward's, bit for bit");
  if (check_output) CHECK(kept == plain);
}

}  // namespace

TEMPLATE_TEST_CASE("the layer's saved forward: the forward's output, each head's saved backward",
                   "[multihead][gradients][saved_forward]", float, double) {
  const Layout l = GENERATE(Layout::batch_first, Layout::head_first);
  const auto kind = GENERATE(SequenceLayout::Kind::batch, SequenceLayout::Kind::packed,
                             SequenceLayout::Kind::padded);
  const Index Hkv = GENERATE(1, 2, 4);
  for_each_rule<TestType>([&](const auto& c) {
    using Attention = std::remove_cvref_t<decltype(c.attn)>;
    constexpr std::size_t N = Attention::rule_type::token_inputs;
    INFO(c.name << (l == Layout::batch_first ? ", batch-first" : ", head-first") << ", layout "
                << int(kind) << ", H_kv = " << Hkv);
    const Index Hq = 4, dk = 5, dv = 3, T = 19;
    const Index B = kind == SequenceLayout::Kind::padded ? 3 : kind == SequenceLayout::Kind::packed ? 1 : 2;
    const std::vector<Index> offsets{0, 7, 7, 19}, lengths{19, 8, 0};
    const SequenceLayout layout = kind == SequenceLayout::Kind::packed   ? SequenceLayout::packed(offsets)
                                  : kind == SequenceLayout::Kind::padded ? SequenceLayout::padded(lengths)
                                                                         : SequenceLayout::batch();
    const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv}, c.attn);
    RuleProblem<Attention> p(c, l, B, T, Hq, Hkv, dk, dv, 1301);
    if (kind == SequenceLayout::Kind::padded) poison_pad_rows(p, lengths);
    LayerSavedForward<TestType> saved;
    layer_saved_step(layer, p, saved, layout);
    const Index sequences = layout.count(B);
    CHECK(saved.sequences() == sequences);
    CHECK(saved.heads() == Hkv);  // one per shared state: the group's heads share it
    for (Index s = 0; s < sequences; ++s) {
      const Index n = kind == SequenceLayout::Kind::batch ? T : layout.length(s, T);
      CHECK(saved.head(s, 0).tokens() == n);
      if (n > 0)
        check_rule_sequence(layer, p, nullptr, nullptr, nullptr, 0, layout.batch_entry(s),
                            layout.first_row(s), n, true);
    }
    if (kind == SequenceLayout::Kind::padded)
      for (Index b = 0; b < B; ++b) {
        const Index n = lengths[std::size_t(b)];
        INFO("pad rows of entry " << b);
        CHECK(rows_are_zero(p.dQ, l, b, n, T - n, T, Hq, dk));
        CHECK(rows_are_zero(p.dK, l, b, n, T - n, T, Hkv, dk));
        CHECK(rows_are_zero(p.dV, l, b, n, T - n, T, Hkv, dv));
        for (std::size_t i = 0; i < N; ++i) CHECK(rows_are_zero(p.d_in[i], l, b, n, T - n, T, Hkv, p.channels[i]));
      }
  });
}

TEMPLATE_TEST_CASE("the layer's carried saved forward: prefill_into's outputs and states, each head's saved backward",
                   "[multihead][gradients][saved_forward]", float, double) {
  const Layout l = GENERATE(Layout::batch_first, Layout::head_first);
  const auto kind = GENERATE(SequenceLayout::Kind::batch, SequenceLayout::Kind::packed,
                             SequenceLayout::Kind::padded);
  const Index Hkv = GENERATE(1, 2, 4);
  for_each_rule<TestType>([&](const auto& c) {
    INFO(c.name << (l == Layout::batch_first ? ", batch-first" : ", head-first") << ", layout "
                << int(kind) << ", H_kv = " << Hkv);
    check_rule_layout(c, l, kind, true, Hkv, true);
  });
}

TEST_CASE("the layer's saved forward with random features keeps one per query head",
          "[multihead][gradients][saved_forward]") {
  // Log-scaled maps do not share a group's state (MultiHeadAttention::shares_states), so each
  // query head keeps its own saved forward, stateless or carried.
  using Attention = LinearAttention<PositiveRandomFeatures<double>, double>;
  Options opt;
  opt.chunk_size = 4;
  const Index Hq = 4, Hkv = 2, dk = 3, dv = 2, B = 2, T = 11;
  const Attention attn(PositiveRandomFeatures<double>(dk, 6, 17), opt);
  const RuleCase<Attention> c{"positive random features", attn, {}};
  const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv}, attn);
  static_assert(!MultiHeadAttention<Attention>::shares_states);
  SECTION("stateless") {
    RuleProblem<Attention> p(c, Layout::batch_first, B, T, Hq, Hkv, dk, dv, 1401);
    LayerSavedForward<double> saved;
    layer_saved_step(layer, p, saved, SequenceLayout::batch());
    CHECK(saved.heads() == Hq);
    for (Index b = 0; b < B; ++b)
      check_rule_sequence(layer, p, nullptr, nullptr, nullptr, 0, b, 0, T, true);
  }
  SECTION("carried, from states that carry a log-scale") {
    RuleProblem<Attention> p(c, Layout::batch_first, B, T, Hq, Hkv, dk, dv, 1451);
    auto state = layer.make_state(B);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_state(state.sequence(i).head(h), std::uint64_t(1460 + 10 * i + h));
    {  // a first prefill gives the states a log-scale, as in decode
      std::vector<double> y(p.dY.size());
      layer.prefill_into(state, p.q(), p.k(), p.v(), view<double>(p.layout, y.data(), B, T, Hq, dv));
    }
    BatchStateGradient<double> fin(state), initial(state);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_gradient(fin.head(i, h), std::uint64_t(1480 + 10 * i + h));
    poison(initial);
    const std::vector<Index> slots{1, 0};
    layer_saved_prefill_step(layer, state, p, &fin, initial, SequenceLayout::batch(), slots);
    for (Index b = 0; b < B; ++b)
      check_rule_sequence(layer, p, &state, &fin, &initial, slots[std::size_t(b)], b, 0, T, true);
  }
}

TEST_CASE("the layer's saved forward and its backward are bit-identical on any number of threads",
          "[multihead][gradients][saved_forward][threads]") {
  // Large enough that the work passes the executor's grain and really runs on two threads.
  for_each_rule<float>([&](const auto& c) {
    using Attention = std::remove_cvref_t<decltype(c.attn)>;
    constexpr std::size_t N = Attention::rule_type::token_inputs;
    INFO(c.name);
    const Index B = 3, T = 200, Hq = 8, Hkv = 2, d = 32;
    MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, d, d}, c.attn);
    RuleProblem<Attention> serial(c, Layout::batch_first, B, T, Hq, Hkv, d, d, 1501);
    RuleProblem<Attention> threaded = serial;
    LayerSavedForward<float> saved_serial, saved_threaded;
    layer_saved_step(layer, serial, saved_serial, SequenceLayout::batch());
    ThreadPool pool(2);
    layer.set_executor(&pool);
    layer_saved_step(layer, threaded, saved_threaded, SequenceLayout::batch());
    CHECK(threaded.dQ == serial.dQ);
    CHECK(threaded.dK == serial.dK);
    CHECK(threaded.dV == serial.dV);
    for (std::size_t i = 0; i < N; ++i) CHECK(threaded.d_in[i] == serial.d_in[i]);
    for (Index s = 0; s < B; ++s)
      for (Index h = 0; h < Hkv; ++h)
        CHECK(saved_threaded.head(s, h).states() == saved_serial.head(s, h).states());
    // The carried saving forward and its backward, from random states.
    auto state = layer.make_state(B);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_state(state.sequence(i).head(h), std::uint64_t(1510 + 10 * i + h));
    BatchStateGradient<float> fin(state), initial_serial(state), initial_threaded(state);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) fill_gradient(fin.head(i, h), std::uint64_t(1540 + 10 * i + h));
    layer.set_executor(nullptr);
    layer_saved_prefill_step(layer, state, serial, &fin, initial_serial, SequenceLayout::batch(), {});
    layer.set_executor(&pool);
    layer_saved_prefill_step(layer, state, threaded, &fin, initial_threaded, SequenceLayout::batch(), {});
    CHECK(threaded.dQ == serial.dQ);
    CHECK(threaded.dK == serial.dK);
    CHECK(threaded.dV == serial.dV);
    for (std::size_t i = 0; i < N; ++i) CHECK(threaded.d_in[i] == serial.d_in[i]);
    for (Index i = 0; i < B; ++i)
      for (Index h = 0; h < state.heads(); ++h) CHECK(initial_threaded.head(i, h).S == initial_serial.head(i, h).S);
  });
}

TEST_CASE("a BackwardWorkspace kept across the layer's calls gives the bits of calls without one",
          "[multihead][gradients][rules][workspace]") {
  // One workspace through calls of every layout, stateless and carried, on one thread and on
  // two (its lanes), each call preceded by one whose keys hold NaN: every call must return
  // exactly the bits of the same call without a workspace, whatever the buffers held before.
  for_each_rule<float>([&](const auto& c) {
    using Attention = std::remove_cvref_t<decltype(c.attn)>;
    constexpr std::size_t N = Attention::rule_type::token_inputs;
    INFO(c.name);
    const Index T = 200, Hq = 8, Hkv = 2, d = 32;  // past the executor's grain: two threads run
    MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, d, d}, c.attn);
    ThreadPool pool(2);
    BackwardWorkspace<float> workspace;
    // Documents of 3 tokens, shorter than the chunk of 4: served by the longer ones' buffers.
    const std::vector<Index> offsets_a{0, 3, 50, 130, 200}, offsets_b{0, 90, 90, 93, 200},
        lengths{200, 61};
    enum class Kind { stateless, carried, saved };  // saved: stateless, from a saved forward
    struct Call {
      SequenceLayout layout;
      Index B;
      Kind kind;
      bool threads;
    };
    const Call calls[] = {{SequenceLayout::batch(), 3, Kind::stateless, true},
                          {SequenceLayout::packed(offsets_a), 1, Kind::carried, false},
                          {SequenceLayout::packed(offsets_b), 1, Kind::saved, true},
                          {SequenceLayout::padded(lengths), 2, Kind::carried, true},
                          {SequenceLayout::packed(offsets_a), 1, Kind::stateless, true},
                          {SequenceLayout::batch(), 3, Kind::saved, false}};
    std::uint64_t seed = 1600;
    for (const Call& call : calls) {
      INFO("layout kind " << int(call.layout.kind()) << ", call kind " << int(call.kind)
                          << (call.threads ? ", two threads" : ", one thread"));
      layer.set_executor(call.threads ? &pool : nullptr);
      RuleProblem<Attention> plain(c, Layout::batch_first, call.B, T, Hq, Hkv, d, d, seed += 10);
      RuleProblem<Attention> kept = plain, poisoned = plain;
      std::fill(poisoned.K.begin(), poisoned.K.end(), std::numeric_limits<float>::quiet_NaN());
      const Index sequences = call.layout.count(call.B);
      auto state = layer.make_state(sequences);
      for (Index i = 0; i < sequences; ++i)
        for (Index h = 0; h < state.heads(); ++h)
          fill_state(state.sequence(i).head(h), seed + std::uint64_t(10 * i + h));
      BatchStateGradient<float> fin(state), initial_plain(state), initial_kept(state),
          initial_poisoned(state);
      for (Index i = 0; i < sequences; ++i)
        for (Index h = 0; h < state.heads(); ++h)
          fill_gradient(fin.head(i, h), seed + 500 + std::uint64_t(10 * i + h));
      const auto run = [&](RuleProblem<Attention>& p, BatchStateGradient<float>& initial,
                           BackwardWorkspace<float>* w) {
        LayerSavedForward<float> saved;
        if (call.kind == Kind::carried)
          layer_prefill_backward(layer, state, p, &fin, initial, call.layout, {}, 0, -1, w);
        else if (call.kind == Kind::saved)  // (the poisoned call's output is NaN: not compared)
          layer_saved_step(layer, p, saved, call.layout, w, &p != &poisoned);
        else
          layer_parallel_backward(layer, p, call.layout, w);
      };
      try {  // NaN keys: a denominator error, or NaN through the buffers
        run(poisoned, initial_poisoned, &workspace);
      } catch (const std::exception&) {
      }
      run(plain, initial_plain, nullptr);
      run(kept, initial_kept, &workspace);
      CHECK(kept.dQ == plain.dQ);
      CHECK(kept.dK == plain.dK);
      CHECK(kept.dV == plain.dV);
      for (std::size_t i = 0; i < N; ++i) CHECK(kept.d_in[i] == plain.d_in[i]);
      if (call.kind == Kind::carried)
        for (Index i = 0; i < sequences; ++i)
          for (Index h = 0; h < state.heads(); ++h) {
            CHECK(initial_kept.head(i, h).S == initial_plain.head(i, h).S);
            CHECK(initial_kept.head(i, h).z == initial_plain.head(i, h).z);
          }
      if (call.threads) {
        INFO("two threads keep two lanes: more than one thread's workspace holds");
        BackwardWorkspace<float> two_lanes, one_lane;
        run(plain, initial_plain, &two_lanes);
        layer.set_executor(nullptr);
        run(plain, initial_plain, &one_lane);
        CHECK(two_lanes.bytes() > one_lane.bytes());
      }
    }
  });
}

TEST_CASE("the layer's saved forward names what does not fit", "[multihead][gradients][saved_forward][errors]") {
  using Attention = RuleAttention<EluPlusOne, Gated, double>;
  Options opt;
  opt.chunk_size = 4;
  const RuleCase<Attention> c{"gated", Attention(EluPlusOne{}, opt), {InputSpec{false, -1.0, -0.05}}};
  const Index B = 2, T = 9, Hq = 2, Hkv = 1, d = 3;
  const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, d, d}, c.attn);
  RuleProblem<Attention> p(c, Layout::batch_first, B, T, Hq, Hkv, d, d, 1601);
  std::vector<double> out(p.dY.size());
  const auto o = view<double>(p.layout, out.data(), B, T, Hq, d);
  const auto in = p.ins()[0];
  const auto d_in = p.d_ins()[0];
  LayerSavedForward<double> saved;
  SECTION("an empty saved forward") {
    CHECK_THROWS_WITH(parallel_backward_into(layer, saved, p.q(), p.k(), p.v(), in, Mask::causal,
                                             p.dy(), p.grads(), d_in),
                      Catch::Contains("holds 0 sequences x 0 state heads, this call has 2 x 1") &&
                          Catch::Contains("it is empty"));
  }
  SECTION("a saved forward of another batch") {
    parallel_saving_into(layer, p.q(), p.k(), p.v(), in, Mask::causal, o, saved);
    using View = TensorView<const double>;
    const auto one = [&](const View& v) {
      return View(v.data(), {1, v.times(), v.heads(), v.dim()}, v.strides());
    };
    auto g = p.grads();
    const GradientViews<double> g1{TensorView<double>(g.Q.data(), {1, T, Hq, d}, g.Q.strides()),
                                   TensorView<double>(g.K.data(), {1, T, Hkv, d}, g.K.strides()),
                                   TensorView<double>(g.V.data(), {1, T, Hkv, d}, g.V.strides())};
    CHECK_THROWS_WITH(parallel_backward_into(layer, saved, one(p.q()), one(p.k()), one(p.v()), one(in),
                                             Mask::causal, one(p.dy()), g1,
                                             TensorView<double>(d_in.data(), {1, T, Hkv, 1}, d_in.strides())),
                      Catch::Contains("holds 2 sequences x 1 state heads, this call has 1 x 1"));
  }
  SECTION("a saved forward of other lengths: the head's own check names them") {
    parallel_saving_into(layer, p.q(), p.k(), p.v(), in, Mask::causal, o, saved);
    const Index n = T - 2;
    const auto gv = p.grads();
    CHECK_THROWS_AS(parallel_backward_into(layer, saved, rows_of(p.q(), 0, n), rows_of(p.k(), 0, n),
                                           rows_of(p.v(), 0, n), rows_of(in, 0, n), Mask::causal,
                                           rows_of(p.dy(), 0, n),
                                           GradientViews<double>{rows_of(gv.Q, 0, n), rows_of(gv.K, 0, n),
                                                                 rows_of(gv.V, 0, n)},
                                           rows_of(d_in, 0, n)),
                    ShapeError);
  }
  SECTION("a forward that throws leaves it empty") {
    parallel_saving_into(layer, p.q(), p.k(), p.v(), in, Mask::causal, o, saved);
    REQUIRE(saved.sequences() == B);
    p.in[0][3] = 0.5;  // a log-gate above 0: the forward's input check throws
    CHECK_THROWS(parallel_saving_into(layer, p.q(), p.k(), p.v(), p.ins()[0], Mask::causal, o, saved));
    CHECK(saved.sequences() == 0);
    CHECK(saved.bytes() == 0);
  }
  SECTION("views that do not fit are named as in the forward") {
    const auto wrong = TensorView<double>::batch_first(out.data(), B, T, Hkv, d);
    CHECK_THROWS_AS(parallel_saving_into(layer, p.q(), p.k(), p.v(), in, Mask::causal, wrong, saved),
                    ShapeError);
    CHECK(saved.sequences() == 0);
  }
  SECTION("carried: the states and the state gradients are checked") {
    auto state = layer.make_state(B + 1);
    CHECK_THROWS_WITH(prefill_saving_into(layer, state, p.q(), p.k(), p.v(), in, o, saved),
                      Catch::Contains("the inputs hold 2 sequences but the batch state 3"));
    CHECK(saved.sequences() == 0);
    const std::vector<Index> slots{2, 0};
    prefill_saving_into(layer, state, p.q(), p.k(), p.v(), in, o, saved, SequenceLayout::batch(), slots);
    BatchStateGradient<double> fin(state), initial(state), other(B + 1, 2, layer.feature_dim(), d, true);
    const auto back = [&](const BatchStateGradient<double>* f, BatchStateGradient<double>& init,
                          std::vector<Index> sl) {
      prefill_backward_into(layer, saved, p.q(), p.k(), p.v(), in, p.dy(), f, p.grads(), d_in, init,
                            SequenceLayout::batch(), sl);
    };
    CHECK_NOTHROW(back(&fin, initial, slots));
    CHECK_THROWS_WITH(back(&fin, other, slots),
                      Catch::Contains("the initial states' gradient has heads=2") &&
                          Catch::Contains("this layer's states have heads=1"));
    CHECK_THROWS_WITH(back(&other, initial, slots),
                      Catch::Contains("the final states' gradient has sequences=3 heads=2"));
    CHECK_THROWS_AS(back(&initial, initial, slots), std::invalid_argument);
    CHECK_THROWS_WITH(back(&fin, initial, {}),
                      Catch::Contains("2 sequences but the initial states' gradient 3"));
    CHECK_THROWS_WITH(back(&fin, initial, {3, 0}),
                      Catch::Contains("slot 3 is outside the initial states' gradient of size 3"));
    CHECK_THROWS_WITH(back(&fin, initial, {1, 1}), Catch::Contains("slot 1 is given twice"));
    LayerSavedForward<double> empty;
    CHECK_THROWS_WITH(prefill_backward_into(layer, empty, p.q(), p.k(), p.v(), in, p.dy(), &fin,
                                            p.grads(), d_in, initial, SequenceLayout::batch(), slots),
                      Catch::Contains("it is empty"));
  }
}

}  // namespace multihead_gradients_test
