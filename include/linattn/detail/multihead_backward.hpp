#pragma once
// The multi-head layer's backward, one work item (sequence, key head) at a time: the
// single-head backward of every output head that reads the key head (the G query heads of a
// group, or the G_v value heads of a query/key head: HeadMap) on views of the buffers, the
// shares of the gradients of heads that several of them read (dK; dV, the per-token inputs' and
// a shared state's; or dQ) added in head order, so the bits do not depend on the thread that
// runs the item.

#include <linattn/backward_workspace.hpp>
#include <linattn/detail/multihead_views.hpp>
#include <linattn/errors.hpp>
#include <linattn/gradients.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <array>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn::detail {

/// Views I = Offset, ..., Offset + N - 1 of a call's arguments, as Element views.
template <std::size_t Offset, std::size_t N, class Element, class Tuple>
std::array<TensorView<Element>, N> views_at(const Tuple& all) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<TensorView<Element>, N>{TensorView<Element>(std::get<Offset + I>(all))...};
  }(std::make_index_sequence<N>{});
}

/// The gradient of per-token input i of `Rule` in a RuleInputGradients, as T x c (its own
/// shape; the T and c given are those of the call).
template <class Rule, class Scalar>
Eigen::Map<const RowMatrix<Scalar>> input_gradient(const RuleInputGradients<Scalar>& d,
                                                   std::size_t i, Index, Index) {
  if constexpr (Rule::kind == WriteKind::gated) {
    static_cast<void>(i);
    return {d.log_gate.data(), d.log_gate.rows(), d.log_gate.cols()};
  } else {
    if (i == 0) return {d.beta.data(), d.beta.size(), 1};
    return {d.log_alpha.data(), d.log_alpha.rows(), d.log_alpha.cols()};
  }
}

/// The same in InputGradientRows: T rows of c columns.
template <class Rule, class Scalar>
Eigen::Map<const RowMatrix<Scalar>> input_gradient(const InputGradientRows<Scalar>& d,
                                                   std::size_t i, Index T, Index c) {
  const Scalar* rows = Rule::kind == WriteKind::gated ? d.log_gate : i == 0 ? d.beta : d.log_alpha;
  return {rows, T, c};
}

/// Rows for the per-token inputs' gradients of one head of `Rule` over T tokens (the columns of
/// input i: d_inputs[i].dim()) in `buffer`, grown to the longest call and never shrunk.
template <class Rule, class Scalar, std::size_t N>
InputGradientRows<Scalar> head_input_rows(ColVector<Scalar>& buffer, Index T,
                                          const std::array<TensorView<Scalar>, N>& d_inputs) {
  InputGradientRows<Scalar> rows;
  if constexpr (N > 0) {
    Index columns = 0;
    for (const auto& d : d_inputs) columns += d.dim();
    if (buffer.size() < T * columns) buffer.resize(T * columns);
    if constexpr (Rule::kind == WriteKind::gated) {
      rows.log_gate = buffer.data();
    } else {
      rows.beta = buffer.data();
      if constexpr (N > 1) rows.log_alpha = buffer.data() + T;
    }
  }
  return rows;
}

/// Writes `from` into `to` (`writes`) or adds it: the first reader of a head writes its
/// gradient rows, the others add theirs in member order, so the sums have the same bits on
/// every run and thread.
template <class To, class From>
void write_or_add(bool writes, To&& to, const From& from) {
  if (writes)
    to = from;
  else
    to += from;
}

/// A member's share of the dK rows of key head `key_head` and of the dV and per-token input
/// gradient rows of value head `value_head`, rows [first, first + n) of sequence `entry`:
/// written where first_key / first_value, else added (write_or_add).
template <class Rule, class Scalar, std::size_t N, class DIn>
void add_key_value_share(bool first_key, bool first_value, const TensorView<Scalar>& dK,
                         const TensorView<Scalar>& dV,
                         const std::array<TensorView<Scalar>, N>& d_inputs, Index entry,
                         Index key_head, Index value_head, Index first, Index n,
                         const std::type_identity_t<Eigen::Ref<const RowMatrix<Scalar>>>& dK_head,
                         const std::type_identity_t<Eigen::Ref<const RowMatrix<Scalar>>>& dV_head,
                         const DIn& d_in) {
  write_or_add(first_key, dK.head_rows(entry, key_head, first, n), dK_head);
  write_or_add(first_value, dV.head_rows(entry, value_head, first, n), dV_head);
  for (std::size_t i = 0; i < N; ++i)
    write_or_add(first_value, d_inputs[i].head_rows(entry, value_head, first, n),
                 input_gradient<Rule>(d_in, i, n, d_inputs[i].dim()));
}

