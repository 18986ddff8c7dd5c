// Gradients of the write rules (linattn/rule_gradients.hpp): central differences in double of
// the library's forward for every input of every rule (gates near 0 and 1, beta at 0 and 1,
// T = 1 and T not a multiple of the chunk); the backward against a reverse-mode derivative of the
// naive recurrent loop written here from the formulas (with a magnitude run on absolute values
// for the rounding bounds); float against double; the reductions to Additive (log-gate 0,
// gamma = 1); beta = 0 cuts the update path; segments; shape errors.

#include <linattn/gradients.hpp>
#include <linattn/rule_gradients.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

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
  VectorXd beta, log_alpha; // delta rules (log_alpha empty for Delta)
  MatrixXdR S0, dS_T;       // r x dv
  VectorXd z0, dz_T;        // r (gated family)
  bool normalized = false;
  bool delta = false;
};

struct OracleOut {
  MatrixXdR dqf, dkf, dV, d_log_gate, dS0;
  VectorXd d_beta, d_log_alpha, dz0;
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
  std::vector<MatrixXdR> St(T + 1);
  St[0] = A(in.S0);
  const auto alpha = [&](Index t) {
    return in.log_alpha.size() == 0 ? 1.0 : std::exp(in.log_alpha(t));
  };
  for (Index t = 0; t < T; ++t) {
    const double a = alpha(t), b = std::abs(in.beta(t));
    const Eigen::RowVectorXd p = kf.row(t) * St[t];
    const Eigen::RowVectorXd e = V.row(t) + sign * a * p;
    St[t + 1] = a * St[t] + b * kf.row(t).transpose() * e;
  }
  out.S_T = St[T];
  MatrixXdR H = A(in.dS_T);
  out.d_beta.setZero(T);
  out.d_log_alpha.setZero(T);
  for (Index t = T - 1; t >= 0; --t) {
    const double a = alpha(t), b = in.beta(t);
    out.dqf.row(t) = (St[t + 1] * dY.row(t).transpose()).transpose();
    H += qf.row(t).transpose() * dY.row(t);
    const Eigen::RowVectorXd p = kf.row(t) * St[t];
    const Eigen::RowVectorXd e = V.row(t) + sign * a * p;
    const Eigen::RowVectorXd de = b * (kf.row(t) * H);
    out.dV.row(t) = de;
    out.d_beta(t) = kf.row(t).dot((H * e.transpose()).transpose());
    out.d_log_alpha(t) = a * ((St[t].array() * H.array()).sum() + sign * p.dot(de));
    const Eigen::RowVectorXd dp = sign * a * de;
    out.dkf.row(t) = b * (H * e.transpose()).transpose() + (St[t] * dp.transpose()).transpose();
    H = a * H + kf.row(t).transpose() * dp;
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
  Vec z0, wz, beta, log_alpha;

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
  h.log_alpha = uniform_matrix<Scalar>(T, 1, seed + 10, -1.0, 0.0);
  if (T >= 3) {
    h.log_alpha(1) = Scalar(-30);
    h.log_alpha(2) = Scalar(-1e-6);
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
  if constexpr (is_delta<Rule>) check_fd("beta", h.beta, g.inputs.beta, 0.0, 1.0, L);
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
  }
}
