#pragma once
// SavedForward (the chunk-boundary states one causal forward keeps for its backward) and the
// access its filling forwards use. Public through linattn/saved_forward.hpp; defined here so
// that BackwardWorkspace (linattn/backward_workspace.hpp) can keep saved forwards of its own
// (the sequence-parallel backward's) without the saving forwards' code.

#include <linattn/detail/delta_backward.hpp>
#include <linattn/detail/huge_pages.hpp>
#include <linattn/detail/saved_backward.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/types.hpp>

#include <cstddef>

namespace linattn {

namespace detail {
struct SavedForwardAccess;
}

/// The chunk-boundary states of one causal forward (linattn/saved_forward.hpp's file comment):
/// the stored S (r x dv) and z (r) before each backward chunk of chunk_size() rows (B, a
/// multiple of the forward's chunk), and for log-scaled maps their log-scale.
/// Filled by parallel_saving_into / prefill_saving_into; read by saved_forward.hpp's backward
/// overloads (and rule_saved_forward.hpp's; for Delta and GatedDelta the saved data is the forward
/// kernel's, kept apart: chunks() is 0 and bytes() counts it).
/// Empty (tokens() == 0, no chunks) until filled; a forward that throws leaves it empty.
template <class Scalar>
class SavedForward {
 public:
  /// Tokens of the forward that filled it.
  [[nodiscard]] Index tokens() const noexcept { return tokens_; }
  [[nodiscard]] Index chunk_size() const noexcept { return chunk_size_; }
  [[nodiscard]] Index chunks() const noexcept { return data_.sums.rows(); }
  [[nodiscard]] Index feature_dim() const noexcept { return data_.sums.cols(); }
  [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
  [[nodiscard]] Index value_dim() const noexcept { return data_.states.cols(); }
  /// S before chunk c: rows [c r, (c + 1) r) of this (chunks() r) x dv matrix.
  [[nodiscard]] const RowMatrix<Scalar>& states() const noexcept { return data_.states; }
  /// z before chunk c: row c of this chunks() x r matrix.
  [[nodiscard]] const RowMatrix<Scalar>& normalizers() const noexcept { return data_.sums; }
  /// The log-scale M before chunk c (log-scaled maps; empty otherwise).
  [[nodiscard]] const ColVector<Scalar>& log_scales() const noexcept { return data_.log_scales; }
  /// Bytes held: chunks() (r dv + r (+ 1 for log-scaled maps)) scalars.
  [[nodiscard]] std::size_t bytes() const noexcept {
    return static_cast<std::size_t>(data_.states.size() + data_.sums.size() +
                                    data_.log_scales.size() + delta_.states.size() +
                                    delta_.corrected.size() + delta_.reads.size()) *
           sizeof(Scalar);
  }

 private:
  friend struct detail::SavedForwardAccess;
  detail::ChunkStates<Scalar> data_;
  // The delta rules' saved data (linattn/rule_saved_forward.hpp); then data_ is empty.
  detail::DeltaSavedStates<Scalar> delta_;
  Index tokens_ = 0, chunk_size_ = 0, key_dim_ = 0;
  detail::StateIdentity identity_;
};

namespace detail {

struct SavedForwardAccess {
  template <class Scalar>
  static ChunkStates<Scalar>& data(SavedForward<Scalar>& s) noexcept {
    return s.data_;
  }
  template <class Scalar>
  static const ChunkStates<Scalar>& data(const SavedForward<Scalar>& s) noexcept {
    return s.data_;
  }
  template <class Scalar>
  static const StateIdentity& identity(const SavedForward<Scalar>& s) noexcept {
    return s.identity_;
  }
  /// Sizes `s` for T tokens (allocating only when the size changes) and marks it empty.
  template <class Scalar>
  static void prepare(SavedForward<Scalar>& s, Index T, Index C, Index r, Index dk, Index dv,
                      bool log_scaled, const StateIdentity& identity) {
    mark_empty(s, C, dk, identity);
    size_chunk_states(s, T == 0 ? 0 : (T + C - 1) / C, r, dv, log_scaled);
    s.delta_.resize(0, C, r, dv);
  }
  template <class Scalar>
  static detail::DeltaSavedStates<Scalar>& delta(SavedForward<Scalar>& s) noexcept {
    return s.delta_;
  }
  template <class Scalar>
  static const detail::DeltaSavedStates<Scalar>& delta(const SavedForward<Scalar>& s) noexcept {
    return s.delta_;
  }
  /// As prepare, for the delta rules' data (chunks of C rows, per-token rows unless not
  /// `per_token`: per-channel GatedDelta); the chunk-state
  /// matrices keep only their widths (feature_dim(), value_dim()).
  /// The delta data is resized in place (not emptied first): a saved forward reused for inputs
  /// of the same size allocates nothing.
  template <class Scalar>
  static void prepare_delta(SavedForward<Scalar>& s, Index T, Index C, Index r, Index dk, Index dv,
                            const StateIdentity& identity, bool per_token = true) {
    mark_empty(s, C, dk, identity);
    size_chunk_states(s, 0, r, dv, false);
    s.delta_.resize(T, C, r, dv, per_token);
  }
  template <class Scalar>
  static void finish(SavedForward<Scalar>& s, Index T) noexcept {
    s.tokens_ = T;
  }

 private:
  template <class Scalar>
  static void size_chunk_states(SavedForward<Scalar>& s, Index chunks, Index r, Index dv,
                                bool log_scaled) {
    detail::resize_with_huge_pages(s.data_.states, chunks * r, dv);
    s.data_.sums.resize(chunks, r);
    s.data_.log_scales.resize(log_scaled ? chunks : 0);
  }
  template <class Scalar>
  static void mark_empty(SavedForward<Scalar>& s, Index C, Index dk,
                         const StateIdentity& identity) {
    s.tokens_ = 0;
    s.chunk_size_ = C;
    s.key_dim_ = dk;
    s.identity_ = identity;
  }
};

}  // namespace detail

}  // namespace linattn
