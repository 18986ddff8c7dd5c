#pragma once
/// \file saved_forward.hpp
/// A causal forward that keeps what its backward needs, and the backward that uses it: for
/// training, where the backward of the same read follows, this skips the backward's sweep that
/// rebuilds the chunk-boundary states (linattn/gradients.hpp's causal backward).
///
///   SavedForward<float> saved;
///   attn.parallel_into(...)  becomes  parallel_saving_into(attn, Q, K, V, Mask::causal, Y, saved)
///   auto g = parallel_backward(attn, saved, Q, K, V, Mask::causal, dY);
///
/// The saving forward is the forward (detail::causal_chunked, or the log-domain kernel for
/// random features) with the state copied out at the start of every backward chunk of B rows
/// (B = Options::chunk_size when set, else 32: a multiple of the forward's chunk, see
/// detail::backward_chunk_size): its outputs are the forward's bits, and the copy costs
/// r (dv + 1) scalars per B rows. The backward from it is one reverse sweep over the chunks
/// (detail/saved_backward.hpp): per token about 8 r dv + B (3 r + 2 dv) flops and one
/// evaluation of the feature map and its derivative per input, against 10 r dv + B (4 r + 3 dv)
/// and two evaluations when it rebuilds the states; the forward is 4 r dv + C (r + dv).
///
/// Memory: SavedForward holds ceil(T / B) (r dv + r) scalars (+ 1 per chunk for log-scaled
/// maps), i.e. (r dv + r) / B scalars per token: r = dv = 128 in float is 2,064 B per token
/// with the default B = 32 (4,128 B with chunk_size = 16); T = 65,536 is then 129 MiB (258 MiB).
/// Every backward chunk's state is kept, none recomputed: at these sizes that is well under a
/// GiB per head, and checkpoints every n chunks would bring back a sweep that rebuilds the
/// states between them. The backward allocates one chunk's scratch, O(B (r + B + dv) + r dv)
/// (saved_backward_bytes).
///
/// The saved states belong to the inputs of the forward that filled them: the backward must
/// get the same Q, K, V (it checks the shapes, the attention's identity and the length, not
/// the values).
///
/// The class SavedForward itself is defined in detail/saved_forward_data.hpp (included here).

#include <Eigen/Core>
#include <cstddef>
#include <linattn/attention.hpp>
#include <linattn/backward_workspace.hpp>
#include <linattn/detail/delta_backward.hpp>
#include <linattn/detail/huge_pages.hpp>
#include <linattn/detail/saved_forward_data.hpp>
#include <linattn/detail/saved_backward.hpp>
#include <linattn/detail/stream_store.hpp>
#include <linattn/gradients.hpp>
#include <stdexcept>
#include <type_traits>

