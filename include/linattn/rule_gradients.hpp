#pragma once
/// \file rule_gradients.hpp
/// Gradients (backward passes) of RuleAttention<Phi, Rule, Scalar>'s causal reads for the write
/// rules Decay, Gated, Delta and GatedDelta (Additive: linattn/gradients.hpp): given dY =
/// dLoss/dY, the gradients with respect to Q, K, V, the rule's per-token inputs and the carried
/// state. Same shape as gradients.hpp: parallel_backward / prefill_backward return a
/// RuleGradients; the *_into forms write dQ, dK, dV into a GradientsRef (views into a model's
/// buffers) and the per-token and state gradients into caller-owned objects.
///
/// Per-token gradients (RuleInputGradients):
///   Gated: log_gate, the shape of the log-gates given (T x 1, or T x r per channel; a 1 x T row
///     of gates gets T x 1).  Delta: beta (length T).  GatedDelta: beta (length T) and log_alpha,
///     the shape given (T x 1, or T x r per channel: Kimi Delta Attention).
///   Decay: none. gamma is a fixed constant of the rule, not an input; its gradient is not
///     offered (the rule has no per-call parameter to differentiate).
/// State gradient (StateGradient): S (r x dv) and, for Decay and Gated, z (length r); delta
///   rules keep no z (their StateGradient::z is empty).
///
/// Math (plain text; detail/gated_backward.hpp and detail/delta_backward.hpp have the derivations):
///   Decay / Gated: with B_t = sum_{s<=t} log g_s (per channel), the read is
///     [num_i, den_i] = sum_{j<=i} (q_i .* exp(B_i - B_j)) . k_j [v_j, 1] + (q_i .* exp(B_i))^T [S0, z0]
///   and the normalized output num / den gets its gradient by the quotient rule as in
///   gradients.hpp. The gate gradient is d log g_s = sum_{t>=s} (q_t .* dq_t - k_t .* dk_t) plus
///   rowsum([S_T, z_T] .* [dS_T, dz_T]) (dq, dk: gradients of the features; summed over the
///   channels for one gate per token).
///   Delta / GatedDelta: S_t = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T,
///   y_t = S_t^T q_t (alpha = 1 for Delta), differentiated through its chunked WY / UT form.
///   Per-channel GatedDelta: S' = diag(alpha_t) S_{t-1}, S_t = S' + beta_t k_t (v_t - S'^T k_t)^T,
///   differentiated through the same chunked form with the decays per channel inside each
///   pairwise product (detail/channel_delta_backward.hpp).
///
/// Cost and memory: every rule runs chunk by chunk (no T x T, no per-token pass over S): a
/// forward sweep rebuilds the chunk-boundary states, a reverse sweep carries the state gradient.
/// Decay / Gated: O(T (r dv + C (r + dv))) time (per-channel gates add O(T c r) for the in-chunk
/// decays, c = 16), 2 scalars per token plus O(C (C + r + dv) + r dv); the register kernel's
/// products, about 10 r dv flops per token against the forward's 4 r dv. A saved forward
/// (linattn/rule_saved_forward.hpp) skips the rebuild: 8 r dv. Delta / GatedDelta (the WY / UT
/// form): O(T (r dv + C (r + dv))) time plus a C x C triangular solve per chunk, the boundary
/// states and each token's corrected values stored: r dv / C + 2 dv scalars per token plus
/// O(C (C + r + dv) + r dv). Per-channel GatedDelta: the forward's chunk kernel keeps the
/// states at chunk starts, then a reverse sweep from them in blocks of 16 rows, about 16 r dv
/// flops per token beyond that forward's key side (plus O(16 r) for the in-block decays); r dv
/// / C scalars per token plus (ceil(C / 16) + 2) r dv and the chunk kernel's buffers. Exact
/// figures: rule_backward_bytes().
///
/// The feature map must be a DifferentiableFeatureMap: gradients flow to Q and K through its
/// backward(). Errors: ShapeError for shapes that do not fit (naming them), std::invalid_argument
/// for per-token inputs the forward would refuse, DenominatorError where the forward read would
/// throw one, StateMismatchError for a state made by another attention.

