// The write rules' saved forward (linattn/rule_saved_forward.hpp): the saving forward against
// the plain forward (outputs and state bit for bit), the backward from it against the
// recomputing backward (bit for bit: both run the same chunk code on the forward's states),
// central differences in double through the saved backward with chunks of several per-channel
// sub-chunks, segments, errors and the memory figures. Decay, Gated with one gate per token and
// per channel; float and double. Delta and GatedDelta (L2-normalized keys, GatedDelta with one
// log_alpha per token and per channel) in the bitwise test; per-channel GatedDelta also through
// central differences, and in the errors and memory figures.

#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>

namespace rule_saved_forward_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::MatrixXdR;
using linattn_test::random_matrix;
using linattn_test::uniform_matrix;

namespace {

enum class Gates { decay, scalar, channel, delta, gated_delta, channel_delta };

const char* name_of(Gates g) {
  switch (g) {
    case Gates::decay: return "decay";
    case Gates::scalar: return "gated, one gate per token";
    case Gates::channel: return "gated per channel";
    case Gates::delta: return "delta";
    case Gates::gated_delta: return "gated delta";
    case Gates::channel_delta: return "gated delta, per-channel log_alpha";
  }
  return "?";
}

template <class Scalar>
Options options_for(Index chunk, Normalization norm) {
  Options o;
  o.normalization = norm;
  o.chunk_size = chunk;
  return o;
}

// One call's inputs: Q, K, V, dY ~ N(0, 1); log-gates uniform in [-2, 0) with -30 and -1e-6
// planted; betas in [0, 1] with 0 and 1 planted, log-alphas in [-1, 0) (T x r when
// `channel_alpha`: per-channel GatedDelta takes those); an initial state
// S0 ~ N(0, 0.25), z0 in [0.5, 1.5) (positive: strict reads defined); a final-state gradient.
template <class Scalar>
struct Case {
  RowMatrix<Scalar> Q, K, V, dY, log_gate, S0, WS;
  ColVector<Scalar> z0, wz, beta, log_alpha;
  RowMatrix<Scalar> alpha_rows;  // T x r
  bool channel_alpha = false;
};

template <class Scalar>
Case<Scalar> make_case(Index T, Index dk, Index dv, Index r, bool per_channel,
                       std::uint64_t seed) {
  Case<Scalar> c;
  c.Q = random_matrix<Scalar>(T, dk, seed);
  c.K = random_matrix<Scalar>(T, dk, seed + 1);
  c.V = random_matrix<Scalar>(T, dv, seed + 2);
  c.dY = random_matrix<Scalar>(T, dv, seed + 3);
  c.log_gate = uniform_matrix<Scalar>(T, per_channel ? r : 1, seed + 4, -2.0, 0.0);
  if (T >= 3) {
    c.log_gate(0, 0) = Scalar(-30);
    c.log_gate(2, 0) = Scalar(-1e-6);
  }
  c.S0 = random_matrix<Scalar>(r, dv, seed + 5, 0.25);
  c.z0 = uniform_matrix<Scalar>(r, 1, seed + 6, 0.5, 1.5);
  c.WS = random_matrix<Scalar>(r, dv, seed + 7);
  c.wz = random_matrix<Scalar>(r, 1, seed + 8);
  c.beta = uniform_matrix<Scalar>(T, 1, seed + 9, 0.0, 1.0);
  c.log_alpha = uniform_matrix<Scalar>(T, 1, seed + 10, -1.0, 0.0);
  c.alpha_rows = uniform_matrix<Scalar>(T, r, seed + 11, -1.0, 0.0);
  if (T >= 3) {
    c.beta(0) = 0;
    c.beta(T - 1) = 1;
  }
  return c;
}

// f(attn, inputs...) with the rule's per-token inputs (none for Decay).
template <class Attn, class Scalar, class F>
decltype(auto) with_inputs(const Attn&, const Case<Scalar>& c, F&& f) {
  constexpr WriteKind kind = Attn::rule_type::kind;
  if constexpr (kind == WriteKind::gated)
    return f(c.log_gate);
  else if constexpr (kind == WriteKind::delta)
    return f(c.beta);
  else if constexpr (kind == WriteKind::gated_delta)
    return c.channel_alpha ? f(c.beta, c.alpha_rows) : f(c.beta, c.log_alpha);
  else
    return f();
}

// The saving forward against the plain forward (Y and the state after it, bit for bit), then
// the backward from the saved states against the recomputing backward from the same initial
// state (every gradient bit for bit), with and without a final-state gradient.
template <class Attn>
void check_bitwise(const Attn& attn, const Case<typename Attn::scalar_type>& c,
                   bool with_initial_state) {
  using Scalar = typename Attn::scalar_type;
  constexpr bool keeps_z = Attn::rule_type::keeps_normalizer;
  const Index T = c.Q.rows(), dk = c.Q.cols(), dv = c.V.cols();
  CAPTURE(T, dk, dv, with_initial_state, attn.chunk_size(attn.feature_dim(dk), dv));
  auto initial = attn.make_state(dk, dv);
  if (with_initial_state) {
    if constexpr (keeps_z)
      initial.assign(c.S0, c.z0);
    else
      initial.assign(c.S0);
  }
  // Every per-token input's gradient (empty where the rule has none): the same bits.
  const auto same_inputs = [](const RuleInputGradients<Scalar>& a,
                              const RuleInputGradients<Scalar>& b) {
    return a.log_gate == b.log_gate && a.beta == b.beta && a.log_alpha == b.log_alpha;
  };
  auto plain_state = initial;
  auto saving_state = initial;
  const RowMatrix<Scalar> Y = with_inputs(attn, c, [&](const auto&... in) {
    return attn.prefill(plain_state, c.Q, c.K, c.V, in...);
  });
  RowMatrix<Scalar> Ys(T, dv);
  SavedForward<Scalar> saved;
  with_inputs(attn, c, [&](const auto&... in) {
    prefill_saving_into(attn, saving_state, c.Q, c.K, c.V, in..., Ys, saved);
  });
  CHECK(Ys == Y);
  CHECK(saving_state.S() == plain_state.S());
  if constexpr (keeps_z) CHECK(saving_state.z() == plain_state.z());
  CHECK(saving_state.tokens() == plain_state.tokens());
  CHECK(saved.tokens() == T);
  CHECK(saved.bytes() == saved_forward_bytes(attn, T, dk, dv, c.channel_alpha));

  const StateGradient<Scalar> final_gradient{c.WS, keeps_z ? c.wz : ColVector<Scalar>()};
  for (const StateGradient<Scalar>* fg : {&final_gradient, static_cast<const StateGradient<Scalar>*>(nullptr)}) {
    INFO((fg != nullptr ? "with a final-state gradient" : "without a final-state gradient"));
    const auto ref = with_inputs(attn, c, [&](const auto&... in) {
      return prefill_backward(attn, initial, c.Q, c.K, c.V, in..., c.dY, fg);
    });
    const auto got = with_inputs(attn, c, [&](const auto&... in) {
      return prefill_backward(attn, saved, c.Q, c.K, c.V, in..., c.dY, fg);
    });
    CHECK(got.Q == ref.Q);
    CHECK(got.K == ref.K);
    CHECK(got.V == ref.V);
    CHECK(same_inputs(got.inputs, ref.inputs));
    CHECK(got.initial.S == ref.initial.S);
    CHECK(got.initial.z == ref.initial.z);
  }
  if (!with_initial_state) {
    // The stateless forms: parallel_saving_into and parallel_backward(_into).
    RowMatrix<Scalar> Yp(T, dv);
    SavedForward<Scalar> saved_p;
    with_inputs(attn, c, [&](const auto&... in) {
      parallel_saving_into(attn, c.Q, c.K, c.V, in..., Mask::causal, Yp, saved_p);
    });
    CHECK(Yp == Y);
    const auto ref = with_inputs(attn, c, [&](const auto&... in) {
      return parallel_backward(attn, c.Q, c.K, c.V, in..., Mask::causal, c.dY);
    });
    const auto got = with_inputs(attn, c, [&](const auto&... in) {
      return parallel_backward(attn, saved_p, c.Q, c.K, c.V, in..., Mask::causal, c.dY);
    });
    CHECK(got.Q == ref.Q);
    CHECK(got.K == ref.K);
    CHECK(got.V == ref.V);
    CHECK(same_inputs(got.inputs, ref.inputs));
    // _into on head 1's columns of [T, 2 d] buffers: the same bits.
    RowMatrix<Scalar> dQ = RowMatrix<Scalar>::Zero(T, 2 * dk), dK = dQ,
                      dV = RowMatrix<Scalar>::Zero(T, 2 * dv);
    using View = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
    View q(dQ.data() + dk, T, dk, Eigen::OuterStride<>(2 * dk));
    View k(dK.data() + dk, T, dk, Eigen::OuterStride<>(2 * dk));
    View v(dV.data() + dv, T, dv, Eigen::OuterStride<>(2 * dv));
    RuleInputGradients<Scalar> d_in;
    StateGradient<Scalar> init;
    with_inputs(attn, c, [&](const auto&... in) {
      parallel_backward_into(attn, saved_p, c.Q, c.K, c.V, in..., Mask::causal, c.dY,
                             GradientsRef<Scalar>{q, k, v}, d_in, &init);
    });
    CHECK(RowMatrix<Scalar>(q) == ref.Q);
    CHECK(RowMatrix<Scalar>(k) == ref.K);
    CHECK(RowMatrix<Scalar>(v) == ref.V);
    CHECK(same_inputs(d_in, ref.inputs));
    CHECK(init.S == ref.initial.S);
    CHECK(dQ.leftCols(dk).cwiseAbs().maxCoeff() == Scalar(0));
  }
}

template <class Scalar>
void run_bitwise(Gates gates, Index T, Index dk, Index dv, Index chunk, Normalization norm) {
  INFO(name_of(gates) << ", chunk " << chunk);
  const Options options = options_for<Scalar>(chunk, norm);
  const EluPlusOne phi;
  const Index r = phi.feature_dim(dk);
  auto c = make_case<Scalar>(T, dk, dv, r, gates == Gates::channel, 301 + T);
  c.channel_alpha = gates == Gates::channel_delta;
  for (const bool with_state : {false, true}) {
    if (gates == Gates::decay)
      check_bitwise(RuleAttention<EluPlusOne, Decay, Scalar>(phi, Decay(0.9), options), c,
                    with_state);
    else if (gates == Gates::delta)
      check_bitwise(RuleAttention<L2Normalize, Delta, Scalar>(L2Normalize{}, Delta{}, options), c,
                    with_state);
    else if (gates == Gates::gated_delta || gates == Gates::channel_delta)
      check_bitwise(
          RuleAttention<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, GatedDelta{}, options), c,
          with_state);
    else
      check_bitwise(RuleAttention<EluPlusOne, Gated, Scalar>(phi, Gated{}, options), c,
                    with_state);
  }
}

}  // namespace

