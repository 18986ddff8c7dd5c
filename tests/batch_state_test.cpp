// batch_state.hpp: sequences added and dropped with stable ids, sequences that must match the
// batch, and the state's size against a K/V cache.

#include <linattn/batch_state.hpp>
#include <linattn/multihead.hpp>
#include <linattn/random_features.hpp>

#include <catch2/catch.hpp>

#include <stdexcept>

namespace batch_state_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("state size against a K/V cache", "[batch_state]") {
  // One head, r = dk = dv = 128: the state is 128*128 + 128 = 16,512 scalars; a K/V cache
  // adds 128 + 128 = 256 per token, 64 * 256 = 16,384 <= 16,512 < 16,640 = 65 * 256.
  const auto one = state_footprint(1, 1, 128, 128, 128);
  CHECK(one.state_scalars_per_head == 16512);
  CHECK(one.kv_scalars_per_token == 256);
  CHECK(one.kv_cache_crossover == 65);
  // dk = dv = 64: 64*64 + 64 = 4160 against 128 per token: 32 * 128 = 4096 <= 4160 < 4224.
  CHECK(state_footprint(1, 1, 64, 64, 64).kv_cache_crossover == 33);
  // Without z (the delta rules): 64*64 = 4096 = 32 * 128, so the cache passes it at 33 too.
  CHECK(state_footprint(1, 1, 64, 64, 64, false).state_scalars_per_head == 4096);
  // 8 state heads against 2 kv heads (a log-scaled map keeps a state per query head), d = 128:
  // 8 * 16512 = 132096 state scalars, 2 * 256 = 512 per token; 132096 / 512 = 258 exactly,
  // so the cache passes it at 259.
  const auto per_query = state_footprint(8, 2, 128, 128, 128);
  CHECK(per_query.state_scalars == 132096);
  CHECK(per_query.kv_cache_crossover == 259);
  // An ordinary map shares one state per kv head: 2 * 16512 = 33024 scalars against 512 per
  // token, 64 * 512 = 32768 <= 33024 < 33280 = 65 * 512: the same 65 as one plain head.
  const MultiHeadAttention<LinearAttention<EluPlusOne>> mha({8, 2, 128, 128});
  CHECK(mha.state_heads() == 2);
  CHECK(mha.footprint().state_scalars == 33024);
  CHECK(mha.footprint().kv_cache_crossover == 65);
  const auto state = mha.make_state(2);
  CHECK(state.heads() == 2);
  CHECK(state.bytes_per_sequence() == 33024u * sizeof(float));
  CHECK(state.sequence(1).scalar_count() == 33024);
  // Random features keep one state per query head: r = 128 features of dk = 64 keys.
  const MultiHeadAttention<LinearAttention<PositiveRandomFeatures<float>>> favor(
      {8, 2, 64, 64}, LinearAttention<PositiveRandomFeatures<float>>(PositiveRandomFeatures<float>(64, 128, 7)));
  CHECK(favor.state_heads() == 8);
  CHECK(favor.make_state(1).heads() == 8);
  CHECK(favor.footprint().state_scalars == 8 * (128 * 64 + 128));
  CHECK_THROWS_AS(state_footprint(0, 1, 1, 1, 1), ShapeError);
}

TEST_CASE("sequences keep their ids while others come and go", "[batch_state]") {
  const LinearAttention<EluPlusOne> attn;
  BatchState<AttentionState<float>> batch(2, attn.make_state(3, 2));
  const SequenceId a = batch.add_sequence(), b = batch.add_sequence(), c = batch.add_sequence();
  CHECK(batch.size() == 3);
  CHECK(batch.index_of(b) == 1);
  const RowVector<float> x = RowVector<float>::Ones(3), v = RowVector<float>::Ones(2);
  static_cast<void>(attn.step(batch.sequence(batch.index_of(c)).head(1), x, x, v));
  auto taken = batch.take_sequence(a);
  CHECK(batch.size() == 2);
  CHECK(batch.index_of(b) == 0);
  CHECK(batch.index_of(c) == 1);
  CHECK(batch.sequence(1).head(1).tokens() == 1);  // moved, not changed
  CHECK_FALSE(batch.contains(a));
  CHECK_THROWS_AS(batch.index_of(a), std::out_of_range);
  CHECK_THROWS_AS(batch.sequence(5), std::out_of_range);
  CHECK_THROWS_AS(batch.sequence(0).head(2), std::out_of_range);
  const SequenceId back = batch.add_sequence(std::move(taken));
  CHECK(back != a);  // a new id
  CHECK(batch.id_at(2) == back);
  batch.sequence(1).reset();
  CHECK(batch.sequence(1).tokens() == 0);
}

TEST_CASE("a sequence of another shape or attention cannot join a batch", "[batch_state]") {
  const LinearAttention<EluPlusOne> elu;
  const LinearAttention<Identity> ident;
  BatchState<AttentionState<float>> batch(2, elu.make_state(3, 2));
  CHECK_THROWS_AS(batch.add_sequence(SequenceState<AttentionState<float>>(3, elu.make_state(3, 2))), ShapeError);
  CHECK_THROWS_AS(batch.add_sequence(SequenceState<AttentionState<float>>(2, elu.make_state(3, 3))), ShapeError);
  CHECK_THROWS_AS(batch.add_sequence(SequenceState<AttentionState<float>>(2, ident.make_state(3, 2))), StateMismatchError);
  CHECK(batch.size() == 0);
  CHECK_THROWS_AS((BatchState<AttentionState<float>>(-1, elu.make_state(3, 2))), ShapeError);
}

}  // namespace batch_state_test
