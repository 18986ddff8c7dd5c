#pragma once
/// \file multihead_gradients.hpp
/// The multi-head layer's backward pass for every write rule (Additive, Decay, Gated, Delta,
/// GatedDelta): the gradients of layer.parallel_into and layer.prefill_into with respect to Q,
/// K, V, the rule's per-token inputs and the carried states, read from and written into the
/// model's own buffers.
///
///   parallel_backward_into(layer, Q, K, V, in..., mask, dY, GradientViews{dQ, dK, dV},
///                          d_in..., layout = batch(), workspace = nullptr)
///   prefill_backward_into(layer, state, Q, K, V, in..., dY, final_gradients,
///                         GradientViews{dQ, dK, dV}, d_in..., initial_gradients,
///                         layout = batch(), slots = {}, workspace = nullptr)
///
/// The backward from a saved forward (no sweep that rebuilds the states) is in
/// multihead_saved_forward.hpp.
///
/// in... are the forward's per-token input views (Gated: log-gates; Delta: beta; GatedDelta:
/// beta, log_alpha; [B, T, H_v, 1] or [B, T, H_v, r]); d_in... are views of the same shapes
/// where their gradients go. Per-sequence, per-state-head state gradients: BatchStateGradient.
///
/// Math: every query head h of every sequence is the single-head read of its key/value head
/// g = h / G (G = H_q / H_kv), so dQ[h] is that read's dQ, and dK[g], dV[g] and the gradients of
/// g's per-token inputs are the sums of the single-head gradients over the G query heads of the
/// group (each from gradients.hpp / rule_gradients.hpp on views of the buffers). With grouped
/// value heads the roles turn: value head h reads query/key head c = h / G_v, so dV[h] and the
/// gradients of h's per-token inputs are its read's, and dQ[c], dK[c] sum the G_v reads'. With a
/// carried
/// state shared by the group (state_heads() = H_kv), the loss is sum_j L_j(Y_j) + L_T(S_T) and
/// the backward is linear in (dY, dS_T): head j = 0 carries the final state's gradient, the
/// others none, and their initial-state gradients are summed. Padded rows get zero gradients
/// and their inputs are never read; packed sequences see only their own rows; a sequence with
/// no rows gets zero gradients and passes the final state's gradient to the initial state.
///
/// Threads: the work items (sequence, key head) run on the layer's executor when the call
/// has enough work (as the forward); each item sums its group's heads in head order into its
/// own rows and state gradients, so the result is bit-identical for every thread count.
///
/// Complexity: 3 to 4 times the forward's flops; per item, the single-head backward's scratch
/// (causal_backward_bytes / rule_backward_bytes) plus, for G > 1, T x (dk + dv + inputs) and one
/// state's gradient for the group's sums. These buffers (for the delta rules also their rebuilt
/// forward data, the bulk of rule_backward_bytes) live in one lane of a BackwardWorkspace per
/// thread, reused by the items that thread runs: the call's own, or `workspace` (a
/// BackwardWorkspace<Scalar>*, the last argument) kept by the caller across calls, which then
/// allocate nothing once warm for the additive rule (tests/allocation_test.cpp; the rules' per
/// token input gradients are still sized per item). The same bits with or without one. The
/// gradient views must not overlap the inputs.

#include <linattn/batch_state.hpp>
#include <linattn/detail/multihead_backward.hpp>
#include <linattn/gradients.hpp>
#include <linattn/multihead.hpp>
#include <linattn/rule_gradients.hpp>

#include <algorithm>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

/// Where the multi-head backward writes dQ [B, Tq, H_q, dk], dK [B, Tk, H_kv, dk] and
/// dV [B, Tk, H_v, dv]: views of the same shapes as Q, K and V (any strides, either layout).
template <class Scalar>
struct GradientViews {
  TensorView<Scalar> Q, K, V;
};

