#pragma once
/// \file state.hpp
/// The fixed-size recurrent state of one head: S = sum phi(k) v^T (r x dv) and z = sum phi(k) (r).
///
/// The state is a compressed summary, not a copy of the K/V list: different histories can give
/// the same S and z. It holds exactly what the normalized causal read needs for the chosen
/// kernel, y = phi(q)^T S / phi(q)^T z, in r*dv + r scalars whatever the context length.

#include <linattn/detail/deferred.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <limits>

namespace linattn {

/// Recurrent state of one head plus the scratch a decode step needs, so that step() never
/// allocates. Create it with LinearAttention::make_state(dk, dv).
///
/// Deferred decode: a state made with decode_block B > 1 (Options::decode_block; by default 16
/// where S is larger than 32 KiB) lets step() and absorb() collect up to B tokens beside S and
/// fold them into S together (see LinearAttention::step_into); S() and the serialized state always include them, and every
/// other path folds them first. They take B (2 r + dv + 1) more scalars (the tokens, and
/// scratch for the fold and the read), which scalar_count() does not count: the pending tokens
/// are part of S, only not yet added.
/// Aligned to 128 bytes: each step writes the state object (token count, z buffers), so states
/// of heads that different threads decode must not share a cache line, nor the pair of lines
/// x86 cores prefetch together; in a std::vector they then never do.
template <class Scalar>
class alignas(kStateAlignment) AttentionState : public detail::StateCore<Scalar> {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  using Core = detail::StateCore<Scalar>;

 public:
  AttentionState() = default;

  /// An empty (all-zero) state for feature dimension r, key dimension dk, value dimension dv.
  /// `log_domain` (set by LinearAttention for a LogScaledFeatureMap) makes the empty state's
  /// log_scale() -infinity instead of 0. Throws ShapeError for a negative dim.
  /// `decode_block` is B above (0 or 1: fold every token at once; ignored when log_domain).
  AttentionState(Index r, Index dk, Index dv, bool log_domain = false, Index decode_block = 0)
      : Core(r, dk, dv, true),
        query_row_(1, dk),
        key_row_(1, dk),
        value_row_(1, dv),
        query_features_(1, r),
        key_features_(1, r),
        z_next_(r),
        pending_(log_domain ? 0 : decode_block, r, dv),
        log_scale_(empty_log_scale(log_domain)),
        log_domain_(log_domain) {}

  // tokens(), the dims, scalar_count() (r*dv + r: 16,512 for r = dv = 128) and check_shape()
  // come from detail::StateCore.

  /// S: r x dv, the sum of phi(k) v^T over all absorbed tokens, pending ones included. A copy,
  /// O(r dv (1 + B)): for inspection and saving, not for per-token use.
  [[nodiscard]] RowMatrix<Scalar> S() const {
    RowMatrix<Scalar> full = this->S_;
    const Index n = pending_.count;
    if (n > 0) full.noalias() += pending_.keys.topRows(n).transpose() * pending_.values.topRows(n);
    return full;
  }
  /// S without the pending tokens (what the state stores; equals S() when none is pending).
  [[nodiscard]] const RowMatrix<Scalar>& stored_S() const noexcept { return this->S_; }
  /// Writable S, for loading a saved state (folds pending tokens first); its shape must not
  /// change.
  [[nodiscard]] Eigen::Ref<RowMatrix<Scalar>> mutable_S() noexcept {
    settle();
    return this->S_;
  }

