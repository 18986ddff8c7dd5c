#pragma once
/// \file state.hpp
/// The fixed-size recurrent state of one head: S = sum phi(k) v^T (r x dv) and z = sum phi(k) (r).
///
/// The state is a compressed summary, not a copy of the K/V list: different histories can give
/// the same S and z. It holds exactly what the normalized causal read needs for the chosen
/// kernel, y = phi(q)^T S / phi(q)^T z, in r*dv + r scalars whatever the context length.

#include <linattn/detail/state_core.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <limits>

namespace linattn {

/// Recurrent state of one head plus the scratch a decode step needs, so that step() never
/// allocates. Create it with LinearAttention::make_state(dk, dv).
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
  AttentionState(Index r, Index dk, Index dv, bool log_domain = false)
      : Core(r, dk, dv, true),
        query_row_(1, dk),
        key_row_(1, dk),
        value_row_(1, dv),
        query_features_(1, r),
        key_features_(1, r),
        z_next_(r),
        log_scale_(empty_log_scale(log_domain)),
        log_domain_(log_domain) {}

  // S(), mutable_S(), tokens(), the dims, scalar_count() (r*dv + r: 16,512 for r = dv = 128)
  // and check_shape() come from detail::StateCore.

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

  Scalar log_scale_ = 0;
  bool log_domain_ = false;
};

}  // namespace linattn
