// Grouped value heads (HeadConfig::value_heads: H_v = G_v H_kv value heads over H_q = H_kv
// query/key heads, the layout of Qwen3-Next's Gated DeltaNet): value head h reads query and key
// head c = h / G_v and has its own state, output head and per-token inputs.
//
// The definition is the layer with H_v heads of everything on copies of Q and K whose head h is
// head h / G_v (the "expanded" problem), itself checked against the references elsewhere. So
// every call is compared with it bit for bit: outputs, states, dV, the per-token inputs' and the
// states' gradients are equal; dQ and dK of head c are the sums of the expanded problem's rows
// of its G_v value heads, added in head order (the same bits as that sum taken here). A
// finite-difference check ties dQ and dK to the loss without the expansion.

#include <linattn/linattn.hpp>
#include <linattn/multihead_saved_forward.hpp>
#include <linattn/thread_pool.hpp>

#include <catch2/catch.hpp>

#include "multihead_buffers.hpp"
#include "test_support.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace grouped_value_heads_test {

using namespace linattn;
using linattn_test::flat;
using linattn_test::Layout;
using linattn_test::view;

struct Dims {
  Index B, T, Hc, Gv, dk, dv;
  [[nodiscard]] Index Hv() const { return Hc * Gv; }
};

using linattn_test::InputSpec;
using linattn_test::RuleCase;

// One problem: Q, K [B, T, H_c, dk], V [B, T, H_v, dv], per-token inputs [B, T, H_v, c], dY
// [B, T, H_v, dv], and the expanded Q, K [B, T, H_v, dk] (head h = head h / G_v).
template <class Attention>
struct Problem {
  using Scalar = typename Attention::scalar_type;
  static constexpr std::size_t N = Attention::rule_type::token_inputs;
  Layout layout;
  Dims d;
  std::vector<Scalar> q, k, v, qx, kx, dy;
  std::array<std::vector<Scalar>, N> in;
  std::array<Index, N> channels{};

  Problem(const RuleCase<Attention>& c, Layout l, Dims dims, std::uint64_t seed)
      : layout(l), d(dims) {
    q = linattn_test::random_buffer<Scalar>(d.B * d.T * d.Hc * d.dk, seed);
    k = linattn_test::random_buffer<Scalar>(d.B * d.T * d.Hc * d.dk, seed + 1);
    v = linattn_test::random_buffer<Scalar>(d.B * d.T * d.Hv() * d.dv, seed + 2);
    dy = linattn_test::random_buffer<Scalar>(d.B * d.T * d.Hv() * d.dv, seed + 3);
    qx = expand(q);
    kx = expand(k);
    const Index r = c.attn.feature_dim(d.dk);
    for (std::size_t i = 0; i < N; ++i) {
      channels[i] = c.inputs[i].per_channel ? r : 1;
      const auto m = linattn_test::uniform_matrix<Scalar>(1, d.B * d.T * d.Hv() * channels[i],
                                                         seed + 10 + i, c.inputs[i].lo,
                                                         c.inputs[i].hi);
      in[i].assign(m.data(), m.data() + m.size());
    }
  }

  // [B, T, H_c, dk] -> [B, T, H_v, dk], head h a copy of head h / G_v.
  std::vector<Scalar> expand(const std::vector<Scalar>& src) const {
    std::vector<Scalar> out(static_cast<std::size_t>(d.B * d.T * d.Hv() * d.dk));
    for (Index b = 0; b < d.B; ++b)
      for (Index t = 0; t < d.T; ++t)
        for (Index h = 0; h < d.Hv(); ++h)
          for (Index c = 0; c < d.dk; ++c)
            out[std::size_t(flat(layout, b, t, h, c, d.T, d.Hv(), d.dk))] =
                src[std::size_t(flat(layout, b, t, h / d.Gv, c, d.T, d.Hc, d.dk))];
    return out;
  }

