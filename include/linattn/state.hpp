#pragma once
/// \file state.hpp
/// The fixed-size recurrent state of one head: S = sum phi(k) v^T (r x dv) and z = sum phi(k) (r).
///
/// The state is a compressed summary, not a copy of the K/V list: different histories can give
/// the same S and z. It holds exactly what the normalized causal read needs for the chosen
/// kernel, y = phi(q)^T S / phi(q)^T z, in r*dv + r scalars whatever the context length.

#include <linattn/errors.hpp>
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
class alignas(kStateAlignment) AttentionState {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");

 public:
  AttentionState() = default;

  /// An empty (all-zero) state for feature dimension r, key dimension dk, value dimension dv.
  /// `log_domain` (set by LinearAttention for a LogScaledFeatureMap) makes the empty state's
  /// log_scale() -infinity instead of 0.
  AttentionState(Index r, Index dk, Index dv, bool log_domain = false)
      : S_(RowMatrix<Scalar>::Zero(r, dv)),
        z_(ColVector<Scalar>::Zero(r)),
        key_dim_(dk),
        query_row_(1, dk),
        key_row_(1, dk),
        value_row_(1, dv),
        query_features_(1, r),
        key_features_(1, r),
        z_next_(r),
        log_scale_(empty_log_scale(log_domain)),
        log_domain_(log_domain) {
    if (r < 0 || dk < 0 || dv < 0)
      detail::throw_shape_error("state dimensions must be non-negative, got r=", r, " dk=", dk,
                                " dv=", dv);
  }

  /// S = sum over absorbed tokens of phi(k) v^T; r x dv, row-major.
  [[nodiscard]] const RowMatrix<Scalar>& S() const noexcept { return S_; }
  /// z = sum over absorbed tokens of phi(k); length r.
  [[nodiscard]] const ColVector<Scalar>& z() const noexcept { return z_; }
  /// Writable S and z, for loading a saved state; shapes must not change.
  [[nodiscard]] Eigen::Ref<RowMatrix<Scalar>> mutable_S() noexcept { return S_; }
  [[nodiscard]] Eigen::Ref<ColVector<Scalar>> mutable_z() noexcept { return z_; }

  /// M: S() and z() hold the true sums divided by exp(M), i.e. true S = exp(M) S(). Always 0
  /// for ordinary feature maps. For a LogScaledFeatureMap it is the running maximum of the
  /// absorbed keys' log-scales (-infinity while empty), so stored entries never overflow.
  [[nodiscard]] Scalar log_scale() const noexcept { return log_scale_; }
  /// Sets M, for loading a saved state together with mutable_S() and mutable_z().
  void set_log_scale(Scalar m) noexcept { log_scale_ = m; }
  /// Whether this state keeps S and z log-scaled (made for a LogScaledFeatureMap).
  [[nodiscard]] bool log_domain() const noexcept { return log_domain_; }

  /// Number of tokens absorbed since the state was made or reset.
  [[nodiscard]] Index tokens() const noexcept { return tokens_; }
  void set_tokens(Index n) noexcept { tokens_ = n; }

  [[nodiscard]] Index feature_dim() const noexcept { return S_.rows(); }
  [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
  [[nodiscard]] Index value_dim() const noexcept { return S_.cols(); }

  /// Scalars that persist between tokens: r*dv + r (16,512 for r = dv = 128).
  [[nodiscard]] Index scalar_count() const noexcept { return S_.size() + z_.size(); }

  /// Back to the empty state; keeps the allocation.
  void reset() noexcept {
    S_.setZero();
    z_.setZero();
    tokens_ = 0;
    log_scale_ = empty_log_scale(log_domain_);
  }

  /// Throws ShapeError unless this state fits (r, dk, dv).
  void check_shape(Index r, Index dk, Index dv) const {
    if (feature_dim() != r || key_dim() != dk || value_dim() != dv)
      detail::throw_shape_error("state has r=", feature_dim(), " dk=", key_dim(),
                                " dv=", value_dim(), " but the inputs need r=", r, " dk=", dk,
                                " dv=", dv);
  }

 private:
  template <class, class>
  friend class LinearAttention;

  static Scalar empty_log_scale(bool log_domain) noexcept {
    return log_domain ? -std::numeric_limits<Scalar>::infinity() : Scalar(0);
  }

  RowMatrix<Scalar> S_;
  ColVector<Scalar> z_;
  Index tokens_ = 0;
  Index key_dim_ = 0;

  // Per-token scratch for step(): sized once, reused, never part of the state's value.
  RowMatrix<Scalar> query_row_, key_row_, value_row_;
  RowMatrix<Scalar> query_features_, key_features_;
  ColVector<Scalar> z_next_;

  Scalar log_scale_ = 0;
  bool log_domain_ = false;
};

}  // namespace linattn
