#pragma once
/// \file batch_state.hpp
/// Recurrent state of a batch of sequences for multi-head decoding: one head state per
/// (sequence, state head), sequences added and dropped one at a time (continuous batching),
/// and the size accounting that compares the state with a K/V cache. HeadState is the state of
/// the layer's attention (AttentionState for Additive, RuleState for the other rules).
///
/// State heads: MultiHeadAttention keeps one state per value head (H_s = H_v, which is H_kv
/// unless values are grouped), since the query heads of a group accumulate the same sums,
/// except for random features under the additive rule (log-scaled maps), which keep one per
/// output head (H_s = max(H_q, H_v)).
///
/// Memory per sequence: H_s (r dv + r) scalars (r dv for the delta rules) whatever the context
/// length. A softmax model's K/V cache holds H_kv dk + H_v dv scalars per token, so it outgrows
/// the state at L = floor(H_s (r dv + r) / (H_kv dk + H_v dv)) + 1 tokens; for
/// r = dk = dv = 128 and one head that is 16,512 scalars against 256 per token: 65 tokens.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace linattn {

/// The state of one sequence: one head state per state head, all of one shape and identity.
template <class HeadState>
class SequenceState {
 public:
  SequenceState() = default;

  /// `heads` copies of the empty state `empty`. O(heads r dv).
  SequenceState(Index heads, const HeadState& empty) {
    if (heads < 0)
      detail::throw_shape_error("a sequence state needs a non-negative head count, got ", heads);
    heads_.assign(static_cast<std::size_t>(heads), empty);
  }

  [[nodiscard]] Index heads() const noexcept { return static_cast<Index>(heads_.size()); }
  /// The state of state head h. Throws std::out_of_range.
  [[nodiscard]] HeadState& head(Index h) { return heads_.at(checked(h)); }
  [[nodiscard]] const HeadState& head(Index h) const { return heads_.at(checked(h)); }

  /// Tokens absorbed (by head 0; heads differ only after a rejected denominator).
  [[nodiscard]] Index tokens() const noexcept { return heads_.empty() ? 0 : heads_[0].tokens(); }

  /// Scalars that persist between tokens, summed over heads.
  [[nodiscard]] Index scalar_count() const noexcept {
    Index n = 0;
    for (const auto& s : heads_) n += s.scalar_count();
    return n;
  }

  /// Throws ShapeError or StateMismatchError unless this has `heads` heads each of the dims
  /// and identity of `prototype`.
  void check_like(Index heads, const HeadState& prototype) const {
    if (this->heads() != heads)
      detail::throw_shape_error("sequence state has ", this->heads(), " heads, expected ", heads);
    for (const auto& s : heads_) prototype.check_like(s);
  }

  /// Back to the empty state; keeps the allocations.
  void reset() noexcept {
    for (auto& s : heads_) s.reset();
  }

 private:
  static std::size_t checked(Index h) {
    if (h < 0) throw std::out_of_range("linattn: negative head index");
    return static_cast<std::size_t>(h);
  }

  std::vector<HeadState> heads_;
};

/// A handle that names a sequence of a BatchState for as long as it stays in the batch.
using SequenceId = std::uint64_t;

/// The states of the sequences that are decoding together, in batch order.
///
/// Position i (0 <= i < size()) is the i-th batch row of a prefill or step call; ids are
/// stable handles that survive other sequences being added or dropped. Adding appends at the
/// end; dropping removes one position and shifts the later ones up by one (their states are
/// moved, never modified). Complexity: add O(heads r dv) (allocation), drop and index_of
/// O(size()).
template <class HeadState>
class BatchState {
 public:
  using Sequence = SequenceState<HeadState>;
  using head_state_type = HeadState;

  /// A batch of `sequences` empty sequences of `heads` state heads, each a copy of `empty` (an
  /// empty state of the layer's attention; MultiHeadAttention::make_state makes both).
  BatchState(Index heads, HeadState empty, Index sequences = 0)
      : heads_(heads), empty_(std::move(empty)) {
    if (heads < 0 || sequences < 0)
      detail::throw_shape_error("batch state needs non-negative heads and sequences, got heads=",
                                heads, " sequences=", sequences);
    empty_.reset();
    for (Index i = 0; i < sequences; ++i) add_sequence();
  }

