// What the library promises not to allocate: a decode step (every write rule; the additive
// rule's fused and deferred steps), a saved forward that is filled again for inputs of the
// same size (its saved data stays where it is), and every rule's backward with a
// BackwardWorkspace that has served a call of the same chunk shape (one head, and the layer's).
// Eigen's run-time allocation check (EIGEN_RUNTIME_NO_MALLOC) reports through eigen_assert,
// which this file turns into an exception so that the check also runs in Release builds (where
// Eigen's own assert is off).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <type_traits>
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
using detail::input_gradient_rows;

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

namespace {

// Calls f(attention, name, per-token input columns: 0 none, 1 one per token, r per channel)
// for Decay, Gated (one gate per token and per channel), Delta and GatedDelta (one log_alpha
// per token and per channel) in float with chunks of C rows.
template <class F>
void for_each_write_rule(Index C, Index r, F&& f) {
  Options strict{Normalization::strict(), C};
  Options plain{Normalization::unnormalized(), C};
  f(RuleAttention<EluPlusOne, Decay, float>(EluPlusOne{}, Decay(0.9), strict), "decay", Index{0});
  f(RuleAttention<EluPlusOne, Gated, float>(EluPlusOne{}, strict), "gated", Index{1});
  f(RuleAttention<EluPlusOne, Gated, float>(EluPlusOne{}, strict), "gated per channel", r);
  f(RuleAttention<L2Normalize, Delta, float>(L2Normalize{}, plain), "delta", Index{1});
  f(RuleAttention<L2Normalize, GatedDelta, float>(L2Normalize{}, plain), "gated delta", Index{1});
  f(RuleAttention<L2Normalize, GatedDelta, float>(L2Normalize{}, plain), "gated delta per channel",
    r);
}

// Per-token inputs of `Rule` for T tokens (`columns` columns of Gated's log-gates and of
// GatedDelta's log_alpha), in their ranges: log-gates in [-0.3, -0.1], beta in [0.1, 0.9], log_alpha in [-0.3, -0.1].
template <class Rule>
std::vector<RowMatrix<float>> token_inputs_for(Index T, Index columns, std::uint64_t seed) {
  std::vector<RowMatrix<float>> in;
  if constexpr (Rule::kind == WriteKind::gated) {
    in.push_back(uniform_matrix<float>(T, columns, seed, -0.3, -0.1));
  } else if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta) {
    in.push_back(uniform_matrix<float>(T, 1, seed, 0.1, 0.9));
    if constexpr (Rule::kind == WriteKind::gated_delta)
      in.push_back(uniform_matrix<float>(T, columns, seed + 1, -0.3, -0.1));
  }
  return in;
}

// f(inputs...) with the rule's per-token inputs from `in` (as token_inputs_for made them).
template <class Rule, class F>
void with_token_inputs(const std::vector<RowMatrix<float>>& in, F&& f) {
  if constexpr (Rule::token_inputs == 0)
    f();
  else if constexpr (Rule::token_inputs == 1)
    f(in[0]);
  else
    f(in[0], in[1]);
}

}  // namespace