  [[nodiscard]] Index qk_heads(bool expanded) const { return expanded ? d.Hv() : d.Hc; }
  TensorView<const Scalar> Q(bool expanded) const {
    return view<const Scalar>(layout, (expanded ? qx : q).data(), d.B, d.T, qk_heads(expanded), d.dk);
  }
  TensorView<const Scalar> K(bool expanded) const {
    return view<const Scalar>(layout, (expanded ? kx : k).data(), d.B, d.T, qk_heads(expanded), d.dk);
  }
  TensorView<const Scalar> V() const { return view<const Scalar>(layout, v.data(), d.B, d.T, d.Hv(), d.dv); }
  TensorView<const Scalar> dY() const { return view<const Scalar>(layout, dy.data(), d.B, d.T, d.Hv(), d.dv); }
  std::array<TensorView<const Scalar>, N> ins() const {
    std::array<TensorView<const Scalar>, N> out;
    for (std::size_t i = 0; i < N; ++i)
      out[i] = view<const Scalar>(layout, in[i].data(), d.B, d.T, d.Hv(), channels[i]);
    return out;
  }
};

// Rows [t0, t0 + n) of every entry of a view.
template <class View>
View rows_of(const View& full, Index t0, Index n) {
  return View(n == 0 ? full.data() : &full(0, t0, 0, 0), {full.batches(), n, full.heads(), full.dim()},
              full.strides());
}

template <class Attention>
using Layer = MultiHeadAttention<Attention>;

// The grouped layer and its expanded twin.
template <class Attention>
Layer<Attention> grouped_layer(const Attention& attn, const Dims& d) {
  return Layer<Attention>(HeadConfig{d.Hc, d.Hc, d.dk, d.dv, d.Hv()}, attn);
}
template <class Attention>
Layer<Attention> expanded_layer(const Attention& attn, const Dims& d) {
  return Layer<Attention>(HeadConfig{d.Hv(), d.Hv(), d.dk, d.dv}, attn);
}

// A backward's results: dQ, dK [B, T, H, dk], dV, the per-token inputs' gradients.
template <class Scalar, std::size_t N>
struct Grads {
  std::vector<Scalar> dQ, dK, dV;
  std::array<std::vector<Scalar>, N> d_in;
  std::optional<BatchStateGradient<Scalar>> initial;
};

template <class Attention, std::size_t N = Attention::rule_type::token_inputs>
Grads<typename Attention::scalar_type, N> make_grads(const Problem<Attention>& p, bool expanded) {
  using Scalar = typename Attention::scalar_type;
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();  // every element must be written
  Grads<Scalar, N> g;
  const auto qk = std::size_t(p.d.B * p.d.T * p.qk_heads(expanded) * p.d.dk);
  g.dQ.assign(qk, nan);
  g.dK.assign(qk, nan);
  g.dV.assign(p.v.size(), nan);
  for (std::size_t i = 0; i < N; ++i) g.d_in[i].assign(p.in[i].size(), nan);
  return g;
}

template <class Attention, class Scalar, std::size_t N>
std::pair<GradientViews<Scalar>, std::array<TensorView<Scalar>, N>> grad_views(
    const Problem<Attention>& p, Grads<Scalar, N>& g, bool expanded) {
  const Dims& d = p.d;
  const Index H = p.qk_heads(expanded);
  GradientViews<Scalar> views{view<Scalar>(p.layout, g.dQ.data(), d.B, d.T, H, d.dk),
                              view<Scalar>(p.layout, g.dK.data(), d.B, d.T, H, d.dk),
                              view<Scalar>(p.layout, g.dV.data(), d.B, d.T, d.Hv(), d.dv)};
  std::array<TensorView<Scalar>, N> d_in;
  for (std::size_t i = 0; i < N; ++i)
    d_in[i] = view<Scalar>(p.layout, g.d_in[i].data(), d.B, d.T, d.Hv(), p.channels[i]);
  return {views, d_in};
}

// dQ or dK of the grouped call against the expanded call's: head c of entry b, row t is the sum
// of the expanded rows of heads c G_v ... c G_v + G_v - 1, added in that order.
template <class Scalar>
void check_summed(const char* what, const std::vector<Scalar>& grouped,
                  const std::vector<Scalar>& expanded, Layout l, const Dims& d) {
  for (Index b = 0; b < d.B; ++b)
    for (Index t = 0; t < d.T; ++t)
      for (Index c = 0; c < d.Hc; ++c)
        for (Index e = 0; e < d.dk; ++e) {
          Scalar sum = expanded[std::size_t(flat(l, b, t, c * d.Gv, e, d.T, d.Hv(), d.dk))];
          for (Index j = 1; j < d.Gv; ++j)
            sum += expanded[std::size_t(flat(l, b, t, c * d.Gv + j, e, d.T, d.Hv(), d.dk))];
          const Scalar got = grouped[std::size_t(flat(l, b, t, c, e, d.T, d.Hc, d.dk))];
          if (got != sum) {
            INFO(what << " of entry " << b << ", token " << t << ", head " << c << ", column " << e
                      << ": grouped " << got << ", the expanded rows' sum " << sum);
            CHECK(got == sum);
            return;
          }
        }
}

