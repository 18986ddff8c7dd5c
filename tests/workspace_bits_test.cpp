// A BackwardWorkspace whose buffers were made for a longer chunk serves a call of one shorter
// chunk (a short document after longer ones) with the bits of buffers made for that call, at
// the packet width of the build. This file is also built for the host's instruction set
// (native_tests in CMakeLists.txt): there Eigen's vectorized exp rounds its packets and its
// scalar tail differently, so a value's place in a buffer could change its bits. The cases put
// values where that would show: lengths n with n * n not a multiple of 8 or 16 (the Gated
// chunk's n x n weights end in a scalar tail), r = 12 features (per-channel sub-chunk blocks
// that would start off a packet boundary if they were placed by the chunk's rows), chunks of
// 40 rows (three sub-chunks of 16), and for the delta rules padded widths of 16 against 48.

#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <vector>

#include "test_support.hpp"

namespace workspace_bits_test {  // this file's own names: it also builds inside native_tests

using namespace linattn;
using linattn_test::random_matrix;
using linattn_test::uniform_matrix;

namespace {

constexpr Index kChunk = 40, kDk = 12, kDv = 16;
// The warming call (three chunks), then single chunks of these lengths (33 to 39: three
// sub-chunks; 6 to 14: n * n = 4 or 9 past a multiple of 8 and 16), then the warming length
// again.
constexpr Index kWarm = 120;
constexpr Index kLengths[] = {37, 10, 14, 6, 11, 13, 33, 34, 35, 36, 38, 39, kWarm};

// Inputs of one call of T tokens for `Rule` (log-gates in [-0.2, 0) with `gate_columns`
// columns, so that decays across a chunk stay away from 0; beta in [0, 1], log_alpha in
// [-0.2, 0)).
template <class Rule, class Scalar>
struct Call {
  RowMatrix<Scalar> Q, K, V, dY, log_gate;
  ColVector<Scalar> beta, log_alpha;

  Call(Index T, Index gate_columns, std::uint64_t seed)
      : Q(random_matrix<Scalar>(T, kDk, seed)),
        K(random_matrix<Scalar>(T, kDk, seed + 1)),
        V(random_matrix<Scalar>(T, kDv, seed + 2)),
        dY(random_matrix<Scalar>(T, kDv, seed + 3)),
        log_gate(uniform_matrix<Scalar>(T, gate_columns, seed + 4, -0.2, 0.0)),
        beta(uniform_matrix<Scalar>(T, 1, seed + 5, 0.0, 1.0)),
        log_alpha(uniform_matrix<Scalar>(T, 1, seed + 6, -0.2, 0.0)) {}