TEST_CASE("every write rule's backward with a warmed BackwardWorkspace allocates nothing") {
  // The workspace keeps each rule's chunk scratch, the forward's chunk kernel (which rebuilds
  // the chunk states), the per-token buffers and (Delta, GatedDelta) the rebuilt forward data,
  // grown to the longest call. After one call of T = 48, calls of 48, 17, 33 and 5 tokens (5 is
  // shorter than the chunk of 8, 17 and 33 shorter than the Gated backward's chunk when it is
  // larger) allocate nothing: the recomputing backward, stateless and carried, and the saved
  // forward's. The caller's outputs are sized beforehand (they are the caller's allocation).
  // dk = dv = 16: whole packets of float with AVX2 and AVX-512 (the register kernel's path).
  constexpr Index C = 8, dk = 16, dv = 16, warm = 48;
  for_each_write_rule(C, dk, [&](const auto& attn, const char* name, Index columns) {
    using Rule = typename std::decay_t<decltype(attn)>::rule_type;
    INFO(name);
    BackwardWorkspace<float> workspace;
    auto state = attn.make_state(dk, dv);
    SavedForward<float> saved;
    RuleInputGradients<float> d_in;
    StateGradient<float> initial;
    std::size_t held = 0;
    for (const Index T : {warm, warm, Index{17}, Index{33}, Index{5}}) {
      const bool warming = held == 0;
      INFO("T = " << T << (warming ? " (warming)" : ""));
      const RowMatrix<float> Q = random_matrix<float>(T, dk, 61), K = random_matrix<float>(T, dk, 62);
      const RowMatrix<float> V = random_matrix<float>(T, dv, 63), dY = random_matrix<float>(T, dv, 64);
      const std::vector<RowMatrix<float>> in = token_inputs_for<Rule>(T, columns, 65);
      RowMatrix<float> dQ(T, dk), dK(T, dk), dV(T, dv), Y(T, dv);
      // The outputs at this call's sizes (the backward then only writes them).
      static_cast<void>(input_gradient_rows<Rule>(d_in, T, columns));
      initial.S.resize(dk, dv);
      initial.z.resize(Rule::keeps_normalizer ? dk : 0);
      with_token_inputs<Rule>(in, [&](const auto&... x) {
        parallel_saving_into(attn, Q, K, V, x..., Mask::causal, Y, saved);
        const GradientsRef<float> out{dQ, dK, dV};
        const auto calls = [&] {
          parallel_backward_into(attn, Q, K, V, x..., Mask::causal, dY, out, d_in, &initial,
                                 &workspace);
          prefill_backward_into(attn, state, Q, K, V, x..., dY, nullptr, out, d_in, initial,
                                &workspace);
          parallel_backward_into(attn, saved, Q, K, V, x..., Mask::causal, dY, out, d_in,
                                 &initial, &workspace);
        };
        if (warming)
          calls();
        else
          CHECK_NOTHROW(without_allocation(calls));
      });
      CHECK(dQ.allFinite());
      if (warming)
        held = workspace.bytes();
      else
        CHECK(workspace.bytes() == held);
    }
    // Without a workspace the call allocates its scratch (what the workspace saves).
    const RowMatrix<float> Q = random_matrix<float>(warm, dk, 66);
    const std::vector<RowMatrix<float>> in = token_inputs_for<Rule>(warm, columns, 67);
    RowMatrix<float> dQ(warm, dk), dK(warm, dk), dV(warm, dv);
    // (Sized first: an allocation refused inside Eigen's resize would leave a freed pointer.)
    static_cast<void>(input_gradient_rows<Rule>(d_in, warm, columns));
    with_token_inputs<Rule>(in, [&](const auto&... x) {
      CHECK_THROWS_AS(without_allocation([&] {
                        parallel_backward_into(attn, Q, Q, Q, x..., Mask::causal, Q,
                                               GradientsRef<float>{dQ, dK, dV}, d_in, &initial);
                      }),
                      std::logic_error);
    });
  });
}

