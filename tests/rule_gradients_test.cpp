// Gradients of the write rules (linattn/rule_gradients.hpp): central differences in double of
// the library's forward for every input of every rule (gates near 0 and 1, beta at 0 and 1,
// T = 1 and T not a multiple of the chunk); the backward against a reverse-mode derivative of the
// naive recurrent loop written here from the formulas (with a magnitude run on absolute values
// for the rounding bounds); float against double; the reductions to Additive (log-gate 0,
// gamma = 1); beta = 0 cuts the update path; segments; shape errors.

#include <linattn/gradients.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace rule_gradients_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::MatrixXdR;
using linattn_test::random_matrix;
using linattn_test::uniform_matrix;
using linattn_test::unit_roundoff;

namespace {

using VectorXd = Eigen::VectorXd;

// ---- the oracle: the naive per-token loop and its reverse mode, from the formulas ----------

// Features, values and the rule's inputs of one call, in double.
struct OracleIn {
  MatrixXdR qf, kf, V, dY;  // T x r, T x r, T x dv, T x dv
  MatrixXdR log_gate;       // T x 1 or T x r (Decay: T x 1 of log gamma); empty for delta rules
  VectorXd beta;            // delta rules
  MatrixXdR log_alpha;      // GatedDelta: T x 1, or T x r per channel (empty for Delta)
  MatrixXdR S0, dS_T;       // r x dv
  VectorXd z0, dz_T;        // r (gated family)
  bool normalized = false;
  bool delta = false;
};

struct OracleOut {
  MatrixXdR dqf, dkf, dV, d_log_gate, dS0;
  VectorXd d_beta, dz0;
  MatrixXdR d_log_alpha;
  MatrixXdR S_T;  // the final state [S, z] (gated family) or S
  // Magnitude of the terms the gate gradient's cumulative sum adds (per token, per channel).
  MatrixXdR gate_terms;
};

// With Abs, every input is read as its absolute value and every subtraction as an addition:
// the result bounds the magnitude of the terms each gradient entry sums, which rounding errors
// are proportional to.
template <bool Abs>
OracleOut oracle(const OracleIn& in) {
  const auto A = [](const auto& m) {
    if constexpr (Abs)
      return decltype(m.eval())(m.cwiseAbs());
    else
      return m.eval();
  };
  const double sign = Abs ? 1.0 : -1.0;
  const MatrixXdR qf = A(in.qf), kf = A(in.kf), V = A(in.V), dY = A(in.dY);
  const Index T = qf.rows(), r = qf.cols(), dv = V.cols();
  OracleOut out;
  out.dqf.setZero(T, r);
  out.dkf.setZero(T, r);
  out.dV.setZero(T, dv);
  out.gate_terms.setZero(T, r);
  if (!in.delta) {
    const Index D = dv + 1;
    std::vector<MatrixXdR> St(T + 1, MatrixXdR(r, D));
    St[0] << A(in.S0), A(in.z0);
    const auto gates = [&](Index t) {
      Eigen::RowVectorXd g(r);
      for (Index n = 0; n < r; ++n)
        g(n) = std::exp(in.log_gate(t, in.log_gate.cols() == 1 ? 0 : n));
      return g;
    };
    for (Index t = 0; t < T; ++t) {
      Eigen::RowVectorXd vx(D);
      vx << V.row(t), 1.0;
      St[t + 1] = gates(t).transpose().asDiagonal() * St[t];
      St[t + 1] += kf.row(t).transpose() * vx;
    }
    out.S_T = St[T];
    MatrixXdR H(r, D);
    H << A(in.dS_T), A(in.dz_T);
    out.d_log_gate.setZero(T, in.log_gate.cols());
    for (Index t = T - 1; t >= 0; --t) {
      const Eigen::RowVectorXd O = qf.row(t) * St[t + 1];
      Eigen::RowVectorXd G(D);
      if (in.normalized) {
        const double den = O(dv);
        const Eigen::RowVectorXd y = O.head(dv) / den;
        G << dY.row(t) / den, sign * dY.row(t).dot(y) / den;
      } else {
        G << dY.row(t), 0.0;
      }
      out.dqf.row(t) = (St[t + 1] * G.transpose()).transpose();
      H += qf.row(t).transpose() * G;
      Eigen::RowVectorXd vx(D);
      vx << V.row(t), 1.0;
      out.dkf.row(t) = (H * vx.transpose()).transpose();
      out.dV.row(t) = (kf.row(t) * H).head(dv);
      const Eigen::RowVectorXd g = gates(t);
      const Eigen::RowVectorXd dg = (H.array() * St[t].array()).rowwise().sum().transpose();
      const Eigen::RowVectorXd dlog = g.array() * dg.array();
      if (in.log_gate.cols() == 1)
        out.d_log_gate(t, 0) = dlog.sum();
      else
        out.d_log_gate.row(t) = dlog;
      H = g.transpose().asDiagonal() * H;
    }
    out.dS0 = H.leftCols(dv);
    out.dz0 = H.col(dv);
    MatrixXdR HT(r, D);
    HT << A(in.dS_T), A(in.dz_T);
    out.gate_terms = (qf.array() * out.dqf.array() + kf.array() * out.dkf.array()).matrix();
    out.gate_terms.row(T - 1) +=
        (St[T].array() * HT.array()).rowwise().sum().transpose().matrix();
    return out;
  }
  // S' = diag(a_t) S_{t-1} (a_t: the token's gates, equal over the channels for one gate per
  // token, 1 for Delta), e = v - S'^T k, S_t = S' + beta k e^T.
  std::vector<MatrixXdR> St(T + 1);
  St[0] = A(in.S0);
  const bool per_channel = in.log_alpha.cols() > 1;
  const auto gates = [&](Index t) {
    VectorXd a = VectorXd::Ones(r);
    if (in.log_alpha.size() > 0)
      for (Index m = 0; m < r; ++m) a(m) = std::exp(in.log_alpha(t, per_channel ? m : 0));
    return a;
  };
  for (Index t = 0; t < T; ++t) {
    const double b = std::abs(in.beta(t));
    const MatrixXdR Sp = gates(t).asDiagonal() * St[t];
    const Eigen::RowVectorXd e = V.row(t) + sign * (kf.row(t) * Sp);
    St[t + 1] = Sp + b * kf.row(t).transpose() * e;
  }
  out.S_T = St[T];
  MatrixXdR H = A(in.dS_T);
  out.d_beta.setZero(T);
  out.d_log_alpha.setZero(T, in.log_alpha.cols());
  for (Index t = T - 1; t >= 0; --t) {
    const double b = in.beta(t);
    const VectorXd a = gates(t);
    out.dqf.row(t) = (St[t + 1] * dY.row(t).transpose()).transpose();
    H += qf.row(t).transpose() * dY.row(t);
    const MatrixXdR Sp = a.asDiagonal() * St[t];
    const Eigen::RowVectorXd e = V.row(t) + sign * (kf.row(t) * Sp);
    const Eigen::RowVectorXd de = b * (kf.row(t) * H);
    out.dV.row(t) = de;
    out.d_beta(t) = kf.row(t).dot((H * e.transpose()).transpose());
    const Eigen::RowVectorXd dp = sign * de;  // the gradient of S'^T k
    out.dkf.row(t) = b * (H * e.transpose()).transpose() + (Sp * dp.transpose()).transpose();
    H += kf.row(t).transpose() * dp;  // now dLoss/dS'
    // d log a_m = a_m dLoss/da_m = sum_c S'_mc (dLoss/dS')_mc.
    const VectorXd d_log = (Sp.array() * H.array()).rowwise().sum();
    if (per_channel)
      out.d_log_alpha.row(t) = d_log.transpose();
    else if (in.log_alpha.size() > 0)
      out.d_log_alpha(t, 0) = d_log.sum();
    H = a.asDiagonal() * H;
  }
  out.dS0 = H;
  return out;
}

// ---- the library's calls, one harness per rule ---------------------------------------------

template <class Rule>
constexpr bool is_delta = Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta;

// One call's inputs and loss L = sum(WY .* Y) + sum(WS .* S_T) (+ sum(wz .* z_T)), in Scalar.
template <class Phi, class Rule, class Scalar>
struct Harness {
  using Attn = RuleAttention<Phi, Rule, Scalar>;
  using M = RowMatrix<Scalar>;
  using Vec = ColVector<Scalar>;
  Attn attn;
  M Q, K, V, WY, S0, WS, log_gate;
  Vec z0, wz, beta;
  M log_alpha;  // T x 1, or T x r per channel