template <class Scalar, std::size_t N>
void check_same_grads(const Grads<Scalar, N>& grouped, const Grads<Scalar, N>& expanded, Layout l,
                      const Dims& d) {
  check_summed("dQ", grouped.dQ, expanded.dQ, l, d);
  check_summed("dK", grouped.dK, expanded.dK, l, d);
  CHECK(grouped.dV == expanded.dV);
  for (std::size_t i = 0; i < N; ++i) {
    INFO("per-token input " << i);
    CHECK(grouped.d_in[i] == expanded.d_in[i]);
  }
  if (grouped.initial) {
    REQUIRE(expanded.initial);
    for (Index s = 0; s < grouped.initial->size(); ++s)
      for (Index h = 0; h < grouped.initial->heads(); ++h) {
        INFO("initial state gradient of sequence " << s << ", head " << h);
        CHECK(grouped.initial->head(s, h).S == expanded.initial->head(s, h).S);
        CHECK(grouped.initial->head(s, h).z == expanded.initial->head(s, h).z);
      }
  }
}

template <class HeadState>
void check_same_state(const HeadState& a, const HeadState& b) {
  CHECK(a.tokens() == b.tokens());
  CHECK(a.S() == b.S());
  if constexpr (linattn::detail::head_keeps_z<HeadState>()) CHECK(a.z() == b.z());
}

template <class Attention>
void check_states(const typename Layer<Attention>::State& a, const typename Layer<Attention>::State& b,
                  const Dims& d) {
  REQUIRE(a.heads() == d.Hv());
  REQUIRE(b.heads() == d.Hv());
  for (Index s = 0; s < d.B; ++s)
    for (Index h = 0; h < d.Hv(); ++h) {
      INFO("state of sequence " << s << ", head " << h);
      check_same_state(a.sequence(s).head(h), b.sequence(s).head(h));
    }
}