#include <linattn/attention.hpp>
#include <linattn/backward_workspace.hpp>
#include <linattn/detail/rule_backward.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/gradients.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace linattn {

/// Gradients with respect to a rule's per-token inputs; the members a rule does not take are
/// empty (0 x 0 or length 0).
template <class Scalar>
struct RuleInputGradients {
  RowMatrix<Scalar> log_gate;   // Gated: T x 1 or T x r
  ColVector<Scalar> beta;       // Delta, GatedDelta: T
  RowMatrix<Scalar> log_alpha;  // GatedDelta: T x 1 or T x r
};

/// Everything a rule's backward returns: dQ, dK, dV, the per-token inputs' gradients and the
/// initial state's gradient.
template <class Scalar>
struct RuleGradients {
  RowMatrix<Scalar> Q, K, V;
  RuleInputGradients<Scalar> inputs;
  StateGradient<Scalar> initial;
};

namespace detail {

template <class Rule>
concept GradientRule = Rule::kind != WriteKind::additive;

/// Where a backward writes the per-token inputs' gradients: contiguous rows, T x gate columns
/// for Gated's log-gates and GatedDelta's log_alpha, T for beta (null where the rule has none). The
/// multi-head layer passes rows of its workspace (sized by the caller) in place of a
/// RuleInputGradients, which the backward resizes.
template <class Scalar>
struct InputGradientRows {
  Scalar* log_gate = nullptr;
  Scalar* beta = nullptr;
  Scalar* log_alpha = nullptr;
};

/// `d` resized for T tokens of `Rule` with `gate_columns` log-gate columns (Gated's log-gates,
/// GatedDelta's log_alpha), as rows.
template <class Rule, class Scalar>
InputGradientRows<Scalar> input_gradient_rows(RuleInputGradients<Scalar>& d, Index T,
                                              Index gate_columns) {
  InputGradientRows<Scalar> rows;
  if constexpr (Rule::kind == WriteKind::gated) {
    d.log_gate.resize(T, gate_columns);
    rows.log_gate = d.log_gate.data();
  } else if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta) {
    d.beta.resize(T);
    rows.beta = d.beta.data();
    if constexpr (Rule::kind == WriteKind::gated_delta) {
      d.log_alpha.resize(T, gate_columns);
      rows.log_alpha = d.log_alpha.data();
    }
  }
  return rows;
}

/// Rows the caller sized: as given.
template <class Rule, class Scalar>
InputGradientRows<Scalar> input_gradient_rows(InputGradientRows<Scalar> d, Index, Index) {
  return d;
}

/// The d_inputs argument of the *_into overloads: a RuleInputGradients (resized) or rows.
template <class Scalar, class D>
constexpr void check_input_gradients() {
  static_assert(std::is_same_v<std::remove_cvref_t<D>, RuleInputGradients<Scalar>> ||
                    std::is_same_v<std::remove_cvref_t<D>, InputGradientRows<Scalar>>,
                "the argument after the GradientsRef must be the inputs' gradients, a "
                "RuleInputGradients<Scalar>&");
}