  typename Attn::State initial_state() const {
    auto st = attn.make_state(K.cols(), V.cols());
    if constexpr (Rule::keeps_normalizer)
      st.assign(S0, z0);
    else
      st.assign(S0);
    return st;
  }
  template <class F>
  decltype(auto) with_inputs(F&& f) const {
    if constexpr (Rule::kind == WriteKind::gated)
      return f(log_gate);
    else if constexpr (Rule::kind == WriteKind::delta)
      return f(beta);
    else if constexpr (Rule::kind == WriteKind::gated_delta)
      return f(beta, log_alpha);
    else
      return f();
  }
  double loss() const {
    auto st = initial_state();
    const M Y = with_inputs([&](const auto&... in) { return attn.prefill(st, Q, K, V, in...); });
    double L = (WY.array() * Y.array()).template cast<double>().sum() +
               (WS.array() * st.S().array()).template cast<double>().sum();
    if constexpr (Rule::keeps_normalizer)
      L += (wz.array() * st.z().array()).template cast<double>().sum();
    return L;
  }
  RuleGradients<Scalar> gradients() const {
    const auto st = initial_state();
    StateGradient<Scalar> final_gradient{WS, Rule::keeps_normalizer ? wz : Vec()};
    return with_inputs([&](const auto&... in) {
      return prefill_backward(attn, st, Q, K, V, in..., WY, &final_gradient);
    });
  }
};

// Random inputs for a rule: Q, K, V ~ N(0, 1); log-gates uniform in [-2, 0) with the extremes
// -30 (gate ~ 1e-13) and -1e-6 (gate ~ 1) planted; beta uniform in [0, 1] with 0 and 1 planted;
// log_alpha in [-1, 0) with -30 and -1e-6 planted (per channel with `per_channel`: channel 0);
// S0 ~ N(0, 1), z0 in [0.5, 1.5) (positive, so normalized reads stay defined).
template <class Phi, class Rule, class Scalar>
Harness<Phi, Rule, Scalar> make_harness(const Phi& phi, const Rule& rule, Normalization norm,
                                        Index T, Index dk, Index dv, Index chunk, bool per_channel,
                                        std::uint64_t seed) {
  Options options;
  options.normalization = norm;
  options.chunk_size = chunk;
  Harness<Phi, Rule, Scalar> h{RuleAttention<Phi, Rule, Scalar>(phi, rule, options), {}, {}, {},
                               {}, {}, {}, {}, {}, {}, {}, {}};
  const Index r = phi.feature_dim(dk);
  h.Q = random_matrix<Scalar>(T, dk, seed);
  h.K = random_matrix<Scalar>(T, dk, seed + 1);
  h.V = random_matrix<Scalar>(T, dv, seed + 2);
  h.WY = random_matrix<Scalar>(T, dv, seed + 3);
  h.S0 = random_matrix<Scalar>(r, dv, seed + 4, 0.5);
  h.WS = random_matrix<Scalar>(r, dv, seed + 5);
  h.z0 = uniform_matrix<Scalar>(r, 1, seed + 6, 0.5, 1.5);
  h.wz = random_matrix<Scalar>(r, 1, seed + 7);
  h.log_gate = uniform_matrix<Scalar>(T, per_channel ? r : 1, seed + 8, -2.0, 0.0);
  if (T >= 3) {
    h.log_gate(0, 0) = Scalar(-30);
    h.log_gate(1, 0) = Scalar(-1e-6);
  }
  h.beta = uniform_matrix<Scalar>(T, 1, seed + 9, 0.0, 1.0);
  if (T >= 3) {
    h.beta(0) = 0;
    h.beta(T - 1) = 1;
  }
  h.log_alpha = uniform_matrix<Scalar>(T, per_channel ? r : 1, seed + 10, -1.0, 0.0);
  if (T >= 3) {
    h.log_alpha(1, 0) = Scalar(-30);
    h.log_alpha(2, 0) = Scalar(-1e-6);
  }
  return h;
}

// d loss / d x(i, j) by a second-order difference with step h: central where [x - h, x + h]
// lies in [lo, hi], else the one-sided 3-point formula pointing into the interval.
template <class Mat, class F>
double numeric_derivative(Mat& x, Index i, Index j, double h, double lo, double hi,
                          const F& loss) {
  const double x0 = x(i, j);
  double d = 0;
  if (x0 - h >= lo && x0 + h <= hi) {
    x(i, j) = x0 + h;
    const double fp = loss();
    x(i, j) = x0 - h;
    const double fm = loss();
    d = (fp - fm) / (2 * h);
  } else {
    const double s = x0 + 2 * h <= hi ? 1.0 : -1.0;
    const double f0 = loss();
    x(i, j) = x0 + s * h;
    const double f1 = loss();
    x(i, j) = x0 + 2 * s * h;
    const double f2 = loss();
    d = s * (-3 * f0 + 4 * f1 - f2) / (2 * h);
  }
  x(i, j) = x0;
  return d;
}

// Every entry of x: |numeric - analytic| <= tol (1 + |analytic|). With step h = 1e-4 on inputs
// of size O(1), the difference's truncation error is h^2 |f'''| / 6 (about 2e-9 |f'''|; the
// loss is a polynomial of degree <= 6 in each entry times exponentials of O(1) arguments, so
// |f'''| stays well below 100 here) and its rounding error about u |L| / h (about 1e-12 |L|):
// tol = 1e-6 covers both with room.
template <class Mat, class G, class F>
void check_fd(const char* what, Mat& x, const G& analytic, double lo, double hi, const F& loss) {
  constexpr double h = 1e-4, tol = 1e-6;
  INFO(what << " (" << x.rows() << "x" << x.cols() << ")");
  REQUIRE(analytic.rows() == x.rows());
  REQUIRE(analytic.cols() == x.cols());
  for (Index i = 0; i < x.rows(); ++i)
    for (Index j = 0; j < x.cols(); ++j) {
      const double numeric = numeric_derivative(x, i, j, h, lo, hi, loss);
      const double a = static_cast<double>(analytic(i, j));
      INFO("entry (" << i << ", " << j << "): numeric " << numeric << ", analytic " << a);
      CHECK(std::abs(numeric - a) <= tol * (1 + std::abs(a)));
    }
}

template <class Phi, class Rule>
void check_all_inputs(Harness<Phi, Rule, double>& h) {
  const auto g = h.gradients();
  const auto L = [&] { return h.loss(); };
  constexpr double inf = std::numeric_limits<double>::infinity();
  check_fd("Q", h.Q, g.Q, -inf, inf, L);
  check_fd("K", h.K, g.K, -inf, inf, L);
  check_fd("V", h.V, g.V, -inf, inf, L);
  check_fd("S0", h.S0, g.initial.S, -inf, inf, L);
  if constexpr (Rule::keeps_normalizer) check_fd("z0", h.z0, g.initial.z, 0.0, inf, L);
  if constexpr (Rule::kind == WriteKind::gated) check_fd("log_gate", h.log_gate, g.inputs.log_gate, -inf, 0.0, L);
  if constexpr (is_delta<Rule>) check_fd("beta", h.beta, g.inputs.beta, 0.0, 2.0, L);
  if constexpr (Rule::kind == WriteKind::gated_delta)
    check_fd("log_alpha", h.log_alpha, g.inputs.log_alpha, -inf, 0.0, L);
}

struct Shape {
  Index T, chunk;
};
// T = 1, T a multiple of the chunk, T not a multiple of it, several chunks.
constexpr Shape kShapes[] = {{1, 4}, {4, 4}, {5, 2}, {7, 3}};

}  // namespace

