#pragma once
// The multi-head layer's plumbing: the checks of its views, layouts, slots and per-token input
// views (each message written once), and the cutting of per-token inputs into one head's rows.

#include <linattn/errors.hpp>
#include <linattn/head_config.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <tuple>
#include <utility>

namespace linattn::detail {

/// Throws ShapeError if a count or dim is not positive, H_q or H_v is not a multiple of H_kv,
/// or both group (grouped values need H_q = H_kv).
inline void check_head_config(const HeadConfig& h) {
  if (h.q_heads < 1 || h.kv_heads < 1 || h.key_dim < 1 || h.value_dim < 1 || h.value_heads < 0)
    throw_shape_error("multi-head attention needs positive heads and dims, got H_q=", h.q_heads,
                      " H_kv=", h.kv_heads, " dk=", h.key_dim, " dv=", h.value_dim,
                      h.value_heads != 0 ? " H_v=" : "",
                      h.value_heads != 0 ? std::to_string(h.value_heads) : std::string());
  if (h.q_heads % h.kv_heads != 0)
    throw_shape_error("query heads H_q=", h.q_heads, " must be a multiple of key/value heads H_kv=",
                      h.kv_heads);
  if (h.v_heads() % h.kv_heads != 0)
    throw_shape_error("value heads H_v=", h.v_heads(), " must be a multiple of key heads H_kv=",
                      h.kv_heads);
  if (h.v_heads() > h.kv_heads && h.q_heads != h.kv_heads)
    throw_shape_error("grouped value heads (H_v=", h.v_heads(), " > H_kv=", h.kv_heads,
                      ") need as many query heads as key heads, got H_q=", h.q_heads);
}

/// Which heads of the buffers a multi-head layer's work reads and writes, for G = H_q / H_kv
/// query heads or G_v = H_v / H_kv value heads per key head (one of them is 1).
///   Forward item = state head h: with shared states (one per value head) it reads query heads
///     [query_first(h), + query_count) and key head key_of(h), value head (and per-token inputs)
///     value_of(h), and writes output heads [out_first(h), + query_count); with one state per
///     output head (log-scaled maps) query_count is 1.
///   Backward item = key head g with G G_v members j (one per output head g G G_v + j): member j
///     reads query head member_query, value head member_value; dQ, dV and the state gradients
///     of heads that several members read are summed, the first of them (first_of_*) writing.
struct HeadMap {
  Index G = 1, Gv = 1;
  bool shared = true;

  HeadMap(const HeadConfig& h, bool shares_states)
      : G(h.q_heads / h.kv_heads), Gv(h.v_heads() / h.kv_heads), shared(shares_states) {}

  [[nodiscard]] Index query_count() const noexcept { return shared ? G : 1; }
  [[nodiscard]] Index query_first(Index h) const noexcept { return shared ? h / Gv * G : h / Gv; }
  [[nodiscard]] Index key_of(Index h) const noexcept { return shared ? h / Gv : h / (G * Gv); }
  [[nodiscard]] Index value_of(Index h) const noexcept { return shared ? h : h / G; }
  [[nodiscard]] Index out_first(Index h) const noexcept { return shared ? h * G : h; }

