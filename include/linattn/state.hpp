#pragma once
/// \file state.hpp
/// AttentionState: the fixed-size recurrent state of one head under the additive rule,
/// S = sum phi(k) v^T (r x dv) and z = sum phi(k) (r).
///
/// The state is a compressed summary, not a copy of the K/V list: different histories can give
/// the same S and z. It holds exactly what the normalized causal read needs for the chosen
/// kernel, y = phi(q)^T S / phi(q)^T z, in r*dv + r scalars whatever the context length.

#include <linattn/detail/deferred.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <limits>

namespace linattn {

/// Recurrent state of one head plus the scratch a decode step needs, so that step() never
/// allocates. Create it with make_state(dk, dv) of the attention that will use it; a state
/// remembers the feature map and rule that made it (identity()) and other attentions refuse it.
///
/// Deferred decode: a state made with decode block B > 1 (Options::decode_block) lets step()
/// and absorb() collect up to B tokens beside S and fold them into S together (a full block
/// folds when the next token arrives). S() and a saved state always include them, and every
/// other path folds them first. They take B (2 r + dv + 1) more scalars, which scalar_count()
/// does not count: the pending tokens are part of S, only not yet added. B belongs to the state
/// (a restored state keeps the B it was saved with), so a state continues with the same bits
/// whichever attention options step it.
/// Aligned to 128 bytes: each step writes the state object (token count, z buffers), so states
/// of heads that different threads decode must not share a cache line, nor the pair of lines
/// x86 cores prefetch together; in a std::vector they then never do.
template <class Scalar>
class alignas(kStateAlignment) AttentionState : public detail::StateCore<Scalar> {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  using Core = detail::StateCore<Scalar>;

 public:
  AttentionState() = default;

  /// An empty (all-zero) state for feature dimension r, key dimension dk, value dimension dv,
  /// made for `identity`. `log_domain` (for a LogScaledFeatureMap) makes the empty state's
  /// log_scale() -infinity instead of 0. `decode_block` is B above (0 or 1: fold every token
  /// at once; ignored when log_domain). Throws ShapeError unless r, dk, dv >= 1.
  AttentionState(Index r, Index dk, Index dv, const detail::StateIdentity& identity,
                 bool log_domain = false, Index decode_block = 0)
      : Core(r, dk, dv, true, identity),
        pending_(log_domain ? 0 : decode_block, r, dv),
        log_scale_(empty_log_scale(log_domain)),
        log_domain_(log_domain) {}

  // tokens(), the dims, scalar_count() (r*dv + r: 16,512 for r = dv = 128), identity() and
  // check_shape() come from detail::StateCore.

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

  /// Folds the pending tokens into S (O(pending r dv)). Nothing observable changes except
  /// rounding in later reads: the paths call it themselves.
  void settle() noexcept { detail::fold_pending(this->S_, pending_); }
  /// Tokens absorbed but not yet added to the stored S (0 <= n <= decode_block()).
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

  /// z = sum over absorbed tokens of phi(k); length r.
  [[nodiscard]] const ColVector<Scalar>& z() const noexcept { return this->z_; }

  /// M: S() and z() hold the true sums divided by exp(M), i.e. true S = exp(M) S(). Always 0
  /// for ordinary feature maps. For a LogScaledFeatureMap it is the running maximum of the
  /// absorbed keys' log-scales (-infinity while empty), so stored entries never overflow.
  [[nodiscard]] Scalar log_scale() const noexcept { return log_scale_; }
  /// Whether this state keeps S and z log-scaled (made for a LogScaledFeatureMap).
  [[nodiscard]] bool log_domain() const noexcept { return log_domain_; }

  /// Sets the state to S (r x dv) and z (length r) with `tokens` absorbed tokens and no pending
  /// token: a carried or learned initial state. For a log-scaled state S and z are the stored
  /// sums at log-scale M = `log_scale` (true S = exp(M) S); an ordinary state takes M = 0 only.
  /// Throws ShapeError for other shapes or a count outside [0, 2^62], std::invalid_argument for
  /// NaN or Inf in S or z (or a value beyond the range of Scalar, which would become Inf), or an
  /// M this state cannot hold; the state is unchanged then. O(r dv).
  template <class DS, class DZ>
  void assign(const Eigen::MatrixBase<DS>& S, const Eigen::MatrixBase<DZ>& z, Index tokens = 0,
              Scalar log_scale = 0) {
    if (!(log_domain_ ? std::isfinite(log_scale) : log_scale == 0))
      throw std::invalid_argument("linattn: assign() needs a finite log-scale for a log-scaled "
                                  "state and 0 otherwise");
    this->assign_sums(S, z, tokens);
    pending_.count = 0;
    log_scale_ = log_scale;
  }

  /// Back to the empty state; keeps the allocation and the decode block.
  void reset() noexcept {
    this->reset_sums();
    pending_.count = 0;
    log_scale_ = empty_log_scale(log_domain_);
  }

 private:
  friend struct detail::StateAccess;

  static Scalar empty_log_scale(bool log_domain) noexcept {
    return log_domain ? -std::numeric_limits<Scalar>::infinity() : Scalar(0);
  }

  // Tokens of a deferred decode not yet in S_: part of the state's value.
  detail::PendingTokens<Scalar> pending_;

  Scalar log_scale_ = 0;
  bool log_domain_ = false;
};

/// Scratch of one reader of a state (read_into): the query row, its features and the scores
/// against pending tokens. Readers that share one state (threads) each need their own; reading
/// then allocates nothing.
template <class Scalar>
class ReadScratch {
 public:
  ReadScratch() = default;
  /// Room to read `state` (and any state of its dims and decode block). O(r + dk + B).
  explicit ReadScratch(const AttentionState<Scalar>& state)
      : scratch_(state.feature_dim(), state.key_dim(), state.value_dim()),
        scores_(std::max<Index>(state.decode_block(), 1)) {}

 private:
  friend struct detail::StateAccess;

  detail::StepScratch<Scalar> scratch_;
  RowVector<Scalar> scores_;
};

}  // namespace linattn