TEST_CASE("finite differences: every input of Decay and Gated, normalized and not") {
  for (const Shape s : kShapes) {
    for (const bool normalized : {false, true}) {
      INFO("T = " << s.T << ", chunk " << s.chunk << (normalized ? ", strict" : ", unnormalized"));
      const Normalization norm =
          normalized ? Normalization::strict() : Normalization::unnormalized();
      {
        INFO("decay");
        auto h = make_harness<EluPlusOne, Decay, double>(EluPlusOne{}, Decay(0.8), norm, s.T, 3,
                                                         2, s.chunk, false, 11);
        check_all_inputs(h);
      }
      for (const bool per_channel : {false, true}) {
        INFO((per_channel ? "gated per channel" : "gated, one gate per token"));
        auto h = make_harness<EluPlusOne, Gated, double>(EluPlusOne{}, Gated{}, norm, s.T, 3, 2,
                                                         s.chunk, per_channel, 21);
        check_all_inputs(h);
      }
    }
    {
      INFO("gated, identity map, unnormalized, T = " << s.T);
      auto h = make_harness<Identity, Gated, double>(Identity{}, Gated{},
                                                     Normalization::unnormalized(), s.T, 3, 2,
                                                     s.chunk, true, 31);
      check_all_inputs(h);
    }
  }
}

TEST_CASE("finite differences: every input of Delta and GatedDelta") {
  for (const Shape s : kShapes) {
    INFO("T = " << s.T << ", chunk " << s.chunk);
    {
      INFO("delta, L2Normalize");
      auto h = make_harness<L2Normalize, Delta, double>(
          L2Normalize{}, Delta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, false, 41);
      check_all_inputs(h);
    }
    {
      INFO("gated delta, L2Normalize");
      auto h = make_harness<L2Normalize, GatedDelta, double>(
          L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, false,
          51);
      check_all_inputs(h);
    }
    {
      INFO("gated delta, identity map");
      auto h = make_harness<Identity, GatedDelta, double>(
          Identity{}, GatedDelta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, false, 61);
      check_all_inputs(h);
    }
    {
      // Betas in [0, 2] (negative eigenvalues 1 - beta along the key), 2 planted last.
      INFO("delta and gated delta, L2Normalize, betas in [0, 2]");
      auto h = make_harness<L2Normalize, Delta, double>(
          L2Normalize{}, Delta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, false, 71);
      auto hg = make_harness<L2Normalize, GatedDelta, double>(
          L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, false,
          72);
      h.beta *= 2.0;
      hg.beta *= 2.0;
      check_all_inputs(h);
      check_all_inputs(hg);
    }
  }
}

TEST_CASE("finite differences: every input of per-channel GatedDelta (Kimi Delta Attention)") {
  for (const Shape s : kShapes) {
    INFO("T = " << s.T << ", chunk " << s.chunk);
    {
      INFO("L2Normalize");
      auto h = make_harness<L2Normalize, GatedDelta, double>(
          L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, true,
          81);
      check_all_inputs(h);
    }
    {
      INFO("identity map");
      auto h = make_harness<Identity, GatedDelta, double>(
          Identity{}, GatedDelta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, true, 82);
      check_all_inputs(h);
    }
    {
      INFO("L2Normalize, betas in [0, 2]");
      auto h = make_harness<L2Normalize, GatedDelta, double>(
          L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), s.T, 3, 2, s.chunk, true,
          83);
      h.beta *= 2.0;
      check_all_inputs(h);
    }
  }
}

namespace {

// The oracle's inputs from a harness whose map is Identity (features = inputs) or EluPlusOne
// (features from the definition here; dQ = dqf .* phi'(Q) after the oracle).
template <class Phi, class Rule>
OracleIn oracle_inputs(const Harness<Phi, Rule, double>& h, bool elu) {
  OracleIn in;
  const auto feat = [&](const MatrixXdR& X) {
    return elu ? MatrixXdR(X.unaryExpr([](double x) { return linattn_test::elu_plus_one(x); }))
               : X;
  };
  in.qf = feat(h.Q);
  in.kf = feat(h.K);
  in.V = h.V;
  in.dY = h.WY;
  in.S0 = h.S0;
  in.dS_T = h.WS;
  in.normalized = h.attn.options().normalization.divides();
  in.delta = is_delta<Rule>;
  if constexpr (Rule::kind == WriteKind::decay)
    in.log_gate = MatrixXdR::Constant(h.Q.rows(), 1, std::log(h.attn.rule().gamma()));
  if constexpr (Rule::kind == WriteKind::gated) in.log_gate = h.log_gate;
  if constexpr (Rule::keeps_normalizer) {
    in.z0 = h.z0;
    in.dz_T = h.wz;
  }
  if constexpr (is_delta<Rule>) in.beta = h.beta;
  if constexpr (Rule::kind == WriteKind::gated_delta) in.log_alpha = h.log_alpha;
  return in;
}

// phi'(x) of the map the oracle used, entry by entry (1 for Identity).
MatrixXdR map_derivative(const MatrixXdR& X, bool elu) {
  if (!elu) return MatrixXdR::Ones(X.rows(), X.cols());
  return X.unaryExpr([](double x) { return x > 0 ? 1.0 : std::exp(x); });
}

// Rounding bound, in units of u, for an entry of the backward: each entry is a sum over at most
// T tokens of terms built from dot products over r features or dv + 1 value columns and in-chunk
// sums of at most C rows (T + C + r + dv + 1 roundings each, doubled for the quotient rule's
// two sums and for the gate gradient's reverse cumulative sum); each decay weight exp(B) comes
// from a cumulative sum of at most C log-gates, whose rounding (C u |B|, |B| <= 30 + 2 C with the
// planted -30 and log-gates in [-2, 0)) moves the weight by that relative amount.
double backward_units(Index T, Index C, Index r, Index dv) {
  return 4.0 * static_cast<double>(T + C + r + dv + 1) +
         static_cast<double>(C) * (30.0 + 2.0 * static_cast<double>(C));
}

// |actual - expected| <= units * u * magnitude, entry by entry (a tiny absolute floor of u for
// entries whose magnitude underflows).
template <class MA, class ME, class MM>
void check_rounding(const char* what, const MA& actual, const ME& expected, const MM& magnitude,
                    double units, double u) {
  INFO(what);
  REQUIRE(actual.rows() == expected.rows());
  REQUIRE(actual.cols() == expected.cols());
  double worst = 0;
  for (Index i = 0; i < expected.rows(); ++i)
    for (Index j = 0; j < expected.cols(); ++j) {
      const double err = std::abs(static_cast<double>(actual(i, j)) - expected(i, j));
      const double allowed = units * u * magnitude(i, j) + u;
      worst = std::max(worst, err / allowed);
    }
  INFO("worst error / bound = " << worst);
  CHECK(worst <= 1.0);
}

// The library's backward (Scalar) against the oracle in double, with its magnitude run.
template <class Scalar, class Phi, class Rule>
void check_against_oracle(const Harness<Phi, Rule, double>& hd, bool elu, double u) {
  Harness<Phi, Rule, Scalar> h{RuleAttention<Phi, Rule, Scalar>(hd.attn.feature_map(),
                                                                hd.attn.rule(), hd.attn.options()),
                               hd.Q.template cast<Scalar>(),  hd.K.template cast<Scalar>(),
                               hd.V.template cast<Scalar>(),  hd.WY.template cast<Scalar>(),
                               hd.S0.template cast<Scalar>(), hd.WS.template cast<Scalar>(),
                               hd.log_gate.template cast<Scalar>(), hd.z0.template cast<Scalar>(),
                               hd.wz.template cast<Scalar>(), hd.beta.template cast<Scalar>(),
                               hd.log_alpha.template cast<Scalar>()};
  // The oracle sees exactly the inputs the library got (rounded to Scalar).
  Harness<Phi, Rule, double> exact{hd.attn,
                                   h.Q.template cast<double>(),
                                   h.K.template cast<double>(),
                                   h.V.template cast<double>(),
                                   h.WY.template cast<double>(),
                                   h.S0.template cast<double>(),
                                   h.WS.template cast<double>(),
                                   h.log_gate.template cast<double>(),
                                   h.z0.template cast<double>(),
                                   h.wz.template cast<double>(),
                                   h.beta.template cast<double>(),
                                   h.log_alpha.template cast<double>()};
  const OracleIn in = oracle_inputs(exact, elu);
  const OracleOut ref = oracle<false>(in);
  const OracleOut mag = oracle<true>(in);
  const auto g = h.gradients();
  const Index T = hd.Q.rows(), r = in.qf.cols(), dv = hd.V.cols();
  const Index C = std::min(hd.attn.chunk_size(r, dv), std::max<Index>(T, 1));
  const double units = backward_units(T, C, r, dv);
  const MatrixXdR dq_phi = map_derivative(exact.Q, elu), dk_phi = map_derivative(exact.K, elu);
  check_rounding("dQ", g.Q, MatrixXdR(ref.dqf.cwiseProduct(dq_phi)),
                 MatrixXdR(mag.dqf.cwiseProduct(dq_phi)), units, u);
  check_rounding("dK", g.K, MatrixXdR(ref.dkf.cwiseProduct(dk_phi)),
                 MatrixXdR(mag.dkf.cwiseProduct(dk_phi)), units, u);
  check_rounding("dV", g.V, ref.dV, mag.dV, units, u);
  check_rounding("dS0", g.initial.S, ref.dS0, mag.dS0, units, u);
  if constexpr (Rule::keeps_normalizer) check_rounding("dz0", g.initial.z, ref.dz0, mag.dz0, units, u);
  if constexpr (Rule::kind == WriteKind::gated) {
    // The library sums the terms q .* dq + k .* dk of every later token: bound by their total.
    MatrixXdR total(ref.d_log_gate.rows(), ref.d_log_gate.cols());
    const Index gc = ref.d_log_gate.cols();
    for (Index t = 0; t < T; ++t)
      for (Index c = 0; c < gc; ++c)
        total(t, c) = gc == 1 ? mag.gate_terms.bottomRows(T - t).sum()
                              : mag.gate_terms.col(c).tail(T - t).sum();
    check_rounding("d log_gate", g.inputs.log_gate, ref.d_log_gate, total, units, u);
  }
  if constexpr (is_delta<Rule>) check_rounding("d beta", g.inputs.beta, ref.d_beta, mag.d_beta, units, u);
  if constexpr (Rule::kind == WriteKind::gated_delta) {
    // The chunked form splits d log_alpha_s into per-chunk terms (pairs of tokens of the chunk,
    // the state before it, the state after it; per channel, of the backward's blocks within the
    // chunk) and sums them from the chunk's (block's) end: each such term crosses at least one
    // token of the chunk, so the chunk's total of the per-token magnitudes, channel by channel,
    // bounds what that sum adds.
    const Index gc = ref.d_log_alpha.cols();
    MatrixXdR total(T, gc);
    for (Index t = 0; t < T; ++t) {
      const Index first = t / C * C, n = std::min(C, T - first);
      for (Index m = 0; m < gc; ++m) total(t, m) = mag.d_log_alpha.col(m).segment(first, n).sum();
    }
    check_rounding("d log_alpha", g.inputs.log_alpha, ref.d_log_alpha, total, units, u);
  }
}

}  // namespace