TEST_CASE("saving forward: the forward's bits; backward from it: the recomputing backward's bits") {
  // T = 1, T a multiple of the chunk, T not a multiple of it; the automatic chunk (32 at d = 16;
  // at d = 128 in float the forward's is 16 and the backward's 32, two forward chunks per saved
  // state) and chunks of several per-channel sub-chunks (40, 64); value widths on the register
  // kernel (16) and off it (5); strict and unnormalized reads.
  struct Shape {
    Index T, dk, dv, chunk;
  };
  constexpr Shape shapes[] = {{1, 16, 16, kAuto},  {64, 16, 16, kAuto},
                              {77, 16, 16, kAuto}, {77, 8, 5, 40},
                              {150, 16, 16, 64},            {45, 3, 2, 4},
                              {70, 128, 128, kAuto}};
  for (const Shape s : shapes)
    for (const Gates g : {Gates::decay, Gates::scalar, Gates::channel, Gates::delta,
                          Gates::gated_delta, Gates::channel_delta})
      for (const bool strict : {true, false}) {
        if ((g == Gates::delta || g == Gates::gated_delta || g == Gates::channel_delta) && strict)
          continue;  // they never divide
        const Normalization norm = strict ? Normalization::strict() : Normalization::unnormalized();
        INFO("T " << s.T << ", dk " << s.dk << ", dv " << s.dv << (strict ? ", strict" : ", unnormalized"));
        run_bitwise<float>(g, s.T, s.dk, s.dv, s.chunk, norm);
        run_bitwise<double>(g, s.T, s.dk, s.dv, s.chunk, norm);
      }
}