// Every call of the layer on one rule: grouped against expanded.
template <class Attention>
void check_rule(const RuleCase<Attention>& c, Layout l, const Dims& d, std::uint64_t seed) {
  using Scalar = typename Attention::scalar_type;
  constexpr std::size_t N = Attention::rule_type::token_inputs;
  INFO(c.name << (l == Layout::batch_first ? ", batch-first" : ", head-first"));
  const Problem<Attention> p(c, l, d, seed);
  const auto grouped = grouped_layer(c.attn, d);
  const auto expanded = expanded_layer(c.attn, d);
  REQUIRE(grouped.state_heads() == d.Hv());
  REQUIRE(grouped.value_group_size() == d.Gv);
  const auto out_view = [&](std::vector<Scalar>& o) {
    return view<Scalar>(l, o.data(), d.B, d.T, d.Hv(), d.dv);
  };
  const auto ins = p.ins();

  // Stateless causal forward.
  {
    std::vector<Scalar> og(p.v.size(), Scalar(-7)), ox(p.v.size(), Scalar(-9));
    std::apply([&](const auto&... x) {
      grouped.parallel_into(p.Q(false), p.K(false), p.V(), x..., Mask::causal, out_view(og));
      expanded.parallel_into(p.Q(true), p.K(true), p.V(), x..., Mask::causal, out_view(ox));
    }, ins);
    INFO("parallel_into");
    CHECK(og == ox);
  }

  // Prefill of T0 tokens, then one decode step per token; states as they go.
  const Index T0 = d.T / 2 + 1;
  auto sg = grouped.make_state(d.B), sx = expanded.make_state(d.B);
  {
    std::vector<Scalar> og(p.v.size(), Scalar(-7)), ox(p.v.size(), Scalar(-9));
    const auto segment = [&](Index t0, Index n, bool step) {
      std::apply([&](const auto&... x) {
        if (step) {
          grouped.step_into(sg, rows_of(p.Q(false), t0, n), rows_of(p.K(false), t0, n),
                            rows_of(p.V(), t0, n), rows_of(x, t0, n)...,
                            rows_of(out_view(og), t0, n));
          expanded.step_into(sx, rows_of(p.Q(true), t0, n), rows_of(p.K(true), t0, n),
                             rows_of(p.V(), t0, n), rows_of(x, t0, n)...,
                             rows_of(out_view(ox), t0, n));
        } else {
          grouped.prefill_into(sg, rows_of(p.Q(false), t0, n), rows_of(p.K(false), t0, n),
                               rows_of(p.V(), t0, n), rows_of(x, t0, n)...,
                               rows_of(out_view(og), t0, n));
          expanded.prefill_into(sx, rows_of(p.Q(true), t0, n), rows_of(p.K(true), t0, n),
                                rows_of(p.V(), t0, n), rows_of(x, t0, n)...,
                                rows_of(out_view(ox), t0, n));
        }
      }, ins);
    };
    segment(0, T0, false);
    for (Index t = T0; t < d.T; ++t) segment(t, 1, true);
    INFO("prefill_into then step_into");
    CHECK(og == ox);
    check_states<Attention>(sg, sx, d);
  }

  // Stateless backward.
  {
    auto gg = make_grads(p, false), gx = make_grads(p, true);
    // (Named members, not structured bindings: clang 14's lambdas cannot capture those.)
    auto views_g = grad_views(p, gg, false), views_x = grad_views(p, gx, true);
    const GradientViews<Scalar>& vx = views_x.first;
    const auto& dx = views_x.second;
    std::apply([&](const auto&... x) {
      std::apply([&](const auto&... dxi) {
        std::apply([&](const auto&... dgi) {
          parallel_backward_into(grouped, p.Q(false), p.K(false), p.V(), x..., Mask::causal,
                                 p.dY(), views_g.first, dgi...);
        }, views_g.second);
        parallel_backward_into(expanded, p.Q(true), p.K(true), p.V(), x..., Mask::causal, p.dY(),
                               vx, dxi...);
      }, dx);
    }, ins);
    INFO("parallel_backward_into");
    check_same_grads(gg, gx, l, d);
  }

  // Carried backward of rows [T0, T) from the states after rows [0, T0) (sg0, sx0, equal by the
  // check above), with a final-state gradient per head, by the recomputing backward and from a
  // saved forward.
  auto sg0 = grouped.make_state(d.B), sx0 = expanded.make_state(d.B);
  {
    std::vector<Scalar> discard(p.v.size());
    std::apply([&](const auto&... x) {
      grouped.prefill_into(sg0, rows_of(p.Q(false), 0, T0), rows_of(p.K(false), 0, T0),
                           rows_of(p.V(), 0, T0), rows_of(x, 0, T0)...,
                           rows_of(out_view(discard), 0, T0));
      expanded.prefill_into(sx0, rows_of(p.Q(true), 0, T0), rows_of(p.K(true), 0, T0),
                            rows_of(p.V(), 0, T0), rows_of(x, 0, T0)...,
                            rows_of(out_view(discard), 0, T0));
    }, ins);
  }
  BatchStateGradient<Scalar> fin(sg0);
  for (Index s = 0; s < d.B; ++s)
    for (Index h = 0; h < d.Hv(); ++h) {
      auto& f = fin.head(s, h);
      f.S = linattn_test::random_matrix<Scalar>(f.S.rows(), f.S.cols(), seed + 100 + 7 * std::uint64_t(s * d.Hv() + h));
      if (f.z.size() > 0)
        f.z = linattn_test::random_matrix<Scalar>(f.z.size(), 1, seed + 200 + std::uint64_t(h)).col(0);
    }
  const Index n = d.T - T0;
  for (const bool from_saved : {false, true}) {
    INFO((from_saved ? "prefill_backward_into from a saved forward" : "prefill_backward_into"));
    auto gg = make_grads(p, false), gx = make_grads(p, true);
    gg.initial.emplace(sg0);
    gx.initial.emplace(sx0);
    auto views_g = grad_views(p, gg, false), views_x = grad_views(p, gx, true);
    const GradientViews<Scalar>& vg = views_g.first;
    const GradientViews<Scalar>& vx = views_x.first;
    auto& dg = views_g.second;
    auto& dx = views_x.second;
    const auto cut = [&](const GradientViews<Scalar>& g) {
      return GradientViews<Scalar>{rows_of(g.Q, T0, n), rows_of(g.K, T0, n), rows_of(g.V, T0, n)};
    };
    for (auto& x : dg) x = rows_of(x, T0, n);
    for (auto& x : dx) x = rows_of(x, T0, n);
    auto cut_ins = ins;
    for (auto& x : cut_ins) x = rows_of(x, T0, n);
    LayerSavedForward<Scalar> saved_g, saved_x;
    if (from_saved) {
      auto cg = sg0, cx = sx0;
      std::vector<Scalar> og(p.v.size()), ox(p.v.size());
      std::apply([&](const auto&... x) {
        prefill_saving_into(grouped, cg, rows_of(p.Q(false), T0, n), rows_of(p.K(false), T0, n),
                            rows_of(p.V(), T0, n), x..., rows_of(out_view(og), T0, n), saved_g);
        prefill_saving_into(expanded, cx, rows_of(p.Q(true), T0, n), rows_of(p.K(true), T0, n),
                            rows_of(p.V(), T0, n), x..., rows_of(out_view(ox), T0, n), saved_x);
      }, cut_ins);
      CHECK(og == ox);
      check_states<Attention>(cg, cx, d);
    }
    // The carried backward of `layer` from `source` (the states before the rows, or the saved
    // forward of them), on the grouped or the expanded problem's inputs.
    const auto backward = [&](const auto& layer, const auto& source, bool expanded_inputs,
                              const GradientViews<Scalar>& views, const auto& d_ins,
                              BatchStateGradient<Scalar>& initial) {
      std::apply([&](const auto&... x) {
        std::apply([&](const auto&... d_in) {
          prefill_backward_into(layer, source, rows_of(p.Q(expanded_inputs), T0, n),
                                rows_of(p.K(expanded_inputs), T0, n), rows_of(p.V(), T0, n), x...,
                                rows_of(p.dY(), T0, n), &fin, cut(views), d_in..., initial);
        }, d_ins);
      }, cut_ins);
    };
    if (from_saved) {
      backward(grouped, saved_g, false, vg, dg, *gg.initial);
      backward(expanded, saved_x, true, vx, dx, *gx.initial);
    } else {
      backward(grouped, sg0, false, vg, dg, *gg.initial);
      backward(expanded, sx0, true, vx, dx, *gx.initial);
    }
    // Rows before T0 were not part of the call: the NaN they were filled with stays in both.
    // Compare the call's rows only.
    Dims tail = d;
    tail.T = n;
    const auto rows = [&](const std::vector<Scalar>& buf, Index H, Index dim) {
      std::vector<Scalar> out;
      for (Index b = 0; b < d.B; ++b)
        for (Index t = T0; t < d.T; ++t)
          for (Index h = 0; h < H; ++h)
            for (Index e = 0; e < dim; ++e)
              out.push_back(buf[std::size_t(flat(l, b, t, h, e, d.T, H, dim))]);
      return out;
    };
    // (Re-laid out batch-first: `tail`'s rows are then addressed with Layout::batch_first.)
    Grads<Scalar, N> tg, tx;
    tg.dQ = rows(gg.dQ, d.Hc, d.dk);
    tg.dK = rows(gg.dK, d.Hc, d.dk);
    tg.dV = rows(gg.dV, d.Hv(), d.dv);
    tx.dQ = rows(gx.dQ, d.Hv(), d.dk);
    tx.dK = rows(gx.dK, d.Hv(), d.dk);
    tx.dV = rows(gx.dV, d.Hv(), d.dv);
    for (std::size_t i = 0; i < N; ++i) {
      tg.d_in[i] = rows(gg.d_in[i], d.Hv(), p.channels[i]);
      tx.d_in[i] = rows(gx.d_in[i], d.Hv(), p.channels[i]);
    }
    tg.initial = std::move(gg.initial);
    tx.initial = std::move(gx.initial);
    check_same_grads(tg, tx, Layout::batch_first, tail);
  }
}