TEST_CASE("backward equals the reverse mode of the naive loop, double and float") {
  constexpr Index T = 37, dk = 4, dv = 3;
  for (const Index chunk : {Index{1}, Index{8}, Index{16}}) {
    INFO("chunk " << chunk);
    for (const bool normalized : {false, true}) {
      INFO((normalized ? "strict" : "unnormalized"));
      const Normalization norm =
          normalized ? Normalization::strict() : Normalization::unnormalized();
      const auto decay = make_harness<EluPlusOne, Decay, double>(EluPlusOne{}, Decay(0.9), norm,
                                                                  T, dk, dv, chunk, false, 101);
      check_against_oracle<double>(decay, true, unit_roundoff<double>());
      check_against_oracle<float>(decay, true, unit_roundoff<float>());
      for (const bool per_channel : {false, true}) {
        INFO((per_channel ? "per channel" : "one gate per token"));
        const auto gated = make_harness<EluPlusOne, Gated, double>(
            EluPlusOne{}, Gated{}, norm, T, dk, dv, chunk, per_channel, 111);
        check_against_oracle<double>(gated, true, unit_roundoff<double>());
        check_against_oracle<float>(gated, true, unit_roundoff<float>());
      }
    }
    auto delta = make_harness<Identity, Delta, double>(Identity{}, Delta{},
                                                       Normalization::unnormalized(), T, dk, dv,
                                                       chunk, false, 121);
    delta.K /= 2.0;  // |k| about 1: I - beta k k^T about a contraction, the state stays O(1)
    check_against_oracle<double>(delta, false, unit_roundoff<double>());
    check_against_oracle<float>(delta, false, unit_roundoff<float>());
    for (const bool per_channel : {false, true}) {
      INFO((per_channel ? "gated delta per channel" : "gated delta"));
      auto gated_delta = make_harness<Identity, GatedDelta, double>(
          Identity{}, GatedDelta{}, Normalization::unnormalized(), T, dk, dv, chunk, per_channel,
          131);
      gated_delta.K /= 2.0;
      check_against_oracle<double>(gated_delta, false, unit_roundoff<double>());
      check_against_oracle<float>(gated_delta, false, unit_roundoff<float>());
    }
  }
}

TEST_CASE("log-gate 0 and gamma = 1 give Additive's gradients") {
  constexpr Index T = 29, dk = 4, dv = 3;
  for (const bool normalized : {false, true}) {
    INFO((normalized ? "strict" : "unnormalized"));
    Options options;
    options.normalization = normalized ? Normalization::strict() : Normalization::unnormalized();
    options.chunk_size = 8;
    const LinearAttention<EluPlusOne, double> additive(EluPlusOne{}, options);
    auto h = make_harness<EluPlusOne, Gated, double>(EluPlusOne{}, Gated{}, options.normalization,
                                                     T, dk, dv, 8, true, 141);
    auto st = additive.make_state(dk, dv);
    st.assign(h.S0, h.z0);
    const StateGradient<double> final_gradient{h.WS, h.wz};
    const auto ref = prefill_backward(additive, st, h.Q, h.K, h.V, h.WY, &final_gradient);
    // Magnitudes for the bound: the oracle on absolute values with log-gates 0.
    h.log_gate.setZero();
    const OracleOut mag = oracle<true>(oracle_inputs(h, true));
    const MatrixXdR dq_phi = map_derivative(h.Q, true), dk_phi = map_derivative(h.K, true);
    const double units = backward_units(T, 8, dk, dv), u = unit_roundoff<double>();
    const auto compare = [&](const char* what, const auto& g) {
      INFO(what);
      check_rounding("dQ", g.Q, ref.Q, MatrixXdR(mag.dqf.cwiseProduct(dq_phi)), units, u);
      check_rounding("dK", g.K, ref.K, MatrixXdR(mag.dkf.cwiseProduct(dk_phi)), units, u);
      check_rounding("dV", g.V, ref.V, mag.dV, units, u);
      check_rounding("dS0", g.initial.S, ref.initial.S, mag.dS0, units, u);
      check_rounding("dz0", g.initial.z, ref.initial.z, mag.dz0, units, u);
    };
    compare("gated, per-channel log-gates 0", h.gradients());
    h.log_gate = MatrixXdR::Zero(T, 1);
    compare("gated, one log-gate 0 per token", h.gradients());
    const auto decay = make_harness<EluPlusOne, Decay, double>(
        EluPlusOne{}, Decay(1.0), options.normalization, T, dk, dv, 8, false, 141);
    compare("decay, gamma = 1", decay.gradients());
  }
}

