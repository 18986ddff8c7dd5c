// Every write rule through the multi-head layer: each query head of the layer equals a
// single-head call of the same attention on contiguous copies cut out of the buffers by
// explicit index formulas (bit for bit), in both layouts, with grouped heads, packed and
// padded batches (padding poisoned with NaN keys and out-of-range gates and betas), prefill
// then decode, a stateless pass, continuous batching and save / restore / continue.

#include <linattn/multihead.hpp>
#include <linattn/serialize.hpp>
#include <linattn/thread_pool.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace multihead_rules_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

namespace {

enum class Layout { batch_first, head_first };

Index flat(Layout l, Index b, Index t, Index h, Index c, Index T, Index H, Index d) {
  return l == Layout::batch_first ? ((b * T + t) * H + h) * d + c : ((b * H + h) * T + t) * d + c;
}

template <class Scalar>
TensorView<Scalar> view(Layout l, Scalar* p, Index B, Index T, Index H, Index d) {
  return l == Layout::batch_first ? TensorView<Scalar>::batch_first(p, B, T, H, d)
                                  : TensorView<Scalar>::head_first(p, B, H, T, d);
}

// A [B, T, H, d] buffer in `layout` with its shape.
template <class Scalar>
struct Buffer {
  std::vector<Scalar> data;
  Index B, T, H, d;
  Layout layout;
  [[nodiscard]] Scalar& at(Index b, Index t, Index h, Index c) {
    return data[static_cast<std::size_t>(flat(layout, b, t, h, c, T, H, d))];
  }
  // Rows [first, first + n) of head h of entry b, copied into a contiguous matrix.
  [[nodiscard]] RowMatrix<Scalar> cut(Index b, Index h, Index first, Index n) const {
    RowMatrix<Scalar> m(n, d);
    for (Index t = 0; t < n; ++t)
      for (Index c = 0; c < d; ++c)
        m(t, c) = data[static_cast<std::size_t>(flat(layout, b, first + t, h, c, T, H, d))];
    return m;
  }
  // Tokens [t0, t0 + n) of every entry, as a view with the full buffer's strides.
  [[nodiscard]] TensorView<const Scalar> rows(Index t0, Index n) const {
    const auto full = view<const Scalar>(layout, data.data(), B, T, H, d);
    return TensorView<const Scalar>(n == 0 ? data.data() : &full(0, t0, 0, 0), {B, n, H, d}, full.strides());
  }
  [[nodiscard]] TensorView<Scalar> out_rows(Index t0, Index n) {
    const auto full = view<Scalar>(layout, data.data(), B, T, H, d);
    return TensorView<Scalar>(n == 0 ? data.data() : &full(0, t0, 0, 0), {B, n, H, d}, full.strides());
  }
};

template <class Scalar>
Buffer<Scalar> gaussian(Layout l, Index B, Index T, Index H, Index d, std::uint64_t seed) {
  const auto m = linattn_test::random_matrix<Scalar>(1, B * T * H * d, seed);
  return {{m.data(), m.data() + m.size()}, B, T, H, d, l};
}
template <class Scalar>
Buffer<Scalar> uniform(Layout l, Index B, Index T, Index H, Index d, std::uint64_t seed, double lo,
                       double hi) {
  const auto m = linattn_test::uniform_matrix<Scalar>(1, B * T * H * d, seed, lo, hi);
  return {{m.data(), m.data() + m.size()}, B, T, H, d, l};
}

// What one rule needs: the attention and, per per-token input, its channels and range.
struct InputSpec {
  bool per_channel;
  double lo, hi;
};

template <class Attention, std::size_t N>
struct RuleCase {
  const char* name;
  Attention attention;
  std::array<InputSpec, N> inputs;
};

// T0 = 150: the prefill spans several of the layer's token blocks (MultiHeadAttention::
// prefill_block(), 64 rows), and ends inside one.
constexpr Index Hq = 4, Hkv = 2, G = Hq / Hkv, dk = 6, dv = 5, T0 = 150, steps = 4, T = T0 + steps;

// The single-head reference for query head h of sequence (entry b, rows [first, first + n)):
// prefill of the first n0 rows through the grouped call with this head alone (the arithmetic
// the layer runs for a group of G heads, per head), then decode steps through the grouped
// step with this head alone (G > 1) or the plain step (G = 1).
template <class Attention, std::size_t N>
RowMatrix<typename Attention::scalar_type> single_head(
    const Attention& attn, const Buffer<typename Attention::scalar_type>& q,
    const Buffer<typename Attention::scalar_type>& k, const Buffer<typename Attention::scalar_type>& v,
    const std::array<Buffer<typename Attention::scalar_type>, N>& in, Index b, Index h, Index first,
    Index n, Index n0, typename Attention::State* state_out = nullptr) {
  using Scalar = typename Attention::scalar_type;
  const Index g = h / G;
  const RowMatrix<Scalar> Q = q.cut(b, h, first, n), K = k.cut(b, g, first, n), V = v.cut(b, g, first, n);
  std::array<RowMatrix<Scalar>, N> I;
  for (std::size_t i = 0; i < N; ++i) I[i] = in[i].cut(b, g, first, n);
  RowMatrix<Scalar> out(n, dv);
  auto state = attn.make_state(dk, dv);
  const std::vector<ConstRowsView<Scalar>> qs{ConstRowsView<Scalar>(Q.data(), n0, dk, Eigen::OuterStride<>(dk))};
  const std::vector<RowsView<Scalar>> os{RowsView<Scalar>(out.data(), n0, dv, Eigen::OuterStride<>(dv))};
  std::apply([&](const auto&... x) { attn.prefill_into(state, qs, K.topRows(n0), V.topRows(n0), x.topRows(n0)..., os); }, I);
  for (Index t = n0; t < n; ++t) {
    const std::vector<ConstRowsView<Scalar>> qt{ConstRowsView<Scalar>(Q.row(t).data(), 1, dk, Eigen::OuterStride<>(dk))};
    const std::vector<RowsView<Scalar>> yt{RowsView<Scalar>(out.row(t).data(), 1, dv, Eigen::OuterStride<>(dv))};
    // A step's inputs: gates as a row (Gated), beta as a number, log_alpha as a number or,
    // per channel, a row.
    const auto step = [&](const auto&... x) { attn.step_into(state, qt, K.row(t), V.row(t), x..., yt); };
    if constexpr (Attention::rule_type::kind == WriteKind::gated)
      step(I[0].row(t));
    else if constexpr (N == 1)
      step(I[0](t, 0));
    else if constexpr (N == 2) {
      if (I[1].cols() > 1)
        step(I[0](t, 0), I[1].row(t));
      else
        step(I[0](t, 0), I[1](t, 0));
    } else
      step();
  }
  if (state_out != nullptr) *state_out = state;
  return out;
}

template <class Attention, std::size_t N>
void check_rule(const RuleCase<Attention, N>& rc, Layout layout) {
  using Scalar = typename Attention::scalar_type;
  INFO(rc.name << (layout == Layout::batch_first ? ", batch-first" : ", head-first"));
  const Index B = 3;
  MultiHeadAttention<Attention> layer({Hq, Hkv, dk, dv}, rc.attention);
  const Index r = layer.feature_dim();
  auto q = gaussian<Scalar>(layout, B, T, Hq, dk, 11), k = gaussian<Scalar>(layout, B, T, Hkv, dk, 12),
       v = gaussian<Scalar>(layout, B, T, Hkv, dv, 13);
  std::array<Buffer<Scalar>, N> in;
  for (std::size_t i = 0; i < N; ++i)
    in[i] = uniform<Scalar>(layout, B, T, Hkv, rc.inputs[i].per_channel ? r : 1, 14 + i,
                            rc.inputs[i].lo, rc.inputs[i].hi);
  const auto in_rows = [&](Index t0, Index n) {
    std::array<TensorView<const Scalar>, N> views;
    for (std::size_t i = 0; i < N; ++i) views[i] = in[i].rows(t0, n);
    return views;
  };
  ThreadPool pool(2);
  layer.set_executor(&pool);

  {
    INFO("batch: prefill then decode, each head equals a single-head call");
    auto out = Buffer<Scalar>{std::vector<Scalar>(static_cast<std::size_t>(B * T * Hq * dv)), B, T, Hq, dv, layout};
    auto state = layer.make_state(B);
    std::apply([&](const auto&... x) { layer.prefill_into(state, q.rows(0, T0), k.rows(0, T0), v.rows(0, T0), x..., out.out_rows(0, T0)); }, in_rows(0, T0));
    for (Index t = T0; t < T; ++t)
      std::apply([&](const auto&... x) { layer.step_into(state, q.rows(t, 1), k.rows(t, 1), v.rows(t, 1), x..., out.out_rows(t, 1)); }, in_rows(t, 1));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hq; ++h) {
        INFO("sequence " << b << " head " << h);
        typename Attention::State single_state;
        CHECK(out.cut(b, h, 0, T) == single_head(rc.attention, q, k, v, in, b, h, 0, T, T0, &single_state));
        CHECK(state.sequence(b).head(h / G).S() == single_state.S());
        CHECK(state.sequence(b).tokens() == T);
      }
    // The stateless causal pass gives the prefill's bits from an empty state.
    auto fwd = Buffer<Scalar>{std::vector<Scalar>(out.data.size()), B, T, Hq, dv, layout};
    std::apply([&](const auto&... x) { layer.parallel_into(q.rows(0, T), k.rows(0, T), v.rows(0, T), x..., Mask::causal, fwd.out_rows(0, T)); }, in_rows(0, T));
    auto pre = Buffer<Scalar>{std::vector<Scalar>(out.data.size()), B, T, Hq, dv, layout};
    auto fresh = layer.make_state(B);
    std::apply([&](const auto&... x) { layer.prefill_into(fresh, q.rows(0, T), k.rows(0, T), v.rows(0, T), x..., pre.out_rows(0, T)); }, in_rows(0, T));
    CHECK(fwd.data == pre.data);
  }