TEMPLATE_TEST_CASE("grouped value heads equal the layer on expanded queries and keys, every rule",
                   "[multihead][grouped_values]", float, double) {
  const Layout l = GENERATE(Layout::batch_first, Layout::head_first);
  // Two query/key heads of three value heads each; T = 11 does not fill the chunks of 4.
  const Dims d{2, 11, 2, 3, 8, 6};
  std::uint64_t seed = 500;
  const auto check = [&](const auto& c) { check_rule(c, l, d, seed += 20); };
  Options opt;
  opt.chunk_size = 4;
  check(RuleCase<LinearAttention<EluPlusOne, TestType>>{
      "LinearAttention", LinearAttention<EluPlusOne, TestType>(EluPlusOne{}, opt), {}});
  // Every rule; betas in [0.1, 1.9) (the delta rules take [0, 2]).
  linattn_test::for_each_rule<TestType>(check, 1.9);
}

TEST_CASE("grouped value heads with log-scaled random features: one state per value head",
          "[multihead][grouped_values]") {
  using Attention = LinearAttention<PositiveRandomFeatures<double>, double>;
  Options opt;
  opt.chunk_size = 4;
  const Dims d{2, 9, 2, 2, 6, 5};
  const RuleCase<Attention> c{"positive random features",
                              Attention(PositiveRandomFeatures<double>(d.dk, 8, 31), opt), {}};
  static_assert(!Layer<Attention>::shares_states);
  check_rule(c, Layout::batch_first, d, 900);
}