// The causal backward from (S0, z0) for bound inputs: the rule's kernel (the caller checked
// the shapes, the final gradient among them).
template <class Phi, class Rule, class Scalar, class DQ, class DK, class DV, class DY>
void rule_backward_bound(const RuleAttention<Phi, Rule, Scalar>& attn,
                         const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                         const ColVector<Scalar>& z0, const DQ& Q, const DK& K, const DV& V,
                         const DY& dY, const StateGradient<Scalar>* final_gradient,
                         GradientsRef<Scalar> out, InputGradientRows<Scalar> d_in,
                         StateGradient<Scalar>& initial, BackwardBuffers<Scalar>& buffers) {
  const Index r = S0.rows(), dv = S0.cols();
  const Index C = attn.chunk_size(r, dv);
  const RowMatrix<Scalar>* dS_T = final_gradient != nullptr ? &final_gradient->S : nullptr;
  if constexpr (Rule::kind == WriteKind::gated_delta) {
    if (in.log_alpha.cols > 1) {
      channel_delta_backward<Scalar>(attn.feature_map(), Q, K, V, dY, in, S0, dS_T, C, out.Q,
                                     out.K, out.V, d_in.beta, d_in.log_alpha, initial.S,
                                     buffers.delta, buffers.channel_delta);
      initial.z.resize(0);
      return;
    }
  }
  if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta) {
    delta_backward<Scalar>(attn.feature_map(), Q, K, V, dY, in, S0, dS_T, C, out.Q, out.K,
                           out.V, d_in.beta, d_in.log_alpha, initial.S, buffers.delta,
                           buffers.delta_forward, buffers.delta_sweep);
    initial.z.resize(0);
  } else {
    Scalar* d_gate = d_in.log_gate;  // null for Decay
    // Chunks of backward_chunk_size (32 rows under kAuto, a multiple of the forward's C).
    gated_backward<Scalar>(attn.feature_map(), Q, K, V, dY, in, S0, z0, dS_T,
                           final_gradient != nullptr ? &final_gradient->z : nullptr,
                           backward_chunk_size(attn, r, dv), C, attn.options().normalization,
                           out.Q, out.K, out.V, d_gate, initial.S, initial.z, buffers.gated);
  }
}

// The causal backward from `state` (null: stateless): checks, then rule_backward_bound.
// `d_in`: a RuleInputGradients (resized) or InputGradientRows (sized by the caller).
template <class Phi, class Rule, class Scalar, class DQ, class DK, class DV, class DY, class DIn,
          class... In>
void rule_backward_into(const RuleAttention<Phi, Rule, Scalar>& attn,
                        const std::type_identity_t<RuleState<Rule, Scalar>>* state,
                        const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                        const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DY>& dY,
                        const std::type_identity_t<StateGradient<Scalar>>* final_gradient,
                        std::type_identity_t<GradientsRef<Scalar>> out, DIn&& d_in,
                        StateGradient<Scalar>& initial,
                        std::type_identity_t<BackwardWorkspace<Scalar>>* workspace,
                        const In&... in) {
  require_differentiable<Phi, Scalar>();
  check_backward_shapes(Q, K, V, dY, Mask::causal);
  const Index T = Q.rows(), dk = K.cols(), dv = V.cols(), r = attn.feature_map().feature_dim(dk);
  check_gradient_outputs(out, T, T, dk, dv);
  TokenInputs<Scalar> bound;
  bind_token_inputs<Scalar>(attn.rule(), std::forward_as_tuple(in...), T, r, bound);
  const auto& Qm = materialize(Q);
  const auto& Km = materialize(K);
  const auto& Vm = materialize(V);
  const auto& dYm = materialize(dY);
  BackwardBuffers<Scalar> call_only;
  BackwardBuffers<Scalar>& buffers = buffers_of(workspace, call_only);
  if (state != nullptr) {
    state->check_shape(r, dk, dv);
    state->check_identity(attn.state_identity());
  }
  check_final_gradient(final_gradient, r, dv, Rule::keeps_normalizer);
  const InputGradientRows<Scalar> d_rows = input_gradient_rows<Rule>(
      d_in, T, bound.gate_columns());
  if (state != nullptr) {
    const ColVector<Scalar> no_z;  // the delta rules keep no z and do not read this one
    const ColVector<Scalar>* z0 = &no_z;
    if constexpr (Rule::keeps_normalizer) z0 = &state->z();
    rule_backward_bound(attn, bound, state->S(), *z0, Qm, Km, Vm, dYm, final_gradient, out,
                        d_rows, initial, buffers);
  } else {
    buffers.zero_start(r, dv);
    rule_backward_bound(attn, bound, buffers.start_S, buffers.start_z, Qm, Km, Vm, dYm,
                        final_gradient, out, d_rows, initial, buffers);
  }
}

}  // namespace detail

