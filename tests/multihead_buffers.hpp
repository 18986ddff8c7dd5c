#pragma once
// Multi-head test buffers: flat [B, T, H, d] or [B, H, T, d] vectors, addressed by an index
// formula written out independently of TensorView, so the tests check the library's views
// against it, and the rule cases the layer's tests run (shared by multihead_test.cpp,
// multihead_gradients_test.cpp and grouped_value_heads_test.cpp).

#include <linattn/attention.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/normalization.hpp>
#include <linattn/options.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include "test_support.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace linattn_test {

using linattn::Index;
using linattn::RowMatrix;
using linattn::TensorView;

enum class Layout { batch_first, head_first };

// Flat offset of element (b, t, h, c) of a row-major [B, T, H, d] or [B, H, T, d] buffer,
// written out independently of TensorView.
Index flat(Layout l, Index b, Index t, Index h, Index c, Index T, Index H, Index d) {
  return l == Layout::batch_first ? ((b * T + t) * H + h) * d + c : ((b * H + h) * T + t) * d + c;
}

template <class Scalar>
std::vector<Scalar> random_buffer(Index n, std::uint64_t seed) {
  const auto m = linattn_test::random_matrix<Scalar>(1, n, seed);
  return {m.data(), m.data() + n};
}

template <class Scalar>
TensorView<Scalar> view(Layout l, Scalar* p, Index B, Index T, Index H, Index d) {
  return l == Layout::batch_first ? TensorView<Scalar>::batch_first(p, B, T, H, d)
                                  : TensorView<Scalar>::head_first(p, B, H, T, d);
}

// Rows [first, first + n) of head h of entry b, copied into a contiguous matrix.
template <class Scalar>
RowMatrix<Scalar> cut(const std::vector<Scalar>& buf, Layout l, Index b, Index h, Index first,
                      Index n, Index T, Index H, Index d) {
  RowMatrix<Scalar> m(n, d);
  for (Index t = 0; t < n; ++t)
    for (Index c = 0; c < d; ++c)
      m(t, c) = buf[static_cast<std::size_t>(flat(l, b, first + t, h, c, T, H, d))];
  return m;
}

// A rule's per-token input: one value per token and value head, or r (per-channel gates), drawn
// uniformly from [lo, hi).
struct InputSpec {
  bool per_channel;
  double lo, hi;
};

// An attention under test, named, with the specs of its rule's per-token inputs.
template <class Attention>
struct RuleCase {
  const char* name;
  Attention attn;
  std::array<InputSpec, Attention::rule_type::token_inputs> inputs;
};

// Calls f(case) for every write rule: Additive, Decay, Gated (one gate, per channel), Delta and
// GatedDelta (one log_alpha per token, per channel; betas uniform on [0.1, beta_hi)), with a
// chunk of 4, which does not divide the lengths the tests use.
template <class Scalar, class F>
void for_each_rule(F&& f, double beta_hi = 0.9) {
  using namespace linattn;
  Options opt;
  opt.chunk_size = 4;
  Options delta_opt = opt;
  delta_opt.normalization = Normalization::unnormalized();
  const InputSpec gate{false, -1.0, -0.05}, channel_gate{true, -1.0, -0.05},
      beta{false, 0.1, beta_hi}, alpha{false, -0.5, -0.01}, channel_alpha{true, -0.5, -0.01};
  using Additive_ = RuleAttention<EluPlusOne, Additive, Scalar>;
  using Decay_ = RuleAttention<EluPlusOne, Decay, Scalar>;
  using Gated_ = RuleAttention<EluPlusOne, Gated, Scalar>;
  using Delta_ = RuleAttention<L2Normalize, Delta, Scalar>;
  using GatedDelta_ = RuleAttention<L2Normalize, GatedDelta, Scalar>;
  f(RuleCase<Additive_>{"additive", Additive_(EluPlusOne{}, opt), {}});
  f(RuleCase<Decay_>{"decay", Decay_(EluPlusOne{}, Decay(0.8), opt), {}});
  f(RuleCase<Gated_>{"gated", Gated_(EluPlusOne{}, opt), {gate}});
  f(RuleCase<Gated_>{"gated per channel", Gated_(EluPlusOne{}, opt), {channel_gate}});
  f(RuleCase<Delta_>{"delta", Delta_(L2Normalize{}, delta_opt), {beta}});
  f(RuleCase<GatedDelta_>{"gated delta", GatedDelta_(L2Normalize{}, delta_opt), {beta, alpha}});
  f(RuleCase<GatedDelta_>{"gated delta per channel (KDA)", GatedDelta_(L2Normalize{}, delta_opt),
                          {beta, channel_alpha}});
}

}  // namespace linattn_test
