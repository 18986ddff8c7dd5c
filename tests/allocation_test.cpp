// What the library promises not to allocate: a decode step (every write rule; the additive
// rule's fused and deferred steps), a saved forward that is filled again for inputs of the
// same size (its saved data stays where it is), and the additive rule's backward with a
// BackwardWorkspace that has served a call of the same chunk shape (one head, and the layer's).
// Eigen's run-time allocation check (EIGEN_RUNTIME_NO_MALLOC) reports through eigen_assert,
// which this file turns into an exception so that the check also runs in Release builds (where
// Eigen's own assert is off).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x)                                                    \
  do {                                                                     \
    if (!(x)) throw std::logic_error("eigen_assert failed: " #x);          \
  } while (false)

#include <linattn/attention.hpp>
#include <linattn/gradients.hpp>
#include <linattn/multihead_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/saved_forward.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

namespace allocation_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::random_matrix;
using linattn_test::uniform_matrix;

namespace {

// Runs f() with Eigen's heap allocation forbidden; an allocation inside throws logic_error.
template <class F>
void without_allocation(F&& f) {
  Eigen::internal::set_is_malloc_allowed(false);
  try {
    f();
  } catch (...) {
    Eigen::internal::set_is_malloc_allowed(true);
    throw;
  }
  Eigen::internal::set_is_malloc_allowed(true);
}

}  // namespace

TEST_CASE("the check itself: an Eigen allocation inside without_allocation throws") {
  // Without this, every test below would pass if the check were off.
  CHECK_THROWS_AS(without_allocation([] { RowMatrix<float> m(64, 64); (void)m; }),
                  std::logic_error);
  RowMatrix<float> sized(64, 64);
  CHECK_NOTHROW(without_allocation([&] { sized.resize(64, 64); }));
}

TEMPLATE_TEST_CASE("a decode step allocates nothing, every rule", "", float, double) {
  using Scalar = TestType;
  constexpr Index T = 40, d = 16, dv = 8;
  const RowMatrix<Scalar> Q = random_matrix<Scalar>(T, d, 11), K = random_matrix<Scalar>(T, d, 12);
  const RowMatrix<Scalar> V = random_matrix<Scalar>(T, dv, 13);
  const RowMatrix<Scalar> beta = uniform_matrix<Scalar>(T, 1, 14, 0.0, 1.0);
  const RowMatrix<Scalar> log_gate = uniform_matrix<Scalar>(T, 1, 15, -0.2, 0.0);
  RowVector<Scalar> y(dv);
  for (const Index block : {Index{0}, Index{16}}) {
    INFO("additive, decode block " << block);
    Options options;
    options.decode_block = block;  // 0: the fused step; 16: deferred (T = 40 folds twice)
    const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, options);
    auto state = attn.make_state(d, dv);
    without_allocation([&] {
      for (Index t = 0; t < T; ++t) attn.step_into(state, Q.row(t), K.row(t), V.row(t), y);
    });
    CHECK(y.allFinite());
  }
  const auto run = [&](const auto& attn, const auto&... per_token) {
    auto state = attn.make_state(d, dv);
    without_allocation([&] {
      for (Index t = 0; t < T; ++t)
        attn.step_into(state, Q.row(t), K.row(t), V.row(t), per_token(t, 0)..., y);
    });
    CHECK(y.allFinite());
    CHECK(state.tokens() == T);
  };
  {
    INFO("decay");
    run(RuleAttention<EluPlusOne, Decay, Scalar>(EluPlusOne{}, Decay(0.9)));
  }
  {
    INFO("gated, one gate per token");
    run(RuleAttention<EluPlusOne, Gated, Scalar>(), log_gate);
  }
  {
    INFO("delta");
    run(RuleAttention<L2Normalize, Delta, Scalar>(), beta);
  }
  {
    INFO("gated delta");
    run(RuleAttention<L2Normalize, GatedDelta, Scalar>(), beta, log_gate);
  }
}