namespace detail {

// f(first N elements of the tuple...).
template <std::size_t N, class Tuple, class F>
decltype(auto) with_first(const Tuple& t, F&& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
    return f(std::get<I>(t)...);
  }(std::make_index_sequence<N>{});
}

template <class Scalar>
RuleGradients<Scalar> sized_rule_gradients(Index T, Index dk, Index dv) {
  RuleGradients<Scalar> g;
  g.Q.resize(T, dk);
  g.K.resize(T, dk);
  g.V.resize(T, dv);
  return g;
}

// The optional workspace argument of the *_into overloads.
template <class Scalar, class W>
BackwardWorkspace<Scalar>* workspace_argument(W workspace) {
  static_assert(std::is_convertible_v<W, BackwardWorkspace<Scalar>*>,
                "the argument after the initial state's gradient must be a "
                "BackwardWorkspace<Scalar>* (or nullptr)");
  return workspace;
}

/// The optional last arguments of a rule's stateless `_into` backward: all's elements n + 4
/// (the initial state's gradient, a StateGradient*; null or absent: not wanted) and n + 5
/// (a BackwardWorkspace*).
template <class Scalar>
struct StatelessTail {
  StateGradient<Scalar>* initial = nullptr;
  BackwardWorkspace<Scalar>* workspace = nullptr;
};

template <class Scalar, std::size_t n, class Tuple>
StatelessTail<Scalar> stateless_tail(const Tuple& all) {
  StatelessTail<Scalar> tail;
  if constexpr (std::tuple_size_v<Tuple> >= n + 5)
    if (std::get<n + 4>(all) != nullptr) tail.initial = std::get<n + 4>(all);
  if constexpr (std::tuple_size_v<Tuple> == n + 6)
    tail.workspace = workspace_argument<Scalar>(std::get<n + 5>(all));
  return tail;
}

}  // namespace detail

/// parallel_backward(attn, Q, K, V, inputs..., Mask::causal, dY): gradients of
/// Y = attn.parallel(Q, K, V, inputs..., Mask::causal) for Decay (no input), Gated (log-gates),
/// Delta (beta), GatedDelta (beta, log_alpha), given dY (T x dv): dQ, dK, dV, the inputs'
/// gradients and `initial`, the gradient with respect to the empty initial state. Complexity
/// and errors as in the file comment.
template <class Phi, detail::GradientRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 2)
[[nodiscard]] RuleGradients<Scalar> parallel_backward(const RuleAttention<Phi, Rule, Scalar>& attn,
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
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_backward_into(attn, nullptr, Q, K, V, dY, nullptr, {g.Q, g.K, g.V}, g.inputs,
                               g.initial, nullptr, in...);
  });
  return g;
}

/// parallel_backward_into(attn, Q, K, V, inputs..., Mask::causal, dY, out, d_inputs[, initial
/// [, workspace]]): parallel_backward() writing dQ, dK, dV into `out` (a GradientsRef: views
/// into a model's buffers, not overlapping the inputs), the inputs' gradients into `d_inputs` (a
/// RuleInputGradients, resized as needed) and, when `initial` (a StateGradient*) is given and
/// not null, the empty initial state's gradient there. Allocates its scratch
/// (rule_backward_bytes) and what d_inputs needs the first time; with `workspace` (a
/// BackwardWorkspace*, may be null) the delta rules keep their rebuilt forward data there
/// instead of allocating it per call. Same results with and without a workspace, bit for bit.
template <class Phi, detail::GradientRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) >= Rule::token_inputs + 4 &&
           sizeof...(Args) <= Rule::token_inputs + 6)
void parallel_backward_into(const RuleAttention<Phi, Rule, Scalar>& attn,
                            const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                            const Eigen::MatrixBase<DV>& V, Args&&... args) {
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
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_backward_into(attn, nullptr, Q, K, V, dY, nullptr, out, d_inputs, initial,
                               tail.workspace, in...);
  });
}

