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
///   prefill_saving_into(layer, state, Q, K, V, in..., out, saved, layout, slots);  // carried
///   prefill_backward_into(layer, saved, Q, K, V, in..., dY, final_gradients,
///                         GradientViews<float>{dQ, dK, dV}, d_in..., initial_gradients,
///                         layout, slots);
///
/// Every rule (Additive, Decay, Gated, Delta, GatedDelta), both layouts, grouped query or value heads,
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
/// against 10 r dv + B (4 r + 3 dv) recomputing.
///
/// Carried states (training in segments): prefill_saving_into(layer, state, Q, K, V, in..., out,
/// saved, layout, slots) is layer.prefill_into keeping the chunk states from the states it
/// continues, and prefill_backward_into(layer, saved, Q, K, V, in..., dY, final_gradients,
/// grads, d_in..., initial_gradients, layout, slots) its backward, which needs neither the
/// states before the call nor a sweep that rebuilds the chunk states.

#include <linattn/errors.hpp>
#include <linattn/executor.hpp>
#include <linattn/multihead.hpp>
#include <linattn/multihead_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/tensor_view.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>
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

namespace detail {

/// The layer's saving forward, stateless (`state` null: layer.parallel_into, causal) or
/// continuing the states at `slots` (layer.prefill_into): checks, then one item per (sequence,
/// state head) on the layer's executor. A shared state is saved by the group's first head
/// and the other G - 1 heads read it in one grouped call (the bits of one call per head, as the
/// layer's forward), from a copy of the state as it was when it is carried; unshared states are
/// each saved by their own head. A throw leaves `saved` empty.
template <class Attention, std::size_t N>
void layer_saving_forward(const MultiHeadAttention<Attention>& layer,
                          BatchState<typename Attention::State>* state,
                          const TensorView<const typename Attention::scalar_type>& Q,
                          const TensorView<const typename Attention::scalar_type>& K,
                          const TensorView<const typename Attention::scalar_type>& V,
                          const std::array<TensorView<const typename Attention::scalar_type>, N>& inputs,
                          const TensorView<typename Attention::scalar_type>& out,
                          LayerSavedForward<typename Attention::scalar_type>& saved,
                          const SequenceLayout& layout, std::span<const Index> slots) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  const HeadConfig& heads = layer.heads();
  const Index r = layer.feature_dim();
  LayerSavedForwardAccess::mark_empty(saved);
  check_views(heads, r, Q, K, V, out, layout, true);
  for (std::size_t i = 0; i < N; ++i)
    check_token_view(inputs[i], K, heads.v_heads(), r, per_channel_input<Rule>(i));
  const Index sequences = layout.count(Q.batches());
  if (state != nullptr) check_slots(*state, layer, sequences, slots);