  {
    INFO("packed and padded batches: padding never read, gates and betas included");
    const auto& k_clean = k;
    const auto& in_clean = in;
    // Packed: 3 sequences in one row of T tokens; padded: lengths 5, 0, T; the padding's keys
    // are NaN and its gates and betas out of range, which would throw or poison if read.
    const std::vector<Index> offsets{0, 4, 4, T}, lengths{5, 0, T};
    const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
    // Poisoned copies: the other blocks read the clean buffers.
    auto k = k_clean;
    auto in = in_clean;
    const auto in_rows = [&](Index t0, Index n) {
      std::array<TensorView<const Scalar>, N> views;
      for (std::size_t i = 0; i < N; ++i) views[i] = in[i].rows(t0, n);
      return views;
    };
    for (Index b = 0; b < B; ++b)
      for (Index t = lengths[static_cast<std::size_t>(b)]; t < T; ++t)
        for (Index g = 0; g < Hkv; ++g) {
          for (Index c = 0; c < dk; ++c) k.at(b, t, g, c) = nan;
          for (std::size_t i = 0; i < N; ++i)
            for (Index c = 0; c < in[i].d; ++c) in[i].at(b, t, g, c) = Scalar(7);
        }
    auto out = Buffer<Scalar>{std::vector<Scalar>(static_cast<std::size_t>(B * T * Hq * dv), Scalar(9)), B, T, Hq, dv, layout};
    auto state = layer.make_state(B);
    std::apply([&](const auto&... x) { layer.prefill_into(state, q.rows(0, T), k.rows(0, T), v.rows(0, T), x..., out.out_rows(0, T), SequenceLayout::padded(lengths)); }, in_rows(0, T));
    for (Index b = 0; b < B; ++b) {
      const Index n = lengths[static_cast<std::size_t>(b)];
      for (Index h = 0; h < Hq; ++h) {
        INFO("padded sequence " << b << " head " << h);
        const auto got = out.cut(b, h, 0, T);
        CHECK((got.bottomRows(T - n).array() == Scalar(0)).all());
        CHECK(RowMatrix<Scalar>(got.topRows(n)) == single_head(rc.attention, q, k, v, in, b, h, 0, n, n));
      }
    }
    // Packed: batch entry 2 (no padding there) split into three sequences.
    auto one = [](const Buffer<Scalar>& x) {
      Buffer<Scalar> y{{}, 1, x.T, x.H, x.d, x.layout};
      for (Index t = 0; t < x.T; ++t)
        for (Index h = 0; h < x.H; ++h)
          for (Index c = 0; c < x.d; ++c) y.data.push_back(Scalar(0));
      for (Index t = 0; t < x.T; ++t)
        for (Index h = 0; h < x.H; ++h)
          for (Index c = 0; c < x.d; ++c)
            y.data[static_cast<std::size_t>(flat(x.layout, 0, t, h, c, x.T, x.H, x.d))] =
                x.data[static_cast<std::size_t>(flat(x.layout, 2, t, h, c, x.T, x.H, x.d))];
      return y;
    };
    const auto q1 = one(q), k1 = one(k), v1 = one(v);
    std::array<Buffer<Scalar>, N> in1;
    std::array<TensorView<const Scalar>, N> in1_views;
    for (std::size_t i = 0; i < N; ++i) {
      in1[i] = one(in[i]);
      in1_views[i] = in1[i].rows(0, T);
    }
    auto packed = Buffer<Scalar>{std::vector<Scalar>(static_cast<std::size_t>(T * Hq * dv)), 1, T, Hq, dv, layout};
    std::apply([&](const auto&... x) { layer.parallel_into(q1.rows(0, T), k1.rows(0, T), v1.rows(0, T), x..., Mask::causal, packed.out_rows(0, T), SequenceLayout::packed(offsets)); }, in1_views);
    for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
      for (Index h = 0; h < Hq; ++h) {
        INFO("packed sequence " << s << " head " << h);
        const Index first = offsets[s], n = offsets[s + 1] - first;
        CHECK(packed.cut(0, h, first, n) == single_head(rc.attention, q1, k1, v1, in1, 0, h, first, n, n));
      }
  }