// A variable-length layout (`values`: packed offsets over B = 1, or padded lengths), on one and
// two threads: the forward, the recomputing backward and the backward from a saved forward
// against the expanded layer's, and the states saved to bytes and restored.
void check_layout_and_threads(SequenceLayout::Kind kind, const std::vector<Index>& values, Index B) {
  using Attention = RuleAttention<L2Normalize, GatedDelta, float>;
  Options opt;
  opt.chunk_size = 8;
  opt.normalization = Normalization::unnormalized();
  const RuleCase<Attention> c{"gated delta", Attention(L2Normalize{}, opt),
                              {InputSpec{false, 0.1, 1.9}, InputSpec{false, -0.5, -0.01}}};
  const bool packed = kind == SequenceLayout::Kind::packed;
  INFO((packed ? "packed" : "padded"));
  // Enough work per item (12 r dv T flops per value head) for the pool to run the items.
  const Dims d{B, 96, 2, 2, 16, 16};
  const Problem<Attention> p(c, Layout::batch_first, d, 1300);
  auto grouped = grouped_layer(c.attn, d);
  const auto expanded = expanded_layer(c.attn, d);
  const auto layout = packed ? SequenceLayout::packed(values) : SequenceLayout::padded(values);
  const Index S = layout.count(B);
  const auto out_view = [&](std::vector<float>& o) {
    return view<float>(p.layout, o.data(), d.B, d.T, d.Hv(), d.dv);
  };
  const auto ins = p.ins();
  const TensorView<const float>& beta = ins[0];
  const TensorView<const float>& alpha = ins[1];
  std::vector<float> og(p.v.size(), -7.f), ox(p.v.size(), -9.f), ot(p.v.size(), -5.f);
  auto sg = grouped.make_state(S), sx = expanded.make_state(S), st = grouped.make_state(S);
  grouped.prefill_into(sg, p.Q(false), p.K(false), p.V(), beta, alpha, out_view(og), layout);
  expanded.prefill_into(sx, p.Q(true), p.K(true), p.V(), beta, alpha, out_view(ox), layout);
  CHECK(og == ox);  // padded rows: zero in both
  ThreadPool pool(2);
  grouped.set_executor(&pool);
  grouped.prefill_into(st, p.Q(false), p.K(false), p.V(), beta, alpha, out_view(ot), layout);
  CHECK(ot == og);
  for (Index s = 0; s < S; ++s)
    for (Index h = 0; h < d.Hv(); ++h) {
      INFO("sequence " << s << ", head " << h);
      check_same_state(sg.sequence(s).head(h), sx.sequence(s).head(h));
      check_same_state(st.sequence(s).head(h), sg.sequence(s).head(h));
    }
  // The backward, one and two threads, against the expanded layer (padded rows: zero in all).
  Grads<float, 2> g1 = make_grads(p, false), g2 = make_grads(p, false), gx = make_grads(p, true);
  for (auto* g : {&g1, &g2, &gx}) {
    const bool is_expanded = g == &gx;
    auto [views, d_in] = grad_views(p, *g, is_expanded);
    if (is_expanded)
      parallel_backward_into(expanded, p.Q(true), p.K(true), p.V(), beta, alpha, Mask::causal,
                             p.dY(), views, d_in[0], d_in[1], layout);
    else {
      grouped.set_executor(g == &g1 ? nullptr : &pool);
      parallel_backward_into(grouped, p.Q(false), p.K(false), p.V(), beta, alpha, Mask::causal,
                             p.dY(), views, d_in[0], d_in[1], layout);
    }
  }
  check_same_grads(g1, gx, p.layout, d);
  CHECK(g2.dQ == g1.dQ);
  CHECK(g2.dK == g1.dK);
  CHECK(g2.dV == g1.dV);
  CHECK(g2.d_in[0] == g1.d_in[0]);
  CHECK(g2.d_in[1] == g1.d_in[1]);
  // From a saved forward (the pool's threads), against the expanded layer's.
  {
    LayerSavedForward<float> saved_g, saved_x;
    std::vector<float> sog(p.v.size(), -3.f), sox(p.v.size(), -4.f);
    parallel_saving_into(grouped, p.Q(false), p.K(false), p.V(), beta, alpha, Mask::causal,
                         out_view(sog), saved_g, layout);
    parallel_saving_into(expanded, p.Q(true), p.K(true), p.V(), beta, alpha, Mask::causal,
                         out_view(sox), saved_x, layout);
    CHECK(sog == sox);
    Grads<float, 2> sg_grads = make_grads(p, false), sx_grads = make_grads(p, true);
    auto views_g = grad_views(p, sg_grads, false), views_x = grad_views(p, sx_grads, true);
    parallel_backward_into(grouped, saved_g, p.Q(false), p.K(false), p.V(), beta, alpha,
                           Mask::causal, p.dY(), views_g.first, views_g.second[0],
                           views_g.second[1], layout);
    parallel_backward_into(expanded, saved_x, p.Q(true), p.K(true), p.V(), beta, alpha,
                           Mask::causal, p.dY(), views_x.first, views_x.second[0],
                           views_x.second[1], layout);
    INFO("from a saved forward");
    check_same_grads(sg_grads, sx_grads, p.layout, d);
  }

  // A saved state is the grouped layer's: it restores into a layer of the same heads, not into
  // one with the same query/key heads and ungrouped values.
  const auto blob = save_state(grouped, sg);
  const auto restored = load_state(grouped, blob);
  for (Index s = 0; s < S; ++s)
    for (Index h = 0; h < d.Hv(); ++h) check_same_state(restored.sequence(s).head(h), sg.sequence(s).head(h));
  const Layer<Attention> ungrouped(HeadConfig{d.Hc, d.Hc, d.dk, d.dv}, c.attn);
  CHECK_THROWS_WITH(load_state(ungrouped, blob), Catch::Contains("H_v=2 and keeps 2"));
}