  constexpr bool shared = MultiHeadAttention<Attention>::shares_states;
  const HeadMap map(heads, shared);
  const Index G = map.query_count(), H = layer.state_heads();
  LayerSavedForwardAccess::resize(saved, sequences, H);
  const bool padded = layout.kind() == SequenceLayout::Kind::padded;
  const bool full_rows = layout.kind() == SequenceLayout::Kind::batch;
  const Attention& attn = layer.attention();
  const auto run = [&](Index item) {
    const Index s = item / H, h = item % H, q0 = map.query_first(h), o0 = map.out_first(h);
    const Index entry = layout.batch_entry(s), first = layout.first_row(s);
    const Index n = full_rows ? Q.times() : layout.length(s, Q.times());
    const Index position = slots.empty() ? s : slots[static_cast<std::size_t>(s)];
    if (padded) zero_rows(out.slice(entry, n, out.times() - n, o0, G));
    const auto k = K.head_rows(entry, map.key_of(h), first, n);
    const auto v = V.head_rows(entry, map.value_of(h), first, n);
    const auto in = rows_inputs(inputs, entry, map.value_of(h), first, n);
    std::apply(
        [&](const auto&... x) {
          std::optional<typename Attention::State> before;  // a shared carried state as it was
          const auto q = Q.head_rows(entry, q0, first, n);
          auto o = out.head_rows(entry, o0, first, n);
          SavedForward<Scalar>& keep = LayerSavedForwardAccess::item(saved, s, h);
          if (state == nullptr) {
            parallel_saving_into(attn, q, k, v, x..., Mask::causal, o, keep);
          } else {
            auto& head = state->sequence(position).head(h);
            if (G > 1) before.emplace(head);
            prefill_saving_into(attn, head, q, k, v, x..., o, keep);
          }
          if constexpr (shared) {
            if (G > 1) {
              const auto rest_q = Q.slice(entry, first, n, q0 + 1, G - 1);
              const auto rest_out = out.slice(entry, first, n, o0 + 1, G - 1);
              if (state == nullptr)
                attn.parallel_into(rest_q, k, v, x..., Mask::causal, rest_out);
              else
                attn.prefill_into(*before, rest_q, k, v, x..., rest_out);
            }
          }
        },
        in);
  };
  // 4 r dv flops per token and query head (the forward's), for the executor's grain decision.
  const double rows = layout.kind() == SequenceLayout::Kind::packed
                          ? double(Q.times()) / double(std::max<Index>(sequences, 1))
                          : double(Q.times());
  const double flops = 4.0 * double(r) * double(heads.value_dim) * rows * double(G);
  try {
    // Every item runs; the lowest failing item's exception is rethrown (as the layer's forward).
    parallel_for(sequences * H, layer.executor(), flops, run);
  } catch (...) {
    LayerSavedForwardAccess::mark_empty(saved);
    throw;
  }
}

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
  constexpr std::size_t N = Attention::rule_type::token_inputs;
  static_assert(sizeof...(Args) == N + 3 || sizeof...(Args) == N + 4,
                "parallel_saving_into takes the layer, Q, K, V, the rule's per-token input views, "
                "Mask::causal, the output, the LayerSavedForward and optionally a SequenceLayout");
  const auto all = std::forward_as_tuple(args...);
  static_assert(std::is_same_v<std::remove_cvref_t<std::tuple_element_t<N, decltype(all)>>,
                               CausalMask>,
                "a saved forward is causal: pass Mask::causal before the output");
  detail::layer_saving_forward<Attention>(
      layer, nullptr, Q, K, V, detail::token_views<N, Scalar>(all),
      TensorView<Scalar>(std::get<N + 1>(all)), std::get<N + 2>(all),
      detail::argument_or<N + 3>(all, SequenceLayout::batch()), {});
}

/// prefill_saving_into(layer, state, Q, K, V, in..., out, saved, layout = batch(), slots = {}):
/// layer.prefill_into(state, Q, K, V, in..., out, layout, slots) (the same bits in out and in
/// the states afterwards) keeping each sequence's and state head's chunk-boundary states, from
/// the state it continued, in `saved` for prefill_backward_into below. For training in
/// segments: the backward then needs neither the states before the call nor the sweep that
/// rebuilds the chunk states. A group that shares a state reads it with G query heads: the
/// first head's saving forward advances the state, the other G - 1 heads read a copy of the
/// state as it was (one r x dv copy per item) in one grouped call. Throws as
/// layer.prefill_into (every item runs; the lowest failing item's exception is rethrown, and the
/// states of the items that ran are advanced, as there); `saved` is then left empty.
template <class Attention, class... Args>
void prefill_saving_into(const MultiHeadAttention<Attention>& layer,
                         BatchState<typename Attention::State>& state,
                         std::type_identity_t<TensorView<const typename Attention::scalar_type>> Q,
                         std::type_identity_t<TensorView<const typename Attention::scalar_type>> K,
                         std::type_identity_t<TensorView<const typename Attention::scalar_type>> V,
                         Args&&... args) {
  using Scalar = typename Attention::scalar_type;
  constexpr std::size_t N = Attention::rule_type::token_inputs;
  static_assert(sizeof...(Args) >= N + 2 && sizeof...(Args) <= N + 4,
                "prefill_saving_into takes the layer, the state, Q, K, V, the rule's per-token "
                "input views, the output, the LayerSavedForward and optionally a SequenceLayout "
                "and slots");
  const auto all = std::forward_as_tuple(args...);
  detail::layer_saving_forward<Attention>(
      layer, &state, Q, K, V, detail::token_views<N, Scalar>(all),
      TensorView<Scalar>(std::get<N>(all)), std::get<N + 1>(all),
      detail::argument_or<N + 2>(all, SequenceLayout::batch()),
      detail::argument_or<N + 3>(all, std::span<const Index>()));
}

