#pragma once
/// \file rule_saved_forward.hpp
/// A saved forward for the write rules Decay, Gated, Delta and GatedDelta (the additive rule's is
/// linattn/saved_forward.hpp): the causal forward keeps the state at every chunk boundary, and
/// the backward from those states skips the sweep that rebuilds them (rule_gradients.hpp's
/// backward).
///
///   SavedForward<float> saved;                                 // reused across steps
///   parallel_saving_into(gated, Q, K, V, log_gates, Mask::causal, Y, saved);
///   auto g = parallel_backward(gated, saved, Q, K, V, log_gates, Mask::causal, dY);
///
/// Decay and Gated: the saving forward is the forward (detail::rule_chunked) with the state
/// (S, z) copied out before every backward chunk of B rows (B = Options::chunk_size when set,
/// else 32: a multiple of the forward's chunk C, detail::backward_chunk_size). The backward from
/// it is one reverse sweep over the chunks (detail::gated_backward_from): per chunk the read's
/// share (dQ, the gate gradient's q .* dq) from the saved state, then the state gradient's
/// (dK, dV, H). Flops per token (c = 16 rows per sub-chunk for per-channel gates): forward
/// 4 r dv + C (r + dv); recomputing backward about 10 r dv + B (5 r + 3 dv); from saved states
/// about 8 r dv + B (3 r + 2 dv) (per-channel gates: + about 2 c r in both backwards, c r in the
/// forward), and one evaluation of the feature map and its derivative per input instead of two.
/// Memory: ceil(T / B) (r dv + r) scalars: 520 B per token at r = dv = 64 and 2,064 B at
/// r = dv = 128 in float (T = 8,192 at d = 128: 16.1 MiB).
///
/// Delta and GatedDelta: the saving forward keeps what the forward's chunk kernel computes
/// anyway: the state before each of its chunks of C rows and, per token, the corrected value
/// u_t and the decayed state read g_t (detail::SaveDeltaChunks). The backward from it is the
/// reverse sweep alone (detail::delta_backward_saved: about 12 r dv + C (5 r + 5 dv) flops per
/// token, no triangular solve), where the recomputing backward first runs that forward again.
/// Memory: ceil(T / C) r dv + 2 T dv scalars: 1 KiB per token at r = dv = 64 (C = 32) and
/// 5 KiB at r = dv = 128 (C = 16) in float (T = 8,192 at d = 128: 40 MiB).
/// GatedDelta with per-channel log_alpha (T x r) keeps the states only, ceil(T / C) r dv
/// scalars (4 KiB per token at r = dv = 128, C = 16); its backward rebuilds the state before
/// each block of 16 rows of a chunk from the chunk's state, then runs the chunked WY backward
/// over the blocks in reverse (detail::channel_delta_backward_saved), skipping the recomputing
/// backward's forward pass.
///
/// Every rule: the saving forward's outputs and final state are the plain forward's bits (the
/// copies are non-temporal stores from an observer that does nothing in the plain forward),
/// and the backward from the saved data gives the recomputing backward's bits (that backward
/// rebuilds the same data with the forward's own chunk kernel). The backward allocates one
/// chunk's scratch (saved_backward_bytes), nothing per token.
///
/// The saved states belong to the inputs of the forward that filled them: the backward must
/// get the same Q, K, V and per-token inputs (it checks the shapes, the attention's identity,
/// the chunk size and the length, not the values).

#include <linattn/attention.hpp>
#include <linattn/detail/rule_saved.hpp>
#include <linattn/gradients.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <tuple>
#include <type_traits>