namespace detail {

template <class Scalar>
void check_gradient_view(const char* name, const TensorView<Scalar>& grad,
                         const TensorView<const Scalar>& input) {
  if (grad.batches() != input.batches() || grad.times() != input.times() ||
      grad.heads() != input.heads() || grad.dim() != input.dim())
    throw_shape_error("gradient view ", name, " is ", grad.describe(), " but its input is ",
                      input.describe(), " (they need the same B, T, H and d)");
}

/// Whether a head state keeps a normalizer z: AttentionState always, RuleState as its rule.
template <class HeadState>
constexpr bool head_keeps_z() {
  if constexpr (requires { HeadState::rule_type::keeps_normalizer; })
    return HeadState::rule_type::keeps_normalizer;
  else
    return true;
}

}  // namespace detail


/// Gradients of a loss with respect to the states of a BatchState: one StateGradient (S r x dv;
/// z length r, or empty for the delta rules, which keep none) per sequence position and state
/// head, in the BatchState's order. What the layer's prefill_backward_into reads as the final
/// states' gradients and writes as the initial states' gradients.
template <class Scalar>
class BatchStateGradient {
 public:
  BatchStateGradient() = default;

  /// Zero gradients for `sequences` positions of `heads` state heads, S r x dv and z of length r
  /// when `keeps_z`. Throws ShapeError for negative counts or dims below 1. O(sequences heads r dv).
  BatchStateGradient(Index sequences, Index heads, Index r, Index dv, bool keeps_z)
      : sequences_(sequences), heads_(heads), r_(r), dv_(dv), keeps_z_(keeps_z) {
    if (sequences < 0 || heads < 0 || r < 1 || dv < 1)
      detail::throw_shape_error("a batch state gradient needs sequences, heads >= 0 and r, dv >= 1, "
                                "got sequences=", sequences, " heads=", heads, " r=", r, " dv=", dv);
    grads_.resize(static_cast<std::size_t>(sequences * heads));
    for (auto& g : grads_) {
      g.S = RowMatrix<Scalar>::Zero(r, dv);
      g.z = ColVector<Scalar>::Zero(keeps_z ? r : 0);
    }
  }

  /// Zero gradients shaped like `state` (its positions, state heads, r, dv and z).
  template <class HeadState>
  explicit BatchStateGradient(const BatchState<HeadState>& state)
      : BatchStateGradient(state.size(), state.heads(), state.feature_dim(), state.value_dim(),
                           detail::head_keeps_z<HeadState>()) {}

  [[nodiscard]] Index size() const noexcept { return sequences_; }
  [[nodiscard]] Index heads() const noexcept { return heads_; }
  [[nodiscard]] Index feature_dim() const noexcept { return r_; }
  [[nodiscard]] Index value_dim() const noexcept { return dv_; }
  [[nodiscard]] bool keeps_z() const noexcept { return keeps_z_; }

  /// The gradient of state head h of the sequence at position i. Throws std::out_of_range.
  [[nodiscard]] StateGradient<Scalar>& head(Index i, Index h) { return grads_.at(index(i, h)); }
  [[nodiscard]] const StateGradient<Scalar>& head(Index i, Index h) const {
    return grads_.at(index(i, h));
  }

  /// Sets every gradient to zero (keeps the allocations).
  void set_zero() noexcept {
    for (auto& g : grads_) {
      g.S.setZero();
      g.z.setZero();
    }
  }

  /// Throws ShapeError naming `what` unless this has the positions, heads and dims of `state`.
  template <class HeadState>
  void check_like(const BatchState<HeadState>& state, const char* what) const {
    if (sequences_ != state.size() || heads_ != state.heads() || r_ != state.feature_dim() ||
        dv_ != state.value_dim() || keeps_z_ != detail::head_keeps_z<HeadState>())
      detail::throw_shape_error(what, " has sequences=", sequences_, " heads=", heads_, " r=", r_,
                                " dv=", dv_, keeps_z_ ? " with z" : " without z",
                                " but the batch state has sequences=", state.size(), " heads=",
                                state.heads(), " r=", state.feature_dim(), " dv=",
                                state.value_dim(),
                                detail::head_keeps_z<HeadState>() ? " with z" : " without z");
  }

 private:
  [[nodiscard]] std::size_t index(Index i, Index h) const {
    if (i < 0 || i >= sequences_ || h < 0 || h >= heads_)
      throw std::out_of_range("linattn: no state gradient at position " + std::to_string(i) +
                              ", head " + std::to_string(h));
    return static_cast<std::size_t>(i * heads_ + h);
  }

