#pragma once
/// \file rule_state.hpp
/// RuleState<Rule, Scalar>: the recurrent state of one head under a write rule other than
/// Additive (Decay, Gated, Delta, GatedDelta; Additive uses AttentionState), and state_t, the
/// state type of any rule.
///
/// S (r x dv) always; z (length r) only for rules that keep a normalizer (Decay, Gated), where
/// it is decayed exactly like S. Delta rules keep no z: their state is not a sum of positive
/// weights, so asking for z() does not compile.

#include <linattn/detail/state_core.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <type_traits>

namespace linattn {

/// Recurrent state plus the scratch one decode step needs, so that step() never allocates.
/// Create it with make_state(dk, dv) of the attention that will use it. Aligned as
/// AttentionState, for the same reason.
template <class Rule, class Scalar>
class alignas(kStateAlignment) RuleState : public detail::StateCore<Scalar> {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  static_assert(WriteRule<Rule>, "Rule is not a write rule (see linattn/write_rules.hpp)");
  static_assert(Rule::kind != WriteKind::additive,
                "the additive rule's state is AttentionState (use state_t<Rule, Scalar>)");
  using Core = detail::StateCore<Scalar>;

 public:
  using rule_type = Rule;

  RuleState() = default;

  /// An empty (all-zero) state for feature dimension r, key dimension dk, value dimension dv,
  /// made for `identity`. Throws ShapeError unless r, dk, dv >= 1.
  RuleState(Index r, Index dk, Index dv, const detail::StateIdentity& identity)
      : Core(r, dk, dv, Rule::keeps_normalizer, identity) {}

  // S(), tokens(), the dims, scalar_count() (r*dv, plus r with a normalizer), identity() and
  // check_shape() come from detail::StateCore.

  /// The normalizer z (length r), decayed like S. Only for rules that keep one.
  [[nodiscard]] const ColVector<Scalar>& z() const noexcept {
    require_normalizer();
    return this->z_;
  }

  /// Sets the state to S (r x dv) and, for rules that keep one, z (length r): true values (a
  /// carried or learned initial state) with `tokens` absorbed tokens. Throws as
  /// AttentionState::assign(). O(r dv).
  template <class DS, class DZ>
  void assign(const Eigen::MatrixBase<DS>& S, const Eigen::MatrixBase<DZ>& z, Index tokens = 0) {
    this->assign_sums(S, z, tokens);
  }
  /// assign() for the delta rules, which keep no z.
  template <class DS>
  void assign(const Eigen::MatrixBase<DS>& S, Index tokens = 0)
    requires(!Rule::keeps_normalizer)
  {
    this->assign_sums(S, ColVector<Scalar>(), tokens);
  }

  /// Back to the empty state; keeps the allocation.
  void reset() noexcept { this->reset_sums(); }

 private:
  friend struct detail::StateAccess;

  static constexpr void require_normalizer() noexcept {
    static_assert(Rule::keeps_normalizer,
                  "this write rule keeps no normalizer z: a delta-rule state is not a sum of "
                  "positive weights, so only the unnormalized read S^T phi(q) exists");
  }
};

/// The state type of write rule Rule: AttentionState for Additive (with the deferred decode and
/// the log domain of random features), RuleState otherwise.
template <class Rule, class Scalar>
using state_t = std::conditional_t<Rule::kind == WriteKind::additive, AttentionState<Scalar>,
                                   RuleState<Rule, Scalar>>;

}  // namespace linattn
