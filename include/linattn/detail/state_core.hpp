#pragma once
// StateCore: what every recurrent state holds whatever its write rule (S, z, the token count,
// the dims) and the accessors over it; AttentionState and RuleState add their own scratch.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

namespace linattn::detail {

template <class Scalar>
class StateCore {
 public:
  /// S: r x dv, row-major; the sum of phi(k) v^T over the absorbed tokens as the write rule
  /// accumulates it.
  [[nodiscard]] const RowMatrix<Scalar>& S() const noexcept { return S_; }
  /// Writable S, for loading a saved state; its shape must not change.
  [[nodiscard]] Eigen::Ref<RowMatrix<Scalar>> mutable_S() noexcept { return S_; }

  /// Number of tokens absorbed since the state was made or reset.
  [[nodiscard]] Index tokens() const noexcept { return tokens_; }
  void set_tokens(Index n) noexcept { tokens_ = n; }

  [[nodiscard]] Index feature_dim() const noexcept { return S_.rows(); }
  [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
  [[nodiscard]] Index value_dim() const noexcept { return S_.cols(); }

  /// Scalars that persist between tokens: r*dv for S, plus r where z is kept.
  [[nodiscard]] Index scalar_count() const noexcept { return S_.size() + z_.size(); }

  /// Throws ShapeError unless this state fits (r, dk, dv).
  void check_shape(Index r, Index dk, Index dv) const {
    if (feature_dim() != r || key_dim() != dk || value_dim() != dv)
      throw_shape_error("state has r=", feature_dim(), " dk=", key_dim(), " dv=", value_dim(),
                        " but the inputs need r=", r, " dk=", dk, " dv=", dv);
  }

 protected:
  StateCore() = default;
  /// Zero S (r x dv) and, when `keeps_z`, zero z (r). Throws ShapeError for a negative dim,
  /// before anything is sized with it.
  StateCore(Index r, Index dk, Index dv, bool keeps_z)
      : S_(RowMatrix<Scalar>::Zero(checked_feature_dim(r, dk, dv), dv)),
        z_(ColVector<Scalar>::Zero(keeps_z ? r : 0)),
        key_dim_(dk) {}

  /// S, z and the token count back to zero; keeps the allocations.
  void reset_sums() noexcept {
    S_.setZero();
    z_.setZero();
    tokens_ = 0;
  }

  RowMatrix<Scalar> S_;
  ColVector<Scalar> z_;
  Index tokens_ = 0;
  Index key_dim_ = 0;

 private:
  static Index checked_feature_dim(Index r, Index dk, Index dv) {
    if (r < 0 || dk < 0 || dv < 0)
      throw_shape_error("state dimensions must be non-negative, got r=", r, " dk=", dk,
                        " dv=", dv);
    return r;
  }
};

}  // namespace linattn::detail
