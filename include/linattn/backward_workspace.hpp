#pragma once
/// \file backward_workspace.hpp
/// BackwardWorkspace: the buffers a backward keeps from one call to the next.
///
/// Every causal backward (Additive in gradients.hpp and saved_forward.hpp, the write rules in
/// rule_gradients.hpp and rule_saved_forward.hpp) works through per-chunk buffers: the chunk's
/// features, transposes and score blocks, the r x dv state and its gradient, 2 scalars per token
/// (a, b of the quotient rule), and for Delta and GatedDelta the rebuilt forward data (the state
/// before each chunk and each token's corrected values and state reads: r dv / C + 2 dv scalars
/// per token, 5 KiB per token at r = dv = 128 in float, C = 16). Without a workspace a call
/// allocates them and frees them on return. That is cheap for one long call but not for many
/// short ones (a packed batch's documents, one call per document and head): on a virtual machine
/// where glibc gives the freed top of the heap back to the kernel, every call then faults its
/// pages in again, and a layer backward over 16 or 64 packed documents took up to 2.7 x as long
/// (docs/gradients.md, "Keeping the buffers between calls").
///
/// Pass one to the *_into backward calls (the last argument) to keep them: a buffer is made when
/// the call's per-chunk shapes (chunk, r, dv, the feature map's kind) first appear, reused while
/// they stay, and its per-token parts grow to the longest call and never shrink; a call shorter
/// than one chunk runs in the buffers of a longer chunk. A reused buffer is zeroed where a new
/// one is zero, so a call returns the bits it returns without a workspace, whatever ran before
/// it (tests: rule_gradients_test.cpp, saved_forward_test.cpp), and once the workspace has
/// served a chunk shape its calls allocate nothing (allocation_test.cpp).
/// The multi-head layer's backward (multihead_gradients.hpp, multihead_saved_forward.hpp) takes
/// one too: it keeps one set of buffers per thread of the layer's executor (the workspace's
/// lanes), shared by the items that thread runs. So does the sequence-parallel layer backward
/// (mpi_gradients.hpp): with the pipeline schedule it also keeps the saved forwards of the items
/// that cross ranks and its messages. Without one, each of these calls keeps its buffers for the
/// call only.
/// Not shared between calls at once: two concurrent calls need two workspaces.

#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/channel_delta_backward.hpp>
#include <linattn/detail/delta_backward.hpp>
#include <linattn/detail/gated_backward.hpp>
#include <linattn/detail/saved_forward_data.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <vector>

namespace linattn {

namespace detail {

/// What a BackwardWorkspace holds, one slot per kernel: a call uses the slot of its rule.
template <class Scalar>
struct BackwardBuffers {
  std::optional<BackwardScratch<Scalar>> additive;          // causal_backward
  std::optional<BackwardScratch<Scalar>> additive_saved;    // saved_causal_backward
  GatedBackwardBuffers<Scalar> gated;                       // Decay, Gated
  DeltaSavedStates<Scalar> delta;                           // Delta, GatedDelta: rebuilt data
  DeltaForwardScratch<Scalar> delta_forward;                // their forward kernel (pass 1)
  std::optional<DeltaBackwardScratch<Scalar>> delta_sweep;  // their reverse sweep
  ChannelDeltaBackwardScratch<Scalar> channel_delta;        // per-channel GatedDelta
  RowMatrix<Scalar> start_S;  // the state a call starts from where the caller's is not stored
  ColVector<Scalar> start_z;  // as such (stateless: zero; pending decode tokens: S() folded)
  RowMatrix<Scalar> head_Q, head_K, head_V;  // a head's gradients before the model's rows (layer)
  ColVector<Scalar> inputs;  // and its per-token inputs' gradients (grown, never shrunk)
  RowMatrix<Scalar> group_S;  // a query head's share of its group's shared state gradient
  ColVector<Scalar> group_z;  // (layer)
  RowMatrix<Scalar> unread_S;  // the initial-state gradient of a stateless call that does
  ColVector<Scalar> unread_z;  // not ask for it (detail::UnreadStateGradient)
  // The sequence-parallel backward's pipeline (detail/mpi_backward_pipeline.hpp): the saved
  // forwards of the items that cross ranks (one per message slot, reused while its rows keep
  // their length) and its messages (grown, never shrunk).
  std::vector<SavedForward<Scalar>> crossing_saved;
  std::vector<Scalar> messages;

