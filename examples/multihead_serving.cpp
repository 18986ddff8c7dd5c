// A toy decode server: conversations share one batched decode step, a conversation is parked
// to bytes and resumed later, and the resumed one continues exactly where it stopped.
//
// Buffers are what a model would hold: batch-first [B, T, H, d] floats. The "model" here is a
// fixed random stream of q, k, v per conversation.

#include <linattn/linattn.hpp>
#include <linattn/thread_pool.hpp>

#include <cstdio>
#include <random>
#include <vector>

using namespace linattn;

namespace {

using Layer = MultiHeadAttention<LinearAttention<EluPlusOne, float>>;

constexpr Index Hq = 4, Hkv = 2, d = 16;

// Token t of conversation c: q [Hq, d], k and v [Hkv, d], from a seed only.
void token(int c, Index t, float* q, float* k, float* v) {
  std::mt19937 gen(static_cast<unsigned>(1000 * c + t));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Index i = 0; i < Hq * d; ++i) q[i] = normal(gen);
  for (Index i = 0; i < Hkv * d; ++i) k[i] = normal(gen);
  for (Index i = 0; i < Hkv * d; ++i) v[i] = normal(gen);
}

// One decode step for the conversations in `who` (batch order = state order) at positions
// `at`; returns the [N, Hq, d] outputs.
std::vector<float> step(const Layer& layer, Layer::State& state, const std::vector<int>& who,
                        std::vector<Index>& at) {
  const auto N = static_cast<Index>(who.size());
  std::vector<float> q(N * Hq * d), k(N * Hkv * d), v(N * Hkv * d), out(N * Hq * d);
  for (Index i = 0; i < N; ++i)
    token(who[i], at[i]++, &q[i * Hq * d], &k[i * Hkv * d], &v[i * Hkv * d]);
  layer.step_into(state, TensorView<const float>::batch_first(q.data(), N, 1, Hq, d),
                  TensorView<const float>::batch_first(k.data(), N, 1, Hkv, d),
                  TensorView<const float>::batch_first(v.data(), N, 1, Hkv, d),
                  TensorView<float>::batch_first(out.data(), N, 1, Hq, d));
  return out;
}

}  // namespace

int main() {
  Layer layer(HeadConfig{Hq, Hkv, d, d});
  // Two threads (the caller and one worker). Steps this small stay on the calling thread (the
  // layer hands work to the pool only when it pays); the bits are the same either way.
  ThreadPool pool(2);
  layer.set_executor(&pool);

  // Conversations 0, 1, 2 decode together for 4 tokens.
  auto state = layer.make_state(3);
  std::vector<int> who{0, 1, 2};
  std::vector<Index> at{0, 0, 0};
  for (int i = 0; i < 4; ++i) static_cast<void>(step(layer, state, who, at));

  // Park conversation 1: save its state, drop it from the batch.
  const SequenceId id1 = state.id_at(1);
  const std::vector<std::byte> parked = save_sequence(layer, state, id1);
  state.drop_sequence(id1);
  who.erase(who.begin() + 1);
  const Index parked_at = at[1];
  at.erase(at.begin() + 1);
  std::printf("parked conversation 1 after %td tokens: %zu bytes\n", parked_at, parked.size());

  // The others go on for 3 tokens, then conversation 1 comes back at the end of the batch.
  for (int i = 0; i < 3; ++i) static_cast<void>(step(layer, state, who, at));
  restore_sequences(layer, state, parked);
  who.push_back(1);
  at.push_back(parked_at);
  const auto resumed = step(layer, state, who, at);

  // Reference: conversation 1 alone, never parked, for the same 5 tokens.
  auto alone = layer.make_state(1);
  std::vector<int> just1{1};
  std::vector<Index> at1{0};
  std::vector<float> last;
  for (int i = 0; i < 5; ++i) last = step(layer, alone, just1, at1);

  bool same = true;
  for (Index c = 0; c < Hq * d; ++c) same = same && resumed[2 * Hq * d + c] == last[c];
  std::printf("resumed output %s the uninterrupted one\n", same ? "is bit-identical to" : "DIFFERS from");
  std::printf("state per conversation: %zu bytes; a K/V cache of this layer is larger after %td "
              "tokens\n",
              state.bytes_per_sequence(), layer.footprint().kv_cache_crossover - 1);
  return same ? 0 : 1;
}