namespace linattn {


/// prefill_saving_into(attn, state, Q, K, V, inputs..., out, saved): attn.prefill_into(state,
/// Q, K, V, inputs..., out) (same bits in out and in the state afterwards), keeping the state
/// before every backward chunk in `saved` (a SavedForward<Scalar>). Throws as prefill_into;
/// `saved` is then left empty. Cost: the forward plus a copy of r (dv + 1) scalars per chunk; `saved` is
/// resized (allocated) only when its size changes.
template <class Phi, detail::SavedRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 2)
void prefill_saving_into(const RuleAttention<Phi, Rule, Scalar>& attn,
                         RuleState<Rule, Scalar>& state, const Eigen::MatrixBase<DQ>& Q,
                         const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                         Args&&... args) {
  constexpr std::size_t n = Rule::token_inputs;
  const auto all = std::forward_as_tuple(args...);
  Eigen::Ref<RowMatrix<Scalar>> out(std::get<n>(all));
  SavedForward<Scalar>& saved = std::get<n + 1>(all);
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_saving_forward(attn, state, Q, K, V, out, saved, in...);
  });
}

/// parallel_saving_into(attn, Q, K, V, inputs..., Mask::causal, out, saved):
/// attn.parallel_into(Q, K, V, inputs..., Mask::causal, out) (same bits in out), keeping the
/// chunk-boundary states in `saved`; otherwise as prefill_saving_into from an empty state.
template <class Phi, detail::SavedRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 3)
void parallel_saving_into(const RuleAttention<Phi, Rule, Scalar>& attn,
                          const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                          const Eigen::MatrixBase<DV>& V, Args&&... args) {
  constexpr std::size_t n = Rule::token_inputs;
  const auto all = std::forward_as_tuple(args...);
  static_assert(std::is_same_v<std::remove_cvref_t<std::tuple_element_t<n, decltype(all)>>,
                               CausalMask>,
                "the argument before the output must be Mask::causal (a write rule's read is "
                "causal)");
  Eigen::Ref<RowMatrix<Scalar>> out(std::get<n + 1>(all));
  SavedForward<Scalar>& saved = std::get<n + 2>(all);
  detail::check_forward_shapes(Q, K, V, out);
  auto state = attn.make_state(K.cols(), V.cols());
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_saving_forward(attn, state, Q, K, V, out, saved, in...);
  });
}

/// prefill_backward_into(attn, saved, Q, K, V, inputs..., dY, final_gradient, out, d_inputs,
/// initial): the gradients of the read `saved` was filled by (continuing whatever state that
/// forward started from), as rule_gradients.hpp's prefill_backward_into from that state, bit
/// for bit, without its sweep that rebuilds the states. `final_gradient` (const
/// StateGradient*, null: 0); dQ, dK, dV into `out` (views, not overlapping the inputs); the
/// inputs' gradients into `d_inputs`; the initial state's gradient into `initial`. Throws
/// ShapeError naming the shapes when `saved` is not for these T, dk, dv, r and chunk size,
/// StateMismatchError when another attention filled it, otherwise as the recomputing backward.
/// Allocates one chunk's scratch (saved_backward_bytes); an optional last argument, a
/// BackwardWorkspace<Scalar>* (null: none), keeps it for the next call.
template <class Phi, detail::SavedRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 5 ||
           sizeof...(Args) == Rule::token_inputs + 6)
void prefill_backward_into(const RuleAttention<Phi, Rule, Scalar>& attn,
                           const SavedForward<Scalar>& saved, const Eigen::MatrixBase<DQ>& Q,
                           const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                           Args&&... args) {
  constexpr std::size_t n = Rule::token_inputs;
  const auto all = std::forward_as_tuple(args...);
  const auto& dY = std::get<n>(all);
  const StateGradient<Scalar>* final_gradient = std::get<n + 1>(all);
  GradientsRef<Scalar> out = std::get<n + 2>(all);
  auto&& d_inputs = std::get<n + 3>(all);
  detail::check_input_gradients<Scalar, decltype(d_inputs)>();
  StateGradient<Scalar>& initial = std::get<n + 4>(all);
  BackwardWorkspace<Scalar>* workspace = nullptr;
  if constexpr (sizeof...(Args) == n + 6)
    workspace = detail::workspace_argument<Scalar>(std::get<n + 5>(all));
  detail::BackwardBuffers<Scalar> call_only;
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_saved_backward(attn, saved, Q, K, V, dY, final_gradient, out, d_inputs, initial,
                                detail::buffers_of(workspace, call_only), in...);
  });
}