  {
    INFO("save mid-sequence, restore, continue: identical bits; batch mates do not matter");
    auto state = layer.make_state(B);
    auto out = Buffer<Scalar>{std::vector<Scalar>(static_cast<std::size_t>(B * T * Hq * dv)), B, T, Hq, dv, layout};
    std::apply([&](const auto&... x) { layer.prefill_into(state, q.rows(0, T0), k.rows(0, T0), v.rows(0, T0), x..., out.out_rows(0, T0)); }, in_rows(0, T0));
    const auto blob = save_state(layer, state);
    auto restored = load_state(layer, blob);
    CHECK(save_state(layer, restored) == blob);
    auto out2 = out;
    for (Index t = T0; t < T; ++t) {
      std::apply([&](const auto&... x) { layer.step_into(state, q.rows(t, 1), k.rows(t, 1), v.rows(t, 1), x..., out.out_rows(t, 1)); }, in_rows(t, 1));
      std::apply([&](const auto&... x) { layer.step_into(restored, q.rows(t, 1), k.rows(t, 1), v.rows(t, 1), x..., out2.out_rows(t, 1)); }, in_rows(t, 1));
    }
    CHECK(out.data == out2.data);
    // Sequence 1 parked alone and restored into a new batch continues as in the full batch.
    const auto parked = save_sequence(layer, load_state(layer, blob), 1);
    auto alone = layer.make_state();
    restore_sequences(layer, alone, parked);
    // Batch entry 1's token t as a batch of one.
    const auto entry = [](const TensorView<const Scalar>& x) {
      return TensorView<const Scalar>(&x(1, 0, 0, 0), {1, 1, x.heads(), x.dim()}, x.strides());
    };
    for (Index t = T0; t < T; ++t) {
      std::array<TensorView<const Scalar>, N> xe;
      const auto rows = in_rows(t, 1);
      for (std::size_t i = 0; i < N; ++i) xe[i] = entry(rows[i]);
      std::vector<Scalar> y(static_cast<std::size_t>(Hq * dv));
      std::apply([&](const auto&... x) { layer.step_into(alone, entry(q.rows(t, 1)), entry(k.rows(t, 1)), entry(v.rows(t, 1)), x..., TensorView<Scalar>::batch_first(y.data(), 1, 1, Hq, dv)); }, xe);
      for (Index h = 0; h < Hq; ++h)
        for (Index c = 0; c < dv; ++c) CHECK(y[static_cast<std::size_t>(h * dv + c)] == out.at(1, t, h, c));
    }
  }
}