  /// start_S, start_z: the zero initial state (S r x dv, z length r) of a stateless call.
  void zero_start(Index r, Index dv) {
    start_S.setZero(r, dv);
    start_z.setZero(r);
  }

  /// head_Q, head_K, head_V with at least q_rows, k_rows, k_rows rows of dk, dk, dv columns
  /// (grown, never shrunk: a caller takes their top rows).
  void fit_heads(Index q_rows, Index k_rows, Index dk, Index dv) {
    const auto fit = [](RowMatrix<Scalar>& m, Index rows, Index cols) {
      if (m.rows() < rows || m.cols() != cols) m.resize(std::max(rows, m.rows()), cols);
    };
    fit(head_Q, q_rows, dk);
    fit(head_K, k_rows, dk);
    fit(head_V, k_rows, dv);
  }

  /// Bytes held now.
  [[nodiscard]] std::size_t bytes() const noexcept {
    const auto held = [](const std::optional<BackwardScratch<Scalar>>& scratch) {
      return scratch ? static_cast<Index>(scratch->bytes() / sizeof(Scalar)) : Index{0};
    };
    const Index scalars = held(additive) + held(additive_saved) + delta.states.size() +
                          delta.corrected.size() + delta.reads.size() +
                          delta_forward.scalars() +
                          (delta_sweep ? delta_sweep->scalars() : 0) + start_S.size() +
                          start_z.size() + head_Q.size() + head_K.size() + head_V.size() +
                          inputs.size() +
                          group_S.size() + group_z.size() + unread_S.size() + unread_z.size() +
                          static_cast<Index>(messages.size());
    std::size_t saved = 0;
    for (const auto& forward : crossing_saved) saved += forward.bytes();
    return static_cast<std::size_t>(scalars) * sizeof(Scalar) + gated.bytes() + saved +
           channel_delta.bytes();
  }
};

struct BackwardWorkspaceAccess;

}  // namespace detail

/// Buffers a backward keeps from one call to the next (see the file comment): pass a pointer to
/// one as the last argument of parallel_backward_into / prefill_backward_into (null: a call
/// without one). Memory: what the calls it served allocate, at the largest of their sizes (a
/// layer call on n threads: n sets of one item's buffers).
template <class Scalar>
class BackwardWorkspace {
 public:
  /// Bytes held now, every lane's (0 until a backward has used it).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = buffers_.bytes();
    for (const auto& lane : lanes_) total += lane.bytes();
    return total;
  }
  /// Frees what it holds.
  void release() noexcept {
    buffers_ = detail::BackwardBuffers<Scalar>{};
    lanes_.clear();
  }

 private:
  friend struct detail::BackwardWorkspaceAccess;
  detail::BackwardBuffers<Scalar> buffers_;
  // Lanes 1, 2, ... of a layer call on several threads (lane 0 is this object's own buffers).
  std::vector<BackwardWorkspace> lanes_;
};

namespace detail {

struct BackwardWorkspaceAccess {
  template <class Scalar>
  static BackwardBuffers<Scalar>& buffers(BackwardWorkspace<Scalar>& w) noexcept {
    return w.buffers_;
  }
  /// Makes `w` hold at least `count` lanes (before the threads that use them start).
  template <class Scalar>
  static void fit_lanes(BackwardWorkspace<Scalar>& w, int count) {
    if (count > 1 && w.lanes_.size() < static_cast<std::size_t>(count - 1))
      w.lanes_.resize(static_cast<std::size_t>(count - 1));
  }
  /// Lane p (< the count fit_lanes made): a workspace of its own for one thread of a call.
  template <class Scalar>
  static BackwardWorkspace<Scalar>& lane(BackwardWorkspace<Scalar>& w, int p) noexcept {
    return p == 0 ? w : w.lanes_[static_cast<std::size_t>(p - 1)];
  }
};

/// The buffers of `workspace`, or `call_only` (the call's own) where it is null.
template <class Scalar>
BackwardBuffers<Scalar>& buffers_of(BackwardWorkspace<Scalar>* workspace,
                                    BackwardBuffers<Scalar>& call_only) noexcept {
  return workspace != nullptr ? BackwardWorkspaceAccess::buffers(*workspace) : call_only;
}

}  // namespace detail

}  // namespace linattn
