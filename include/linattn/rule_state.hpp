#pragma once
/// \file rule_state.hpp
/// RuleState<Rule, Scalar>: the recurrent state of one head under a non-additive write rule
/// (Decay, Gated, Delta, GatedDelta; the Additive rule uses AttentionState).
///
/// S (r x dv) always; z (length r) only for rules that keep a normalizer (Decay, Gated), where
/// it is decayed exactly like S. Delta rules keep no z: their state is not a sum of positive
/// weights, so asking for z() does not compile.

#include <linattn/detail/state_core.hpp>
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
class alignas(kStateAlignment) RuleState : public detail::StateCore<Scalar> {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  static_assert(WriteRule<Rule>, "Rule is not a write rule (see linattn/write_rules.hpp)");
  using Core = detail::StateCore<Scalar>;

 public:
  using rule_type = Rule;

  RuleState() = default;

  /// An empty (all-zero) state for feature dimension r, key dimension dk, value dimension dv.
  /// Throws ShapeError for a negative dim.
  RuleState(Index r, Index dk, Index dv)
      : Core(r, dk, dv, Rule::keeps_normalizer),
        query_row_(1, dk),
        key_row_(1, dk),
        value_row_(1, dv),
        query_features_(1, r),
        key_features_(1, r),
        gate_row_(1, r),
        scratch_(this->z_.size()),
        prediction_(1, dv) {}

  // S(), mutable_S(), tokens(), the dims, scalar_count() (r*dv, plus r with a normalizer) and
  // check_shape() come from detail::StateCore.

  /// The normalizer z (length r), decayed like S. Only for rules that keep one.
  [[nodiscard]] const ColVector<Scalar>& z() const noexcept {
    require_normalizer();
    return this->z_;
  }
  /// Writable z, for loading a saved state. Only for rules that keep one.
  [[nodiscard]] Eigen::Ref<ColVector<Scalar>> mutable_z() noexcept {
    require_normalizer();
    return this->z_;
  }

  /// Back to the empty state; keeps the allocation.
  void reset() noexcept { this->reset_sums(); }

 private:
  template <class, class, class>
  friend class RuleAttention;

  static constexpr void require_normalizer() noexcept {
    static_assert(Rule::keeps_normalizer,
                  "this write rule keeps no normalizer z: a delta-rule state is not a sum of "
                  "positive weights, so only the unnormalized read S^T phi(q) exists");
  }

  // Per-token scratch for step(): sized once, reused, never part of the state's value.
  RowMatrix<Scalar> query_row_, key_row_, value_row_;
  RowMatrix<Scalar> query_features_, key_features_, gate_row_;
  ColVector<Scalar> scratch_;
  RowVector<Scalar> prediction_;
};

}  // namespace linattn