/// prefill_backward(attn, saved, Q, K, V, inputs..., dY[, final_gradient]): the backward from
/// a saved forward returning a RuleGradients (dQ, dK, dV, the inputs' gradients, `initial`).
template <class Phi, detail::SavedRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 1 ||
           sizeof...(Args) == Rule::token_inputs + 2)
[[nodiscard]] RuleGradients<Scalar> prefill_backward(const RuleAttention<Phi, Rule, Scalar>& attn,
                                                     const SavedForward<Scalar>& saved,
                                                     const Eigen::MatrixBase<DQ>& Q,
                                                     const Eigen::MatrixBase<DK>& K,
                                                     const Eigen::MatrixBase<DV>& V,
                                                     const Args&... args) {
  constexpr std::size_t n = Rule::token_inputs;
  const auto all = std::forward_as_tuple(args...);
  const auto& dY = std::get<n>(all);
  const StateGradient<Scalar>* final_gradient = nullptr;
  if constexpr (sizeof...(Args) == n + 2) final_gradient = std::get<n + 1>(all);
  detail::check_backward_shapes(Q, K, V, dY, Mask::causal);
  auto g = detail::sized_rule_gradients<Scalar>(Q.rows(), K.cols(), V.cols());
  detail::BackwardBuffers<Scalar> call_only;
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_saved_backward(attn, saved, Q, K, V, dY, final_gradient, {g.Q, g.K, g.V},
                                g.inputs, g.initial, call_only, in...);
  });
  return g;
}

/// parallel_backward_into(attn, saved, Q, K, V, inputs..., Mask::causal, dY, out, d_inputs[,
/// initial[, workspace]]): the backward from the saved forward of parallel_saving_into;
/// `initial` (a StateGradient*), when given and not null, gets the empty initial state's
/// gradient; `workspace` (a BackwardWorkspace<Scalar>*, null: none) keeps the scratch.
template <class Phi, detail::SavedRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) >= Rule::token_inputs + 4 &&
           sizeof...(Args) <= Rule::token_inputs + 6)
void parallel_backward_into(const RuleAttention<Phi, Rule, Scalar>& attn,
                            const SavedForward<Scalar>& saved, const Eigen::MatrixBase<DQ>& Q,
                            const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                            Args&&... args) {
  constexpr std::size_t n = Rule::token_inputs;
  const auto all = std::forward_as_tuple(args...);
  static_assert(std::is_same_v<std::remove_cvref_t<std::tuple_element_t<n, decltype(all)>>,
                               CausalMask>,
                "the argument before dY must be Mask::causal (a write rule's read is causal)");
  const auto& dY = std::get<n + 1>(all);
  GradientsRef<Scalar> out = std::get<n + 2>(all);
  auto&& d_inputs = std::get<n + 3>(all);
  detail::check_input_gradients<Scalar, decltype(d_inputs)>();
  const auto tail = detail::stateless_tail<Scalar, n>(all);
  detail::UnreadStateGradient<Scalar> discarded(tail.workspace);
  StateGradient<Scalar>& initial = discarded.target(tail.initial);
  detail::BackwardBuffers<Scalar> call_only;
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_saved_backward(attn, saved, Q, K, V, dY,
                                static_cast<const StateGradient<Scalar>*>(nullptr), out, d_inputs,
                                initial, detail::buffers_of(tail.workspace, call_only), in...);
  });
}

