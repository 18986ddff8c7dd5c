// rule_state.hpp: the states of the write rules other than Additive, and state_t.

#include <linattn/attention.hpp>
#include <linattn/rule_state.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace rule_state_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("state_t picks AttentionState for Additive and RuleState otherwise", "[rule_state]") {
  static_assert(std::is_same_v<state_t<Additive, float>, AttentionState<float>>);
  static_assert(std::is_same_v<state_t<Decay, double>, RuleState<Decay, double>>);
  static_assert(std::is_same_v<RuleAttention<L2Normalize, Delta>::State, RuleState<Delta, float>>);
  static_assert(std::is_same_v<LinearAttention<EluPlusOne>::State, AttentionState<float>>);
}

TEST_CASE("rules that keep a normalizer keep z; the delta rules keep S only", "[rule_state]") {
  const RuleAttention<EluPlusOne, Gated> gated;
  const auto g = gated.make_state(8, 4);
  CHECK(g.scalar_count() == 8 * 4 + 8);
  CHECK(g.z().size() == 8);
  const RuleAttention<L2Normalize, GatedDelta> gdelta;
  const auto d = gdelta.make_state(8, 4);
  CHECK(d.scalar_count() == 8 * 4);  // no z: asking for it does not compile (tests/static)
  CHECK(std::string(d.identity().rule_name) == "gated_delta");
  const RuleAttention<EluPlusOne, Decay> decay(EluPlusOne{}, Decay(0.5));
  CHECK(decay.make_state(2, 2).identity().rule_parameter == 0.5);
}

TEST_CASE("reset() empties a rule state and keeps its allocation", "[rule_state]") {
  const RuleAttention<EluPlusOne, Decay> decay(EluPlusOne{}, Decay(0.9));
  auto s = decay.make_state(3, 3);
  const RowVector<float> x = RowVector<float>::Ones(3);
  static_cast<void>(decay.step(s, x, x, x));
  CHECK(s.tokens() == 1);
  const float* storage = s.S().data();
  s.reset();
  CHECK(s.tokens() == 0);
  CHECK(s.S().isZero(0));
  CHECK(s.z().isZero(0));
  CHECK(s.S().data() == storage);
  std::vector<RuleState<Decay, float>> states(3, decay.make_state(3, 3));
  for (const auto& st : states) CHECK(reinterpret_cast<std::uintptr_t>(&st) % kStateAlignment == 0);
}

TEST_CASE("assign() for rule states, with and without z", "[rule_state]") {
  const RuleAttention<L2Normalize, Delta, double> delta;
  auto d = delta.make_state(2, 2);
  const RowMatrix<double> S = RowMatrix<double>::Identity(2, 2);
  d.assign(S, 3);
  CHECK(d.S() == S);
  CHECK(d.tokens() == 3);
  const RuleAttention<EluPlusOne, Decay, double> decay(EluPlusOne{}, Decay(0.5));
  auto g = decay.make_state(2, 2);
  g.assign(S, ColVector<double>::Ones(2));
  CHECK(g.z() == ColVector<double>::Ones(2));
  CHECK_THROWS_AS(g.assign(S, ColVector<double>::Ones(3)), ShapeError);
}

}  // namespace rule_state_test
