// Must NOT compile: a log-scaled (random-feature) state rescales S per token, so it has no
// absorb()/read_into(); ctest checks that the error carries our readable message.
#include <linattn/attention.hpp>
#include <linattn/random_features.hpp>

int main() {
  using Map = linattn::PositiveRandomFeatures<float>;
  const linattn::LinearAttention<Map> attn(Map(4, 8, 1));
  auto state = attn.make_state(4, 4);
  linattn::ReadScratch<float> scratch(state);
  linattn::RowVector<float> y(4);
  attn.read_into(state, y, y, scratch);
}
