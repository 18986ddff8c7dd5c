// Writes the fuzzers' seed corpus, made by the library itself: valid saved states of every
// kind the state-blob target tries (head states and batches, pending decode tokens, a
// log-scaled state), API inputs of each rule, and layer inputs of each rule, head grouping and
// sequence layout. Usage: make_seed_corpus <blob dir> <api dir> <layer dir>.

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
  if (argc != 4) {
    std::fprintf(stderr, "usage: make_seed_corpus <blob dir> <api dir> <layer dir>\n");
    return 2;
  }
  const std::string blobs = argv[1], api = argv[2], layers = argv[3];
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
  for (int rule = 0; rule < 8; ++rule) {
    std::vector<std::byte> seed{std::byte(rule % 2), std::byte(9), std::byte(3), std::byte(4), std::byte(rule)};
    for (int i = 0; i < 400; ++i) seed.push_back(static_cast<std::byte>((i * 37 + rule * 11) % 256));
    write(api + "/rule" + std::to_string(rule), seed);
  }
  // Layer seeds, in fuzz_layer.cpp's reading order: scalar type, rule, per-channel gates,
  // H_kv - 1, G - 1, G_v - 1, no broken heads, dk - 1, dv - 1, T, layout, B - 1 (not packed), no
  // broken layout, the layout's numbers (packed: 3 sequences cut at 2 and 5; padded: lengths 7
  // and 4), no broken view, ordinary values and inputs, the carried states' extra positions
  // (0 to 2; with none, slots or not), unbroken slots; then the buffers' placements and the
  // values' seed. H_kv = 2 with (G, G_v) = (1, 1), (3, 1), (1, 2); dk = 3, dv = 2, T = 7; rules
  // 0 to 4 (the last is random features).
  const int groups[3][2] = {{1, 1}, {3, 1}, {1, 2}};
  for (int rule = 0; rule < 5; ++rule)
    for (const auto& group : groups)
      for (int layout = 0; layout < 3; ++layout) {
        std::vector<int> bytes{rule % 2, rule, 1, 1, group[0] - 1, group[1] - 1, 0, 2, 1, 7, layout};
        if (layout != 1) bytes.push_back(1);
        bytes.push_back(0);
        if (layout == 1) bytes.insert(bytes.end(), {2, 2, 3});
        if (layout == 2) bytes.insert(bytes.end(), {7, 4});
        bytes.insert(bytes.end(), {0, 0, 0, layout});
        if (layout == 0) bytes.push_back(rule % 2);  // slots or not
        if (layout != 0 || rule % 2 == 1) bytes.push_back(0);
        for (int i = 0; i < 40; ++i) bytes.push_back((i * 37 + rule * 11 + layout * 5) % 256);
        std::vector<std::byte> seed;
        for (const int b : bytes) seed.push_back(static_cast<std::byte>(b));
        write(layers + "/rule" + std::to_string(rule) + "_g" + std::to_string(group[0]) + "_gv" +
                  std::to_string(group[1]) + "_layout" + std::to_string(layout),
              seed);
      }
  return 0;
}
