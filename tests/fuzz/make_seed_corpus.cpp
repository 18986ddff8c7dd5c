// Writes the fuzzers' seed corpus, made by the library itself: valid saved states of every
// kind the state-blob target tries (head states and batches, pending decode tokens, a
// log-scaled state) and API inputs of each rule. Usage: make_seed_corpus <blob dir> <api dir>.

#include <linattn/linattn.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

using namespace linattn;

namespace {

void write(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

template <class Attention>
void head(const std::string& dir, const std::string& name, const Attention& attn, int steps) {
  auto state = attn.make_state(3, 2);
  using Scalar = typename Attention::scalar_type;
  for (int t = 0; t < steps; ++t) {
    const RowVector<Scalar> q = RowVector<Scalar>::Constant(3, Scalar(0.1) * Scalar(t)), v = RowVector<Scalar>::Ones(2);
    using Rule = typename Attention::rule_type;
    if constexpr (Rule::kind == WriteKind::gated) static_cast<void>(attn.step(state, q, q, v, -0.5));
    else if constexpr (Rule::kind == WriteKind::delta) static_cast<void>(attn.step(state, q, q, v, 0.5));
    else static_cast<void>(attn.step(state, q, q, v));
  }
  write(dir + "/" + name, save_state(state));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_seed_corpus <blob dir> <api dir>\n");
    return 2;
  }
  const std::string blobs = argv[1], api = argv[2];
  Options blocked;
  blocked.decode_block = 4;
  head(blobs, "additive", LinearAttention<EluPlusOne>(), 5);
  head(blobs, "additive_pending", LinearAttention<EluPlusOne>(EluPlusOne{}, blocked), 6);
  head(blobs, "favor", LinearAttention<PositiveRandomFeatures<double>, double>(PositiveRandomFeatures<double>(3, 4, 1)), 3);
  head(blobs, "gated", RuleAttention<EluPlusOne, Gated>(), 4);
  head(blobs, "delta", RuleAttention<L2Normalize, Delta, double>(), 4);
  const MultiHeadAttention<LinearAttention<EluPlusOne>> layer({2, 1, 3, 2});
  write(blobs + "/batch", save_state(layer, layer.make_state(2)));
  // API seeds: scalar type, T, dk, dv, rule choice, then values of every kind.
  for (int rule = 0; rule < 6; ++rule) {
    std::vector<std::byte> seed{std::byte(rule % 2), std::byte(9), std::byte(3), std::byte(4), std::byte(rule)};
    for (int i = 0; i < 400; ++i) seed.push_back(static_cast<std::byte>((i * 37 + rule * 11) % 256));
    write(api + "/rule" + std::to_string(rule), seed);
  }
  return 0;
}