/// prefill_backward_into(layer, saved, Q, K, V, in..., dY, final_gradients, grads, d_in...,
/// initial_gradients, layout = batch(), slots = {}): the backward of the layer's
/// prefill_saving_into that filled `saved` (same inputs, layout and slots), as
/// multihead_gradients.hpp's prefill_backward_into from the states before that call, without
/// needing them: final_gradients (const BatchStateGradient*, null: none) by position in,
/// dQ, dK, dV into `grads`, the per-token inputs' gradients into d_in..., and the gradients of
/// the states the forward continued into initial_gradients by position (positions named by no
/// slot untouched). Both gradient objects are shaped for the layer's state heads
/// (BatchStateGradient(state)) and must be two objects. Throws ShapeError for views, layouts,
/// slots, gradient objects or a saved forward that do not fit (naming them), otherwise as the
/// layer's backward.
template <class Attention, class... Args>
void prefill_backward_into(
    const MultiHeadAttention<Attention>& layer,
    const LayerSavedForward<typename Attention::scalar_type>& saved,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> Q,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> K,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> V, Args&&... args) {
  using Scalar = typename Attention::scalar_type;
  constexpr std::size_t N = Attention::rule_type::token_inputs;
  static_assert(sizeof...(Args) >= 2 * N + 4 && sizeof...(Args) <= 2 * N + 7,
                "prefill_backward_into from a saved forward takes the layer, the "
                "LayerSavedForward, Q, K, V, the rule's per-token input views, dY, the final "
                "states' gradient (or nullptr), the GradientViews, the per-token inputs' gradient "
                "views, the initial states' gradient and optionally a SequenceLayout, slots and a "
                "BackwardWorkspace*");
  const auto all = std::forward_as_tuple(args...);
  const auto options = detail::layer_backward_options<Scalar, 2 * N + 4, true>(all);
  const BatchStateGradient<Scalar>* final_gradients = std::get<N + 1>(all);
  BatchStateGradient<Scalar>& initial = std::get<2 * N + 3>(all);
  detail::layer_backward<Attention>(
      layer, nullptr, Q, K, V, detail::token_views<N, Scalar>(all), Mask::causal,
      TensorView<const Scalar>(std::get<N>(all)), final_gradients,
      GradientViews<Scalar>(std::get<N + 2>(all)), detail::views_at<N + 3, N, Scalar>(all),
      &initial, options.layout, options.slots, &saved, options.workspace);
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
  static_assert(sizeof...(Args) >= 2 * N + 3 && sizeof...(Args) <= 2 * N + 5,
                "parallel_backward_into from a saved forward takes the layer, the "
                "LayerSavedForward, Q, K, V, the rule's per-token input views, Mask::causal, dY, "
                "the GradientViews, the per-token inputs' gradient views and optionally a "
                "SequenceLayout and a BackwardWorkspace*");
  const auto all = std::forward_as_tuple(args...);
  const auto options = detail::layer_backward_options<Scalar, 2 * N + 3, false>(all);
  static_assert(std::is_same_v<std::remove_cvref_t<std::tuple_element_t<N, decltype(all)>>,
                               CausalMask>,
                "a saved forward is causal: pass Mask::causal before dY");
  detail::layer_backward<Attention>(
      layer, nullptr, Q, K, V, detail::token_views<N, Scalar>(all), Mask::causal,
      TensorView<const Scalar>(std::get<N + 1>(all)), nullptr,
      GradientViews<Scalar>(std::get<N + 2>(all)), detail::views_at<N + 3, N, Scalar>(all),
      nullptr, options.layout, {}, &saved, options.workspace);
}

}  // namespace linattn