/// parallel_backward(attn, saved, Q, K, V, inputs..., Mask::causal, dY): the backward from the
/// saved forward of parallel_saving_into, returning a RuleGradients.
template <class Phi, detail::SavedRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 2)
[[nodiscard]] RuleGradients<Scalar> parallel_backward(const RuleAttention<Phi, Rule, Scalar>& attn,
                                                      const SavedForward<Scalar>& saved,
                                                      const Eigen::MatrixBase<DQ>& Q,
                                                      const Eigen::MatrixBase<DK>& K,
                                                      const Eigen::MatrixBase<DV>& V,
                                                      const Args&... args) {
  constexpr std::size_t n = Rule::token_inputs;
  const auto all = std::forward_as_tuple(args...);
  static_assert(std::is_same_v<std::remove_cvref_t<std::tuple_element_t<n, decltype(all)>>,
                               CausalMask>,
                "the argument before dY must be Mask::causal (a write rule's read is causal)");
  const auto& dY = std::get<n + 1>(all);
  detail::check_backward_shapes(Q, K, V, dY, Mask::causal);
  auto g = detail::sized_rule_gradients<Scalar>(Q.rows(), K.cols(), V.cols());
  detail::BackwardBuffers<Scalar> call_only;
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_saved_backward(attn, saved, Q, K, V, dY,
                                static_cast<const StateGradient<Scalar>*>(nullptr),
                                {g.Q, g.K, g.V}, g.inputs, g.initial, call_only, in...);
  });
  return g;
}

/// Bytes a SavedForward holds for T tokens of key dim dk and value dim dv under this rule
/// attention. Decay, Gated: ceil(T / B) (r dv + r) scalars, B the backward chunk (32 under
/// kAuto); r = dv = 128, float, T = 8,192: 16,908,288 (16.1 MiB). Delta, GatedDelta:
/// ceil(T / C) r dv + 2 T dv scalars, C the forward's chunk (16 at r = dv = 128 under kAuto):
/// 41,943,040 (40 MiB) there; GatedDelta with `per_channel_gates` (log_alpha T x r):
/// ceil(T / C) r dv, 33,554,432 (32 MiB) there.
template <class Phi, detail::SavedRule Rule, class Scalar>
[[nodiscard]] std::size_t saved_forward_bytes(const RuleAttention<Phi, Rule, Scalar>& attn,
                                              Index T, Index dk, Index dv,
                                              bool per_channel_gates = false) {
  const Index r = attn.feature_map().feature_dim(dk);
  const Index C = detail::saved_chunk_size(attn, T, r, dv);
  if constexpr (detail::is_delta_rule<Rule>)
    return detail::DeltaSavedStates<Scalar>::bytes_for(
        T, C, r, dv, !(Rule::kind == WriteKind::gated_delta && per_channel_gates));
  else
    return detail::ChunkStates<Scalar>::bytes_for(T, C, r, dv, false);
}

/// Bytes the backward from a saved forward allocates for itself (one chunk's scratch, with
/// row-major contiguous V and dY; Gated and GatedDelta: one gate per token, or
/// `per_channel_gates`): nothing per token.
template <class Phi, detail::SavedRule Rule, class Scalar>
[[nodiscard]] std::size_t saved_backward_bytes(const RuleAttention<Phi, Rule, Scalar>& attn,
                                               Index T, Index dk, Index dv,
                                               bool per_channel_gates = false) {
  const Index r = attn.feature_map().feature_dim(dk);
  const Index C = detail::saved_chunk_size(attn, T, r, dv);
  if constexpr (Rule::kind == WriteKind::gated_delta)
    if (per_channel_gates)
      return detail::ChannelDeltaBackwardScratch<Scalar>::bytes_for(C, r, dv, false, 0);
  if constexpr (detail::is_delta_rule<Rule>)
    return detail::DeltaBackwardScratch<Scalar>::scalars_for(C, r, dv) * sizeof(Scalar);
  else
    return detail::gated_backward_bytes<Scalar>(T, C, attn.chunk_size(r, dv), r, dv,
                                                per_channel_gates, false);
}

}  // namespace linattn