  template <class F>
  void with_inputs(F&& f) const {
    if constexpr (Rule::kind == WriteKind::gated)
      f(log_gate);
    else if constexpr (Rule::kind == WriteKind::delta)
      f(beta);
    else if constexpr (Rule::kind == WriteKind::gated_delta)
      f(beta, log_alpha);
    else
      f();
  }
};

// Every gradient of the three backward calls (stateless, carried, from a saved forward).
template <class Scalar>
struct Results {
  RowMatrix<Scalar> dQ, dK, dV;
  RuleInputGradients<Scalar> d_in;
  StateGradient<Scalar> initial;
};

template <class Scalar>
void check_same(const Results<Scalar>& a, const Results<Scalar>& b) {
  CHECK(a.dQ == b.dQ);
  CHECK(a.dK == b.dK);
  CHECK(a.dV == b.dV);
  CHECK(a.d_in.log_gate == b.d_in.log_gate);
  CHECK(a.d_in.beta == b.d_in.beta);
  CHECK(a.d_in.log_alpha == b.d_in.log_alpha);
  CHECK(a.initial.S == b.initial.S);
  CHECK(a.initial.z == b.initial.z);
}

// The three backward calls of `call` through `workspace` (null: none), each into its Results.
template <class Attention, class Call>
std::vector<Results<typename Attention::scalar_type>> backward_calls(
    const Attention& attn, const typename Attention::State& state, const Call& call,
    BackwardWorkspace<typename Attention::scalar_type>* workspace) {
  using Scalar = typename Attention::scalar_type;
  const Index T = call.Q.rows();
  std::vector<Results<Scalar>> out(3);
  for (auto& r : out) {
    r.dQ.resize(T, kDk);
    r.dK.resize(T, kDk);
    r.dV.resize(T, kDv);
  }
  call.with_inputs([&](const auto&... in) {
    const auto grads = [](Results<Scalar>& r) { return GradientsRef<Scalar>{r.dQ, r.dK, r.dV}; };
    parallel_backward_into(attn, call.Q, call.K, call.V, in..., Mask::causal, call.dY,
                           grads(out[0]), out[0].d_in, &out[0].initial, workspace);
    const StateGradient<Scalar> final_gradient{
        random_matrix<Scalar>(kDk, kDv, 91),
        Attention::rule_type::keeps_normalizer ? random_matrix<Scalar>(kDk, 1, 92).col(0).eval()
                                               : ColVector<Scalar>()};
    prefill_backward_into(attn, state, call.Q, call.K, call.V, in..., call.dY, &final_gradient,
                          grads(out[1]), out[1].d_in, out[1].initial, workspace);
    SavedForward<Scalar> saved;
    RowMatrix<Scalar> Y(T, kDv);
    parallel_saving_into(attn, call.Q, call.K, call.V, in..., Mask::causal, Y, saved);
    parallel_backward_into(attn, saved, call.Q, call.K, call.V, in..., Mask::causal, call.dY,
                           grads(out[2]), out[2].d_in, &out[2].initial, workspace);
  });
  return out;
}

template <class Attention>
void check_rule(const Attention& attn, Index gate_columns) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  auto state = attn.make_state(kDk, kDv);
  {  // a state to continue: the forward over some tokens from zero
    const Call<Rule, Scalar> prefix(24, gate_columns, 81);
    prefix.with_inputs([&](const auto&... in) {
      static_cast<void>(attn.prefill(state, prefix.Q, prefix.K, prefix.V, in...));
    });
  }
  BackwardWorkspace<Scalar> workspace;
  std::uint64_t seed = 100;
  const Call<Rule, Scalar> warm(kWarm, gate_columns, seed);
  static_cast<void>(backward_calls(attn, state, warm, &workspace));
  for (const Index T : kLengths) {
    INFO("T = " << T);
    seed += 10;
    const Call<Rule, Scalar> call(T, gate_columns, seed);
    const auto kept = backward_calls(attn, state, call, &workspace);
    const auto fresh = backward_calls(attn, state, call, nullptr);
    for (std::size_t i = 0; i < kept.size(); ++i) {
      INFO((i == 0 ? "stateless" : i == 1 ? "carried" : "from a saved forward"));
      CHECK(kept[i].dQ.allFinite());
      check_same(kept[i], fresh[i]);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("a kept workspace serves a shorter chunk with the bits of buffers for it",
                   "[workspace]", float, double) {
  using Scalar = TestType;
  Options strict{Normalization::strict(), kChunk};
  Options plain{Normalization::unnormalized(), kChunk};
  const Index r = EluPlusOne{}.feature_dim(kDk);
  SECTION("Decay") {
    check_rule(RuleAttention<EluPlusOne, Decay, Scalar>(EluPlusOne{}, Decay(0.9), strict), 0);
  }
  SECTION("Gated, one gate per token") {
    check_rule(RuleAttention<EluPlusOne, Gated, Scalar>(EluPlusOne{}, strict), 1);
  }
  SECTION("Gated, one gate per channel") {
    check_rule(RuleAttention<EluPlusOne, Gated, Scalar>(EluPlusOne{}, strict), r);
  }
  SECTION("Delta") {
    check_rule(RuleAttention<L2Normalize, Delta, Scalar>(L2Normalize{}, plain), 1);
  }
  SECTION("GatedDelta") {
    check_rule(RuleAttention<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, plain), 1);
  }
}

}  // namespace workspace_bits_test