TEST_CASE("beta = 0 gives zero gradients into the update path") {
  constexpr Index T = 13, dk = 4, dv = 3;
  auto delta = make_harness<L2Normalize, Delta, double>(
      L2Normalize{}, Delta{}, Normalization::unnormalized(), T, dk, dv, 4, false, 151);
  auto gated_delta = make_harness<L2Normalize, GatedDelta, double>(
      L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), T, dk, dv, 4, false, 161);
  const auto check = [](const auto& h, const char* what) {
    INFO(what);
    const auto g = h.gradients();
    for (Index t = 0; t < T; ++t) {
      INFO("token " << t << ", beta " << h.beta(t));
      if (h.beta(t) == 0) {
        // The token writes nothing: its key and value cannot move the loss.
        CHECK(g.K.row(t).cwiseAbs().maxCoeff() == 0.0);
        CHECK(g.V.row(t).cwiseAbs().maxCoeff() == 0.0);
      } else {
        CHECK(g.V.row(t).cwiseAbs().maxCoeff() > 0.0);
      }
    }
  };
  for (Index t = 0; t < T; t += 2) {
    delta.beta(t) = 0;
    gated_delta.beta(t) = 0;
  }
  check(delta, "delta, every other beta 0");
  check(gated_delta, "gated delta, every other beta 0");
  delta.beta.setZero();
  check(delta, "delta, all beta 0");
  // With no write, dS0 is the read's and the final state's gradient carried back unchanged.
  const auto g = delta.gradients();
  const MatrixXdR qf = MatrixXdR(delta.Q.rowwise().normalized());
  const MatrixXdR expected = delta.WS + qf.transpose() * delta.WY;
  check_rounding("dS0 with all beta 0", g.initial.S, expected,
                 MatrixXdR(delta.WS.cwiseAbs() + qf.cwiseAbs().transpose() * delta.WY.cwiseAbs()),
                 static_cast<double>(T + dk + 2), unit_roundoff<double>());
}

TEST_CASE("segments: the state and its gradient carried between calls") {
  constexpr Index T = 23, split = 9, dk = 4, dv = 3;
  const auto run = [&](auto h, const char* what) {
    INFO(what);
    using H = decltype(h);
    const auto whole = h.gradients();
    H first = h, second = h;
    first.Q = h.Q.topRows(split);
    first.K = h.K.topRows(split);
    first.V = h.V.topRows(split);
    first.WY = h.WY.topRows(split);
    second.Q = h.Q.bottomRows(T - split);
    second.K = h.K.bottomRows(T - split);
    second.V = h.V.bottomRows(T - split);
    second.WY = h.WY.bottomRows(T - split);
    for (auto* m : {&first.log_gate, &second.log_gate}) static_cast<void>(m);
    first.log_gate = h.log_gate.topRows(split);
    second.log_gate = h.log_gate.bottomRows(T - split);
    first.beta = h.beta.head(split);
    second.beta = h.beta.tail(T - split);
    first.log_alpha = h.log_alpha.topRows(split);
    second.log_alpha = h.log_alpha.bottomRows(T - split);
    // The second segment starts from the state the first one leaves.
    auto st = first.initial_state();
    first.with_inputs([&](const auto&... in) {
      static_cast<void>(first.attn.prefill(st, first.Q, first.K, first.V, in...));
    });
    second.S0 = st.S();
    if constexpr (std::decay_t<decltype(h.attn.rule())>::keeps_normalizer) second.z0 = st.z();
    const auto g2 = second.gradients();
    first.WS = g2.initial.S;
    first.wz = g2.initial.z;
    const auto g1 = first.gradients();
    // Both ways compute the same sums in a different order: compare to a bound of the same
    // form as the oracle test's, with the magnitude of the whole call's gradients.
    const double tol = 1e-11;  // (T + C + r + dv) u |grad| with |grad| = O(10): about 1e-13
    const auto near = [&](const auto& a, const auto& b) {
      return (a - b).cwiseAbs().maxCoeff() <= tol * (1 + b.cwiseAbs().maxCoeff());
    };
    CHECK(near(g1.Q, whole.Q.topRows(split)));
    CHECK(near(g2.Q, whole.Q.bottomRows(T - split)));
    CHECK(near(g1.K, whole.K.topRows(split)));
    CHECK(near(g2.K, whole.K.bottomRows(T - split)));
    CHECK(near(g1.V, whole.V.topRows(split)));
    CHECK(near(g2.V, whole.V.bottomRows(T - split)));
    CHECK(near(g1.initial.S, whole.initial.S));
    if (whole.inputs.log_gate.size() > 0) {
      CHECK(near(g1.inputs.log_gate, whole.inputs.log_gate.topRows(split)));
      CHECK(near(g2.inputs.log_gate, whole.inputs.log_gate.bottomRows(T - split)));
    }
    if (whole.inputs.beta.size() > 0) {
      CHECK(near(g1.inputs.beta, whole.inputs.beta.head(split)));
      CHECK(near(g2.inputs.beta, whole.inputs.beta.tail(T - split)));
    }
    if (whole.inputs.log_alpha.size() > 0) {
      CHECK(near(g1.inputs.log_alpha, whole.inputs.log_alpha.topRows(split)));
      CHECK(near(g2.inputs.log_alpha, whole.inputs.log_alpha.bottomRows(T - split)));
    }
  };
  run(make_harness<EluPlusOne, Gated, double>(EluPlusOne{}, Gated{}, Normalization::strict(), T,
                                              dk, dv, 4, true, 171),
      "gated per channel, strict");
  run(make_harness<EluPlusOne, Decay, double>(EluPlusOne{}, Decay(0.7), Normalization::strict(), T,
                                              dk, dv, 4, false, 181),
      "decay, strict");
  run(make_harness<L2Normalize, GatedDelta, double>(L2Normalize{}, GatedDelta{},
                                                    Normalization::unnormalized(), T, dk, dv, 4,
                                                    false, 191),
      "gated delta");
  run(make_harness<L2Normalize, GatedDelta, double>(L2Normalize{}, GatedDelta{},
                                                    Normalization::unnormalized(), T, dk, dv, 4,
                                                    true, 192),
      "gated delta per channel");
}

TEST_CASE("rule backward: errors") {
  constexpr Index T = 6, dk = 3, dv = 2;
  const auto h = make_harness<EluPlusOne, Gated, double>(EluPlusOne{}, Gated{},
                                                         Normalization::strict(), T, dk, dv, 4,
                                                         false, 201);
  const MatrixXdR bad_dY = MatrixXdR::Zero(T, dv + 1);
  CHECK_THROWS_AS(parallel_backward(h.attn, h.Q, h.K, h.V, h.log_gate, Mask::causal, bad_dY),
                  ShapeError);
  const MatrixXdR bad_gates = MatrixXdR::Zero(T, 2);
  CHECK_THROWS_AS(parallel_backward(h.attn, h.Q, h.K, h.V, bad_gates, Mask::causal, h.WY),
                  ShapeError);
  MatrixXdR positive = h.log_gate;
  positive(2, 0) = 0.5;
  CHECK_THROWS_AS(parallel_backward(h.attn, h.Q, h.K, h.V, positive, Mask::causal, h.WY),
                  std::invalid_argument);
  const auto st = h.initial_state();
  const StateGradient<double> bad_final{MatrixXdR::Zero(dk + 1, dv), VectorXd::Zero(dk)};
  CHECK_THROWS_AS(prefill_backward(h.attn, st, h.Q, h.K, h.V, h.log_gate, h.WY, &bad_final),
                  ShapeError);
  const RuleAttention<Identity, Gated, double> other;
  CHECK_THROWS_AS(prefill_backward(other, st, h.Q, h.K, h.V, h.log_gate, h.WY), StateMismatchError);
  const VectorXd bad_beta = VectorXd::Constant(T, 2.5);
  const RuleAttention<L2Normalize, Delta, double> delta;
  CHECK_THROWS_AS(parallel_backward(delta, h.Q, h.K, h.V, bad_beta, Mask::causal, h.WY),
                  std::invalid_argument);
  // A normalized read whose denominator is not positive throws as the forward does.
  const RuleAttention<Identity, Gated, double> identity_strict;
  const MatrixXdR negative_keys = -h.Q.cwiseAbs();
  CHECK_THROWS_AS(parallel_backward(identity_strict, h.Q.cwiseAbs(), negative_keys, h.V,
                                    h.log_gate, Mask::causal, h.WY),
                  DenominatorError);
}