  Index sequences_ = 0, heads_ = 0, r_ = 0, dv_ = 0;
  bool keeps_z_ = true;
  std::vector<StateGradient<Scalar>> grads_;
};

namespace detail {

template <std::size_t I, class Tuple, class T>
T argument_or(const Tuple& all, T fallback) {
  if constexpr (I < std::tuple_size_v<Tuple>)
    return std::get<I>(all);
  else
    return fallback;
}

/// The optional last arguments of a layer backward, in this order: a SequenceLayout, the slots
/// (a span of Index, or what converts to one: carried calls only) and a BackwardWorkspace*.
template <class Scalar>
struct LayerBackwardOptions {
  SequenceLayout layout = SequenceLayout::batch();
  std::span<const Index> slots;
  BackwardWorkspace<Scalar>* workspace = nullptr;
};

// 0: a layout, 1: slots, 2: a workspace, -1: none of them.
template <class Scalar, class Arg>
constexpr int layer_option_kind() {
  using A = std::remove_cvref_t<Arg>;
  if constexpr (std::is_same_v<A, SequenceLayout>)
    return 0;
  else if constexpr (std::is_same_v<A, BackwardWorkspace<Scalar>*>)
    return 2;
  else if constexpr (std::is_convertible_v<const A&, std::span<const Index>>)
    return 1;
  else
    return -1;
}

/// The options among all's elements [From, end): at most one of each kind, in the order above;
/// slots only where `takes_slots`.
template <class Scalar, std::size_t From, bool TakesSlots, class Tuple>
LayerBackwardOptions<Scalar> layer_backward_options(const Tuple& all) {
  constexpr std::size_t count = std::tuple_size_v<Tuple> - From;
  LayerBackwardOptions<Scalar> options;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    // ([[maybe_unused]]: a call without options expands the folds below over nothing)
    [[maybe_unused]] constexpr int kinds[] = {
        layer_option_kind<Scalar, std::tuple_element_t<From + I, Tuple>>()..., 3};
    static_assert(((kinds[I] >= 0 && (TakesSlots || kinds[I] != 1)) && ... && true),
                  "a layer backward's last arguments are a SequenceLayout, the slots (a span of "
                  "Index; carried calls only) and a BackwardWorkspace<Scalar>*, each optional");
    static_assert(((kinds[I] < kinds[I + 1]) && ... && true),
                  "a layer backward's optional arguments come in the order: SequenceLayout, "
                  "slots, BackwardWorkspace<Scalar>* (each at most once)");
    [[maybe_unused]] const auto take = [&]<std::size_t At>(std::integral_constant<std::size_t, At>) {
      constexpr int kind = layer_option_kind<Scalar, std::tuple_element_t<At, Tuple>>();
      if constexpr (kind == 0)
        options.layout = std::get<At>(all);
      else if constexpr (kind == 1)
        options.slots = std::get<At>(all);
      else if constexpr (kind == 2)
        options.workspace = std::get<At>(all);
    };
    (take(std::integral_constant<std::size_t, From + I>{}), ...);
  }(std::make_index_sequence<count>{});
  return options;
}