TEST_CASE("a saved forward filled again for the same size keeps its saved data in place") {
  // The saving forward sizes its SavedForward first (SavedForwardAccess::prepare /
  // prepare_delta), then fills it. Sizing for the size it already has must not allocate: the
  // delta rules' data is 5 KiB per token at r = dv = 128, and re-allocating it per call cost
  // several times the forward on virtual machines where a large free makes the next touches
  // slow (docs/performance.md, "Timing on a virtual machine").
  using Access = detail::SavedForwardAccess;
  constexpr Index T = 50, C = 16, r = 8, dk = 8, dv = 4;
  const RuleAttention<L2Normalize, Delta, float> delta;
  const RuleAttention<EluPlusOne, Decay, float> decay(EluPlusOne{}, Decay(0.9));
  SavedForward<float> saved;
  Access::prepare_delta(saved, T, C, r, dk, dv, delta.state_identity());
  const std::size_t bytes = saved.bytes();
  CHECK(bytes == detail::DeltaSavedStates<float>::bytes_for(T, C, r, dv));
  CHECK_NOTHROW(without_allocation(
      [&] { Access::prepare_delta(saved, T, C, r, dk, dv, delta.state_identity()); }));
  CHECK(saved.bytes() == bytes);
  CHECK(saved.tokens() == 0);  // marked empty until a forward fills it

  Access::prepare(saved, T, C, r, dk, dv, false, decay.state_identity());
  CHECK_NOTHROW(without_allocation(
      [&] { Access::prepare(saved, T, C, r, dk, dv, false, decay.state_identity()); }));
  CHECK(saved.chunks() == (T + C - 1) / C);

  // Through the public call: filling it again gives the same outputs.
  const RowMatrix<float> Q = random_matrix<float>(T, dk, 21), K = random_matrix<float>(T, dk, 22);
  const RowMatrix<float> V = random_matrix<float>(T, dv, 23);
  const ColVector<float> beta = uniform_matrix<float>(T, 1, 24, 0.0, 1.0);
  RowMatrix<float> Y(T, dv), Y2(T, dv);
  parallel_saving_into(delta, Q, K, V, beta, Mask::causal, Y, saved);
  const std::size_t filled = saved.bytes();
  parallel_saving_into(delta, Q, K, V, beta, Mask::causal, Y2, saved);
  CHECK(saved.bytes() == filled);
  CHECK(saved.tokens() == T);
  CHECK(Y == Y2);
}


TEST_CASE("the additive backward with a warmed BackwardWorkspace allocates nothing") {
  // The workspace keeps the chunk scratch, the per-token buffers (grown to the longest call) and
  // the zero initial state; the outputs are the caller's. So after one call of a chunk shape,
  // calls of that shape, longer or shorter (packed documents of many lengths), allocate nothing:
  // the recomputing backward, stateless and carried, and the saved forward's.
  constexpr Index C = 8, dk = 8, dv = 4;
  const LinearAttention<EluPlusOne, float> attn(EluPlusOne{}, Options{{}, C});
  BackwardWorkspace<float> workspace;
  const RowMatrix<float> warm_Q = random_matrix<float>(40, dk, 31);
  RowMatrix<float> dQ(40, dk), dK(40, dk), dV(40, dv), Y(40, dv);
  StateGradient<float> initial;
  parallel_backward_into(attn, warm_Q, warm_Q, warm_Q.leftCols(dv), Mask::causal,
                         warm_Q.leftCols(dv), {dQ, dK, dV}, &initial, &workspace);
  auto state = attn.make_state(dk, dv);
  static_cast<void>(attn.prefill(state, warm_Q, warm_Q, warm_Q.leftCols(dv)));
  prefill_backward_into(attn, state, warm_Q, warm_Q, warm_Q.leftCols(dv), warm_Q.leftCols(dv),
                        nullptr, {dQ, dK, dV}, initial, &workspace);
  SavedForward<float> saved;
  parallel_saving_into(attn, warm_Q, warm_Q, warm_Q.leftCols(dv), Mask::causal, Y, saved);
  parallel_backward_into(attn, saved, warm_Q, warm_Q, warm_Q.leftCols(dv), Mask::causal,
                         warm_Q.leftCols(dv), {dQ, dK, dV}, &initial, &workspace);
  const std::size_t held = workspace.bytes();
  for (const Index T : {Index{40}, Index{17}, Index{33}}) {
    INFO("T = " << T);
    const RowMatrix<float> Q = random_matrix<float>(T, dk, 32), K = random_matrix<float>(T, dk, 33);
    const RowMatrix<float> V = random_matrix<float>(T, dv, 34), dY = random_matrix<float>(T, dv, 35);
    GradientsRef<float> out{dQ.topRows(T), dK.topRows(T), dV.topRows(T)};
    CHECK_NOTHROW(without_allocation([&] {
      parallel_backward_into(attn, Q, K, V, Mask::causal, dY, out, &initial, &workspace);
    }));
    CHECK_NOTHROW(without_allocation([&] {
      prefill_backward_into(attn, state, Q, K, V, dY, nullptr, out, initial, &workspace);
    }));
    parallel_saving_into(attn, Q, K, V, Mask::causal, Y.topRows(T), saved);
    CHECK_NOTHROW(without_allocation([&] {
      parallel_backward_into(attn, saved, Q, K, V, Mask::causal, dY, out, &initial, &workspace);
    }));
    CHECK(dQ.topRows(T).allFinite());
  }
  CHECK(workspace.bytes() == held);
  // Without a workspace the call allocates its scratch (what the workspace saves).
  CHECK_THROWS_AS(without_allocation([&] {
                    parallel_backward_into(attn, warm_Q, warm_Q, warm_Q.leftCols(dv),
                                           Mask::causal, warm_Q.leftCols(dv), {dQ, dK, dV},
                                           &initial);
                  }),
                  std::logic_error);
}

