#pragma once
/// \file gradients.hpp
/// Gradients (backward passes) of LinearAttention<Phi, Scalar>'s reads, so that models built
/// on linattn can be trained: given the gradient dY of a loss with respect to the outputs,
/// the gradients with respect to Q, K, V and the carried state.
///
/// Math (rows are tokens, phi row-wise, w_ij = phi(q_i)^T phi(k_j), j over all keys or j <= i):
///   num_i = sum_j w_ij v_j (+ phi(q_i)^T S0),  den_i = sum_j w_ij (+ phi(q_i)^T z0),
///   y_i = num_i / divisor(den_i)  (num_i when unnormalized).
/// The read is one product A [V, 1] = [num, den]; by the quotient rule its gradient is
///   G_i = [dy_i / divisor_i, -(dy_i . y_i) / divisor_i]
/// (last entry 0 when unnormalized, and for clamped rows with den_i < eps, whose divisor is the
/// constant eps: the derivative of max(den, eps) as written). Then, with V' = [V, 1],
///   d phi(q_i) = sum_j (G_i . v'_j) phi(k_j) + [S0, z0] G_i,
///   d phi(k_j) = sum_i (G_i . v'_j) phi(q_i) + [dS_T, dz_T] v'_j,
///   dv_j = sum_i w_ij G_i(value part) + dS_T^T phi(k_j),
///   [dS0, dz0] = sum_i phi(q_i) G_i^T + [dS_T, dz_T],
/// and dQ, dK through the feature map's derivative (DifferentiableFeatureMap). The causal
/// backward runs in chunks (detail/backward_chunked.hpp: a forward sweep for dQ, a reverse sweep
/// of the state gradient for dK and dV), never forming T x T; the full one by associativity.
///
/// Log-scaled maps (random features): the kernels work on the scaled features and on gradients
/// shifted by the forward's running maxima, so nothing overflows where the forward is finite.
/// The shifts are constants whose derivatives cancel: they choose how the same sums are stored,
/// and the outputs do not depend on them. State gradients are taken with respect to the stored
/// S(), z() at the state's log_scale() M, M held fixed: they equal the gradients with respect
/// to the true sums exp(M) S(), exp(M) z() times exp(M). A loss that depends on a state only
/// through its true sums (as the next segment's outputs do) gets its exact gradient that way.
///
/// Cost, causal: about 10 r dv + B (4 r + 3 dv) flops per token for the backward's chunk B
/// (backward_chunk_size: Options::chunk_size, or 32 rows under kAuto), against the forward's
/// 4 r dv + C (r + dv), plus the feature map twice per input and its derivative once. A forward
/// that keeps its chunk-boundary states (linattn/saved_forward.hpp) saves the 2 r dv of the
/// sweep that rebuilds them and one evaluation of the map.
/// Memory: 2 scalars per token (3 for log-scaled maps) plus O(C (r + C + dv) + r dv), beside
/// the inputs and the returned gradients (causal_backward_bytes; docs/gradients.md). Full:
/// O((Tq + Tk) r dv) time, the features of all rows in memory (as the forward's full read).

#include <linattn/attention.hpp>
#include <linattn/backward_workspace.hpp>
#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/checks.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/errors.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>

namespace linattn {

/// Gradient of a loss with respect to a state: dS (r x dv) and dz (r), for the stored S() and
/// z() (at the state's log_scale(), held fixed, for log-scaled maps).
template <class Scalar>
struct StateGradient {
  RowMatrix<Scalar> S;
  ColVector<Scalar> z;
};

/// Gradients of a loss with respect to the inputs of a read: Q (Tq x dk), K (Tk x dk),
/// V (Tk x dv), and the initial state (r x dv and r; empty for a full read, which has none).
template <class Scalar>
struct Gradients {
  RowMatrix<Scalar> Q, K, V;
  StateGradient<Scalar> initial;
};

/// Where the *_into calls write dQ (Tq x dk), dK (Tk x dk) and dV (Tk x dv): matrices or
/// strided views into larger buffers (one head's columns of a [T, H d] gradient), so a training
/// loop reuses its buffers instead of allocating three per call. They must not overlap the
/// inputs (the backward reads Q and K twice).
template <class Scalar>
struct GradientsRef {
  Eigen::Ref<RowMatrix<Scalar>> Q, K, V;
};

namespace detail {

/// Where a stateless backward puts the initial state's gradient that its caller does not ask
/// for: while the call runs, in the workspace's buffers (moved in, and back on return), so a
/// warmed workspace allocates nothing for it; without a workspace, in its own.
template <class Scalar>
class UnreadStateGradient {
 public:
  explicit UnreadStateGradient(BackwardWorkspace<Scalar>* workspace) noexcept
      : workspace_(workspace) {
    if (workspace_ == nullptr) return;
    BackwardBuffers<Scalar>& kept = BackwardWorkspaceAccess::buffers(*workspace_);
    gradient_.S = std::move(kept.unread_S);
    gradient_.z = std::move(kept.unread_z);
  }
  ~UnreadStateGradient() {
    if (workspace_ == nullptr) return;
    BackwardBuffers<Scalar>& kept = BackwardWorkspaceAccess::buffers(*workspace_);
    kept.unread_S = std::move(gradient_.S);
    kept.unread_z = std::move(gradient_.z);
  }
  UnreadStateGradient(const UnreadStateGradient&) = delete;
  UnreadStateGradient& operator=(const UnreadStateGradient&) = delete;
  /// Where the call writes the initial state's gradient: `wanted` where the caller asked for
  /// it (not null), else here.
  [[nodiscard]] StateGradient<Scalar>& target(StateGradient<Scalar>* wanted) noexcept {
    return wanted != nullptr ? *wanted : gradient_;
  }