TEST_CASE("grouped value heads: packed and padded sequences, threads, saved forward and state",
          "[multihead][grouped_values][threads]") {
  // Packed: the second sequence is empty. Padded: the second entry's rows from 41 on are pad.
  check_layout_and_threads(SequenceLayout::Kind::packed, {0, 37, 37, 96}, 1);
  check_layout_and_threads(SequenceLayout::Kind::padded, {96, 41}, 2);
}

TEST_CASE("grouped value heads: dQ and dK by finite differences", "[multihead][grouped_values][fd]") {
  // The loss L = sum(dY .* out) of the grouped layer's causal forward in double; its gradient
  // in Q and K (which sums over each head's G_v value heads) against central differences.
  // Error of a central difference with step h: h^2 |L'''| / 6 from truncation (|L'''| is O(1)
  // for these O(1) inputs: about 1e-10) plus about eps |L| / h from rounding (|L| < 100:
  // about 2e-9); 1e-6 (1 + |g|) bounds both with room.
  using Attention = RuleAttention<L2Normalize, GatedDelta, double>;
  Options opt;
  opt.chunk_size = 4;
  opt.normalization = Normalization::unnormalized();
  const RuleCase<Attention> c{"gated delta", Attention(L2Normalize{}, opt),
                              {InputSpec{false, 0.1, 1.9}, InputSpec{false, -0.5, -0.01}}};
  const Dims d{1, 7, 2, 2, 4, 3};
  Problem<Attention> p(c, Layout::batch_first, d, 1700);
  const auto grouped = grouped_layer(c.attn, d);
  const auto ins = p.ins();
  const TensorView<const double>& beta = ins[0];
  const TensorView<const double>& alpha = ins[1];
  const auto loss = [&] {
    std::vector<double> o(p.v.size());
    grouped.parallel_into(p.Q(false), p.K(false), p.V(), beta, alpha, Mask::causal,
                          view<double>(p.layout, o.data(), d.B, d.T, d.Hv(), d.dv));
    double L = 0;
    for (std::size_t i = 0; i < o.size(); ++i) L += o[i] * p.dy[i];
    return L;
  };
  auto g = make_grads(p, false);
  auto [views, d_in] = grad_views(p, g, false);
  parallel_backward_into(grouped, p.Q(false), p.K(false), p.V(), beta, alpha, Mask::causal, p.dY(),
                         views, d_in[0], d_in[1]);
  const double step = 1e-5;
  for (auto* which : {&p.q, &p.k}) {
    const auto& grad = which == &p.q ? g.dQ : g.dK;
    for (std::size_t i = 0; i < which->size(); ++i) {
      const double x = (*which)[i];
      (*which)[i] = x + step;
      const double up = loss();
      (*which)[i] = x - step;
      const double down = loss();
      (*which)[i] = x;
      const double fd = (up - down) / (2 * step);
      INFO((which == &p.q ? "dQ" : "dK") << " element " << i);
      CHECK(std::abs(grad[i] - fd) <= 1e-6 * (1 + std::abs(grad[i])));
    }
  }
}