namespace {

// Central differences in double of the loss L = sum(WY .* Y) + sum(WS .* S_T) + sum(wz .* z_T)
// through the plain forward, against the backward from the saved states, entry by entry. Step
// h = 1e-4 on O(1) inputs: truncation h^2 |f'''| / 6 (about 2e-9 |f'''|, |f'''| well below 100
// here) and rounding about u |L| / h (about 1e-12 |L|): tol = 1e-6 (1 + |analytic|) covers both,
// as in rule_gradients_test.
template <class Attn>
void check_fd_saved(const Attn& attn, Case<double> c) {
  constexpr bool keeps_z = Attn::rule_type::keeps_normalizer;
  const Index T = c.Q.rows(), dk = c.Q.cols(), dv = c.V.cols();
  auto initial = attn.make_state(dk, dv);
  const auto start = [&](auto& st) {
    if constexpr (keeps_z)
      st.assign(c.S0, c.z0);
    else
      st.assign(c.S0);
  };
  const auto loss = [&] {
    auto st = attn.make_state(dk, dv);
    start(st);
    const RowMatrix<double> Y = with_inputs(attn, c, [&](const auto&... in) {
      return attn.prefill(st, c.Q, c.K, c.V, in...);
    });
    double l = (c.dY.array() * Y.array()).sum() + (c.WS.array() * st.S().array()).sum();
    if constexpr (keeps_z) l += (c.wz.array() * st.z().array()).sum();
    return l;
  };
  start(initial);
  RowMatrix<double> Y(T, dv);
  SavedForward<double> saved;
  with_inputs(attn, c, [&](const auto&... in) {
    prefill_saving_into(attn, initial, c.Q, c.K, c.V, in..., Y, saved);
  });
  const StateGradient<double> fg{c.WS, keeps_z ? c.wz : ColVector<double>()};
  const auto g = with_inputs(attn, c, [&](const auto&... in) {
    return prefill_backward(attn, saved, c.Q, c.K, c.V, in..., c.dY, &fg);
  });
  constexpr double h = 1e-4, tol = 1e-6;
  const auto check = [&](const char* what, auto& x, const auto& analytic, double hi) {
    INFO(what);
    REQUIRE(analytic.rows() == x.rows());
    REQUIRE(analytic.cols() == x.cols());
    for (Index i = 0; i < x.rows(); ++i)
      for (Index j = 0; j < x.cols(); ++j) {
        const double x0 = x(i, j);
        double numeric = 0;
        if (x0 + h <= hi) {
          x(i, j) = x0 + h;
          const double fp = loss();
          x(i, j) = x0 - h;
          numeric = (fp - loss()) / (2 * h);
        } else {  // one-sided 3-point formula, staying in the domain (log-gates <= 0)
          const double f0 = loss();
          x(i, j) = x0 - h;
          const double f1 = loss();
          x(i, j) = x0 - 2 * h;
          numeric = -(-3 * f0 + 4 * f1 - loss()) / (2 * h);
        }
        x(i, j) = x0;
        const double a = analytic(i, j);
        INFO("entry (" << i << ", " << j << "): numeric " << numeric << ", analytic " << a);
        CHECK(std::abs(numeric - a) <= tol * (1 + std::abs(a)));
      }
  };
  constexpr double inf = std::numeric_limits<double>::infinity();
  check("Q", c.Q, g.Q, inf);
  check("K", c.K, g.K, inf);
  check("V", c.V, g.V, inf);
  check("S0", c.S0, g.initial.S, inf);
  if constexpr (keeps_z) check("z0", c.z0, g.initial.z, inf);
  if constexpr (Attn::rule_type::kind == WriteKind::gated)
    check("log_gate", c.log_gate, g.inputs.log_gate, 0.0);
  if constexpr (Attn::rule_type::kind == WriteKind::gated_delta) {
    check("beta", c.beta, g.inputs.beta, inf);
    if (c.channel_alpha)
      check("log_alpha (per channel)", c.alpha_rows, g.inputs.log_alpha, 0.0);
    else
      check("log_alpha", c.log_alpha, g.inputs.log_alpha, 0.0);
  }
}

}  // namespace

