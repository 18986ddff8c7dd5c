// Must NOT compile: a delta-rule state has no normalizer z, so the weighted average cannot be
// formed from it. ctest checks that the error carries our readable message.
#include <linattn/attention.hpp>

int main() {
  const linattn::RuleAttention<linattn::L2Normalize, linattn::Delta> attn;
  auto state = attn.make_state(4, 4);
  return static_cast<int>(state.z().size());
}