TEST_CASE("grouped value heads: configurations and views that do not fit are refused",
          "[multihead][grouped_values][errors]") {
  using Attention = RuleAttention<L2Normalize, Delta, float>;
  // `call` throws ShapeError naming `part`.
  const auto expect = [](auto&& call, const std::string& part) {
    CHECK_THROWS_AS(call(), ShapeError);
    CHECK_THROWS_WITH(call(), Catch::Contains(part));
  };
  const auto refused = [&](const HeadConfig& h, const std::string& part) {
    expect([&] { static_cast<void>(Layer<Attention>(h)); }, part);
  };
  refused(HeadConfig{2, 2, 8, 8, 3}, "value heads H_v=3 must be a multiple of key heads H_kv=2");
  refused(HeadConfig{4, 2, 8, 8, 4}, "need as many query heads as key heads, got H_q=4");
  refused(HeadConfig{2, 2, 8, 8, -1}, "H_v=-1");

  const Layer<Attention> layer(HeadConfig{2, 2, 8, 8, 4});
  CHECK(layer.state_heads() == 4);
  CHECK(layer.make_state(1).heads() == 4);
  // A K/V cache would keep H_kv dk + H_v dv per token.
  CHECK(layer.footprint().kv_scalars_per_token == 2 * 8 + 4 * 8);
  std::vector<float> buf(2 * 5 * 4 * 8, 0.5f);
  const auto at = [&](Index H) { return TensorView<const float>::batch_first(buf.data(), 1, 5, H, 8); };
  std::vector<float> out(5 * 4 * 8);
  const auto out_of = [&](Index H) { return TensorView<float>::batch_first(out.data(), 1, 5, H, 8); };
  std::vector<float> beta(5 * 4, 0.5f);
  const auto beta_of = [&](Index H) { return TensorView<const float>::batch_first(beta.data(), 1, 5, H, 1); };
  expect([&] { layer.parallel_into(at(2), at(2), at(2), beta_of(4), Mask::causal, out_of(4)); },
         "V and out need H_v heads");
  expect([&] { layer.parallel_into(at(4), at(2), at(4), beta_of(4), Mask::causal, out_of(4)); },
         "Q and K need H_q = H_kv heads");
  expect([&] { layer.parallel_into(at(2), at(2), at(4), beta_of(2), Mask::causal, out_of(4)); },
         "H_v=4, 1]");
  // And the fitting call runs.
  layer.parallel_into(at(2), at(2), at(4), beta_of(4), Mask::causal, out_of(4));
}

}  // namespace grouped_value_heads_test