TEST_CASE("finite differences through the saved backward, chunks of several sub-chunks") {
  // Chunk 40: sub-chunks of 16, 16 and 8 rows (the per-channel path's products across
  // sub-chunks), T = 45 (a second, partial chunk).
  constexpr Index T = 45, dk = 3, dv = 2;
  for (const bool strict : {true, false}) {
    INFO((strict ? "strict" : "unnormalized"));
    const Options options =
        options_for<double>(40, strict ? Normalization::strict() : Normalization::unnormalized());
    for (const bool per_channel : {true, false}) {
      INFO((per_channel ? "per channel" : "one gate per token"));
      check_fd_saved(RuleAttention<EluPlusOne, Gated, double>(EluPlusOne{}, Gated{}, options),
                     make_case<double>(T, dk, dv, dk, per_channel, 401));
    }
    check_fd_saved(RuleAttention<EluPlusOne, Decay, double>(EluPlusOne{}, Decay(0.8), options),
                   make_case<double>(T, dk, dv, dk, false, 411));
  }
  // Per-channel GatedDelta (L2-normalized keys, r = dk), the same shape in chunks of 40 and 8.
  for (const Index chunk : {40, 8}) {
    INFO("per-channel GatedDelta, chunk " << chunk);
    auto c = make_case<double>(T, dk, dv, dk, false, 421);
    c.channel_alpha = true;
    c.beta(0) = 0.25;  // off the planted 0: the central difference stays inside [0, 2]
    check_fd_saved(RuleAttention<L2Normalize, GatedDelta, double>(
                       L2Normalize{}, GatedDelta{},
                       options_for<double>(chunk, Normalization::unnormalized())),
                   c);
  }
}

