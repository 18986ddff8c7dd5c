#pragma once
/// \file multihead_saved_forward.hpp
/// The multi-head layer's saved forward, for training: layer.parallel_into (causal, from empty
/// states) that keeps, per sequence and state head, the chunk-boundary states a SavedForward
/// keeps for one head (saved_forward.hpp, rule_saved_forward.hpp), and the layer's backward from
/// them, which skips the sweep that rebuilds those states (multihead_gradients.hpp's backward).
///
///   LayerSavedForward<float> saved;                                   // reused across steps
///   parallel_saving_into(layer, Q, K, V, in..., Mask::causal, out, saved, layout = batch());
///   parallel_backward_into(layer, saved, Q, K, V, in..., Mask::causal, dY,
///                          GradientViews<float>{dQ, dK, dV}, d_in..., layout = batch());
///
/// Every rule (Additive, Decay, Gated, Delta, GatedDelta), both layouts, grouped-query heads,
/// batch / packed / padded layouts (SequenceLayout), the layer's executor.
///
/// What is saved depends on K, V and the per-token inputs only, never on Q: the G query heads of
/// a group that share one state (MultiHeadAttention::shares_states; every map but the
/// log-scaled random features) share one SavedForward, which the group's first head's forward
/// fills, while the other G - 1 heads read their state in one grouped forward, as the layer's
/// forward does. Without shared states each query head keeps its own. So the memory is that of
/// state_heads() single-head saved forwards per sequence (520 B per token and state head at
/// r = dv = 64 in float for the additive, decay and gated rules; about 1 KiB for the delta
/// rules: rule_saved_forward.hpp).
///
/// Bits: `out` holds layer.parallel_into's bits (each head's rows are the bits of one
/// single-head call in both); the gradients are those of the single-head backward from each
/// head's saved forward, summed over a group in head order as the recomputing layer backward
/// does, and so, like the single-head saved backward, the recomputing layer backward's bits
/// wherever the single-head ones agree (docs/gradients.md).
///
/// Complexity: the forward (for G > 1, twice the state updates of the layer's forward, whose
/// grouped call runs them once) plus r (dv + 1) scalars copied per saved chunk; the backward about
/// 8 r dv + B (3 r + 2 dv) flops per token and query head (additive; B the backward's chunk)
/// against 10 r dv + B (4 r + 3 dv) recomputing. Not offered (yet): carried states
/// (prefill_into); the recomputing prefill_backward_into covers them.

#include <linattn/errors.hpp>
#include <linattn/executor.hpp>
#include <linattn/multihead.hpp>
#include <linattn/multihead_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace linattn {

namespace detail {
struct LayerSavedForwardAccess;
}

/// The saved forwards of one layer.parallel_saving_into call: one SavedForward per sequence and
/// state head (see the file comment), read by the layer's backward from a saved forward. Empty
/// (sequences() == 0) until filled; a forward that throws leaves it empty. Reused across steps:
/// a call of the same shapes allocates nothing.
template <class Scalar>
class LayerSavedForward {
 public:
  /// Sequences of the forward that filled it (the layout's count).
  [[nodiscard]] Index sequences() const noexcept { return sequences_; }
  /// State heads per sequence (MultiHeadAttention::state_heads()).
  [[nodiscard]] Index heads() const noexcept { return heads_; }

  /// The saved forward of state head h of sequence s (empty for a sequence without rows).
  /// Throws std::out_of_range.
  [[nodiscard]] const SavedForward<Scalar>& head(Index s, Index h) const {
    if (s < 0 || s >= sequences_ || h < 0 || h >= heads_)
      throw std::out_of_range("linattn: no saved forward for sequence " + std::to_string(s) +
                              ", state head " + std::to_string(h));
    return items_[static_cast<std::size_t>(s * heads_ + h)];
  }