 private:
  BackwardWorkspace<Scalar>* workspace_;
  StateGradient<Scalar> gradient_;
};

template <class Phi, class Scalar>
constexpr void require_differentiable() {
  static_assert(DifferentiableFeatureMap<Phi, Scalar>,
                "the feature map has no derivative: give it `void backward(const In& x, const F& "
                "features, const DF& d_features, DX& d_x) const` computing d_x = J^T d_features "
                "per row (see linattn/feature_maps.hpp)");
}

/// The causal backward's chunk: Options::chunk_size when it is set, and under kAuto the
/// forward's automatic chunk C times ceil(32 / C), i.e. 32 rows (C is 16 or 32). The backward
/// reads H (r x dv) three times per chunk where the forward reads S twice, and at r = dv = 128
/// measured 15% faster in chunks of 32 than of 16 (docs/gradients.md); a multiple of the
/// forward's chunk, so its chunk boundaries are the forward's (a saved forward keeps every k-th
/// state, and the states rebuilt at them have the forward's bits).
template <class Attn>
Index backward_chunk_size(const Attn& attn, Index r, Index dv) {
  const Index C = attn.chunk_size(r, dv);
  if (attn.options().chunk_size != kAuto) return C;
  constexpr Index kRows = 32;
  return C * ((kRows + C - 1) / C);
}

// Q, K, V and dY fit together: dk, rows per token, dY = Tq x dv, and Tq = Tk when causal.
template <class DQ, class DK, class DV, class DY>
void check_backward_shapes(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DY>& dY,
                           Mask mask) {
  check_qkv_pairing(Q, K, V, mask == Mask::causal);
  if (dY.rows() != Q.rows() || dY.cols() != V.cols())
    throw_shape_error("output gradient dY is ", shape_of(dY), ", expected ", Q.rows(), "x",
                      V.cols(), " (Q rows x V cols)");
}

template <class Scalar>
Gradients<Scalar> sized_gradients(Index Tq, Index Tk, Index dk, Index dv) {
  return {RowMatrix<Scalar>(Tq, dk), RowMatrix<Scalar>(Tk, dk), RowMatrix<Scalar>(Tk, dv), {}};
}

// The output views are Tq x dk, Tk x dk and Tk x dv.
template <class Scalar>
void check_gradient_outputs(const GradientsRef<Scalar>& out, Index Tq, Index Tk, Index dk,
                            Index dv) {
  if (out.Q.rows() != Tq || out.Q.cols() != dk || out.K.rows() != Tk || out.K.cols() != dk ||
      out.V.rows() != Tk || out.V.cols() != dv)
    throw_shape_error("gradient outputs are dQ ", shape_of(out.Q), ", dK ", shape_of(out.K),
                      " and dV ", shape_of(out.V), ", expected ", Tq, "x", dk, ", ", Tk, "x", dk,
                      " and ", Tk, "x", dv);
}

// A final state's gradient, where given, fits the state: S r x dv, z of length r for a rule
// that keeps the normalizer and empty for one that does not (the delta rules, whose initial
// gradient's z is empty too, so segment s's `initial` is segment s + 1's final gradient).
template <class Scalar>
void check_final_gradient(const StateGradient<Scalar>* final_gradient, Index r, Index dv,
                          bool keeps_normalizer = true) {
  if (final_gradient == nullptr) return;
  const Index z_length = keeps_normalizer ? r : 0;
  if (final_gradient->S.rows() != r || final_gradient->S.cols() != dv ||
      final_gradient->z.size() != z_length)
    throw_shape_error("final state gradient has S ", shape_of(final_gradient->S),
                      " and z of length ", final_gradient->z.size(), ", expected S ", r, "x", dv,
                      " and z of length ", z_length);
}

}  // namespace detail

/// parallel_backward() writing dQ, dK, dV into `out` (see GradientsRef); with Mask::causal the
/// gradient of the empty initial state goes to `initial` when it is not null (resized to r x dv
/// and r). Allocates only its scratch (causal_backward_bytes), kept in `workspace` when given
/// (BackwardWorkspace), or, for Mask::none, the features.
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
void parallel_backward_into(const LinearAttention<Phi, Scalar>& attn,
                            const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                            const Eigen::MatrixBase<DV>& V, Mask mask,
                            const Eigen::MatrixBase<DY>& dY, GradientsRef<Scalar> out,
                            std::type_identity_t<StateGradient<Scalar>>* initial = nullptr,
                            std::type_identity_t<BackwardWorkspace<Scalar>>* workspace = nullptr) {
  detail::require_differentiable<Phi, Scalar>();
  detail::check_backward_shapes(Q, K, V, dY, mask);
  const Phi& phi = attn.feature_map();
  const Index dk = K.cols(), dv = V.cols(), r = phi.feature_dim(dk);
  detail::check_gradient_outputs(out, Q.rows(), K.rows(), dk, dv);
  const auto& Qm = detail::materialize(Q);
  const auto& Km = detail::materialize(K);
  const auto& Vm = detail::materialize(V);
  const auto& dYm = detail::materialize(dY);
  if (mask == Mask::none) {
    detail::full_backward<Scalar>(phi, Qm, Km, Vm, dYm, attn.options().normalization, out.Q,
                                  out.K, out.V);
    return;
  }
  constexpr bool log_scaled = LogScaledFeatureMap<Phi, Scalar>;
  detail::BackwardBuffers<Scalar> call_only;
  detail::BackwardBuffers<Scalar>& buffers = detail::buffers_of(workspace, call_only);
  buffers.zero_start(r, dv);
  const Scalar M0 = log_scaled ? -std::numeric_limits<Scalar>::infinity() : Scalar(0);
  detail::UnreadStateGradient<Scalar> discarded(workspace);
  StateGradient<Scalar>& d0 = discarded.target(initial);
  detail::causal_backward<Scalar>(phi, Qm, Km, Vm, dYm, buffers.start_S, buffers.start_z, M0,
                                  nullptr, nullptr, detail::backward_chunk_size(attn, r, dv),
                                  attn.options().normalization, out.Q, out.K, out.V, d0.S, d0.z,
                                  buffers.additive);
}

/// Gradients of Y = attn.parallel(Q, K, V, mask) given dY = dLoss/dY (Tq x dv): dQ, dK, dV.
/// Mask::none (Tq may differ from Tk): O((Tq + Tk) r dv), `initial` empty. Mask::causal: the
/// chunked backward from an empty state, `initial` the gradient with respect to that (zero)
/// state's S and z (always 0 for a log-scaled map, whose empty state has weight exp(-inf)).
/// Throws ShapeError for shapes that do not fit (naming them) and DenominatorError where the
/// forward read would. Needs a DifferentiableFeatureMap.
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
[[nodiscard]] Gradients<Scalar> parallel_backward(const LinearAttention<Phi, Scalar>& attn,
                                                  const Eigen::MatrixBase<DQ>& Q,
                                                  const Eigen::MatrixBase<DK>& K,
                                                  const Eigen::MatrixBase<DV>& V, Mask mask,
                                                  const Eigen::MatrixBase<DY>& dY) {
  detail::check_backward_shapes(Q, K, V, dY, mask);
  auto grads = detail::sized_gradients<Scalar>(Q.rows(), K.rows(), K.cols(), V.cols());
  parallel_backward_into(attn, Q, K, V, mask, dY, {grads.Q, grads.K, grads.V},
                         mask == Mask::causal ? &grads.initial : nullptr);
  return grads;
}

/// prefill_backward() writing dQ, dK, dV into `out` (see GradientsRef) and (dS0, dz0) into
/// `initial` (resized to r x dv and r); allocates only its scratch (causal_backward_bytes), kept
/// in `workspace` when given (BackwardWorkspace).
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
void prefill_backward_into(const LinearAttention<Phi, Scalar>& attn,
                           const typename LinearAttention<Phi, Scalar>::State& initial_state,
                           const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DY>& dY,
                           const std::type_identity_t<StateGradient<Scalar>>* final_gradient,
                           GradientsRef<Scalar> out, StateGradient<Scalar>& initial,
                           std::type_identity_t<BackwardWorkspace<Scalar>>* workspace = nullptr) {
  detail::require_differentiable<Phi, Scalar>();
  detail::check_backward_shapes(Q, K, V, dY, Mask::causal);
  const Phi& phi = attn.feature_map();
  const Index dk = K.cols(), dv = V.cols(), r = phi.feature_dim(dk);
  detail::check_gradient_outputs(out, Q.rows(), K.rows(), dk, dv);
  initial_state.check_shape(r, dk, dv);
  initial_state.check_identity(attn.state_identity());
  detail::check_final_gradient(final_gradient, r, dv);
  detail::BackwardBuffers<Scalar> call_only;
  detail::BackwardBuffers<Scalar>& buffers = detail::buffers_of(workspace, call_only);
  // The stored S read in place unless decode tokens are pending (then S() folds them in).
  const RowMatrix<Scalar>* S0 = &initial_state.stored_S();
  if (initial_state.pending_tokens() > 0) {
    buffers.start_S = initial_state.S();
    S0 = &buffers.start_S;
  }
  detail::causal_backward<Scalar>(
      phi, detail::materialize(Q), detail::materialize(K), detail::materialize(V),
      detail::materialize(dY), *S0, initial_state.z(), initial_state.log_scale(),
      final_gradient != nullptr ? &final_gradient->S : nullptr,
      final_gradient != nullptr ? &final_gradient->z : nullptr,
      detail::backward_chunk_size(attn, r, dv), attn.options().normalization, out.Q, out.K,
      out.V, initial.S, initial.z, buffers.additive);
}

/// Gradients of the causal read that continues `initial_state` (made by attn.make_state; read,
/// not changed), i.e. of Y = attn.prefill(state, Q, K, V) with state equal to initial_state
/// before the call, given dY (T x dv) and, optionally, the gradient of the loss
/// with respect to the final state. `final_gradient` null means the loss does not depend on the
/// final state (dS_T = 0, dz_T = 0); otherwise its S must be r x dv and its z have length r.
/// Returns dQ, dK, dV and `initial` = (dS0, dz0) with respect to initial_state's S() and z().
/// Training a long sequence in segments: run the forward over the segments carrying the state
/// and keep each segment's initial state; then from the last segment to the first, call this
/// with that segment's initial state and the `initial` of the segment after it as
/// `final_gradient`. The gradients equal those of one call over the whole sequence (to rounding).
/// Complexity and memory as in the file comment; throws as parallel_backward, and ShapeError for
/// a state or final gradient that does not fit.
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
[[nodiscard]] Gradients<Scalar> prefill_backward(
    const LinearAttention<Phi, Scalar>& attn,
    const typename LinearAttention<Phi, Scalar>::State& initial_state,
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DY>& dY,
    const StateGradient<Scalar>* final_gradient = nullptr) {
  detail::check_backward_shapes(Q, K, V, dY, Mask::causal);
  auto grads = detail::sized_gradients<Scalar>(Q.rows(), K.rows(), K.cols(), V.cols());
  prefill_backward_into(attn, initial_state, Q, K, V, dY, final_gradient,
                        {grads.Q, grads.K, grads.V}, grads.initial);
  return grads;
}

/// Bytes the causal backward allocates for itself for T tokens of key dim dk and value dim dv
/// (beyond the inputs and the returned gradients), with row-major contiguous V and dY (others
/// add two C x dv copies): 2 scalars per token (3 for log-scaled maps) plus per-call buffers of
/// O(C (r + C + dv) + r dv). For T = 65,536, r = dv = 128, C = 32, float: 836,992 bytes
/// (0.80 MiB: 8 per token and 312,704 per call).
template <class Phi, class Scalar>
[[nodiscard]] std::size_t causal_backward_bytes(const LinearAttention<Phi, Scalar>& attn, Index T,
                                                Index dk, Index dv) {
  const Index r = attn.feature_map().feature_dim(dk);
  return detail::BackwardScratch<Scalar>::bytes_for(T, detail::backward_chunk_size(attn, r, dv),
                                                     r, dv,
                                                     LogScaledFeatureMap<Phi, Scalar>, false,
                                                     false);
}

}  // namespace linattn