TEST_CASE("the additive layer backward with a warmed BackwardWorkspace allocates nothing") {
  // The layer keeps each thread's buffers in a lane of the workspace: the single-head scratch,
  // the head's gradient rows (grown to the longest document) and a query head's share of its
  // group's shared state gradient. So after the longest document has run, packed batches of
  // other document lengths allocate nothing, stateless and carried, with grouped heads.
  constexpr Index C = 8, T = 48, Hq = 4, Hkv = 2, dk = 8, dv = 4;
  using Attention = LinearAttention<EluPlusOne, float>;
  const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv},
                                            Attention(EluPlusOne{}, Options{{}, C}));
  const auto values = [](Index n, std::uint64_t seed) {
    const RowMatrix<float> m = random_matrix<float>(1, n, seed);
    return std::vector<float>(m.data(), m.data() + m.size());
  };
  const std::vector<float> Q = values(T * Hq * dk, 41), K = values(T * Hkv * dk, 42),
                           V = values(T * Hkv * dv, 43), dY = values(T * Hq * dv, 44);
  std::vector<float> dQ(Q.size()), dK(K.size()), dV(V.size());
  using View = TensorView<const float>;
  const View q = View::batch_first(Q.data(), 1, T, Hq, dk), k = View::batch_first(K.data(), 1, T, Hkv, dk),
             v = View::batch_first(V.data(), 1, T, Hkv, dv), dy = View::batch_first(dY.data(), 1, T, Hq, dv);
  const GradientViews<float> grads{TensorView<float>::batch_first(dQ.data(), 1, T, Hq, dk),
                                   TensorView<float>::batch_first(dK.data(), 1, T, Hkv, dk),
                                   TensorView<float>::batch_first(dV.data(), 1, T, Hkv, dv)};
  const std::vector<Index> longest{0, 40, 44, 48}, offsets_a{0, 17, 30, 48}, offsets_b{0, 5, 38, 48};
  BackwardWorkspace<float> workspace;
  auto state = layer.make_state(3);
  BatchStateGradient<float> initial(state);
  parallel_backward_into(layer, q, k, v, Mask::causal, dy, grads, SequenceLayout::packed(longest),
                         &workspace);
  prefill_backward_into(layer, state, q, k, v, dy, nullptr, grads, initial,
                        SequenceLayout::packed(longest), &workspace);
  const std::size_t held = workspace.bytes();
  for (const auto* offsets : {&offsets_a, &offsets_b}) {
    const SequenceLayout layout = SequenceLayout::packed(*offsets);
    CHECK_NOTHROW(without_allocation([&] {
      parallel_backward_into(layer, q, k, v, Mask::causal, dy, grads, layout, &workspace);
    }));
    CHECK_NOTHROW(without_allocation([&] {
      prefill_backward_into(layer, state, q, k, v, dy, nullptr, grads, initial, layout, &workspace);
    }));
  }
  CHECK(workspace.bytes() == held);
  CHECK(std::all_of(dQ.begin(), dQ.end(), [](float x) { return std::isfinite(x); }));
  // Without a workspace the call allocates its buffers (what the workspace saves).
  CHECK_THROWS_AS(without_allocation([&] {
                    parallel_backward_into(layer, q, k, v, Mask::causal, dy, grads,
                                           SequenceLayout::packed(offsets_a));
                  }),
                  std::logic_error);
}

}  // namespace allocation_test