  [[nodiscard]] Index members() const noexcept { return G * Gv; }
  [[nodiscard]] Index member_query(Index g, Index j) const noexcept { return g * G + j / Gv; }
  [[nodiscard]] Index member_value(Index g, Index j) const noexcept { return g * Gv + j / G; }
  [[nodiscard]] Index member_out(Index g, Index j) const noexcept { return g * G * Gv + j; }
  [[nodiscard]] Index member_state(Index g, Index j) const noexcept {
    return shared ? member_value(g, j) : member_out(g, j);
  }
  /// Whether member j is the first of those that read its query head, its value head, its state.
  [[nodiscard]] bool first_of_query(Index j) const noexcept { return j % Gv == 0; }
  [[nodiscard]] bool first_of_value(Index j) const noexcept { return j % G == 0; }
  [[nodiscard]] bool first_of_state(Index j) const noexcept { return !shared || j % G == 0; }
};

/// Q [B, Tq, H_q, dk], K [B, Tk, H_kv, dk], V [B, Tk, H_v, dv], out [B, Tq, max(H_q, H_v), dv]
/// (or the output's gradient, read-only), and a layout that fits; `same_length` (causal, or a
/// variable-length layout) needs Tq = Tk.
template <class Scalar, class OutElement>
void check_views(const HeadConfig& heads, Index r, const TensorView<const Scalar>& Q,
                 const TensorView<const Scalar>& K, const TensorView<const Scalar>& V,
                 const TensorView<OutElement>& out, const SequenceLayout& layout,
                 bool same_length) {
  static_cast<void>(r);
  const bool grouped_values = heads.v_heads() != heads.kv_heads;
  auto fail = [&](const char* what) {
    throw_shape_error(what, "; Q ", Q.describe(), ", K ", K.describe(), ", V ", V.describe(),
                      ", out ", out.describe(), " for H_q=", heads.q_heads, " H_kv=",
                      heads.kv_heads, grouped_values ? " H_v=" : "",
                      grouped_values ? std::to_string(heads.v_heads()) : std::string(), " dk=",
                      heads.key_dim, " dv=", heads.value_dim);
  };
  if (grouped_values) {
    if (Q.heads() != heads.q_heads || K.heads() != heads.kv_heads)
      fail("Q and K need H_q = H_kv heads");
    if (V.heads() != heads.v_heads() || out.heads() != heads.v_heads())
      fail("V and out need H_v heads");
  } else {
    if (Q.heads() != heads.q_heads || out.heads() != heads.q_heads) fail("Q and out need H_q heads");
    if (K.heads() != heads.kv_heads || V.heads() != heads.kv_heads) fail("K and V need H_kv heads");
  }
  if (Q.dim() != heads.key_dim || K.dim() != heads.key_dim) fail("Q and K need dim dk");
  if (V.dim() != heads.value_dim || out.dim() != heads.value_dim) fail("V and out need dim dv");
  if (K.batches() != Q.batches() || V.batches() != Q.batches() || out.batches() != Q.batches())
    fail("Q, K, V and out need the same batch size");
  if (K.times() != V.times()) fail("K and V need the same number of tokens");
  if (out.times() != Q.times()) fail("out needs as many tokens as Q");
  if ((same_length || layout.kind() != SequenceLayout::Kind::batch) && Q.times() != K.times())
    fail("causal and variable-length attention need as many queries as keys");
  layout.check(Q.batches(), Q.times());
}

/// Whether per-token input i of Rule may hold one value per feature channel ([B, T, H_v, r]):
/// Gated's log-gates and GatedDelta's log_alpha (Kimi Delta Attention).
template <class Rule>
constexpr bool per_channel_input(std::size_t i) noexcept {
  return Rule::kind == WriteKind::gated || (Rule::kind == WriteKind::gated_delta && i == 1);
}

/// A per-token input view: [B, T, H_v, 1], or [B, T, H_v, r] where per-channel values are
/// allowed (per_channel_input), with B and T of K (H_v: the value heads, HeadConfig::v_heads()).
template <class Scalar>
void check_token_view(const TensorView<const Scalar>& in, const TensorView<const Scalar>& K,
                      Index value_heads, Index r, bool per_channel) {
  if (in.batches() != K.batches() || in.times() != K.times() || in.heads() != value_heads ||
      !(in.dim() == 1 || (per_channel && in.dim() == r)))
    throw_shape_error("a per-token input view is ", in.describe(), ", expected [B=", K.batches(),
                      ", T=", K.times(), ", H_v=", value_heads, ", 1", per_channel ? " or r=" : "",
                      per_channel ? std::to_string(r) : std::string(),
                      "] (one value per token and value head)");
}

/// `positions` (the size of `what`, a batch state or its gradient) is `sequences`, or `slots`
/// names `sequences` distinct positions in it.
inline void check_slot_list(Index positions, Index sequences, std::span<const Index> slots,
                            const char* what) {
  if (slots.empty()) {
    if (positions != sequences)
      throw_shape_error("the inputs hold ", sequences, " sequences but ", what, " ", positions,
                        " (pass slots to use a subset)");
    return;
  }
  if (static_cast<Index>(slots.size()) != sequences)
    throw_shape_error("the inputs hold ", sequences, " sequences but ", slots.size(),
                      " slots were given");
  // Slots must be distinct: two batch rows on one state would race and double-count.
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0 || slots[i] >= positions)
      throw_shape_error("slot ", slots[i], " is outside ", what, " of size ", positions);
    for (std::size_t j = 0; j < i; ++j)
      if (slots[j] == slots[i]) throw_shape_error("slot ", slots[i], " is given twice");
  }
}