TEST_CASE("every rule's layer backward with a warmed BackwardWorkspace allocates nothing") {
  // The layer keeps each thread's buffers in a lane of the workspace: the single-head scratch,
  // the head's gradient rows and its per-token inputs' gradients (grown to the longest
  // document) and a query head's share of its group's shared state gradient. So after the
  // longest document has run, packed batches of other document lengths (one of 5 tokens,
  // shorter than the chunk of 8) allocate nothing, stateless and carried, with grouped heads,
  // for Additive and every write rule. Without a workspace the call allocates.
  constexpr Index C = 8, T = 48, Hq = 4, Hkv = 2, dk = 16, dv = 16;
  const auto check = [&](const auto& attn, const char* name, Index columns) {
    using Attention = std::decay_t<decltype(attn)>;
    using Rule = typename Attention::rule_type;
    constexpr std::size_t N = Rule::token_inputs;
    INFO(name);
    const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv}, attn);
    const auto values = [](Index n, std::uint64_t seed, double lo, double hi) {
      const RowMatrix<float> m = uniform_matrix<float>(1, n, seed, lo, hi);
      return std::vector<float>(m.data(), m.data() + m.size());
    };
    const std::vector<float> Q = values(T * Hq * dk, 71, -1, 1), K = values(T * Hkv * dk, 72, -1, 1),
                             V = values(T * Hkv * dv, 73, -1, 1), dY = values(T * Hq * dv, 74, -1, 1);
    std::vector<float> dQ(Q.size()), dK(K.size()), dV(V.size());
    using View = TensorView<const float>;
    const View q = View::batch_first(Q.data(), 1, T, Hq, dk), k = View::batch_first(K.data(), 1, T, Hkv, dk),
               v = View::batch_first(V.data(), 1, T, Hkv, dv), dy = View::batch_first(dY.data(), 1, T, Hq, dv);
    const GradientViews<float> grads{TensorView<float>::batch_first(dQ.data(), 1, T, Hq, dk),
                                     TensorView<float>::batch_first(dK.data(), 1, T, Hkv, dk),
                                     TensorView<float>::batch_first(dV.data(), 1, T, Hkv, dv)};
    // Per-token inputs [1, T, Hkv, c] and their gradients: log-gates and log_alpha (c = 1 or r),
    // beta (c = 1).
    std::array<std::vector<float>, N> in_data, d_in_data;
    std::array<View, N> ins;
    std::array<TensorView<float>, N> d_ins;
    for (std::size_t i = 0; i < N; ++i) {
      const bool is_beta = Rule::kind != WriteKind::gated && i == 0;
      const Index c = is_beta ? 1 : columns;  // beta: one per token
      in_data[i] = is_beta ? values(T * Hkv * c, 75 + i, 0.1, 0.9) : values(T * Hkv * c, 75 + i, -0.3, -0.1);
      d_in_data[i].resize(in_data[i].size());
      ins[i] = View::batch_first(in_data[i].data(), 1, T, Hkv, c);
      d_ins[i] = TensorView<float>::batch_first(d_in_data[i].data(), 1, T, Hkv, c);
    }
    const std::vector<Index> longest{0, 40, 44, 48}, offsets_a{0, 17, 30, 48}, offsets_b{0, 5, 38, 48};
    BackwardWorkspace<float> workspace;
    auto state = layer.make_state(3);
    BatchStateGradient<float> initial(state);
    const auto calls = [&](const SequenceLayout& layout) {
      std::apply(
          [&](const auto&... x) {
            std::apply(
                [&](const auto&... d) {
                  parallel_backward_into(layer, q, k, v, x..., Mask::causal, dy, grads, d...,
                                         layout, &workspace);
                  prefill_backward_into(layer, state, q, k, v, x..., dy, nullptr, grads, d...,
                                        initial, layout, &workspace);
                },
                d_ins);
          },
          ins);
    };
    calls(SequenceLayout::packed(longest));
    const std::size_t held = workspace.bytes();
    for (const auto* offsets : {&offsets_a, &offsets_b}) {
      const SequenceLayout layout = SequenceLayout::packed(*offsets);
      CHECK_NOTHROW(without_allocation([&] { calls(layout); }));
    }
    CHECK(workspace.bytes() == held);
    CHECK(std::all_of(dQ.begin(), dQ.end(), [](float x) { return std::isfinite(x); }));
    // Without a workspace the call allocates its buffers (what the workspace saves).
    std::apply(
        [&](const auto&... x) {
          std::apply(
              [&](const auto&... d) {
                CHECK_THROWS_AS(without_allocation([&] {
                                  parallel_backward_into(layer, q, k, v, x..., Mask::causal, dy,
                                                         grads, d...,
                                                         SequenceLayout::packed(offsets_a));
                                }),
                                std::logic_error);
              },
              d_ins);
        },
        ins);
  };
  check(LinearAttention<EluPlusOne, float>(EluPlusOne{}, Options{{}, C}), "additive", 0);
  for_each_write_rule(C, dk, check);
}

}  // namespace allocation_test
