#pragma once
// The saving forward and the backward from its data for the write rules
// (linattn/rule_saved_forward.hpp has the API and the costs). Decay and Gated keep the state
// (S, z) before every backward chunk (SaveChunkStates; the backward: gated_backward_from);
// Delta and GatedDelta keep, per forward chunk, the state before it and, per token, the
// corrected values and decayed state reads of the forward's kernel (SaveDeltaChunks; the
// backward: delta_backward_saved).

#include <linattn/attention.hpp>
#include <linattn/detail/channel_delta_backward.hpp>
#include <linattn/detail/delta_backward.hpp>
#include <linattn/detail/gated_backward.hpp>
#include <linattn/detail/rule_paths.hpp>
#include <linattn/detail/stream_store.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/gradients.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <tuple>

namespace linattn {

namespace detail {

/// The rules with a saved forward here: Decay, Gated, Delta and GatedDelta.
template <class Rule>
concept SavedRule = Rule::kind == WriteKind::decay || Rule::kind == WriteKind::gated ||
                    is_delta_rule<Rule>;

/// The rows per saved chunk: the backward's chunk for Decay and Gated (a multiple of the
/// forward's), the forward's own chunk for the delta rules (whose saved data is the forward
/// kernel's: the state before each chunk, each token's corrected values and state reads).
template <class Phi, class Rule, class Scalar>
Index saved_chunk_size(const RuleAttention<Phi, Rule, Scalar>& attn, Index T, Index r, Index dv) {
  if constexpr (is_delta_rule<Rule>)
    return std::min(attn.chunk_size(r, dv), std::max<Index>(T, 1));
  else
    return backward_chunk_size(attn, r, dv);
}

template <class Phi, class Rule, class Scalar, class DQ, class DK, class DV>
void check_rule_saved(const RuleAttention<Phi, Rule, Scalar>& attn,
                      const SavedForward<Scalar>& saved, const Eigen::MatrixBase<DQ>& Q,
                      const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V) {
  const Index dk = K.cols(), dv = V.cols(), r = attn.feature_map().feature_dim(dk);
  const Index C = saved_chunk_size(attn, Q.rows(), r, dv);
  if (saved.tokens() != Q.rows() || saved.key_dim() != dk || saved.value_dim() != dv ||
      saved.feature_dim() != r || (Q.rows() > 0 && saved.chunk_size() != C))
    throw_shape_error("the saved forward holds ", saved.tokens(), " tokens of key dim ",
                      saved.key_dim(), ", value dim ", saved.value_dim(), ", feature dim ",
                      saved.feature_dim(), " in chunks of ", saved.chunk_size(),
                      "; this backward has Q ", shape_of(Q), ", K ", shape_of(K), ", V ",
                      shape_of(V), ", feature dim ", r, " and chunks of ", C,
                      " (pass the saved forward of these inputs)");
  const StateIdentity& id = SavedForwardAccess::identity(saved);
  if (!(id == attn.state_identity()))
    throw_error<StateMismatchError>("the saved forward was made by ", id.describe(),
                                    ", this attention uses ", attn.state_identity().describe());
}

// The saving forward continuing `state` for bound or unbound inputs `in...`.
template <class Phi, class Rule, class Scalar, class DQ, class DK, class DV, class... In>
void rule_saving_forward(const RuleAttention<Phi, Rule, Scalar>& attn,
                         RuleState<Rule, Scalar>& state, const Eigen::MatrixBase<DQ>& Q,
                         const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                         Eigen::Ref<RowMatrix<Scalar>> out, SavedForward<Scalar>& saved,
                         const In&... in) {
  check_forward_shapes(Q, K, V, out);
  const Index T = Q.rows(), dk = K.cols(), dv = V.cols(), r = attn.feature_map().feature_dim(dk);
  state.check_shape(r, dk, dv);
  state.check_identity(attn.state_identity());
  state.check_room(T);
  TokenInputs<Scalar> bound;
  bind_token_inputs<Scalar>(attn.rule(), std::forward_as_tuple(in...), T, r, bound);
  const Index C = attn.chunk_size(r, dv), B = saved_chunk_size(attn, T, r, dv);
  const auto& Qm = materialize(Q);
  const auto& Km = materialize(K);
  const auto& Vm = materialize(V);
  const auto query = [&](Index) -> const auto& { return Qm; };
  const auto output = [&](Index) -> Eigen::Ref<RowMatrix<Scalar>> { return out; };
  const auto forward = [&](const auto& save) {
    rule_chunked(attn.feature_map(), attn.options().normalization, C, 1, query, Km, Vm, bound,
                 state, output, save);
  };
  if constexpr (is_delta_rule<Rule>) {
    // Per-channel log_alpha: the chunk states only (its backward recomputes the tokens).
    SavedForwardAccess::prepare_delta(saved, T, B, r, dk, dv, attn.state_identity(),
                                      bound.log_alpha.cols <= 1);
    forward(SaveDeltaChunks<Scalar>{SavedForwardAccess::delta(saved)});
  } else {
    SavedForwardAccess::prepare(saved, T, B, r, dk, dv, false, attn.state_identity());
    forward(SaveChunkStates<Scalar>{SavedForwardAccess::data(saved), B});
  }
  stream_fence();
  SavedForwardAccess::finish(saved, T);
}

// The backward from `saved` for the inputs `in...`: checks, then gated_backward_from (Decay,
// Gated) or delta_backward_saved (Delta, GatedDelta). `d_in`: a RuleInputGradients (resized)
// or InputGradientRows (sized by the caller).
template <class Phi, class Rule, class Scalar, class DQ, class DK, class DV, class DY, class DIn,
          class... In>
void rule_saved_backward(const RuleAttention<Phi, Rule, Scalar>& attn,
                         const SavedForward<Scalar>& saved, const Eigen::MatrixBase<DQ>& Q,
                         const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                         const Eigen::MatrixBase<DY>& dY,
                         const StateGradient<Scalar>* final_gradient, GradientsRef<Scalar> out,
                         DIn&& d_in, StateGradient<Scalar>& initial,
                         BackwardBuffers<Scalar>& buffers, const In&... in) {
  require_differentiable<Phi, Scalar>();
  check_backward_shapes(Q, K, V, dY, Mask::causal);
  const Index T = Q.rows(), dk = K.cols(), dv = V.cols(), r = attn.feature_map().feature_dim(dk);
  check_gradient_outputs(out, T, T, dk, dv);
  check_rule_saved(attn, saved, Q, K, V);
  check_final_gradient(final_gradient, r, dv, Rule::keeps_normalizer);
  TokenInputs<Scalar> bound;
  bind_token_inputs<Scalar>(attn.rule(), std::forward_as_tuple(in...), T, r, bound);
  const RowMatrix<Scalar>* dS_T = final_gradient != nullptr ? &final_gradient->S : nullptr;
  const InputGradientRows<Scalar> d_rows =
      input_gradient_rows<Rule>(d_in, T, bound.gate_columns());
  if constexpr (is_delta_rule<Rule>) {
    const DeltaSavedStates<Scalar>& data = SavedForwardAccess::delta(saved);
    const bool per_channel = bound.log_alpha.cols > 1;
    if (T > 0 && per_channel == data.per_token)
      throw_shape_error("the saved forward was made with ",
                        data.per_token ? "one log_alpha per token (T x 1)"
                                       : "per-channel log_alpha (T x r)",
                        ", this backward has log_alpha ", T, "x", bound.log_alpha.cols,
                        " (pass the saved forward of these inputs)");
    if (per_channel) {
      channel_delta_backward_saved<Scalar>(attn.feature_map(), materialize(Q), materialize(K),
                                           materialize(V), materialize(dY), bound, data, dS_T,
                                           out.Q, out.K, out.V, d_rows.beta, d_rows.log_alpha,
                                           initial.S, buffers.channel_delta);
      initial.z.resize(0);
      return;
    }
    delta_backward_saved<Scalar>(attn.feature_map(), materialize(Q), materialize(K),
                                 materialize(V), materialize(dY), bound,
                                 SavedForwardAccess::delta(saved), dS_T, out.Q, out.K, out.V,
                                 d_rows.beta, d_rows.log_alpha, initial.S, buffers.delta_sweep);
    initial.z.resize(0);
  } else {
    Scalar* d_gate = d_rows.log_gate;  // null for Decay
    gated_backward_from<Scalar>(
        attn.feature_map(), materialize(Q), materialize(K), materialize(V), materialize(dY),
        bound, nullptr, nullptr, &SavedForwardAccess::data(saved), r, dS_T,
        final_gradient != nullptr ? &final_gradient->z : nullptr, saved.chunk_size(),
        attn.chunk_size(r, dv), attn.options().normalization, out.Q, out.K, out.V, d_gate,
        initial.S, initial.z, buffers.gated);
  }
}

}  // namespace detail

}  // namespace linattn
