#pragma once
/// \file batch_state.hpp
/// Recurrent state of a batch of sequences for multi-head decoding: one AttentionState per
/// (sequence, state head), sequences added and dropped one at a time (continuous batching),
/// and the size accounting that compares the state with a K/V cache.
///
/// State heads: MultiHeadAttention keeps one state per key/value head (H_s = H_kv) for an
/// ordinary feature map, since the query heads of a group accumulate the same S and z, and
/// one per query head (H_s = H_q) for a log-scaled one (MultiHeadAttention::state_heads()).
///
/// Memory per sequence: H_s (r dv + r) scalars whatever the context length. A softmax model's
/// K/V cache holds H_kv (dk + dv) scalars per token, so it outgrows the state at
/// L = floor(H_s (r dv + r) / (H_kv (dk + dv))) + 1 tokens (kv_cache_crossover()); for
/// r = dk = dv = 128 and one head that is 16,512 scalars against 256 per token: 65 tokens,
/// whatever the number of query heads per key/value head when H_s = H_kv.

#include <linattn/errors.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace linattn {

/// The state of one sequence: one AttentionState per state head, all with the same (r, dk, dv).
template <class Scalar>
class SequenceState {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");

 public:
  SequenceState() = default;

  /// `heads` empty head states of feature dim r, key dim dk, value dim dv. O(heads r dv).
  /// `log_domain` as for AttentionState: true for a LogScaledFeatureMap (random features);
  /// `decode_block` as for AttentionState (LinearAttention::decode_block(r, dv) gives the layer's).
  SequenceState(Index heads, Index r, Index dk, Index dv, bool log_domain = false,
                Index decode_block = 0) {
    if (heads < 0)
      detail::throw_shape_error("a sequence state needs a non-negative head count, got ", heads);
    heads_.reserve(static_cast<std::size_t>(heads));
    for (Index h = 0; h < heads; ++h) heads_.emplace_back(r, dk, dv, log_domain, decode_block);
  }

  [[nodiscard]] Index heads() const noexcept { return static_cast<Index>(heads_.size()); }
  /// The state of state head h (key/value head h, or query head h for a log-scaled map; see
  /// the file comment). No bounds check beyond an assertion in debug builds.
  [[nodiscard]] AttentionState<Scalar>& head(Index h) noexcept {
    return heads_[static_cast<std::size_t>(h)];
  }
  [[nodiscard]] const AttentionState<Scalar>& head(Index h) const noexcept {
    return heads_[static_cast<std::size_t>(h)];
  }

  /// Tokens absorbed (by head 0; heads differ only after a rejected denominator).
  [[nodiscard]] Index tokens() const noexcept { return heads_.empty() ? 0 : heads_[0].tokens(); }

  /// Scalars that persist between tokens: heads * (r dv + r).
  [[nodiscard]] Index scalar_count() const noexcept {
    Index n = 0;
    for (const auto& s : heads_) n += s.scalar_count();
    return n;
  }

  /// Throws ShapeError unless this has `heads` heads of shape (r, dk, dv) and log domain
  /// `log_domain`.
  void check_shape(Index heads, Index r, Index dk, Index dv, bool log_domain = false) const {
    if (this->heads() != heads)
      detail::throw_shape_error("sequence state has ", this->heads(), " heads, expected ", heads);
    for (const auto& s : heads_) {
      s.check_shape(r, dk, dv);
      if (s.log_domain() != log_domain)
        detail::throw_shape_error("sequence state was made for ",
                                  s.log_domain() ? "a log-scaled" : "an ordinary",
                                  " feature map, this batch holds the other kind");
    }
  }

  /// Back to the empty state; keeps the allocations.
  void reset() noexcept {
    for (auto& s : heads_) s.reset();
  }

 private:
  std::vector<AttentionState<Scalar>> heads_;
};

/// A handle that names a sequence of a BatchState for as long as it stays in the batch.
using SequenceId = std::uint64_t;

/// The states of the sequences that are decoding together, in batch order.
///
/// Position i (0 <= i < size()) is the i-th batch row of a prefill or step call; ids are
/// stable handles that survive other sequences being added or dropped. Adding appends at the
/// end; dropping removes one position and shifts the later ones up by one (their states are
/// moved, never modified). Complexity: add O(heads r dv) (allocation), drop and index_of O(size()).
template <class Scalar>
class BatchState {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");

 public:
  using Sequence = SequenceState<Scalar>;

  /// A batch of `sequences` empty sequences, each with `heads` state heads of shape (r, dk, dv);
  /// `log_domain` for a LogScaledFeatureMap, `decode_block` for the deferred decode of each
  /// head state (MultiHeadAttention::make_state sets both).
  BatchState(Index heads, Index r, Index dk, Index dv, Index sequences = 0,
             bool log_domain = false, Index decode_block = 0)
      : heads_(heads), r_(r), dk_(dk), dv_(dv), decode_block_(decode_block),
        log_domain_(log_domain) {
    if (heads < 0 || r < 0 || dk < 0 || dv < 0 || sequences < 0)
      detail::throw_shape_error("batch state dimensions must be non-negative, got heads=", heads,
                                " r=", r, " dk=", dk, " dv=", dv, " sequences=", sequences);
    for (Index i = 0; i < sequences; ++i) add_sequence();
  }