/// A member's share of a state head's gradient (S, z): the first member that reads the state
/// writes it, the others add theirs in member order.
template <class Scalar, class DS, class DZ>
void add_state_share(bool writes, StateGradient<Scalar>& to, const DS& S, const DZ& z) {
  if (writes) {
    to.S = S;
    to.z = z;
  } else {
    to.S += S;
    if (to.z.size() > 0) to.z += z;
  }
}

/// The layer's backward without a saved forward: it rebuilds the chunk-boundary states.
struct NoSavedForward {};

/// The backward of one (sequence s, key head g) item: its members j (output heads, `map`:
/// G query heads of one key/value head, or G_v value heads of one query/key head) in turn.
/// `state_of(j)` gives the initial head state member j read (null: stateless), `final_of(j)`
/// the final-state gradient it carries back (null: none; given for the first reader of a shared
/// state only) and `initial_of(j)` where its initial-state gradient goes (null: stateless); a
/// state that several members read (map.shared) gets the sum of their gradients, in member
/// order, as dQ of a query head and dK, dV of a key and value head do. `saved_of(j)`:
/// the SavedForward of a causal forward (stateless, or carried when initial_of(j) is not null)
/// that head j's backward reads instead of rebuilding the states (a callable returning const
/// NoSavedForward*: none). `workspace`: the backward's buffers and the head's gradient rows,
/// kept by the caller across the items one thread runs (BackwardWorkspace).
template <class Attention, class MaskArg, class Inputs, class DInputs, class StateOf, class FinalOf,
          class InitialOf, class SavedOf>