/// The layer's state holds `sequences` sequences (or `slots` names distinct positions in it)
/// and was made by this layer (state heads, dims, identity).
template <class State, class Layer>
void check_slots(const State& state, const Layer& layer, Index sequences,
                 std::span<const Index> slots) {
  const HeadConfig& h = layer.heads();
  if (state.heads() != layer.state_heads() || state.feature_dim() != layer.feature_dim() ||
      state.key_dim() != h.key_dim || state.value_dim() != h.value_dim)
    throw_shape_error("batch state has heads=", state.heads(), " r=", state.feature_dim(),
                      " dk=", state.key_dim(), " dv=", state.value_dim(),
                      " but this layer needs heads=", layer.state_heads(), " r=",
                      layer.feature_dim(), " dk=", h.key_dim, " dv=", h.value_dim);
  state.empty_head().check_identity(layer.attention().state_identity());
  check_slot_list(state.size(), sequences, slots, "the batch state");
}

/// The first N arguments of a call as read-only views.
template <std::size_t N, class Scalar, class Tuple>
std::array<TensorView<const Scalar>, N> token_views(const Tuple& all) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<TensorView<const Scalar>, N>{TensorView<const Scalar>(std::get<I>(all))...};
  }(std::make_index_sequence<N>{});
}

/// Rows [first, first + n) of value head g of batch entry `entry` of each per-token input,
/// as a tuple of n x c row views (what the single-head calls take).
template <class Scalar, std::size_t N>
auto rows_inputs(const std::array<TensorView<const Scalar>, N>& inputs, Index entry, Index g,
                 Index first, Index n) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::make_tuple(inputs[I].head_rows(entry, g, first, n)...);
  }(std::make_index_sequence<N>{});
}

/// One decode token's per-token inputs of value head g of batch row b: the gates as a
/// 1 x c row (Gated), beta and log_alpha as numbers (the delta rules; channel_step_inputs for
/// GatedDelta's per-channel log_alpha).
template <class Rule, class Scalar, std::size_t N>
auto step_inputs(const std::array<TensorView<const Scalar>, N>& inputs, Index b, Index g) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    if constexpr (Rule::kind == WriteKind::gated)
      return std::make_tuple(inputs[I].head_rows(b, g, 0, 1)...);
    else
      return std::make_tuple(inputs[I](b, 0, g, 0)...);
  }(std::make_index_sequence<N>{});
}

/// GatedDelta's decode inputs with per-channel log_alpha ([B, 1, H_v, r]): beta as a number,
/// log_alpha as the 1 x r row of value head g of batch row b.
template <class Scalar>
auto channel_step_inputs(const std::array<TensorView<const Scalar>, 2>& inputs, Index b,
                         Index g) {
  return std::make_tuple(inputs[0](b, 0, g, 0), inputs[1].head_rows(b, g, 0, 1));
}

/// Sets every row of every head of a view to zero (padded rows of an output).
template <class Scalar>
void zero_rows(const TensorView<Scalar>& view) {
  for (Index b = 0; b < view.batches(); ++b)
    for (Index h = 0; h < view.heads(); ++h) view.head_matrix(b, h).setZero();
}

}  // namespace linattn::detail