  /// Folds the pending tokens into S (O(pending r dv)); S() is then this->S_ without a copy.
  /// Nothing observable changes except rounding in later reads: the paths call it themselves.
  void settle() noexcept { detail::fold_pending(this->S_, pending_); }
  /// Tokens absorbed but not yet added to the stored S (0 <= n <= decode_block(); a full block
  /// is folded when the next token arrives).
  [[nodiscard]] Index pending_tokens() const noexcept { return pending_.count; }
  /// B: how many tokens step() collects before folding them into S; 0 when it folds each one.
  [[nodiscard]] Index decode_block() const noexcept { return pending_.capacity; }
  /// The pending tokens' key features, one row per token (pending_tokens() x r).
  [[nodiscard]] auto pending_key_features() const noexcept {
    return pending_.keys.topRows(pending_.count);
  }
  /// The pending tokens' values, one row per token (pending_tokens() x dv).
  [[nodiscard]] auto pending_values() const noexcept {
    return pending_.values.topRows(pending_.count);
  }
  /// Appends one pending token (key features kf, length r; value v, length dv), for loading a
  /// saved state; a full block is folded into S first, and a state without one (B <= 1) adds
  /// the token to S. Does not change tokens() or z. Throws ShapeError for wrong lengths.
  template <class Dk, class Dv>
  void load_pending_token(const Eigen::MatrixBase<Dk>& kf, const Eigen::MatrixBase<Dv>& v) {
    if (kf.size() != this->feature_dim() || v.size() != this->value_dim() ||
        (kf.rows() != 1 && kf.cols() != 1) || (v.rows() != 1 && v.cols() != 1))
      detail::throw_shape_error("a pending token needs key features of length r = ",
                                this->feature_dim(), " and a value of length dv = ",
                                this->value_dim(), ", got ", kf.rows(), "x", kf.cols(), " and ",
                                v.rows(), "x", v.cols());
    if (pending_.capacity == 0) {
      this->S_.noalias() += kf.reshaped() * v.reshaped().transpose();
      return;
    }
    if (pending_.count == pending_.capacity) settle();  // as the next step would
    const Index j = pending_.count++;
    pending_.keys.row(j) = kf.reshaped().transpose();
    pending_.values.row(j) = v.reshaped().transpose();
  }

  /// z = sum over absorbed tokens of phi(k); length r.
  [[nodiscard]] const ColVector<Scalar>& z() const noexcept { return this->z_; }
  /// Writable z, for loading a saved state; its length must not change.
  [[nodiscard]] Eigen::Ref<ColVector<Scalar>> mutable_z() noexcept { return this->z_; }

  /// M: S() and z() hold the true sums divided by exp(M), i.e. true S = exp(M) S(). Always 0
  /// for ordinary feature maps. For a LogScaledFeatureMap it is the running maximum of the
  /// absorbed keys' log-scales (-infinity while empty), so stored entries never overflow.
  [[nodiscard]] Scalar log_scale() const noexcept { return log_scale_; }
  /// Sets M, for loading a saved state together with mutable_S() and mutable_z().
  void set_log_scale(Scalar m) noexcept { log_scale_ = m; }
  /// Whether this state keeps S and z log-scaled (made for a LogScaledFeatureMap).
  [[nodiscard]] bool log_domain() const noexcept { return log_domain_; }

  /// Back to the empty state; keeps the allocation.
  void reset() noexcept {
    this->reset_sums();
    pending_.count = 0;
    log_scale_ = empty_log_scale(log_domain_);
  }

 private:
  template <class, class>
  friend class LinearAttention;

  static Scalar empty_log_scale(bool log_domain) noexcept {
    return log_domain ? -std::numeric_limits<Scalar>::infinity() : Scalar(0);
  }

  // Per-token scratch for step(): sized once, reused, never part of the state's value.
  RowMatrix<Scalar> query_row_, key_row_, value_row_;
  RowMatrix<Scalar> query_features_, key_features_;
  ColVector<Scalar> z_next_;
  // Tokens of a deferred decode not yet in S_: part of the state's value.
  detail::PendingTokens<Scalar> pending_;

  Scalar log_scale_ = 0;
  bool log_domain_ = false;
};

/// Scratch of one reader of a state (LinearAttention::read_into): the query row, its features
/// and the scores against pending tokens. Readers that share one state (grouped-query heads,
/// threads) each need their own; reading then allocates nothing. Make it with
/// LinearAttention::make_read_scratch(dk, dv).
template <class Scalar>
class ReadScratch {
 public:
  ReadScratch() = default;
  /// Room for queries of dimension dk, features of dimension r and `block` pending tokens.
  ReadScratch(Index dk, Index r, Index block)
      : query_row_(1, dk), query_features_(1, r), scores_(std::max<Index>(block, 1)) {}

 private:
  template <class, class>
  friend class LinearAttention;

  RowMatrix<Scalar> query_row_, query_features_;
  RowVector<Scalar> scores_;
};

}  // namespace linattn