  [[nodiscard]] Index size() const noexcept { return static_cast<Index>(sequences_.size()); }
  [[nodiscard]] bool empty() const noexcept { return sequences_.empty(); }
  [[nodiscard]] Index heads() const noexcept { return heads_; }
  [[nodiscard]] Index feature_dim() const noexcept { return empty_.feature_dim(); }
  [[nodiscard]] Index key_dim() const noexcept { return empty_.key_dim(); }
  [[nodiscard]] Index value_dim() const noexcept { return empty_.value_dim(); }
  /// An empty head state of this batch: its dims, identity and decode block.
  [[nodiscard]] const HeadState& empty_head() const noexcept { return empty_; }

  /// Appends an empty sequence; returns its id.
  SequenceId add_sequence() { return add_sequence(Sequence(heads_, empty_)); }

  /// Appends `sequence` (e.g. one prefilled alone, or restored from bytes); returns its id.
  /// Throws ShapeError or StateMismatchError if its heads, shapes or identity differ.
  SequenceId add_sequence(Sequence sequence) {
    sequence.check_like(heads_, empty_);
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

  /// Bytes of state one sequence keeps: heads scalar_count() sizeof(Scalar).
  [[nodiscard]] std::size_t bytes_per_sequence() const noexcept {
    return static_cast<std::size_t>(heads_ * empty_.scalar_count()) *
           sizeof(typename HeadState::scalar_type);
  }

 private:
  static std::size_t checked(Index i) {
    if (i < 0) throw std::out_of_range("linattn: negative batch position");
    return static_cast<std::size_t>(i);
  }

  Index heads_ = 0;
  HeadState empty_;
  std::vector<Sequence> sequences_;
  std::vector<SequenceId> ids_;
  SequenceId next_id_ = 0;
};

/// State against K/V cache for one sequence of a model (per layer), in scalars.
struct StateFootprint {
  /// One head's state: r dv + r (r dv for the delta rules); 16,512 for r = dv = 128.
  Index state_scalars_per_head = 0;
  /// H_s times that: what a BatchState keeps per sequence.
  Index state_scalars = 0;
  /// H_kv dk + H_v dv (H_kv (dk + dv) unless values are grouped): what a softmax model's K/V
  /// cache adds per token.
  Index kv_scalars_per_token = 0;
  /// Smallest context length whose K/V cache holds more scalars than the state
  /// (state_scalars / kv_scalars_per_token + 1, integer division); 65 for one head of 128s.
  Index kv_cache_crossover = 0;
};

/// The footprint of H_s state heads with feature dim r against a K/V cache of H_kv key heads
/// of dim dk and H_v value heads of dim dv (value_heads; 0: H_kv); `keeps_z` adds r per head.
/// Throws ShapeError on non-positive heads or dims, or sizes that do not fit an Index. O(1).
[[nodiscard]] inline StateFootprint state_footprint(Index state_heads, Index kv_heads, Index r,
                                                    Index dk, Index dv, bool keeps_z = true,
                                                    Index value_heads = 0) {
  if (value_heads == 0) value_heads = kv_heads;
  if (state_heads < 1 || kv_heads < 1 || r < 1 || dk < 1 || dv < 1 || value_heads < 1)
    detail::throw_shape_error("state_footprint needs positive heads and dims, got H_s=",
                              state_heads, " H_kv=", kv_heads, " r=", r, " dk=", dk, " dv=", dv,
                              " H_v=", value_heads);
  StateFootprint f;
  f.state_scalars_per_head =
      detail::checked_sum(detail::checked_product(r, dv, "r x dv"), keeps_z ? r : 0, "r dv + r");
  f.state_scalars = detail::checked_product(state_heads, f.state_scalars_per_head, "H_s (r dv + r)");
  f.kv_scalars_per_token =
      detail::checked_sum(detail::checked_product(kv_heads, dk, "H_kv dk"),
                          detail::checked_product(value_heads, dv, "H_v dv"), "H_kv dk + H_v dv");
  f.kv_cache_crossover = f.state_scalars / f.kv_scalars_per_token + 1;
  return f;
}

}  // namespace linattn