TEST_CASE("segments: saved forwards chained through the state gradient give the whole call's bits") {
  // Segments of whole chunks: the second segment's saved states are the whole call's, so
  // chaining the backwards (the initial gradient of segment 2 is the final gradient of
  // segment 1) gives the whole backward's bits.
  constexpr Index T = 96, split = 64, d = 16;
  const RuleAttention<EluPlusOne, Gated, float> attn(EluPlusOne{}, Gated{},
                                                      options_for<float>(32, Normalization::strict()));
  const auto c = make_case<float>(T, d, d, d, true, 501);
  auto state = attn.make_state(d, d);
  RowMatrix<float> Y(T, d), Y1(split, d), Y2(T - split, d);
  SavedForward<float> whole, first, second;
  parallel_saving_into(attn, c.Q, c.K, c.V, c.log_gate, Mask::causal, Y, whole);
  prefill_saving_into(attn, state, c.Q.topRows(split), c.K.topRows(split), c.V.topRows(split),
                      c.log_gate.topRows(split), Y1, first);
  prefill_saving_into(attn, state, c.Q.bottomRows(T - split), c.K.bottomRows(T - split),
                      c.V.bottomRows(T - split), c.log_gate.bottomRows(T - split), Y2, second);
  CHECK(Y1 == Y.topRows(split));
  CHECK(Y2 == Y.bottomRows(T - split));
  const auto g = parallel_backward(attn, whole, c.Q, c.K, c.V, c.log_gate, Mask::causal, c.dY);
  const auto g2 = prefill_backward(attn, second, c.Q.bottomRows(T - split), c.K.bottomRows(T - split),
                                   c.V.bottomRows(T - split), c.log_gate.bottomRows(T - split),
                                   c.dY.bottomRows(T - split));
  const auto g1 = prefill_backward(attn, first, c.Q.topRows(split), c.K.topRows(split),
                                   c.V.topRows(split), c.log_gate.topRows(split),
                                   c.dY.topRows(split), &g2.initial);
  CHECK(g1.Q == g.Q.topRows(split));
  CHECK(g2.Q == g.Q.bottomRows(T - split));
  CHECK(g1.K == g.K.topRows(split));
  CHECK(g2.V == g.V.bottomRows(T - split));
  CHECK(g1.V == g.V.topRows(split));
  // The per-token gate gradients of segment 1 carry segment 2's sum through the final-state
  // term (rowsum(S_T .* dS_T)) instead of token by token: the same sum in another order, so
  // only the later segment's (no carried term) is compared bit for bit.
  CHECK(g2.inputs.log_gate == g.inputs.log_gate.bottomRows(T - split));
}

