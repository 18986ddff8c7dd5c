// Prints how much state linear attention keeps per sequence and the context length at which a
// softmax model's K/V cache of the same shape grows past it.
//
// One head with feature dim r and value dim dv keeps S (r x dv) and z (r): r dv + r scalars,
// whatever the context length. A K/V cache keeps dk + dv scalars per token and kv head. For
// r = dk = dv = 128 that is 16,512 scalars against 256 per token: the cache passes the state
// at 65 tokens (64 * 256 = 16,384 still fits).

#include <linattn/batch_state.hpp>
#include <linattn/multihead.hpp>

#include <cstdio>

int main() {
  using linattn::Index;
  std::printf("One head (r = dk for ELU+1 features; r = 2 dk as for a random-feature map):\n");
  std::printf("%5s %5s %5s %16s %14s %15s %22s\n", "dk", "dv", "r", "state scalars", "state bytes",
              "K/V per token", "K/V cache larger at");
  std::printf("%5s %5s %5s %16s %14s %15s %22s\n", "", "", "", "(r dv + r)", "(float)",
              "(dk + dv)", "(tokens)");
  const Index sizes[] = {32, 64, 80, 96, 128, 256};
  for (Index d : sizes)
    for (Index r : {d, 2 * d}) {
      const auto f = linattn::state_footprint(1, 1, r, d, d);
      std::printf("%5td %5td %5td %16td %14td %15td %22td\n", d, d, r, f.state_scalars_per_head,
                  f.state_scalars_per_head * static_cast<Index>(sizeof(float)),
                  f.kv_scalars_per_token, f.kv_cache_crossover);
    }

  struct Model {
    const char* name;
    Index q_heads, kv_heads, d, value_heads = 0;  // 0: as many value heads as key heads
  };
  // Head layouts of common shapes (per layer); with ELU+1 features the state is kept per
  // value head, as the K/V cache is (see batch_state.hpp). The last row has grouped value heads,
  // as Qwen3-Next's Gated DeltaNet layers: 32 value heads over 16 query/key heads.
  const Model models[] = {{"MHA 8 x 64", 8, 8, 64},
                          {"MHA 16 x 128", 16, 16, 128},
                          {"GQA 32 q / 8 kv x 128", 32, 8, 128},
                          {"MQA 16 q / 1 kv x 128", 16, 1, 128},
                          {"GVA 16 qk / 32 v x 128", 16, 16, 128, 32}};
  std::printf("\nPer layer and sequence, ELU+1 features (r = dk), float:\n");
  std::printf("%-24s %14s %18s %22s\n", "heads", "state bytes", "K/V bytes/token",
              "K/V cache larger at");
  for (const Model& m : models) {
    const linattn::MultiHeadAttention<linattn::LinearAttention<linattn::EluPlusOne, float>> layer(
        linattn::HeadConfig{m.q_heads, m.kv_heads, m.d, m.d, m.value_heads});
    const auto f = layer.footprint();
    const auto state = layer.make_state();
    std::printf("%-24s %14zu %18td %22td\n", m.name, state.bytes_per_sequence(),
                f.kv_scalars_per_token * static_cast<Index>(sizeof(float)), f.kv_cache_crossover);
  }
  return 0;
}
