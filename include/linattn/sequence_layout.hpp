#pragma once
/// \file sequence_layout.hpp
/// SequenceLayout: which rows of a [B, T, ...] view form each sequence of a multi-head call.
///   batch()          sequence b = all T rows of batch entry b (B sequences).
///   packed(offsets)  B = 1 and sequence s = rows [offsets[s], offsets[s+1]), offsets
///                    cumulative lengths starting at 0 and ending at T (fla's cu_seqlens).
///   padded(lengths)  sequence b = rows [0, lengths[b]) of batch entry b; rows at and after
///                    lengths[b] are padding: their keys, values and per-token inputs never
///                    enter any read or any state, their queries are not read, and their
///                    output rows are set to zero.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <cstddef>
#include <span>

namespace linattn {

/// Which rows of a view form each sequence. Non-owning: the spans must outlive the call.
class SequenceLayout {
 public:
  enum class Kind { batch, packed, padded };

  /// Every batch entry is one sequence of all T rows.
  [[nodiscard]] static SequenceLayout batch() { return SequenceLayout(Kind::batch, {}); }
  /// B = 1; sequence s is rows [offsets[s], offsets[s+1]); offsets.size() = sequences + 1.
  [[nodiscard]] static SequenceLayout packed(std::span<const Index> offsets) {
    return SequenceLayout(Kind::packed, offsets);
  }
  /// Sequence b is rows [0, lengths[b]) of batch entry b; lengths.size() = B.
  [[nodiscard]] static SequenceLayout padded(std::span<const Index> lengths) {
    return SequenceLayout(Kind::padded, lengths);
  }

  [[nodiscard]] Kind kind() const noexcept { return kind_; }
  [[nodiscard]] std::span<const Index> values() const noexcept { return values_; }

  /// Number of sequences in a view with B batch entries (after check()).
  [[nodiscard]] Index count(Index B) const noexcept {
    return kind_ == Kind::packed ? static_cast<Index>(values_.size()) - 1 : B;
  }
  /// Batch entry, first row and length of sequence s in a view of T rows (after check()).
  [[nodiscard]] Index batch_entry(Index s) const noexcept { return kind_ == Kind::packed ? 0 : s; }
  [[nodiscard]] Index first_row(Index s) const noexcept {
    return kind_ == Kind::packed ? at(s) : 0;
  }
  [[nodiscard]] Index length(Index s, Index T) const noexcept {
    switch (kind_) {
      case Kind::packed:
        return at(s + 1) - at(s);
      case Kind::padded:
        return at(s);
      case Kind::batch:
        break;
    }
    return T;
  }

  /// Throws ShapeError unless this layout fits a view of B entries and T rows.
  void check(Index B, Index T) const {
    check_entries(B);
    if (kind_ == Kind::packed) {
      if (values_.back() != T)
        detail::throw_shape_error("packed offsets must start at 0 and end at T=", T, ", got ",
                                  values_.size(), " offsets from ", values_.front(), " to ",
                                  values_.back());
    } else if (kind_ == Kind::padded) {
      for (std::size_t i = 0; i < values_.size(); ++i)
        if (values_[i] > T)
          detail::throw_shape_error("padded length ", values_[i], " of sequence ", i,
                                    " is outside [0, T=", T, "]");
    }
  }

  /// The checks of check() that do not need T (for a caller that learns T later, as the
  /// sequence-parallel layer learns the whole sequence's length from the other ranks): packed
  /// offsets start at 0, do not decrease, and B = 1; padded lengths number B and are >= 0.
  void check_entries(Index B) const {
    if (kind_ == Kind::packed) {
      if (B != 1)
        detail::throw_shape_error("a packed (offsets) layout needs batch size 1, got B=", B);
      if (values_.empty() || values_.front() != 0)
        detail::throw_shape_error("packed offsets must start at 0, got ", values_.size(),
                                  " offsets from ", values_.empty() ? -1 : values_.front());
      for (std::size_t i = 1; i < values_.size(); ++i)
        if (values_[i] < values_[i - 1])
          detail::throw_shape_error("packed offsets must not decrease, got ", values_[i - 1],
                                    " then ", values_[i], " at position ", i);
    } else if (kind_ == Kind::padded) {
      if (static_cast<Index>(values_.size()) != B)
        detail::throw_shape_error("padded layout has ", values_.size(),
                                  " lengths for batch size B=", B);
      for (std::size_t i = 0; i < values_.size(); ++i)
        if (values_[i] < 0)
          detail::throw_shape_error("padded length ", values_[i], " of sequence ", i,
                                    " is outside [0, T]");
    }
  }

 private:
  SequenceLayout(Kind kind, std::span<const Index> values) : kind_(kind), values_(values) {}
  [[nodiscard]] Index at(Index i) const noexcept { return values_[static_cast<std::size_t>(i)]; }

  Kind kind_ = Kind::batch;
  std::span<const Index> values_;
};

}  // namespace linattn