TEST_CASE("rule saved forward: errors") {
  constexpr Index T = 20, dk = 4, dv = 3;
  const EluPlusOne phi;
  const RuleAttention<EluPlusOne, Gated, double> attn(phi, Gated{},
                                                       options_for<double>(8, Normalization::strict()));
  const auto c = make_case<double>(T, dk, dv, dk, false, 601);
  RowMatrix<double> Y(T, dv);
  SavedForward<double> saved;
  parallel_saving_into(attn, c.Q, c.K, c.V, c.log_gate, Mask::causal, Y, saved);
  // Output of the wrong shape; gates of the wrong length; positive log-gates.
  RowMatrix<double> bad_Y(T, dv + 1);
  SavedForward<double> other;
  CHECK_THROWS_AS(parallel_saving_into(attn, c.Q, c.K, c.V, c.log_gate, Mask::causal, bad_Y, other),
                  ShapeError);
  const RowMatrix<double> short_gates = c.log_gate.topRows(T - 1);
  CHECK_THROWS_AS(parallel_saving_into(attn, c.Q, c.K, c.V, short_gates, Mask::causal, Y, other),
                  ShapeError);
  RowMatrix<double> positive = c.log_gate;
  positive(3, 0) = 0.5;
  CHECK_THROWS_AS(parallel_saving_into(attn, c.Q, c.K, c.V, positive, Mask::causal, Y, other),
                  std::invalid_argument);
  CHECK(other.tokens() == 0);
  // A saved forward of another length, dk, dv: ShapeError naming the shapes.
  const RowMatrix<double> Q_short = c.Q.topRows(T - 1), K_short = c.K.topRows(T - 1),
                          V_short = c.V.topRows(T - 1), dY_short = c.dY.topRows(T - 1),
                          g_short = c.log_gate.topRows(T - 1);
  try {
    static_cast<void>(parallel_backward(attn, saved, Q_short, K_short, V_short, g_short,
                                        Mask::causal, dY_short));
    FAIL("no ShapeError");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("20 tokens") != std::string::npos);
    CHECK(std::string(e.what()).find("19x4") != std::string::npos);
  }
  const RowMatrix<double> V_wide = random_matrix<double>(T, dv + 1, 9), dY_wide = V_wide;
  CHECK_THROWS_AS(parallel_backward(attn, saved, c.Q, c.K, V_wide, c.log_gate, Mask::causal, dY_wide),
                  ShapeError);
  // Another chunk size; another attention (rule, map); a bad dY; a bad final gradient.
  const RuleAttention<EluPlusOne, Gated, double> chunk4(phi, Gated{},
                                                         options_for<double>(4, Normalization::strict()));
  CHECK_THROWS_AS(parallel_backward(chunk4, saved, c.Q, c.K, c.V, c.log_gate, Mask::causal, c.dY),
                  ShapeError);
  const RuleAttention<EluPlusOne, Decay, double> decay(phi, Decay(0.5),
                                                        options_for<double>(8, Normalization::strict()));
  CHECK_THROWS_AS(parallel_backward(decay, saved, c.Q, c.K, c.V, Mask::causal, c.dY),
                  StateMismatchError);
  const RowMatrix<double> bad_dY(T, dv + 1);
  CHECK_THROWS_AS(parallel_backward(attn, saved, c.Q, c.K, c.V, c.log_gate, Mask::causal, bad_dY),
                  ShapeError);
  const StateGradient<double> bad_final{RowMatrix<double>::Zero(dk + 1, dv), ColVector<double>::Zero(dk)};
  CHECK_THROWS_AS(prefill_backward(attn, saved, c.Q, c.K, c.V, c.log_gate, c.dY, &bad_final),
                  ShapeError);
  // A state made by another attention; a forward that throws (a denominator <= 0 under the
  // strict policy) leaves the saved forward empty.
  const RuleAttention<Identity, Gated, double> identity(Identity{}, Gated{},
                                                        options_for<double>(8, Normalization::strict()));
  auto foreign = identity.make_state(dk, dv);
  CHECK_THROWS_AS(prefill_saving_into(attn, foreign, c.Q, c.K, c.V, c.log_gate, Y, other),
                  StateMismatchError);
  const RowMatrix<double> negative_keys = -c.Q.cwiseAbs();
  SavedForward<double> failed;
  parallel_saving_into(identity, c.Q.cwiseAbs(), c.Q.cwiseAbs(), c.V, c.log_gate, Mask::causal, Y,
                       failed);
  CHECK(failed.tokens() == T);
  CHECK_THROWS_AS(parallel_saving_into(identity, c.Q.cwiseAbs(), negative_keys, c.V, c.log_gate,
                                       Mask::causal, Y, failed),
                  DenominatorError);
  CHECK(failed.tokens() == 0);
}