TEST_CASE("parallel_backward equals prefill_backward from an empty state") {
  constexpr Index T = 11, dk = 3, dv = 2;
  auto h = make_harness<EluPlusOne, Gated, double>(EluPlusOne{}, Gated{}, Normalization::strict(),
                                                   T, dk, dv, 4, true, 211);
  const auto p = parallel_backward(h.attn, h.Q, h.K, h.V, h.log_gate, Mask::causal, h.WY);
  h.S0.setZero();
  h.z0.setZero();
  h.WS.setZero();
  h.wz.setZero();
  const auto q = h.gradients();
  CHECK(p.Q == q.Q);
  CHECK(p.K == q.K);
  CHECK(p.V == q.V);
  CHECK(p.inputs.log_gate == q.inputs.log_gate);
  CHECK(p.initial.S == q.initial.S);
  auto gd = make_harness<L2Normalize, GatedDelta, double>(
      L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), T, dk, dv, 4, false, 221);
  const auto pd = parallel_backward(gd.attn, gd.Q, gd.K, gd.V, gd.beta, gd.log_alpha,
                                    Mask::causal, gd.WY);
  gd.S0.setZero();
  gd.WS.setZero();
  const auto qd = gd.gradients();
  CHECK(pd.Q == qd.Q);
  CHECK(pd.inputs.beta == qd.inputs.beta);
  CHECK(pd.inputs.log_alpha == qd.inputs.log_alpha);
  auto kd = make_harness<L2Normalize, GatedDelta, double>(
      L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), T, dk, dv, 4, true, 222);
  const auto pk = parallel_backward(kd.attn, kd.Q, kd.K, kd.V, kd.beta, kd.log_alpha,
                                    Mask::causal, kd.WY);
  kd.S0.setZero();
  kd.WS.setZero();
  const auto qk = kd.gradients();
  CHECK(pk.Q == qk.Q);
  CHECK(pk.K == qk.K);
  CHECK(pk.V == qk.V);
  CHECK(pk.inputs.beta == qk.inputs.beta);
  CHECK(pk.inputs.log_alpha == qk.inputs.log_alpha);
  CHECK(pk.inputs.log_alpha.cols() == dk);  // L2Normalize: r = dk
  CHECK(pk.initial.S == qk.initial.S);
  const RuleAttention<EluPlusOne, Decay, double> decay(EluPlusOne{}, Decay(0.5));
  const auto dd = parallel_backward(decay, h.Q, h.K, h.V, Mask::causal, h.WY);
  CHECK(dd.inputs.log_gate.size() == 0);
  CHECK(dd.initial.z.size() == dk);
}

TEST_CASE("per-channel GatedDelta: rule_backward_bytes is what its backward keeps") {
  // A stateless call with a workspace holds the backward's buffers (rule_backward_bytes with
  // per-channel gates) and the zero initial state it starts from (r dv + r scalars).
  for (const Index T : {Index{1}, Index{9}, Index{16}}) {
    INFO("T = " << T);
    constexpr Index dk = 3, dv = 2, r = dk;  // L2Normalize: r = dk
    const auto h = make_harness<L2Normalize, GatedDelta, double>(
        L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), T, dk, dv, 4, true, 231);
    BackwardWorkspace<double> workspace;
    MatrixXdR dQ(T, dk), dK(T, dk), dV(T, dv);
    RuleInputGradients<double> d_in;
    StateGradient<double> initial;
    parallel_backward_into(h.attn, h.Q, h.K, h.V, h.beta, h.log_alpha, Mask::causal, h.WY,
                           GradientsRef<double>{dQ, dK, dV}, d_in, &initial, &workspace);
    CHECK(workspace.bytes() == rule_backward_bytes(h.attn, T, dk, dv, true) +
                                   static_cast<std::size_t>(r * dv + r) * sizeof(double));
    CHECK(rule_backward_bytes(h.attn, T, dk, dv, true) !=
          rule_backward_bytes(h.attn, T, dk, dv, false));
  }
}

TEST_CASE("parallel_backward_into writes strided views with parallel_backward's bits") {
  constexpr Index T = 10, dk = 3, dv = 2, heads = 2;
  const auto h = make_harness<EluPlusOne, Gated, double>(EluPlusOne{}, Gated{},
                                                         Normalization::strict(), T, dk, dv, 4,
                                                         true, 231);
  const auto g = parallel_backward(h.attn, h.Q, h.K, h.V, h.log_gate, Mask::causal, h.WY);
  // Head 1's columns of [T, heads d] buffers.
  MatrixXdR dQ = MatrixXdR::Zero(T, heads * dk), dK = dQ, dV = MatrixXdR::Zero(T, heads * dv);
  using View = Eigen::Map<MatrixXdR, 0, Eigen::OuterStride<>>;
  View q(dQ.data() + dk, T, dk, Eigen::OuterStride<>(heads * dk));
  View k(dK.data() + dk, T, dk, Eigen::OuterStride<>(heads * dk));
  View v(dV.data() + dv, T, dv, Eigen::OuterStride<>(heads * dv));
  RuleInputGradients<double> d_in;
  StateGradient<double> initial;
  parallel_backward_into(h.attn, h.Q, h.K, h.V, h.log_gate, Mask::causal, h.WY,
                         GradientsRef<double>{q, k, v}, d_in, &initial);
  CHECK(MatrixXdR(q) == g.Q);
  CHECK(MatrixXdR(k) == g.K);
  CHECK(MatrixXdR(v) == g.V);
  CHECK(d_in.log_gate == g.inputs.log_gate);
  CHECK(initial.S == g.initial.S);
  CHECK(dQ.leftCols(dk).cwiseAbs().maxCoeff() == 0.0);  // the other head's columns untouched
}

// The _into outputs of a delta-rule backward against the returning call's gradients, bit for
// bit (log_alpha where the rule has one).
static void check_delta_into(const MatrixXdR& dQ, const MatrixXdR& dK, const MatrixXdR& dV,
                             const RuleInputGradients<double>& d_in,
                             const StateGradient<double>& initial, const RuleGradients<double>& g) {
  CHECK(dQ == g.Q);
  CHECK(dK == g.K);
  CHECK(dV == g.V);
  CHECK(d_in.beta == g.inputs.beta);
  if (g.inputs.log_alpha.size() > 0) CHECK(d_in.log_alpha == g.inputs.log_alpha);
  CHECK(initial.S == g.initial.S);
}

TEST_CASE("prefill_backward_into writes prefill_backward's bits into reused buffers") {
  constexpr Index T = 9, dk = 3, dv = 2;
  const auto h = make_harness<L2Normalize, GatedDelta, double>(
      L2Normalize{}, GatedDelta{}, Normalization::unnormalized(), T, dk, dv, 4, false, 241);
  const auto st = h.initial_state();
  const StateGradient<double> final_gradient{h.WS, VectorXd()};
  const auto g = prefill_backward(h.attn, st, h.Q, h.K, h.V, h.beta, h.log_alpha, h.WY,
                                  &final_gradient);
  MatrixXdR dQ(T, dk), dK(T, dk), dV(T, dv);
  RuleInputGradients<double> d_in;
  StateGradient<double> initial;
  for (int call = 0; call < 2; ++call) {  // the second call reuses the sized buffers
    prefill_backward_into(h.attn, st, h.Q, h.K, h.V, h.beta, h.log_alpha, h.WY, &final_gradient,
                          GradientsRef<double>{dQ, dK, dV}, d_in, initial);
    check_delta_into(dQ, dK, dV, d_in, initial, g);
    CHECK(initial.z.size() == 0);  // delta rules keep no z
  }
}