  /// Bytes held by the saved states of every sequence and head.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (Index i = 0; i < sequences_ * heads_; ++i)
      total += items_[static_cast<std::size_t>(i)].bytes();
    return total;
  }

  /// Throws ShapeError unless this holds `sequences` sequences of `layer`'s state heads (what a
  /// backward from it needs; each head's SavedForward then checks its length, dims and attention).
  template <class Attention>
  void check_for(const MultiHeadAttention<Attention>& layer, Index sequences) const {
    if (sequences_ != sequences || heads_ != layer.state_heads())
      detail::throw_shape_error("the layer's saved forward holds ", sequences_, " sequences x ",
                                heads_, " state heads, this call has ", sequences, " x ",
                                layer.state_heads(),
                                sequences_ == 0
                                    ? " (it is empty: fill it with parallel_saving_into)"
                                    : "");
  }

 private:
  friend struct detail::LayerSavedForwardAccess;

  // Sized for `sequences` x `heads`; keeps the items' allocations for the next call.
  void resize(Index sequences, Index heads) {
    const auto n = static_cast<std::size_t>(sequences * heads);
    if (items_.size() < n) items_.resize(n);
    sequences_ = sequences;
    heads_ = heads;
  }
  void mark_empty() noexcept {
    sequences_ = 0;
    heads_ = 0;
  }
  SavedForward<Scalar>& item(Index s, Index h) {
    return items_[static_cast<std::size_t>(s * heads_ + h)];
  }

  Index sequences_ = 0, heads_ = 0;
  std::vector<SavedForward<Scalar>> items_;
};

namespace detail {

/// What the layer's saving forward changes in a LayerSavedForward.
struct LayerSavedForwardAccess {
  template <class Scalar>
  static void resize(LayerSavedForward<Scalar>& saved, Index sequences, Index heads) {
    saved.resize(sequences, heads);
  }
  template <class Scalar>
  static void mark_empty(LayerSavedForward<Scalar>& saved) noexcept {
    saved.mark_empty();
  }
  template <class Scalar>
  static SavedForward<Scalar>& item(LayerSavedForward<Scalar>& saved, Index s, Index h) {
    return saved.item(s, h);
  }
};

}  // namespace detail

/// parallel_saving_into(layer, Q, K, V, in..., Mask::causal, out, saved, layout = batch()):
/// layer.parallel_into(Q, K, V, in..., Mask::causal, out, layout) (same bits in out) keeping
/// each sequence's and state head's chunk-boundary states in `saved` for the backward. A saved
/// forward is causal: pass Mask::causal. Throws as layer.parallel_into (ShapeError naming views
/// or a layout that do not fit; the lowest failing item's exception after every item ran);
/// `saved` is then left empty. Cost: the forward plus the copies of the states (file comment).
template <class Attention, class... Args>
void parallel_saving_into(const MultiHeadAttention<Attention>& layer,
                          std::type_identity_t<TensorView<const typename Attention::scalar_type>> Q,
                          std::type_identity_t<TensorView<const typename Attention::scalar_type>> K,
                          std::type_identity_t<TensorView<const typename Attention::scalar_type>> V,
                          Args&&... args) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  constexpr std::size_t N = Rule::token_inputs;
  static_assert(sizeof...(Args) == N + 3 || sizeof...(Args) == N + 4,
                "parallel_saving_into takes the layer, Q, K, V, the rule's per-token input views, "
                "Mask::causal, the output, the LayerSavedForward and optionally a SequenceLayout");
  const auto all = std::forward_as_tuple(args...);
  static_assert(std::is_same_v<std::remove_cvref_t<std::tuple_element_t<N, decltype(all)>>,
                               CausalMask>,
                "a saved forward is causal: pass Mask::causal before the output");
  const auto inputs = detail::token_views<N, Scalar>(all);
  const TensorView<Scalar> out = std::get<N + 1>(all);
  LayerSavedForward<Scalar>& saved = std::get<N + 2>(all);
  const SequenceLayout layout = detail::argument_or<N + 3>(all, SequenceLayout::batch());
  const HeadConfig& heads = layer.heads();
  const Index r = layer.feature_dim();
  detail::LayerSavedForwardAccess::mark_empty(saved);
  detail::check_views(heads, r, Q, K, V, out, layout, true);
  for (std::size_t i = 0; i < N; ++i)
    detail::check_token_view(inputs[i], K, heads.kv_heads, r, Rule::kind == WriteKind::gated);

  constexpr bool shared = MultiHeadAttention<Attention>::shares_states;
  const Index G = layer.group_size(), Hkv = heads.kv_heads, H = layer.state_heads();
  const Index sequences = layout.count(Q.batches());
  detail::LayerSavedForwardAccess::resize(saved, sequences, H);
  const bool padded = layout.kind() == SequenceLayout::Kind::padded;
  const bool full_rows = layout.kind() == SequenceLayout::Kind::batch;
  const Attention& attn = layer.attention();
  // Item (sequence s, key/value head g): the group's G query heads. A shared state is saved by
  // the group's first head and the others read it in one grouped call (the bits of one call per
  // head, as the layer's forward); unshared states are each saved by their own head.
  const auto run = [&](Index item) {
    const Index s = item / Hkv, g = item % Hkv, h0 = g * G;
    const Index entry = layout.batch_entry(s), first = layout.first_row(s);
    const Index n = full_rows ? Q.times() : layout.length(s, Q.times());
    if (padded) detail::zero_rows(out.slice(entry, n, out.times() - n, h0, G));
    const auto k = K.head_rows(entry, g, first, n);
    const auto v = V.head_rows(entry, g, first, n);
    const auto in = detail::rows_inputs(inputs, entry, g, first, n);
    std::apply(
        [&](const auto&... x) {
          for (Index j = 0; j < (shared ? 1 : G); ++j) {
            auto o = out.head_rows(entry, h0 + j, first, n);
            SavedForward<Scalar>& keep =
                detail::LayerSavedForwardAccess::item(saved, s, shared ? g : h0 + j);
            parallel_saving_into(attn, Q.head_rows(entry, h0 + j, first, n), k, v, x...,
                                 Mask::causal, o, keep);
          }
          if constexpr (shared) {
            if (G > 1)
              attn.parallel_into(Q.slice(entry, first, n, h0 + 1, G - 1), k, v, x...,
                                 Mask::causal, out.slice(entry, first, n, h0 + 1, G - 1));
          }
        },
        in);
  };
  const Index items = sequences * Hkv;
  // 4 r dv flops per token and query head (the forward's), for the executor's grain decision.
  const double rows = layout.kind() == SequenceLayout::Kind::packed
                          ? double(Q.times()) / double(std::max<Index>(sequences, 1))
                          : double(Q.times());
  const double flops = 4.0 * double(r) * double(heads.value_dim) * rows * double(G);
  try {
    // Every item runs; the lowest failing item's exception is rethrown (as the layer's forward).
    detail::parallel_for(items, layer.executor(), flops, run);
  } catch (...) {
    detail::LayerSavedForwardAccess::mark_empty(saved);
    throw;
  }
}