TEST_CASE("rule saved forward: GatedDelta's saved data is for its kind of log_alpha") {
  // A forward saved with per-channel log_alpha keeps the chunk states only, one saved with one
  // log_alpha per token also each token's rows: a backward given the other kind is refused
  // (ShapeError naming both), not read out of bounds.
  constexpr Index T = 20, d = 4;
  const RuleAttention<L2Normalize, GatedDelta, double> attn(
      L2Normalize{}, GatedDelta{}, options_for<double>(8, Normalization::unnormalized()));
  auto c = make_case<double>(T, d, d, d, false, 611);
  RowMatrix<double> Y(T, d);
  SavedForward<double> by_channel, by_token;
  parallel_saving_into(attn, c.Q, c.K, c.V, c.beta, c.alpha_rows, Mask::causal, Y, by_channel);
  parallel_saving_into(attn, c.Q, c.K, c.V, c.beta, c.log_alpha, Mask::causal, Y, by_token);
  try {
    static_cast<void>(
        parallel_backward(attn, by_channel, c.Q, c.K, c.V, c.beta, c.log_alpha, Mask::causal, c.dY));
    FAIL("no ShapeError");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("per-channel log_alpha (T x r)") != std::string::npos);
    CHECK(std::string(e.what()).find("20x1") != std::string::npos);
  }
  try {
    static_cast<void>(
        parallel_backward(attn, by_token, c.Q, c.K, c.V, c.beta, c.alpha_rows, Mask::causal, c.dY));
    FAIL("no ShapeError");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("one log_alpha per token") != std::string::npos);
    CHECK(std::string(e.what()).find("20x4") != std::string::npos);
  }
  // A saved forward reused for the other kind is refilled for it.
  parallel_saving_into(attn, c.Q, c.K, c.V, c.beta, c.log_alpha, Mask::causal, Y, by_channel);
  CHECK(by_channel.bytes() == saved_forward_bytes(attn, T, d, d, false));
  CHECK_NOTHROW(
      parallel_backward(attn, by_channel, c.Q, c.K, c.V, c.beta, c.log_alpha, Mask::causal, c.dY));
}

