#pragma once
// The causal backward from a saved forward (linattn/saved_forward.hpp): the chunk-boundary
// states come from the forward instead of a rebuilding sweep, so the backward is one reverse
// sweep over the chunks that does pass 1's and pass 2's work of detail::causal_backward on each
// chunk while its features and score blocks are at hand.

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/prefetch.hpp>
#include <linattn/detail/stream_store.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>
#include <optional>
#include <type_traits>

namespace linattn::detail {

/// The forward's state before each chunk c of C rows: S in rows [c r, (c + 1) r) of `states`
/// (chunks r x dv, the state's own row-major layout), z in row c of `sums` (chunks x r) and,
/// for log-scaled maps, the log-scale M in `log_scales(c)`.
template <class Scalar>
struct ChunkStates {
  RowMatrix<Scalar> states, sums;
  ColVector<Scalar> log_scales;

  /// Scalars kept for T tokens in chunks of C: ceil(T / C) (r dv + r (+ 1 when log_scaled)).
  [[nodiscard]] static std::size_t bytes_for(Index T, Index C, Index r, Index dv, bool log_scaled) {
    const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
    return static_cast<std::size_t>(chunks * (r * dv + r + (log_scaled ? 1 : 0))) * sizeof(Scalar);
  }
};

/// Gradients of the causal read whose chunk-boundary states `saved` holds (chunks of
/// `chunk_size` rows), given dY and the gradient (dS_T, dz_T) of the stored final state (null:
/// zero). Writes dQ, dK, dV and the gradient of the stored initial state into (dS0, dz0), as
/// causal_backward does and with its arithmetic: per chunk, from the last, chunk_query_gradients
/// and chunk_key_value_gradients run on one load of the chunk (features once per input, score
/// blocks once), with the state before the chunk read in place from `saved` (the left operand
/// of X^T = S dY^T; the next chunk's is prefetched while this one computes). Where the saved
/// states have the bits causal_backward rebuilds (the register forward and backward products),
/// the result is its result bit for bit. Per token about 8 r dv + C (3 r + 2 dv) flops plus one
/// evaluation of the feature map and its derivative per input; memory: BackwardScratch for one
/// chunk (O(C (r + C + dv) + r dv)), nothing per token, in `scratch` (kept: scratch_in).
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void saved_causal_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                           const ChunkStates<Scalar>& saved, Index chunk_size,
                           const RowMatrix<Scalar>* dS_T, const ColVector<Scalar>* dz_T,
                           const Normalization& norm, Eigen::Ref<RowMatrix<Scalar>> dQ,
                           Eigen::Ref<RowMatrix<Scalar>> dK, Eigen::Ref<RowMatrix<Scalar>> dV,
                           RowMatrix<Scalar>& dS0, ColVector<Scalar>& dz0,
                           std::optional<BackwardScratch<Scalar>>& scratch) {
  constexpr bool LogScaled = LogScaledFeatureMap<Phi, Scalar>;
  const Index T = Q.rows(), dv = V.cols(), r = saved.sums.cols();
  // One chunk of per-token (a, b, m): BackwardScratch sizes them by its first argument.
  BackwardScratch<Scalar>& w =
      scratch_in(scratch, std::min(T, chunk_size), chunk_size, r, dv, LogScaled,
                 !has_row_major_storage<DV>(), !has_row_major_storage<DY>(), false);
  const Index C = chunk_size;
  start_state_gradient(w, dS_T, dz_T);
  const Index last_first = T == 0 ? -1 : (T - 1) / C * C;
  for (Index first = last_first; first >= 0; first -= C) {
    const Index n = std::min(C, T - first), chunk = first / C;
    const Scalar* state = saved.states.data() + chunk * r * dv;
    // The chunk before this one: its input rows and its saved state, spread over this chunk's
    // products (prefetch_chunk_rows).
    prefetch_chunk_rows(w.prefetch, Q, K, V, dY, first - C, first > 0 ? C : 0);
    if (chunk > 0) w.prefetch.add(saved.states, (chunk - 1) * r, r);
    w.z = saved.sums.row(chunk).transpose();
    const Scalar M_before = LogScaled ? saved.log_scales(chunk) : Scalar(0);
    Scalar* m = LogScaled ? w.m.data() : nullptr;
    const ChunkRows<Scalar> c =
        load_chunk<Scalar, LogScaled>(w, phi, Q, K, V, dY, first, n, r, dv, M_before, m, true);
    chunk_query_gradients<Scalar, LogScaled>(w, phi, Q, c, r, dv, state, M_before, m, norm,
                                             w.a.data(), w.b.data(), dQ);
    chunk_key_value_gradients<Scalar, LogScaled>(w, phi, K, c, r, dv, M_before, m, w.a.data(),
                                                 w.b.data(), dK, dV);
  }
  dS0 = w.H;
  dz0 = w.hz;
}

}  // namespace linattn::detail