TEMPLATE_TEST_CASE("a BackwardWorkspace kept across calls and lengths gives the bits of calls without",
                   "", float, double) {
  // Every rule keeps its buffers in the workspace: the chunk scratch and the forward's chunk
  // kernel (zeroed again where a new one is zero), per-token buffers grown and never shrunk,
  // and for Delta and GatedDelta the rebuilt forward data. Each call, whatever ran before it,
  // must return exactly what a call without a workspace returns. Two shapes: dk = 3, dv = 2 in
  // chunks of 4 (the row-by-row fallback of the products) with lengths 9, 14, 9, 3, 9 (short
  // last chunks, growth, a longer buffer reused, a call shorter than the chunk and back); and
  // dk = dv = 16 in chunks of 40 (the register kernel; three per-channel sub-chunks) with
  // lengths 100, 130, 100, 37, 13, 10, 9, 100 (single chunks of three sub-chunks and of one,
  // each served by buffers made for 40 rows; workspace_bits_test.cpp checks such chunks at the
  // host's packet width too). Before each call one whose query holds NaN leaves NaN in the
  // buffers. The recomputing backward (stateless and carried) and the saved forward's, one
  // workspace for all.
  using Scalar = TestType;
  using M = RowMatrix<Scalar>;
  using Vec = ColVector<Scalar>;
  struct Shape {
    Index dk, dv, chunk;
    std::vector<Index> lengths;
  };
  const Shape shapes[] = {
      {3, 2, 4, std::vector<Index>(std::begin(linattn_test::kWorkspaceLengths),
                                   std::end(linattn_test::kWorkspaceLengths))},
      {16, 16, 40, {100, 130, 100, 37, 13, 10, 9, 100}}};
  // run(make): every shape through make(T, seed, shape), a harness (the shapes loop inside each
  // SECTION: Catch runs one section per pass through the test case); `saved_design` false skips
  // the backward from a saved forward (per-channel GatedDelta has none yet).
  const auto run = [&](const auto& make, bool saved_design = true) {
    for (const Shape& shape : shapes) {
      const Index dk = shape.dk, dv = shape.dv;
      INFO("dk " << dk << ", dv " << dv << ", chunk " << shape.chunk);
      using H = std::decay_t<decltype(make(Index{1}, std::uint64_t{1}, shape))>;
      BackwardWorkspace<Scalar> workspace;
      CHECK(workspace.bytes() == 0);
      linattn_test::WorkspaceGrowth growth(
          *std::max_element(shape.lengths.begin(), shape.lengths.end()));
      std::uint64_t seed = 251;
      for (const Index T : shape.lengths) {
        INFO("T = " << T);
        const H h = make(T, seed, shape);
        seed += 10;
        const auto st = h.initial_state();
        const StateGradient<Scalar> final_gradient{
            h.WS, H::Attn::rule_type::keeps_normalizer ? h.wz : Vec()};
        M dQ(T, dk), dK(T, dk), dV(T, dv), Y(T, dv);
        RuleInputGradients<Scalar> d_in;
        StateGradient<Scalar> initial;
        const auto same = [&](const RuleGradients<Scalar>& g) {
          CHECK(dQ == g.Q);
          CHECK(dK == g.K);
          CHECK(dV == g.V);
          CHECK(d_in.log_gate == g.inputs.log_gate);
          CHECK(d_in.beta == g.inputs.beta);
          CHECK(d_in.log_alpha == g.inputs.log_alpha);
          CHECK(initial.S == g.initial.S);
          CHECK(initial.z == g.initial.z);
        };
        const auto poison = [&] {
          M bad = h.Q;
          bad(T - 1, 0) = std::numeric_limits<Scalar>::quiet_NaN();
          h.with_inputs([&](const auto&... in) {
            try {
              parallel_backward_into(h.attn, bad, h.K, h.V, in..., Mask::causal, h.WY,
                                     GradientsRef<Scalar>{dQ, dK, dV}, d_in, &initial, &workspace);
            } catch (const std::exception&) {  // a NaN denominator may throw: the buffers stay used
            }
          });
        };
        h.with_inputs([&](const auto&... in) {
          poison();
          const auto stateless = parallel_backward(h.attn, h.Q, h.K, h.V, in..., Mask::causal, h.WY);
          parallel_backward_into(h.attn, h.Q, h.K, h.V, in..., Mask::causal, h.WY,
                                 GradientsRef<Scalar>{dQ, dK, dV}, d_in, &initial, &workspace);
          same(stateless);

          poison();
          const auto carried = prefill_backward(h.attn, st, h.Q, h.K, h.V, in..., h.WY,
                                                &final_gradient);
          prefill_backward_into(h.attn, st, h.Q, h.K, h.V, in..., h.WY, &final_gradient,
                                GradientsRef<Scalar>{dQ, dK, dV}, d_in, initial, &workspace);
          same(carried);
          if (!saved_design) return;

          SavedForward<Scalar> saved;
          parallel_saving_into(h.attn, h.Q, h.K, h.V, in..., Mask::causal, Y, saved);
          poison();
          const auto from_saved = parallel_backward(h.attn, saved, h.Q, h.K, h.V, in...,
                                                    Mask::causal, h.WY);
          parallel_backward_into(h.attn, saved, h.Q, h.K, h.V, in..., Mask::causal, h.WY,
                                 GradientsRef<Scalar>{dQ, dK, dV}, d_in, &initial, &workspace);
          same(from_saved);
        });
        // Grown, never shrunk: after the longest call every later one, shorter than the chunk
        // too, is served by what it left.
        CHECK(growth.holds(T, workspace.bytes()));
      }
      workspace.release();
      CHECK(workspace.bytes() == 0);
    }
  };
  const auto strict = Normalization::strict(), none = Normalization::unnormalized();
  SECTION("Decay") {
    run([&](Index T, std::uint64_t seed, const Shape& sh) {
      return make_harness<EluPlusOne, Decay, Scalar>(EluPlusOne{}, Decay(0.8), strict, T, sh.dk,
                                                     sh.dv, sh.chunk, false, seed);
    });
  }
  SECTION("Gated, one gate per token and per channel") {
    for (const bool per_channel : {false, true}) {
      INFO("per channel " << per_channel);
      run([&](Index T, std::uint64_t seed, const Shape& sh) {
        return make_harness<EluPlusOne, Gated, Scalar>(EluPlusOne{}, Gated{}, strict, T, sh.dk,
                                                       sh.dv, sh.chunk, per_channel, seed);
      });
    }
  }
  SECTION("Delta and GatedDelta") {
    run([&](Index T, std::uint64_t seed, const Shape& sh) {
      return make_harness<L2Normalize, Delta, Scalar>(L2Normalize{}, Delta{}, none, T, sh.dk,
                                                      sh.dv, sh.chunk, false, seed);
    });
    run([&](Index T, std::uint64_t seed, const Shape& sh) {
      return make_harness<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, GatedDelta{}, none, T,
                                                           sh.dk, sh.dv, sh.chunk, false, seed);
    });
  }
  SECTION("GatedDelta with per-channel log_alpha") {
    run(
        [&](Index T, std::uint64_t seed, const Shape& sh) {
          return make_harness<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, GatedDelta{}, none,
                                                               T, sh.dk, sh.dv, sh.chunk, true,
                                                               seed);
        },
        false);
  }
}