namespace linattn {

namespace detail {

/// Copies the state before each chunk into a SavedForward's ChunkStates (the kernels' observer;
/// S is contiguous r x dv in both chunked kernels). Non-temporal stores for S: the saved states
/// are written once and read back only by the backward, after the whole forward, so they
/// should not evict the forward's working set nor read their lines before overwriting them.
template <class Scalar>
struct SaveChunkStates {
  ChunkStates<Scalar>& out;
  Index stride;  // the backward's chunk, a multiple of the forward's: every k-th state is kept
  template <class S, class Z, class... M>
  void operator()(Index first, const S& state, const Z& z, const M&... log_scale) const {
    if (first % stride != 0) return;
    const Index c = first / stride, r = state.rows();
    stream_copy(state.data(), state.size(), out.states.data() + c * r * state.cols());
    out.sums.row(c) = z.transpose();
    if constexpr (sizeof...(M) == 1) ((out.log_scales(c) = log_scale), ...);
  }
};

// Q, K, V of a causal read and its output (T x dv) fit together.
template <class DQ, class DK, class DV, class Out>
void check_forward_shapes(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                          const Eigen::MatrixBase<DV>& V, const Out& out) {
  if (Q.cols() != K.cols() || K.rows() != V.rows() || Q.rows() != K.rows() || K.cols() < 1 ||
      V.cols() < 1)
    throw_shape_error(
        "a causal read needs Q, K, V with one row per token, Q and K of one key "
        "dimension and dk, dv >= 1, got Q ",
        shape_of(Q), ", K ", shape_of(K), " and V ", shape_of(V));
  if (out.rows() != Q.rows() || out.cols() != V.cols())
    throw_shape_error("output is ", shape_of(out), ", expected ", Q.rows(), "x", V.cols(),
                      " (Q rows x V cols)");
}

template <class Phi, class Scalar, class DQ, class DK, class DV>
void check_saved(const LinearAttention<Phi, Scalar>& attn, const SavedForward<Scalar>& saved,
                 const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                 const Eigen::MatrixBase<DV>& V) {
  const Index dk = K.cols(), dv = V.cols(), r = attn.feature_map().feature_dim(dk);
  if (saved.tokens() != Q.rows() || saved.key_dim() != dk || saved.value_dim() != dv ||
      saved.feature_dim() != r || (Q.rows() > 0 && saved.chunk_size() < 1))
    throw_shape_error("the saved forward holds ", saved.tokens(), " tokens of key dim ",
                      saved.key_dim(), ", value dim ", saved.value_dim(), " and feature dim ",
                      saved.feature_dim(), "; this backward has Q ", shape_of(Q), ", K ",
                      shape_of(K), ", V ", shape_of(V), " and feature dim ", r,
                      " (pass the saved forward of these inputs)");
  const StateIdentity& id = SavedForwardAccess::identity(saved);
  if (!(id == attn.state_identity()))
    throw_error<StateMismatchError>("the saved forward was made by ", id.describe(),
                                    ", this attention uses ", attn.state_identity().describe());
}

}  // namespace detail

/// The causal read continuing `state`, as attn.prefill_into(state, Q, K, V, out) (same bits in
/// out and in the state afterwards), keeping the state before every chunk in `saved` for the
/// backward. Throws as prefill_into; `saved` is then left empty. Cost: the forward plus a copy
/// of r (dv + 1) scalars per chunk; `saved` is resized (allocated) only when its size changes.
template <class Phi, class Scalar, class DQ, class DK, class DV, class Out>
void prefill_saving_into(const LinearAttention<Phi, Scalar>& attn,
                         typename LinearAttention<Phi, Scalar>::State& state,
                         const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                         const Eigen::MatrixBase<DV>& V, Out&& out_arg,
                         SavedForward<Scalar>& saved) {
  Eigen::Ref<RowMatrix<Scalar>> out(out_arg);
  detail::check_forward_shapes(Q, K, V, out);
  const Phi& phi = attn.feature_map();
  const Index T = Q.rows(), dk = K.cols(), dv = V.cols(), r = phi.feature_dim(dk);
  state.check_shape(r, dk, dv);
  state.check_identity(attn.state_identity());
  state.check_room(T);
  constexpr bool log_scaled = LogScaledFeatureMap<Phi, Scalar>;
  const Index C = attn.chunk_size(r, dv), stride = detail::backward_chunk_size(attn, r, dv);
  detail::SavedForwardAccess::prepare(saved, T, stride, r, dk, dv, log_scaled,
                                      attn.state_identity());
  const detail::SaveChunkStates<Scalar> save{detail::SavedForwardAccess::data(saved), stride};
  const auto& Qm = detail::materialize(Q);
  const auto& Km = detail::materialize(K);
  const auto& Vm = detail::materialize(V);
  const Normalization& norm = attn.options().normalization;
  state.settle();
  auto& S = detail::StateAccess::S(state);
  auto& z = detail::StateAccess::z(state);
  auto& tokens = detail::StateAccess::tokens(state);
  if constexpr (log_scaled) {
    detail::log_domain_causal<Scalar>(phi, Qm, Km, Vm, S, z, detail::StateAccess::log_scale(state),
                                      tokens, C, out, norm, save);
  } else {
    const auto query = [&](Index) -> const auto& { return Qm; };
    const auto output = [&](Index) -> Eigen::Ref<RowMatrix<Scalar>> { return out; };
    detail::causal_chunked<Scalar>(phi, 1, query, Km, Vm, S, z, tokens, C, norm, output, save);
  }
  detail::stream_fence();
  detail::SavedForwardAccess::finish(saved, T);
}

/// attn.parallel_into(Q, K, V, Mask::causal, out) keeping the chunk-boundary states in `saved`
/// (same bits in out). A saved forward is causal: Mask::none throws std::invalid_argument (the
/// full read's backward needs nothing saved). Otherwise as prefill_saving_into.
template <class Phi, class Scalar, class DQ, class DK, class DV, class Out>
void parallel_saving_into(const LinearAttention<Phi, Scalar>& attn, const Eigen::MatrixBase<DQ>& Q,
                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, Mask mask,
                          Out&& out_arg, SavedForward<Scalar>& saved) {
  Eigen::Ref<RowMatrix<Scalar>> out(out_arg);
  if (mask != Mask::causal)
    throw std::invalid_argument(
        "parallel_saving_into: a saved forward is causal (Mask::causal); "
        "Mask::none needs nothing saved, use parallel_into");
  detail::check_forward_shapes(Q, K, V, out);
  auto state = attn.make_state(K.cols(), V.cols());
  prefill_saving_into(attn, state, Q, K, V, out, saved);
}

/// prefill_backward_into() from a saved forward: the gradients of the read `saved` was filled
/// by (continuing whatever state that forward started from), given dY and optionally the
/// gradient of the final state; `initial` gets the gradient of the forward's initial stored
/// state. The same results as prefill_backward_into from that initial state, without its sweep
/// that rebuilds the states (bit for bit where both use the register kernel; see
/// docs/gradients.md). Throws ShapeError naming the shapes when `saved` is not for T = Q.rows(),
/// this dk, dv, r; StateMismatchError when another attention filled it; DenominatorError as the
/// forward. Allocates one chunk's scratch (saved_backward_bytes), kept in `workspace` when
/// given (BackwardWorkspace).
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
void prefill_backward_into(const LinearAttention<Phi, Scalar>& attn,
                           const SavedForward<Scalar>& saved, const Eigen::MatrixBase<DQ>& Q,
                           const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                           const Eigen::MatrixBase<DY>& dY,
                           const std::type_identity_t<StateGradient<Scalar>>* final_gradient,
                           GradientsRef<Scalar> out, StateGradient<Scalar>& initial,
                           std::type_identity_t<BackwardWorkspace<Scalar>>* workspace = nullptr) {
  detail::require_differentiable<Phi, Scalar>();
  detail::check_backward_shapes(Q, K, V, dY, Mask::causal);
  const Index dk = K.cols(), dv = V.cols(), r = attn.feature_map().feature_dim(dk);
  detail::check_gradient_outputs(out, Q.rows(), K.rows(), dk, dv);
  detail::check_saved(attn, saved, Q, K, V);
  detail::check_final_gradient(final_gradient, r, dv);
  detail::BackwardBuffers<Scalar> call_only;
  detail::saved_causal_backward<Scalar>(
      attn.feature_map(), detail::materialize(Q), detail::materialize(K), detail::materialize(V),
      detail::materialize(dY), detail::SavedForwardAccess::data(saved), saved.chunk_size(),
      final_gradient != nullptr ? &final_gradient->S : nullptr,
      final_gradient != nullptr ? &final_gradient->z : nullptr, attn.options().normalization, out.Q,
      out.K, out.V, initial.S, initial.z,
      detail::buffers_of(workspace, call_only).additive_saved);
}

/// prefill_backward_into() from a saved forward, returning the gradients (and `initial`).
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
[[nodiscard]] Gradients<Scalar> prefill_backward(
    const LinearAttention<Phi, Scalar>& attn, const SavedForward<Scalar>& saved,
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DY>& dY, const StateGradient<Scalar>* final_gradient = nullptr) {
  detail::check_backward_shapes(Q, K, V, dY, Mask::causal);
  auto grads = detail::sized_gradients<Scalar>(Q.rows(), K.rows(), K.cols(), V.cols());
  prefill_backward_into(attn, saved, Q, K, V, dY, final_gradient, {grads.Q, grads.K, grads.V},
                        grads.initial);
  return grads;
}

/// parallel_backward_into() from a saved forward (Mask::causal only: std::invalid_argument
/// otherwise); `initial`, when not null, gets the initial state's gradient; `workspace` as in
/// prefill_backward_into.
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
void parallel_backward_into(const LinearAttention<Phi, Scalar>& attn,
                            const SavedForward<Scalar>& saved, const Eigen::MatrixBase<DQ>& Q,
                            const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                            Mask mask, const Eigen::MatrixBase<DY>& dY, GradientsRef<Scalar> out,
                            std::type_identity_t<StateGradient<Scalar>>* initial = nullptr,
                            std::type_identity_t<BackwardWorkspace<Scalar>>* workspace = nullptr) {
  if (mask != Mask::causal)
    throw std::invalid_argument("parallel_backward_into: a saved forward is causal (Mask::causal)");
  detail::UnreadStateGradient<Scalar> discarded(workspace);
  prefill_backward_into(attn, saved, Q, K, V, dY,
                        static_cast<const StateGradient<Scalar>*>(nullptr), out,
                        discarded.target(initial), workspace);
}

/// parallel_backward() from a saved forward: dQ, dK, dV and `initial` (Mask::causal only).
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
[[nodiscard]] Gradients<Scalar> parallel_backward(const LinearAttention<Phi, Scalar>& attn,
                                                  const SavedForward<Scalar>& saved,
                                                  const Eigen::MatrixBase<DQ>& Q,
                                                  const Eigen::MatrixBase<DK>& K,
                                                  const Eigen::MatrixBase<DV>& V, Mask mask,
                                                  const Eigen::MatrixBase<DY>& dY) {
  if (mask != Mask::causal)
    throw std::invalid_argument("parallel_backward: a saved forward is causal (Mask::causal)");
  return prefill_backward(attn, saved, Q, K, V, dY);
}

/// Bytes a SavedForward holds for T tokens of key dim dk and value dim dv with this attention's
/// backward chunk B: ceil(T / B) (r dv + r) scalars (+ ceil(T / B) for log-scaled maps).
/// r = dv = 128, float, T = 65,536: 135,266,304 (129 MiB) with the default B = 32.
template <class Phi, class Scalar>
[[nodiscard]] std::size_t saved_forward_bytes(const LinearAttention<Phi, Scalar>& attn, Index T,
                                              Index dk, Index dv) {
  const Index r = attn.feature_map().feature_dim(dk);
  return detail::ChunkStates<Scalar>::bytes_for(T, detail::backward_chunk_size(attn, r, dv), r, dv,
                                                LogScaledFeatureMap<Phi, Scalar>);
}

/// Bytes the backward from a saved forward allocates for itself (one chunk's scratch, with
/// row-major contiguous V and dY): causal_backward_bytes' per-call part, nothing per token.
template <class Phi, class Scalar>
[[nodiscard]] std::size_t saved_backward_bytes(const LinearAttention<Phi, Scalar>& attn, Index T,
                                               Index dk, Index dv) {
  const Index r = attn.feature_map().feature_dim(dk), C = detail::backward_chunk_size(attn, r, dv);
  return detail::BackwardScratch<Scalar>::bytes_for(
      std::min(T, C), C, r, dv, LogScaledFeatureMap<Phi, Scalar>, false, false, false);
}

}  // namespace linattn