void backward_item(const Attention& attn, const HeadMap& map, Index g, Index entry, Index first,
                   Index q_len, Index k_len, const TensorView<const typename Attention::scalar_type>& Q,
                   const TensorView<const typename Attention::scalar_type>& K,
                   const TensorView<const typename Attention::scalar_type>& V, const Inputs& inputs,
                   const MaskArg& mask, const TensorView<const typename Attention::scalar_type>& dY,
                   const TensorView<typename Attention::scalar_type>& dQ,
                   const TensorView<typename Attention::scalar_type>& dK,
                   const TensorView<typename Attention::scalar_type>& dV, const DInputs& d_inputs,
                   const StateOf& state_of, const FinalOf& final_of,
                   const InitialOf& initial_of, const SavedOf& saved_of,
                   BackwardWorkspace<typename Attention::scalar_type>& workspace) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  constexpr std::size_t N = Rule::token_inputs;
  constexpr bool from_saved =
      !std::is_same_v<std::remove_cvref_t<decltype(saved_of(Index(0)))>, const NoSavedForward*>;
  if (q_len == 0 || k_len == 0) {
    // No query reads a key: the rows' gradients are zero and a carried state's gradient is the
    // final state's gradient passed through (no token changes the state).
    zero_rows(dQ.slice(entry, first, q_len, g * map.G, map.G));
    zero_rows(dK.slice(entry, first, k_len, g, 1));
    zero_rows(dV.slice(entry, first, k_len, g * map.Gv, map.Gv));
    for (std::size_t i = 0; i < N; ++i)
      zero_rows(d_inputs[i].slice(entry, first, k_len, g * map.Gv, map.Gv));
    for (Index j = 0; j < map.members(); ++j) {
      if (!map.first_of_state(j)) continue;
      StateGradient<Scalar>* initial = initial_of(j);
      if (initial == nullptr) continue;
      if (const StateGradient<Scalar>* fin = final_of(j); fin != nullptr) {
        initial->S = fin->S;
        initial->z = fin->z;
      } else {
        initial->S.setZero();
        initial->z.setZero();
      }
    }
    return;
  }
  const auto k = K.head_rows(entry, g, first, k_len);
  // Every query head's gradients go through contiguous buffers of their own, copied (first
  // head) or added (the others, in head order: the same bits on any thread) into the model's
  // rows: Eigen's products round differently into a strided destination on some instruction
  // sets, and a head's gradients must not depend on the buffers' layout.
  BackwardBuffers<Scalar>& buffers = BackwardWorkspaceAccess::buffers(workspace);
  buffers.fit_heads(q_len, k_len, Q.dim(), V.dim());
  auto dQ_head = buffers.head_Q.topRows(q_len);
  auto dK_head = buffers.head_K.topRows(k_len);
  auto dV_head = buffers.head_V.topRows(k_len);
  // The per-token inputs' gradients of one head, before the model's rows: the lane's buffer.
  const InputGradientRows<Scalar> d_in_head = head_input_rows<Rule>(buffers.inputs, k_len, d_inputs);
  // Query head j > 0's share of a shared state's gradient: the lane's buffers, moved in and
  // back (no allocation once they have the state's shape).
  StateGradient<Scalar> d0_head{std::move(buffers.group_S), std::move(buffers.group_z)};
  for (Index j = 0; j < map.members(); ++j) {
    const Index qh = map.member_query(g, j), vh = map.member_value(g, j);
    const auto q = Q.head_rows(entry, qh, first, q_len);
    const auto v = V.head_rows(entry, vh, first, k_len);
    const auto in = rows_inputs(inputs, entry, vh, first, k_len);
    const auto dy = dY.head_rows(entry, map.member_out(g, j), first, q_len);
    GradientsRef<Scalar> out{dQ_head, dK_head, dV_head};
    const auto* state = state_of(j);
    // A shared state's gradient: the first head writes it, the others add theirs.
    StateGradient<Scalar>* initial = initial_of(j);
    const bool add_initial = !map.first_of_state(j) && initial != nullptr;
    StateGradient<Scalar>& d0 = add_initial || initial == nullptr ? d0_head : *initial;
    std::apply(
        [&](const auto&... x) {
          if constexpr (from_saved) {
            // A causal forward's saved states (multihead_saved_forward.hpp): stateless, or
            // carried (an initial-state gradient to write).
            if constexpr (Rule::kind == WriteKind::additive) {
              if (initial == nullptr)
                parallel_backward_into(attn, *saved_of(j), q, k, v, linattn::Mask::causal, dy, out,
                                       nullptr, &workspace);
              else
                prefill_backward_into(attn, *saved_of(j), q, k, v, dy, final_of(j), out, d0,
                                      &workspace);
            } else {
              if (initial == nullptr)
                parallel_backward_into(attn, *saved_of(j), q, k, v, x..., linattn::Mask::causal, dy,
                                       out, d_in_head, nullptr, &workspace);
              else
                prefill_backward_into(attn, *saved_of(j), q, k, v, x..., dy, final_of(j), out,
                                      d_in_head, d0, &workspace);
            }
          } else if constexpr (Rule::kind == WriteKind::additive) {
            if (state == nullptr)
              parallel_backward_into(attn, q, k, v, linattn::Mask(mask), dy, out, nullptr,
                                     &workspace);
            else
              prefill_backward_into(attn, *state, q, k, v, dy, final_of(j), out, d0, &workspace);
          } else {
            if (state == nullptr)
              parallel_backward_into(attn, q, k, v, x..., linattn::Mask::causal, dy, out, d_in_head,
                                     nullptr, &workspace);
            else
              prefill_backward_into(attn, *state, q, k, v, x..., dy, final_of(j), out, d_in_head,
                                    d0, &workspace);
          }
        },
        in);
    write_or_add(map.first_of_query(j), dQ.head_rows(entry, qh, first, q_len), dQ_head);
    add_key_value_share<Rule>(j == 0, map.first_of_value(j), dK, dV, d_inputs, entry, g, vh, first,
                              k_len, dK_head, dV_head, d_in_head);
    if (add_initial) {
      initial->S += d0_head.S;
      if (initial->z.size() > 0) initial->z += d0_head.z;
    }
  }
  buffers.group_S = std::move(d0_head.S);
  buffers.group_z = std::move(d0_head.z);
}

}  // namespace linattn::detail