template <class Scalar>
void check_every_rule(Layout layout) {
  Options opt;
  opt.chunk_size = 3;  // several chunks per sequence, one partial
  check_rule(RuleCase<LinearAttention<EluPlusOne, Scalar>, 0>{"additive", LinearAttention<EluPlusOne, Scalar>(EluPlusOne{}, opt), {}}, layout);
  check_rule(RuleCase<RuleAttention<EluPlusOne, Decay, Scalar>, 0>{"decay", RuleAttention<EluPlusOne, Decay, Scalar>(EluPlusOne{}, Decay(0.9), opt), {}}, layout);
  check_rule(RuleCase<RuleAttention<EluPlusOne, Gated, Scalar>, 1>{"scalar gates", RuleAttention<EluPlusOne, Gated, Scalar>(EluPlusOne{}, opt), {InputSpec{false, -1.0, 0.0}}}, layout);
  check_rule(RuleCase<RuleAttention<EluPlusOne, Gated, Scalar>, 1>{"per-channel gates", RuleAttention<EluPlusOne, Gated, Scalar>(EluPlusOne{}, opt), {InputSpec{true, -1.0, 0.0}}}, layout);
  Options unnormalized = opt;
  unnormalized.normalization = Normalization::unnormalized();
  check_rule(RuleCase<RuleAttention<L2Normalize, Delta, Scalar>, 1>{"delta", RuleAttention<L2Normalize, Delta, Scalar>(L2Normalize{}, unnormalized), {InputSpec{false, 0.0, 1.0}}}, layout);
  check_rule(RuleCase<RuleAttention<L2Normalize, GatedDelta, Scalar>, 2>{"gated delta", RuleAttention<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, unnormalized), {InputSpec{false, 0.0, 1.0}, InputSpec{false, -1.0, 0.0}}}, layout);
  check_rule(RuleCase<RuleAttention<L2Normalize, GatedDelta, Scalar>, 2>{"gated delta, per-channel log_alpha (KDA)", RuleAttention<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, unnormalized), {InputSpec{false, 0.0, 1.0}, InputSpec{true, -1.0, 0.0}}}, layout);
}

}  // namespace