// The state gradients of a carried backward from a saved forward (no state to compare them
// with): shaped for this layer's state heads, like each other, two objects, and positions for
// the call's sequences (or slots).
template <class Attention, class Scalar>
void check_state_gradients(const MultiHeadAttention<Attention>& layer,
                           const BatchStateGradient<Scalar>& initial,
                           const BatchStateGradient<Scalar>* final_gradients, Index sequences,
                           std::span<const Index> slots) {
  const bool z = head_keeps_z<typename Attention::State>();
  const auto describe = [](const BatchStateGradient<Scalar>& g) {
    return "heads=" + std::to_string(g.heads()) + " r=" + std::to_string(g.feature_dim()) +
           " dv=" + std::to_string(g.value_dim()) + (g.keeps_z() ? " with z" : " without z");
  };
  if (initial.heads() != layer.state_heads() || initial.feature_dim() != layer.feature_dim() ||
      initial.value_dim() != layer.heads().value_dim || initial.keeps_z() != z)
    throw_shape_error("the initial states' gradient has ", describe(initial),
                      " but this layer's states have heads=", layer.state_heads(), " r=",
                      layer.feature_dim(), " dv=", layer.heads().value_dim,
                      z ? " with z" : " without z");
  if (final_gradients != nullptr) {
    if (final_gradients == &initial)
      throw std::invalid_argument("linattn: the final and initial states' gradients must be "
                                  "two objects (the backward reads one while writing the other)");
    const BatchStateGradient<Scalar>& f = *final_gradients;
    if (f.size() != initial.size() || f.heads() != initial.heads() ||
        f.feature_dim() != initial.feature_dim() || f.value_dim() != initial.value_dim() ||
        f.keeps_z() != initial.keeps_z())
      throw_shape_error("the final states' gradient has sequences=", final_gradients->size(), " ",
                        describe(*final_gradients), " but the initial states' gradient sequences=",
                        initial.size(), " ", describe(initial));
  }
  check_slot_list(initial.size(), sequences, slots, "the initial states' gradient");
}