/// prefill_backward_into(attn, initial_state, Q, K, V, inputs..., dY, final_gradient, out,
/// d_inputs, initial[, workspace]): the backward of attn.prefill(state, Q, K, V, inputs...) with
/// state equal to `initial_state` before the call (read, not changed), writing dQ, dK, dV into
/// `out` (views; must not overlap the inputs), the inputs' gradients into `d_inputs` (a
/// RuleInputGradients) and (dS0, dz0) into `initial` (a StateGradient), resized as needed (no
/// allocation when already sized). `final_gradient` (a const StateGradient*) null means the loss
/// does not depend on the final state; otherwise its S is r x dv and (Decay, Gated) its z has
/// length r. `workspace` (a BackwardWorkspace*, may be null): as in parallel_backward_into.
template <class Phi, detail::GradientRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 5 ||
           sizeof...(Args) == Rule::token_inputs + 6)
void prefill_backward_into(const RuleAttention<Phi, Rule, Scalar>& attn,
                           const RuleState<Rule, Scalar>& initial_state,
                           const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, Args&&... args) {
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
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_backward_into(attn, &initial_state, Q, K, V, dY, final_gradient, out, d_inputs,
                               initial, workspace, in...);
  });
}

/// prefill_backward(attn, initial_state, Q, K, V, inputs..., dY[, final_gradient]): gradients of
/// Y = attn.prefill(state, Q, K, V, inputs...) with state equal to `initial_state` before the
/// call, given dY and, optionally, the final state's gradient (a const StateGradient*; omitted
/// or null: 0). Returns dQ, dK, dV, the inputs' gradients and (dS0, dz0) for initial_state's S()
/// and z(). Training in segments: as in gradients.hpp, the `initial` of segment s + 1 is the
/// final_gradient of segment s.
template <class Phi, detail::GradientRule Rule, class Scalar, class DQ, class DK, class DV,
          class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 1 ||
           sizeof...(Args) == Rule::token_inputs + 2)
[[nodiscard]] RuleGradients<Scalar> prefill_backward(const RuleAttention<Phi, Rule, Scalar>& attn,
                                                     const RuleState<Rule, Scalar>& initial_state,
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
  detail::with_first<n>(all, [&](const auto&... in) {
    detail::rule_backward_into(attn, &initial_state, Q, K, V, dY, final_gradient,
                               {g.Q, g.K, g.V}, g.inputs, g.initial, nullptr, in...);
  });
  return g;
}

/// Bytes a rule's backward allocates for itself for T tokens of key dim dk, value dim dv (one
/// gate per token, or `per_channel_gates`: Gated's log-gates, GatedDelta's log_alpha), beyond the inputs and the returned gradients. For
/// Delta and GatedDelta most of it is the rebuilt forward data, which a BackwardWorkspace holds
/// instead when one is passed (its bytes() after the call).
template <class Phi, detail::GradientRule Rule, class Scalar>
[[nodiscard]] std::size_t rule_backward_bytes(const RuleAttention<Phi, Rule, Scalar>& attn,
                                              Index T, Index dk, Index dv,
                                              bool per_channel_gates = false) {
  const Index r = attn.feature_map().feature_dim(dk), C = attn.chunk_size(r, dv);
  if constexpr (Rule::kind == WriteKind::gated_delta)
    if (per_channel_gates) {
      // The kept chunk states (no per-token rows), pass 2's buffers, pass 1's kernel.
      const Index rows = std::max<Index>(std::min(C, T), 1);
      return detail::DeltaSavedStates<Scalar>::bytes_for(T, rows, r, dv, false) +
             detail::ChannelDeltaBackwardScratch<Scalar>::bytes_for(rows, r, dv, T > 0, C);
    }
  if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta)
    return detail::DeltaBackwardScratch<Scalar>::bytes_for(T, C, r, dv);
  else
    return detail::gated_backward_bytes<Scalar>(T, detail::backward_chunk_size(attn, r, dv), C, r,
                                                dv, per_channel_gates, true);
}

}  // namespace linattn