TEMPLATE_TEST_CASE("every write rule through the multi-head layer", "[multihead][rules]", float,
                   double) {
  check_every_rule<TestType>(GENERATE(Layout::batch_first, Layout::head_first));
}

TEST_CASE("per-token input views are checked and named", "[multihead][rules][errors]") {
  const Index B = 2, Tn = 3;
  MultiHeadAttention<RuleAttention<L2Normalize, Delta>> layer({Hq, Hkv, dk, dv});
  std::vector<float> x(static_cast<std::size_t>(B * Tn * Hq * dk), 0.5f), o(static_cast<std::size_t>(B * Tn * Hq * dv));
  std::vector<float> beta(static_cast<std::size_t>(B * Tn * Hq), 0.5f);
  const auto Q = TensorView<const float>::batch_first(x.data(), B, Tn, Hq, dk);
  const auto K = TensorView<const float>::batch_first(x.data(), B, Tn, Hkv, dk);
  const auto V = TensorView<const float>::batch_first(x.data(), B, Tn, Hkv, dv);
  const auto out = TensorView<float>::batch_first(o.data(), B, Tn, Hq, dv);
  const auto expect = [](auto&& call, const std::string& part) {
    try {
      call();
      FAIL("accepted");
    } catch (const ShapeError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
  };
  // One value per key/value head, not per query head.
  expect([&] { layer.parallel_into(Q, K, V, TensorView<const float>::batch_first(beta.data(), B, Tn, Hq, 1), Mask::causal, out); }, "H_v=2");
  // Beta has no per-channel form, not even beside GatedDelta's per-channel log_alpha.
  expect([&] { layer.parallel_into(Q, K, V, TensorView<const float>::batch_first(beta.data(), 1, Tn, Hkv, 2), Mask::causal, out); }, "per-token input view");
  MultiHeadAttention<RuleAttention<L2Normalize, GatedDelta>> kda({Hq, Hkv, dk, dv});
  std::vector<float> channels(static_cast<std::size_t>(B * Tn * Hkv * dk), -0.5f);
  const auto alpha = TensorView<const float>::batch_first(channels.data(), B, Tn, Hkv, dk);
  expect([&] { kda.parallel_into(Q, K, V, alpha, alpha, Mask::causal, out); }, "per-token input view");
  CHECK_NOTHROW(kda.parallel_into(Q, K, V, TensorView<const float>::batch_first(beta.data(), B, Tn, Hkv, 1), alpha, Mask::causal, out));
  // An out-of-range beta inside a valid row is rejected by the rule's own check.
  beta[0] = 2.5f;
  CHECK_THROWS_AS(layer.parallel_into(Q, K, V, TensorView<const float>::batch_first(beta.data(), B, Tn, Hkv, 1), Mask::causal, out),
                  std::invalid_argument);
}

}  // namespace multihead_rules_test