TEST_CASE("delta backward on the register kernel's widths against the naive loop") {
  // dk = dv = 16 and 24 fill whole packets (the register kernel's products; the cases above, at
  // dk = 4, dv = 3, run its row-by-row fallback); chunk 16 is a whole number of packets, 12 is
  // padded; T = 45 ends in a short chunk; chunk 24 with T = 45 takes more than one solve block.
  for (const Index d : {Index{16}, Index{24}})
    for (const Index chunk : {Index{12}, Index{16}, Index{24}}) {
      INFO("d " << d << ", chunk " << chunk);
      constexpr Index T = 45;
      auto delta = make_harness<Identity, Delta, double>(
          Identity{}, Delta{}, Normalization::unnormalized(), T, d, d, chunk, false, 311);
      delta.K /= std::sqrt(static_cast<double>(d));  // |k| about 1, as above
      check_against_oracle<double>(delta, false, unit_roundoff<double>());
      check_against_oracle<float>(delta, false, unit_roundoff<float>());
      auto gated_delta = make_harness<Identity, GatedDelta, double>(
          Identity{}, GatedDelta{}, Normalization::unnormalized(), T, d, d, chunk, false, 321);
      gated_delta.K /= std::sqrt(static_cast<double>(d));
      check_against_oracle<double>(gated_delta, false, unit_roundoff<double>());
      check_against_oracle<float>(gated_delta, false, unit_roundoff<float>());
    }
}

namespace {

// The detail-level saved forward of a delta rule: the chunked forward with SaveDeltaChunks as
// its observer, then delta_backward_saved, against the plain forward and delta_backward.
template <class Rule, class Scalar>
void check_saved_delta(Index T, Index dk, Index dv, Index chunk, std::uint64_t seed) {
  using M = RowMatrix<Scalar>;
  auto hd = make_harness<L2Normalize, Rule, double>(L2Normalize{}, Rule{},
                                                    Normalization::unnormalized(), T, dk, dv,
                                                    chunk, false, seed);
  const RuleAttention<L2Normalize, Rule, Scalar> attn(L2Normalize{}, Rule{}, hd.attn.options());
  const M Q = hd.Q.template cast<Scalar>(), K = hd.K.template cast<Scalar>(),
          V = hd.V.template cast<Scalar>(), dY = hd.WY.template cast<Scalar>(),
          S0 = hd.S0.template cast<Scalar>(), dS_T = hd.WS.template cast<Scalar>();
  const ColVector<Scalar> beta = hd.beta.template cast<Scalar>(),
                          log_alpha = hd.log_alpha.template cast<Scalar>();
  const Index r = attn.feature_map().feature_dim(dk), C = attn.chunk_size(r, dv);
  detail::TokenInputs<Scalar> in;
  if constexpr (Rule::kind == WriteKind::gated_delta)
    detail::bind_token_inputs<Scalar>(attn.rule(), std::forward_as_tuple(beta, log_alpha), T, r, in);
  else
    detail::bind_token_inputs<Scalar>(attn.rule(), std::forward_as_tuple(beta), T, r, in);

  // The forward with the saving observer against the plain one: the same bits in Y and S_T.
  auto plain = attn.make_state(dk, dv), saving = attn.make_state(dk, dv);
  plain.assign(S0);
  saving.assign(S0);
  M Y_plain(T, dv), Y_saving(T, dv);
  const auto query = [&](Index) -> const M& { return Q; };
  detail::rule_chunked(attn.feature_map(), attn.options().normalization, C, 1, query, K, V, in,
                       plain, [&](Index) -> Eigen::Ref<M> { return Y_plain; });
  detail::DeltaSavedStates<Scalar> saved;
  saved.resize(T, std::min(C, std::max<Index>(T, 1)), r, dv);  // the forward's chunk
  detail::rule_chunked(attn.feature_map(), attn.options().normalization, C, 1, query, K, V, in,
                       saving, [&](Index) -> Eigen::Ref<M> { return Y_saving; },
                       detail::SaveDeltaChunks<Scalar>{saved});
  CHECK(Y_saving == Y_plain);
  CHECK(saving.S() == plain.S());
  // The public forward gives the same bits too (it runs the same chunked kernel).
  auto pub = attn.make_state(dk, dv);
  pub.assign(S0);
  M Y_public;
  if constexpr (Rule::kind == WriteKind::gated_delta)
    Y_public = attn.prefill(pub, Q, K, V, beta, log_alpha);
  else
    Y_public = attn.prefill(pub, Q, K, V, beta);
  CHECK(Y_public == Y_plain);

  // Pass 1 of the recomputing backward keeps the forward's bits.
  detail::DeltaSavedStates<Scalar> rebuilt;
  detail::DeltaForwardScratch<Scalar> pass1;
  detail::delta_save_chunks(attn.feature_map(), K, V, in, S0, C, rebuilt, pass1);
  CHECK(rebuilt.chunk_size == saved.chunk_size);
  CHECK(rebuilt.states == saved.states);
  CHECK(rebuilt.corrected == saved.corrected);
  CHECK(rebuilt.reads == saved.reads);

  // The backward from the saved data against delta_backward and the public prefill_backward.
  Scalar* no_alpha = nullptr;
  M dQ(T, dk), dK(T, dk), dV(T, dv), dS0;
  ColVector<Scalar> d_beta(T), d_log_alpha(T);
  const bool gated = Rule::kind == WriteKind::gated_delta;
  std::optional<detail::DeltaBackwardScratch<Scalar>> scratch, scratch_again;
  detail::delta_backward_saved<Scalar>(attn.feature_map(), Q, K, V, dY, in, saved, &dS_T, dQ, dK, dV,
                               d_beta.data(), gated ? d_log_alpha.data() : no_alpha, dS0, scratch);
  M eQ(T, dk), eK(T, dk), eV(T, dv), eS0;
  ColVector<Scalar> e_beta(T), e_log_alpha(T);
  detail::DeltaSavedStates<Scalar> rebuilt_again;
  detail::delta_backward<Scalar>(attn.feature_map(), Q, K, V, dY, in, S0, &dS_T, C, eQ, eK, eV,
                         e_beta.data(), gated ? e_log_alpha.data() : no_alpha, eS0,
                         rebuilt_again, pass1, scratch_again);
  CHECK(dQ == eQ);
  CHECK(dK == eK);
  CHECK(dV == eV);
  CHECK(d_beta == e_beta);
  if (gated) CHECK(d_log_alpha == e_log_alpha);
  CHECK(dS0 == eS0);
  auto st = attn.make_state(dk, dv);
  st.assign(S0);
  const StateGradient<Scalar> final_gradient{dS_T, ColVector<Scalar>()};
  RuleGradients<Scalar> g;
  if constexpr (Rule::kind == WriteKind::gated_delta)
    g = prefill_backward(attn, st, Q, K, V, beta, log_alpha, dY, &final_gradient);
  else
    g = prefill_backward(attn, st, Q, K, V, beta, dY, &final_gradient);
  CHECK(g.Q == dQ);
  CHECK(g.K == dK);
  CHECK(g.V == dV);
  CHECK(g.inputs.beta == d_beta);
  CHECK(g.initial.S == dS0);
}

}  // namespace

TEST_CASE("delta backward from the forward's saved chunks (detail level)") {
  // The register kernel's widths (16) and the fallback's (3, 5); T a multiple of the chunk, not
  // one, shorter than one chunk, 1 and 0.
  struct Case {
    Index T, dk, dv, chunk;
  };
  for (const Case c : {Case{64, 16, 16, 16}, Case{45, 16, 16, 16}, Case{37, 16, 24, 12},
                       Case{10, 16, 16, 32}, Case{1, 8, 8, 8}, Case{0, 8, 8, 8},
                       Case{23, 3, 5, 4}}) {
    INFO("T " << c.T << ", dk " << c.dk << ", dv " << c.dv << ", chunk " << c.chunk);
    check_saved_delta<Delta, float>(c.T, c.dk, c.dv, c.chunk, 411);
    check_saved_delta<GatedDelta, float>(c.T, c.dk, c.dv, c.chunk, 421);
    check_saved_delta<GatedDelta, double>(c.T, c.dk, c.dv, c.chunk, 431);
  }
}

}  // namespace rule_gradients_test