  [[nodiscard]] Index size() const noexcept { return static_cast<Index>(sequences_.size()); }
  [[nodiscard]] bool empty() const noexcept { return sequences_.empty(); }
  [[nodiscard]] Index heads() const noexcept { return heads_; }
  [[nodiscard]] Index feature_dim() const noexcept { return r_; }
  [[nodiscard]] Index key_dim() const noexcept { return dk_; }
  [[nodiscard]] Index value_dim() const noexcept { return dv_; }
  /// Whether the states keep S and z log-scaled (see AttentionState::log_scale()).
  [[nodiscard]] bool log_domain() const noexcept { return log_domain_; }

  /// Appends an empty sequence; returns its id.
  SequenceId add_sequence() {
    return add_sequence(Sequence(heads_, r_, dk_, dv_, log_domain_, decode_block_));
  }

  /// Appends `sequence` (e.g. one prefilled alone, or restored from bytes); returns its id.
  /// Throws ShapeError if its heads or shapes differ from this batch's.
  SequenceId add_sequence(Sequence sequence) {
    sequence.check_shape(heads_, r_, dk_, dv_, log_domain_);
    sequences_.push_back(std::move(sequence));
    ids_.push_back(next_id_);
    return next_id_++;
  }

  /// Removes sequence `id`; the others keep their states and relative order.
  /// Throws std::out_of_range for an unknown id.
  void drop_sequence(SequenceId id) { static_cast<void>(take_sequence(id)); }

  /// Removes sequence `id` and returns its state (to park it or move it to another batch).
  Sequence take_sequence(SequenceId id) {
    const auto i = static_cast<std::size_t>(index_of(id));
    Sequence out = std::move(sequences_[i]);
    sequences_.erase(sequences_.begin() + static_cast<std::ptrdiff_t>(i));
    ids_.erase(ids_.begin() + static_cast<std::ptrdiff_t>(i));
    return out;
  }

  /// Batch position of sequence `id`. Throws std::out_of_range for an unknown id.
  [[nodiscard]] Index index_of(SequenceId id) const {
    const auto it = std::find(ids_.begin(), ids_.end(), id);
    if (it == ids_.end())
      throw std::out_of_range("linattn: no sequence with id " + std::to_string(id) +
                              " in this batch state");
    return static_cast<Index>(it - ids_.begin());
  }
  [[nodiscard]] bool contains(SequenceId id) const noexcept {
    return std::find(ids_.begin(), ids_.end(), id) != ids_.end();
  }

  /// Id of the sequence at batch position i. Throws std::out_of_range.
  [[nodiscard]] SequenceId id_at(Index i) const { return ids_.at(checked(i)); }
  /// State of the sequence at batch position i. Throws std::out_of_range.
  [[nodiscard]] Sequence& sequence(Index i) { return sequences_.at(checked(i)); }
  [[nodiscard]] const Sequence& sequence(Index i) const { return sequences_.at(checked(i)); }

  /// Bytes of state one sequence keeps: heads (r dv + r) sizeof(Scalar).
  [[nodiscard]] std::size_t bytes_per_sequence() const noexcept {
    return static_cast<std::size_t>(heads_ * (r_ * dv_ + r_)) * sizeof(Scalar);
  }

 private:
  static std::size_t checked(Index i) {
    if (i < 0) throw std::out_of_range("linattn: negative batch position");
    return static_cast<std::size_t>(i);
  }

  Index heads_ = 0, r_ = 0, dk_ = 0, dv_ = 0;
  Index decode_block_ = 0;
  bool log_domain_ = false;
  std::vector<Sequence> sequences_;
  std::vector<SequenceId> ids_;
  SequenceId next_id_ = 0;
};

/// State against K/V cache for one sequence of a model (per layer), in scalars.
struct StateFootprint {
  /// r dv + r: one head's state (16,512 for r = dv = 128).
  Index state_scalars_per_head = 0;
  /// H_s (r dv + r): what a BatchState keeps per sequence.
  Index state_scalars = 0;
  /// H_kv (dk + dv): what a softmax model's K/V cache adds per token.
  Index kv_scalars_per_token = 0;
  /// Smallest context length whose K/V cache holds more scalars than the state
  /// (state_scalars / kv_scalars_per_token + 1, integer division); 65 for one head of 128s.
  Index kv_cache_crossover = 0;
};

/// The footprint of H_s state heads with feature dim r (MultiHeadAttention::state_heads():
/// H_kv, or H_q for a log-scaled map) against a K/V cache of H_kv key/value heads of key dim
/// dk and value dim dv. Throws ShapeError on non-positive heads or dims. O(1).
[[nodiscard]] inline StateFootprint state_footprint(Index state_heads, Index kv_heads, Index r,
                                                    Index dk, Index dv) {
  if (state_heads < 1 || kv_heads < 1 || r < 1 || dk < 1 || dv < 1)
    detail::throw_shape_error("state_footprint needs positive heads and dims, got H_s=",
                              state_heads, " H_kv=", kv_heads, " r=", r, " dk=", dk, " dv=", dv);
  StateFootprint f;
  f.state_scalars_per_head = r * dv + r;
  f.state_scalars = state_heads * f.state_scalars_per_head;
  f.kv_scalars_per_token = kv_heads * (dk + dv);
  f.kv_cache_crossover = f.state_scalars / f.kv_scalars_per_token + 1;
  return f;
}

}  // namespace linattn