TEST_CASE("rule saved forward: memory figures") {
  const RuleAttention<EluPlusOne, Gated, float> attn;
  // r = dv = 128 in float: the forward's automatic chunk is 16, the backward's 32, so the saved
  // forward holds ceil(8192 / 32) (128 * 128 + 128) floats.
  CHECK(attn.chunk_size(128, 128) == 16);
  CHECK(detail::backward_chunk_size(attn, 128, 128) == 32);
  CHECK(saved_forward_bytes(attn, 8192, 128, 128) == std::size_t{16908288});
  CHECK(saved_forward_bytes(attn, 0, 128, 128) == 0);
  // The backward from saved states allocates nothing per token; the recomputing one 2 scalars.
  CHECK(saved_backward_bytes(attn, 8192, 64, 64) == saved_backward_bytes(attn, 65536, 64, 64));
  CHECK(rule_backward_bytes(attn, 8192, 64, 64) - rule_backward_bytes(attn, 4096, 64, 64) ==
        std::size_t{2 * 4096 * sizeof(float)});
  const RowMatrix<float> Q = random_matrix<float>(100, 64, 1), K = random_matrix<float>(100, 64, 2),
                         V = random_matrix<float>(100, 64, 3);
  const RowMatrix<float> gates = uniform_matrix<float>(100, 64, 4, -1.0, 0.0);
  RowMatrix<float> Y(100, 64);
  SavedForward<float> saved;
  parallel_saving_into(attn, Q, K, V, gates, Mask::causal, Y, saved);
  CHECK(saved.bytes() == saved_forward_bytes(attn, 100, 64, 64));
  CHECK(saved.chunks() == (100 + attn.chunk_size(64, 64) - 1) / attn.chunk_size(64, 64));
  // The delta rules keep the forward kernel's data: the state before each forward chunk of C
  // rows and two rows of dv per token (u_t, g_t); their backward from it nothing per token.
  const RuleAttention<L2Normalize, Delta, float> delta;
  const Index C = delta.chunk_size(128, 128);
  CHECK(saved_forward_bytes(delta, 8192, 128, 128) ==
        static_cast<std::size_t>((8192 + C - 1) / C * 128 * 128 + 2 * 8192 * 128) * sizeof(float));
  CHECK(saved_backward_bytes(delta, 8192, 64, 64) == saved_backward_bytes(delta, 65536, 64, 64));
  // Per-channel GatedDelta keeps the states only; its backward from them nothing per token.
  const RuleAttention<L2Normalize, GatedDelta, float> gated_delta;
  CHECK(saved_forward_bytes(gated_delta, 8192, 128, 128, true) ==
        static_cast<std::size_t>((8192 + C - 1) / C * 128 * 128) * sizeof(float));
  CHECK(saved_backward_bytes(gated_delta, 8192, 64, 64, true) ==
        saved_backward_bytes(gated_delta, 65536, 64, 64, true));
  const RowMatrix<float> beta = uniform_matrix<float>(100, 1, 5, 0.0, 1.0);
  SavedForward<float> channel_saved;
  parallel_saving_into(gated_delta, Q, K, V, beta, gates, Mask::causal, Y, channel_saved);
  CHECK(channel_saved.bytes() == saved_forward_bytes(gated_delta, 100, 64, 64, true));
}

}  // namespace rule_saved_forward_test
