#pragma once
/// \file rule_state.hpp
/// RuleState<Rule, Scalar>: the recurrent state of one head under a non-additive write rule
/// (Decay, Gated, Delta, GatedDelta; the Additive rule uses AttentionState).
///
/// S (r x dv) always; z (length r) only for rules that keep a normalizer (Decay, Gated), where
/// it is decayed exactly like S. Delta rules keep no z: their state is not a sum of positive
/// weights, so asking for z() does not compile.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

namespace linattn {

template <class Phi, class Rule, class Scalar>
class RuleAttention;

/// Recurrent state plus the scratch one decode step needs, so that step() never allocates.
/// Create it with RuleAttention::make_state(dk, dv). Aligned as AttentionState, for the same
/// reason.
template <class Rule, class Scalar>
class alignas(kStateAlignment) RuleState {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  static_assert(WriteRule<Rule>, "Rule is not a write rule (see linattn/write_rules.hpp)");

 public:
  using rule_type = Rule;

  RuleState() = default;

  /// An empty (all-zero) state for feature dimension r, key dimension dk, value dimension dv.
  RuleState(Index r, Index dk, Index dv)
      : S_(RowMatrix<Scalar>::Zero(r < 0 ? 0 : r, dv < 0 ? 0 : dv)),
        z_(ColVector<Scalar>::Zero(Rule::keeps_normalizer && r > 0 ? r : 0)),
        key_dim_(dk),
        query_row_(1, dk < 0 ? 0 : dk),
        key_row_(1, dk < 0 ? 0 : dk),
        value_row_(1, dv < 0 ? 0 : dv),
        query_features_(1, r < 0 ? 0 : r),
        key_features_(1, r < 0 ? 0 : r),
        gate_row_(1, r < 0 ? 0 : r),
        scratch_(z_.size()),
        prediction_(1, dv < 0 ? 0 : dv) {
    if (r < 0 || dk < 0 || dv < 0)
      detail::throw_shape_error("state dimensions must be non-negative, got r=", r, " dk=", dk,
                                " dv=", dv);
  }

  /// S: r x dv, row-major.
  [[nodiscard]] const RowMatrix<Scalar>& S() const noexcept { return S_; }
  /// The normalizer z (length r), decayed like S. Only for rules that keep one.
  [[nodiscard]] const ColVector<Scalar>& z() const noexcept {
    static_assert(Rule::keeps_normalizer,
                  "this write rule keeps no normalizer z: a delta-rule state is not a sum of "
                  "positive weights, so only the unnormalized read S^T phi(q) exists");
    return z_;
  }
  /// Writable S (and z), for loading a saved state; shapes must not change.
  [[nodiscard]] Eigen::Ref<RowMatrix<Scalar>> mutable_S() noexcept { return S_; }
  [[nodiscard]] Eigen::Ref<ColVector<Scalar>> mutable_z() noexcept {
    static_assert(Rule::keeps_normalizer,
                  "this write rule keeps no normalizer z: a delta-rule state is not a sum of "
                  "positive weights, so only the unnormalized read S^T phi(q) exists");
    return z_;
  }

  /// Number of tokens absorbed since the state was made or reset.
  [[nodiscard]] Index tokens() const noexcept { return tokens_; }
  void set_tokens(Index n) noexcept { tokens_ = n; }

  [[nodiscard]] Index feature_dim() const noexcept { return S_.rows(); }
  [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
  [[nodiscard]] Index value_dim() const noexcept { return S_.cols(); }

  /// Scalars that persist between tokens: r*dv, plus r for rules with a normalizer.
  [[nodiscard]] Index scalar_count() const noexcept { return S_.size() + z_.size(); }

  /// Back to the empty state; keeps the allocation.
  void reset() noexcept {
    S_.setZero();
    z_.setZero();
    tokens_ = 0;
  }

  /// Throws ShapeError unless this state fits (r, dk, dv).
  void check_shape(Index r, Index dk, Index dv) const {
    if (feature_dim() != r || key_dim() != dk || value_dim() != dv)
      detail::throw_shape_error("state has r=", feature_dim(), " dk=", key_dim(),
                                " dv=", value_dim(), " but the inputs need r=", r, " dk=", dk,
                                " dv=", dv);
  }

 private:
  template <class, class, class>
  friend class RuleAttention;

  RowMatrix<Scalar> S_;
  ColVector<Scalar> z_;
  Index tokens_ = 0;
  Index key_dim_ = 0;

  // Per-token scratch for step(): sized once, reused, never part of the state's value.
  RowMatrix<Scalar> query_row_, key_row_, value_row_;
  RowMatrix<Scalar> query_features_, key_features_, gate_row_;
  ColVector<Scalar> scratch_;
  RowVector<Scalar> prediction_;
};

}  // namespace linattn