/// parallel_backward_into(layer, saved, Q, K, V, in..., Mask::causal, dY, grads, d_in...,
/// layout = batch()): the layer's backward (multihead_gradients.hpp) of the forward that filled
/// `saved` (parallel_saving_into above, same inputs and layout), reading its saved states instead
/// of rebuilding them. Throws ShapeError when `saved` does not hold this call's sequences and
/// state heads, or a head's saved forward is not for its rows and dims (naming them),
/// StateMismatchError when another attention filled it, otherwise as the layer's backward.
template <class Attention, class... Args>
void parallel_backward_into(
    const MultiHeadAttention<Attention>& layer,
    const LayerSavedForward<typename Attention::scalar_type>& saved,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> Q,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> K,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> V, Args&&... args) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  constexpr std::size_t N = Rule::token_inputs;
  static_assert(sizeof...(Args) == 2 * N + 3 || sizeof...(Args) == 2 * N + 4,
                "parallel_backward_into from a saved forward takes the layer, the "
                "LayerSavedForward, Q, K, V, the rule's per-token input views, Mask::causal, dY, "
                "the GradientViews, the per-token inputs' gradient views and optionally a "
                "SequenceLayout");
  const auto all = std::forward_as_tuple(args...);
  static_assert(std::is_same_v<std::remove_cvref_t<std::tuple_element_t<N, decltype(all)>>,
                               CausalMask>,
                "a saved forward is causal: pass Mask::causal before dY");
  detail::layer_backward<Attention>(
      layer, nullptr, Q, K, V, detail::token_views<N, Scalar>(all), Mask::causal,
      TensorView<const Scalar>(std::get<N + 1>(all)), nullptr,
      GradientViews<Scalar>(std::get<N + 2>(all)), detail::views_at<N + 3, N, Scalar>(all),
      nullptr, detail::argument_or<2 * N + 3>(all, SequenceLayout::batch()), {}, &saved);
}

}  // namespace linattn