// Checks everything, then runs the items (see the file comment). `state` null: stateless.
// `saved` (a LayerSavedForward, multihead_saved_forward.hpp; null with Saved = NoSavedForward:
// none) holds a causal forward's saved states per (sequence, state head); with `initial` (and
// no state: the saved forward replaces it) the backward is the carried one.
template <class Attention, class MaskArg, std::size_t N, class Saved = NoSavedForward>
void layer_backward(const MultiHeadAttention<Attention>& layer,
                    const BatchState<typename Attention::State>* state,
                    const TensorView<const typename Attention::scalar_type>& Q,
                    const TensorView<const typename Attention::scalar_type>& K,
                    const TensorView<const typename Attention::scalar_type>& V,
                    const std::array<TensorView<const typename Attention::scalar_type>, N>& inputs,
                    const MaskArg& mask, const TensorView<const typename Attention::scalar_type>& dY,
                    const BatchStateGradient<typename Attention::scalar_type>* final_gradients,
                    const GradientViews<typename Attention::scalar_type>& grads,
                    const std::array<TensorView<typename Attention::scalar_type>, N>& d_inputs,
                    BatchStateGradient<typename Attention::scalar_type>* initial,
                    const SequenceLayout& layout, std::span<const Index> slots,
                    const Saved* saved = nullptr,
                    BackwardWorkspace<typename Attention::scalar_type>* workspace = nullptr) {
  using Rule = typename Attention::rule_type;
  const HeadConfig& heads = layer.heads();
  const Index r = layer.feature_dim();
  check_views(heads, r, Q, K, V, dY, layout, state != nullptr || Mask(mask).is_causal());
  for (std::size_t i = 0; i < N; ++i) {
    check_token_view(inputs[i], K, heads.v_heads(), r, per_channel_input<Rule>(i));
    check_gradient_view(i == 0 ? "of the first per-token input" : "of the second per-token input",
                        d_inputs[i], inputs[i]);
  }
  check_gradient_view("dQ", grads.Q, Q);
  check_gradient_view("dK", grads.K, K);
  check_gradient_view("dV", grads.V, V);
  const Index Hkv = heads.kv_heads, sequences = layout.count(Q.batches());
  if (state != nullptr) {
    check_slots(*state, layer, sequences, slots);
    initial->check_like(*state, "the initial states' gradient");
    if (final_gradients != nullptr) {
      final_gradients->check_like(*state, "the final states' gradient");
      if (final_gradients == initial)
        throw std::invalid_argument("linattn: the final and initial states' gradients must be "
                                    "two objects (the backward reads one while writing the other)");
    }
  } else if (initial != nullptr) {
    check_state_gradients(layer, *initial, final_gradients, sequences, slots);
  }
  const HeadMap map(heads, MultiHeadAttention<Attention>::shares_states);
  constexpr bool from_saved = !std::is_same_v<Saved, NoSavedForward>;
  if constexpr (from_saved) saved->check_for(layer, sequences);
  const bool padded = layout.kind() == SequenceLayout::Kind::padded;
  const bool full_rows = layout.kind() == SequenceLayout::Kind::batch;
  const double rows_per_sequence =
      layout.kind() == SequenceLayout::Kind::packed
          ? double(Q.times()) / double(std::max<Index>(sequences, 1))
          : double(Q.times());
  // About three forward reads per output head (the read, dV and dS, dQ and dK).
  const double flops =
      12.0 * double(r) * double(heads.value_dim) * rows_per_sequence * double(map.members());
  using Scalar = typename Attention::scalar_type;
  const auto run = [&](Index item, BackwardWorkspace<Scalar>& workspace) {
    const Index s = item / Hkv, g = item % Hkv;
    const Index entry = layout.batch_entry(s), first = layout.first_row(s);
    const Index q_len = full_rows ? Q.times() : layout.length(s, Q.times());
    const Index k_len = full_rows ? K.times() : q_len;
    if (padded) {
      zero_rows(grads.Q.slice(entry, q_len, Q.times() - q_len, g * map.G, map.G));
      zero_rows(grads.K.slice(entry, k_len, K.times() - k_len, g, 1));
      zero_rows(grads.V.slice(entry, k_len, V.times() - k_len, g * map.Gv, map.Gv));
      for (std::size_t i = 0; i < N; ++i)
        zero_rows(d_inputs[i].slice(entry, k_len, K.times() - k_len, g * map.Gv, map.Gv));
    }
    const Index position = slots.empty() ? s : slots[static_cast<std::size_t>(s)];
    const auto state_head = [&](Index j) { return map.member_state(g, j); };
    const auto state_of = [&](Index j) -> const typename Attention::State* {
      return state != nullptr ? &state->sequence(position).head(state_head(j)) : nullptr;
    };
    const auto final_of = [&](Index j) -> const StateGradient<typename Attention::scalar_type>* {
      if (final_gradients == nullptr || !map.first_of_state(j)) return nullptr;
      return &final_gradients->head(position, state_head(j));
    };
    const auto initial_of = [&](Index j) -> StateGradient<typename Attention::scalar_type>* {
      return initial != nullptr ? &initial->head(position, state_head(j)) : nullptr;
    };
    const auto saved_of = [&](Index j) {
      if constexpr (from_saved)
        return &saved->head(s, state_head(j));
      else
        return static_cast<const NoSavedForward*>(nullptr);
    };
    backward_item(layer.attention(), map, g, entry, first, q_len, k_len, Q, K, V, inputs, mask, dY,
                  grads.Q, grads.K, grads.V, d_inputs, state_of, final_of, initial_of, saved_of,
                  workspace);
  };
  // Each thread's items share one lane of the workspace (the caller's, kept across calls, or
  // this call's): the buffers are then allocated once per thread, not once per item (same bits
  // either way).
  const Index items = sequences * Hkv;
  const int parts = range_count(items, layer.executor(), flops);
  BackwardWorkspace<Scalar> call_only;
  BackwardWorkspace<Scalar>& kept = workspace != nullptr ? *workspace : call_only;
  BackwardWorkspaceAccess::fit_lanes(kept, parts);
  FirstItemError errors(items);
  auto range = [&](Index begin, Index end) {
    BackwardWorkspace<Scalar>& lane =
        BackwardWorkspaceAccess::lane(kept, range_index(begin, items, parts));
    for (Index item = begin; item < end; ++item) {
      try {
        run(item, lane);
      } catch (...) {
        errors.record(item);
      }
    }
  };
  parallel_ranges(items, layer.executor(), flops, range);
  errors.rethrow();
}

}  // namespace detail

/// parallel_backward_into(layer, Q, K, V, in..., mask, dY, grads, d_in..., layout = batch()):
/// the gradients of out = layer.parallel_into(Q, K, V, in..., mask, out, layout) given
/// dY = dLoss/dout ([B, Tq, max(H_q, H_v), dv]): dQ, dK, dV into `grads` (a GradientViews) and the
/// per-token inputs' gradients into d_in... (views shaped like in..., in the same order).
/// Mask::none (additive only) or Mask::causal as in the forward. Throws ShapeError for views or
/// a layout that do not fit (naming them) and what the single-head backward throws; as the
/// forward, every work item runs and the lowest failing item's exception is rethrown.
template <class Attention, class... Args>
void parallel_backward_into(
    const MultiHeadAttention<Attention>& layer,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> Q,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> K,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> V, Args&&... args) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  constexpr std::size_t N = Rule::token_inputs;
  static_assert(sizeof...(Args) >= 2 * N + 3 && sizeof...(Args) <= 2 * N + 5,
                "parallel_backward_into takes the layer, Q, K, V, the rule's per-token input "
                "views, the mask, dY, the GradientViews, the per-token inputs' gradient views "
                "and optionally a SequenceLayout and a BackwardWorkspace*");
  const auto all = std::forward_as_tuple(args...);
  const auto options = detail::layer_backward_options<Scalar, 2 * N + 3, false>(all);
  const auto& mask = std::get<N>(all);
  static_assert(Rule::kind == WriteKind::additive ||
                    std::is_same_v<std::remove_cvref_t<decltype(mask)>, CausalMask>,
                "a write rule's read is causal: pass Mask::causal");
  detail::layer_backward<Attention>(
      layer, nullptr, Q, K, V, detail::token_views<N, Scalar>(all), mask,
      TensorView<const Scalar>(std::get<N + 1>(all)), nullptr,
      GradientViews<Scalar>(std::get<N + 2>(all)), detail::views_at<N + 3, N, Scalar>(all),
      nullptr, options.layout, {}, static_cast<const detail::NoSavedForward*>(nullptr),
      options.workspace);
}

/// prefill_backward_into(layer, state, Q, K, V, in..., dY, final_gradients, grads, d_in...,
/// initial_gradients, layout = batch(), slots = {}): the backward of
/// layer.prefill_into(state, Q, K, V, in..., out, layout, slots) with `state` as it was before
/// that call (read, not changed): dQ, dK, dV into `grads`, the per-token inputs' gradients into
/// d_in..., and, for sequence i at batch position p = slots[i] (or i), the gradients of the
/// initial states of p's state heads into initial_gradients.head(p, h) (other positions are not
/// touched). final_gradients (a const BatchStateGradient*; null: the loss does not depend on
/// the final states) gives the final states' gradients by position. Both gradient objects are
/// shaped like `state` (BatchStateGradient(state)) and must be two objects. Training in
/// segments: the initial_gradients of segment s + 1 are the final_gradients of segment s.
/// Throws ShapeError for views, layouts, slots or gradient objects that do not fit (naming
/// them), StateMismatchError for another layer's state, and what the single-head backward throws.
template <class Attention, class... Args>
void prefill_backward_into(
    const MultiHeadAttention<Attention>& layer, const BatchState<typename Attention::State>& state,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> Q,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> K,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> V, Args&&... args) {
  using Scalar = typename Attention::scalar_type;
  constexpr std::size_t N = Attention::rule_type::token_inputs;
  static_assert(sizeof...(Args) >= 2 * N + 4 && sizeof...(Args) <= 2 * N + 7,
                "prefill_backward_into takes the layer, the state, Q, K, V, the rule's per-token "
                "input views, dY, the final states' gradient (or nullptr), the GradientViews, the "
                "per-token inputs' gradient views, the initial states' gradient and optionally a "
                "SequenceLayout, slots and a BackwardWorkspace*");
  const auto all = std::forward_as_tuple(args...);
  const auto options = detail::layer_backward_options<Scalar, 2 * N + 4, true>(all);
  const BatchStateGradient<Scalar>* final_gradients = std::get<N + 1>(all);
  BatchStateGradient<Scalar>& initial = std::get<2 * N + 3>(all);
  detail::layer_backward<Attention>(
      layer, &state, Q, K, V, detail::token_views<N, Scalar>(all), Mask::causal,
      TensorView<const Scalar>(std::get<N>(all)), final_gradients,
      GradientViews<Scalar>(std::get<N + 2>(all)), detail::views_at<N + 3, N, Scalar>(all),
      &initial, options.layout, options.slots, static_cast<const detail::NoSavedForward*>(nullptr),
      options.workspace);
}

}  // namespace linattn
