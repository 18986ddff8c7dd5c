// Gradients of LinearAttention (linattn/gradients.hpp) and of the feature maps' backward():
// central differences in double for every map, normalization and mask, a quadratic reference
// in double or long double written here from the formulas (with the magnitude of every sum, for
// rounding bounds), float against double, training in segments, large-norm random features,
// shape errors.

#include <linattn/gradients.hpp>
#include <linattn/random_features.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace gradients_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::MatrixXdR;
using linattn_test::random_matrix;
using linattn_test::unit_roundoff;

namespace {

using LD = long double;

// ---- the forward calls the gradients are checked against ---------------------------------

// The causal forward continuing a state.
template <class Attn, class State, class MQ, class MK, class MV>
auto carried_forward(const Attn& attn, State& state, const MQ& Q, const MK& K, const MV& V) {
  return attn.prefill(state, Q, K, V);
}

// ---- the maps, in the library and in the reference -------------------------------------------

enum class MapKind { identity, elu, l2, taylor, positive, hyperbolic, trig };
constexpr MapKind kAllMaps[] = {MapKind::identity, MapKind::elu,        MapKind::l2,
                                MapKind::taylor,   MapKind::positive,   MapKind::hyperbolic,
                                MapKind::trig};
constexpr Index kProjections = 4;  // m of the random maps in the small tests

const char* map_name(MapKind kind) {
  switch (kind) {
    case MapKind::identity: return "identity";
    case MapKind::elu: return "elu_plus_one";
    case MapKind::l2: return "l2_normalize";
    case MapKind::taylor: return "taylor_exp";
    case MapKind::positive: return "positive_random_features";
    case MapKind::hyperbolic: return "hyperbolic_random_features";
    case MapKind::trig: return "trig_random_features";
  }
  return "";
}

bool is_random(MapKind kind) {
  return kind == MapKind::positive || kind == MapKind::hyperbolic || kind == MapKind::trig;
}

// Calls f(phi) with the library's map of that kind for inputs of dimension d (m projections).
template <class Scalar, class F>
void with_map(MapKind kind, Index d, Index m, F&& f) {
  switch (kind) {
    case MapKind::identity: f(Identity{}); break;
    case MapKind::elu: f(EluPlusOne{}); break;
    case MapKind::l2: f(L2Normalize{}); break;
    case MapKind::taylor: f(TaylorExp{}); break;
    case MapKind::positive: f(PositiveRandomFeatures<Scalar>(d, m, 5)); break;
    case MapKind::hyperbolic:
      f(PositiveRandomFeatures<Scalar>(d, m, 6, {Projection::orthogonal, std::nan(""), true}));
      break;
    case MapKind::trig: f(TrigRandomFeatures<Scalar>(d, m, 7)); break;
  }
}

// The reference's own feature maps in precision R, from the definitions: phi(x) and
// J(x)^T g. With `abs`, every term is replaced by its absolute value (x, f and g are then
// read as |x|, |f|, |g|), which gives the magnitude rounding errors are proportional to.
template <class R>
struct RefMap {
  MapKind kind = MapKind::elu;
  RowMatrix<double> W;  // m x d, random maps only
  double tau = 0;

  Index dim(Index d) const {
    if (kind == MapKind::taylor) return 1 + d + d * (d + 1) / 2;
    if (!is_random(kind)) return d;
    return kind == MapKind::positive ? W.rows() : 2 * W.rows();
  }

  std::vector<R> features(const std::vector<R>& x) const {
    const Index d = static_cast<Index>(x.size());
    R sq = 0;
    for (R v : x) sq += v * v;
    std::vector<R> f(static_cast<std::size_t>(dim(d)));
    switch (kind) {
      case MapKind::identity: f = x; break;
      case MapKind::elu:
        for (Index n = 0; n < d; ++n) f[n] = x[n] > 0 ? x[n] + 1 : std::exp(x[n]);
        break;
      case MapKind::l2:
        for (Index n = 0; n < d; ++n) f[n] = sq > 0 ? x[n] / std::sqrt(sq) : R(0);
        break;
      case MapKind::taylor: {  // 1, x / d^(1/4), x_i x_j / sqrt(d) (i < j), x_i^2 / sqrt(2 d)
        const R root_d = std::sqrt(static_cast<R>(d));
        std::size_t at = 0;
        f[at++] = 1;
        for (Index n = 0; n < d; ++n) f[at++] = x[n] / std::sqrt(root_d);
        for (Index i = 0; i < d; ++i)
          for (Index j = i; j < d; ++j)
            f[at++] = x[i] * x[j] / (i == j ? std::sqrt(2 * static_cast<R>(d)) : root_d);
        break;
      }
      default: {
        const Index m = W.rows();
        const R root = std::sqrt(static_cast<R>(tau)), t = static_cast<R>(tau);
        for (Index i = 0; i < m; ++i) {
          R p = 0;
          for (Index n = 0; n < d; ++n) p += root * static_cast<R>(W(i, n)) * x[n];
          if (kind == MapKind::trig) {
            const R s = std::exp(t * sq / 2) / std::sqrt(static_cast<R>(m));
            f[i] = std::sin(p) * s;
            f[m + i] = std::cos(p) * s;
          } else if (kind == MapKind::positive) {
            f[i] = std::exp(p - t * sq / 2) / std::sqrt(static_cast<R>(m));
          } else {
            f[i] = std::exp(p - t * sq / 2) / std::sqrt(static_cast<R>(2 * m));
            f[m + i] = std::exp(-p - t * sq / 2) / std::sqrt(static_cast<R>(2 * m));
          }
        }
      }
    }
    return f;
  }

  // J^T g at x with features f: each map's derivative written out.
  std::vector<R> chain(const std::vector<R>& x, const std::vector<R>& f, const std::vector<R>& g,
                       bool abs) const {
    const Index d = static_cast<Index>(x.size());
    const auto sgn = [abs](R v) { return abs ? std::abs(v) : v; };
    std::vector<R> dx(static_cast<std::size_t>(d), R(0));
    switch (kind) {
      case MapKind::identity: dx = g; break;
      case MapKind::elu:
        for (Index n = 0; n < d; ++n) dx[n] = g[n] * (x[n] > 0 ? R(1) : std::exp(x[n]));
        break;
      case MapKind::l2: {
        R sq = 0, fg = 0;
        for (Index n = 0; n < d; ++n) {
          sq += x[n] * x[n];
          fg += f[n] * g[n];
        }
        if (sq == 0) break;
        // d(x/|x|) = (I - f f^T) / |x|
        for (Index n = 0; n < d; ++n)
          dx[n] = (abs ? g[n] + f[n] * fg : g[n] - f[n] * fg) / std::sqrt(sq);
        break;
      }
      case MapKind::taylor: {  // d f / d x_n of each feature, times its g
        // (x is the true input also under `abs`, which then needs |x| for the magnitudes)
        const auto xn = [&](Index n) { return abs ? std::abs(x[n]) : x[n]; };
        const R root_d = std::sqrt(static_cast<R>(d));
        std::size_t at = 1;
        for (Index n = 0; n < d; ++n) dx[n] += g[at++] / std::sqrt(root_d);
        for (Index i = 0; i < d; ++i)
          for (Index j = i; j < d; ++j, ++at) {
            if (i == j) {
              dx[i] += g[at] * 2 * xn(i) / std::sqrt(2 * static_cast<R>(d));
            } else {
              dx[i] += g[at] * xn(j) / root_d;
              dx[j] += g[at] * xn(i) / root_d;
            }
          }
        break;
      }
      default: {
        const Index m = W.rows();
        const R root = std::sqrt(static_cast<R>(tau)), t = static_cast<R>(tau);
        R radial = 0;  // sum of g . f times the derivative of the common exponent, per x
        for (Index i = 0; i < dim(d); ++i) radial += g[i] * f[i];
        for (Index i = 0; i < m; ++i) {
          // d f_i / d x = f_i (root w_i - tau x) for positive; for trig, the sin / cos swap.
          R coeff = 0;
          if (kind == MapKind::positive) coeff = g[i] * f[i];
          if (kind == MapKind::hyperbolic) coeff = g[i] * f[i] + sgn(-g[m + i] * f[m + i]);
          if (kind == MapKind::trig) coeff = g[i] * f[m + i] + sgn(-g[m + i] * f[i]);
          for (Index n = 0; n < d; ++n) dx[n] += coeff * root * sgn(static_cast<R>(W(i, n)));
        }
        const R sign = kind == MapKind::trig ? R(1) : R(-1);  // exp(+|x'|^2/2) or exp(-...)
        for (Index n = 0; n < d; ++n) dx[n] += sgn(sign * t * x[n]) * radial;
      }
    }
    return dx;
  }
};

template <class R, class Phi>
RefMap<R> ref_map(MapKind kind, const Phi& phi) {
  RefMap<R> map;
  map.kind = kind;
  if constexpr (requires { phi.projection(); }) {
    map.W = phi.projection().template cast<double>();
    map.tau = phi.scale();
  }
  return map;
}

// ---- the quadratic reference ------------------------------------------------------------------

// What the reference computes: the outputs, the gradients, the final state and the row
// denominators (true domain).
struct RefGrads {
  MatrixXdR Y, dQ, dK, dV, dS0, dz0, S_T, z_T;
  std::vector<double> den;
};

struct Problem {
  MatrixXdR Q, K, V, dY;
  bool causal = true;
  Normalization norm{};
  MatrixXdR S0, z0;    // true initial state (r x dv, r x 1); empty: none
  MatrixXdR dS_T, dz_T;  // gradient of the true final state; empty: none
};

// y_i = sum_j w_ij v_j (+ phi(q_i)^T S0) / divisor(den_i) and its gradients, by loops over
// the quadratic form in precision R. With `abs` every product and sum is of absolute values
// (the divisors and clamp decisions are the value run's, passed in `divisors`), so the result
// is the magnitude sum |terms| of every output and gradient.
template <class R>
RefGrads reference_pass(const RefMap<R>& map, const Problem& p, bool abs,
                        std::vector<R>& divisors, std::vector<char>& through_den) {
  const Index Tq = p.Q.rows(), Tk = p.K.rows(), d = p.Q.cols(), dv = p.V.cols();
  const Index r = map.dim(d);
  const auto val = [abs](double v) { return abs ? R(std::abs(v)) : R(v); };
  // Features (and the chain rule) always see the true inputs; `abs` takes |f| afterwards.
  const auto row_of = [&](const MatrixXdR& X, Index i) {
    std::vector<R> x(static_cast<std::size_t>(X.cols()));
    for (Index n = 0; n < X.cols(); ++n) x[n] = R(X(i, n));
    return x;
  };
  const bool has_state = p.S0.size() > 0, has_final = p.dS_T.size() > 0;
  std::vector<std::vector<R>> qf(Tq), kf(Tk), qx(Tq), kx(Tk);
  for (Index i = 0; i < Tq; ++i) {
    qx[i] = row_of(p.Q, i);
    qf[i] = map.features(qx[i]);
    if (abs) for (R& v : qf[i]) v = std::abs(v);
  }
  for (Index j = 0; j < Tk; ++j) {
    kx[j] = row_of(p.K, j);
    kf[j] = map.features(kx[j]);
    if (abs) for (R& v : kf[j]) v = std::abs(v);
  }
  const auto S0 = [&](Index n, Index c) { return has_state ? val(p.S0(n, c)) : R(0); };
  const auto z0 = [&](Index n) { return has_state ? val(p.z0(n, 0)) : R(0); };
  const auto dST = [&](Index n, Index c) { return has_final ? val(p.dS_T(n, c)) : R(0); };
  const auto dzT = [&](Index n) { return has_final ? val(p.dz_T(n, 0)) : R(0); };

  RefGrads out;
  out.Y = MatrixXdR::Zero(Tq, dv);
  out.den.assign(static_cast<std::size_t>(Tq), 0.0);
  std::vector<std::vector<R>> g(Tq, std::vector<R>(static_cast<std::size_t>(dv))), y = g;
  std::vector<R> gd(static_cast<std::size_t>(Tq));
  if (!abs) {
    divisors.assign(static_cast<std::size_t>(Tq), R(1));
    through_den.assign(static_cast<std::size_t>(Tq), 0);
  }
  const auto visible = [&](Index i) { return p.causal ? i + 1 : Tk; };
  const auto dot = [](const std::vector<R>& a, const std::vector<R>& b) {
    R s = 0;
    for (std::size_t n = 0; n < a.size(); ++n) s += a[n] * b[n];
    return s;
  };
  for (Index i = 0; i < Tq; ++i) {
    std::vector<R> num(static_cast<std::size_t>(dv), R(0));
    R den = 0;
    for (Index n = 0; n < r; ++n) {
      den += qf[i][n] * z0(n);
      for (Index c = 0; c < dv; ++c) num[c] += qf[i][n] * S0(n, c);
    }
    for (Index j = 0; j < visible(i); ++j) {
      const R w = dot(qf[i], kf[j]);
      den += w;
      for (Index c = 0; c < dv; ++c) num[c] += w * val(p.V(j, c));
    }
    out.den[i] = static_cast<double>(den);
    if (!abs) {
      const double eps = p.norm.epsilon();
      switch (p.norm.kind()) {
        case Normalization::Kind::strict: divisors[i] = den; through_den[i] = 1; break;
        case Normalization::Kind::shifted: divisors[i] = den + R(eps); through_den[i] = 1; break;
        case Normalization::Kind::clamped:
          through_den[i] = den < R(eps) ? 0 : 1;
          divisors[i] = through_den[i] ? den : R(eps);
          break;
        case Normalization::Kind::unnormalized: break;
      }
    }
    const R D = abs ? std::abs(divisors[i]) : divisors[i];
    R dy_y = 0;
    for (Index c = 0; c < dv; ++c) {
      y[i][c] = num[c] / D;
      out.Y(i, c) = static_cast<double>(y[i][c]);
      g[i][c] = val(p.dY(i, c)) / D;
      dy_y += val(p.dY(i, c)) * y[i][c];
    }
    gd[i] = through_den[i] ? (abs ? dy_y / D : -dy_y / D) : R(0);
  }
  // dw_ij = g_i . v_j + gd_i, the gradient of the score w_ij.
  const auto dw = [&](Index i, Index j) {
    R s = gd[i];
    for (Index c = 0; c < dv; ++c) s += g[i][c] * val(p.V(j, c));
    return s;
  };
  out.dQ = MatrixXdR::Zero(Tq, d);
  out.dK = MatrixXdR::Zero(Tk, d);
  out.dV = MatrixXdR::Zero(Tk, dv);
  std::vector<std::vector<R>> dkf(Tk, std::vector<R>(static_cast<std::size_t>(r), R(0)));
  std::vector<std::vector<R>> dvr(Tk, std::vector<R>(static_cast<std::size_t>(dv), R(0)));
  for (Index j = 0; j < Tk; ++j)
    for (Index n = 0; n < r; ++n) {
      R s = dzT(n);
      for (Index c = 0; c < dv; ++c) {
        s += dST(n, c) * val(p.V(j, c));
        dvr[j][c] += dST(n, c) * kf[j][n];
      }
      dkf[j][n] = s;
    }
  for (Index i = 0; i < Tq; ++i) {
    std::vector<R> dqf(static_cast<std::size_t>(r), R(0));
    for (Index n = 0; n < r; ++n) {
      dqf[n] = z0(n) * gd[i];
      for (Index c = 0; c < dv; ++c) dqf[n] += S0(n, c) * g[i][c];
    }
    for (Index j = 0; j < visible(i); ++j) {
      const R dwij = dw(i, j), w = dot(qf[i], kf[j]);
      for (Index n = 0; n < r; ++n) {
        dqf[n] += dwij * kf[j][n];
        dkf[j][n] += dwij * qf[i][n];
      }
      for (Index c = 0; c < dv; ++c) dvr[j][c] += w * g[i][c];
    }
    const std::vector<R> dq = map.chain(qx[i], qf[i], dqf, abs);
    for (Index n = 0; n < d; ++n) out.dQ(i, n) = static_cast<double>(dq[n]);
  }
  for (Index j = 0; j < Tk; ++j) {
    const std::vector<R> dk = map.chain(kx[j], kf[j], dkf[j], abs);
    for (Index n = 0; n < d; ++n) out.dK(j, n) = static_cast<double>(dk[n]);
    for (Index c = 0; c < dv; ++c) out.dV(j, c) = static_cast<double>(dvr[j][c]);
  }
  out.dS0 = MatrixXdR::Zero(r, dv);
  out.dz0 = MatrixXdR::Zero(r, 1);
  out.S_T = MatrixXdR::Zero(r, dv);
  out.z_T = MatrixXdR::Zero(r, 1);
  for (Index n = 0; n < r; ++n) {
    R dz = dzT(n), z = z0(n);
    for (Index i = 0; i < Tq; ++i) dz += qf[i][n] * gd[i];
    for (Index j = 0; j < Tk; ++j) z += kf[j][n];
    out.dz0(n, 0) = static_cast<double>(dz);
    out.z_T(n, 0) = static_cast<double>(z);
    for (Index c = 0; c < dv; ++c) {
      R ds = dST(n, c), s = S0(n, c);
      for (Index i = 0; i < Tq; ++i) ds += qf[i][n] * g[i][c];
      for (Index j = 0; j < Tk; ++j) s += kf[j][n] * val(p.V(j, c));
      out.dS0(n, c) = static_cast<double>(ds);
      out.S_T(n, c) = static_cast<double>(s);
    }
  }
  return out;
}

// The reference's values and, with the same divisors, their magnitudes.
template <class R = double>
std::pair<RefGrads, RefGrads> reference_backward(const RefMap<R>& map, const Problem& p) {
  std::vector<R> divisors;
  std::vector<char> through_den;
  RefGrads value = reference_pass<R>(map, p, false, divisors, through_den);
  RefGrads magnitude = reference_pass<R>(map, p, true, divisors, through_den);
  return {value, magnitude};
}

// ---- rounding bounds ----------------------------------------------------------------------------

// Rounding bound, in units of u, for every output and gradient relative to its magnitude (the
// same sum over |terms|). Along the longest chain of operations each rounding adds at most u
// (first order) relative to the magnitude of what it rounds: the scores w (r products summed),
// num and den (T keys plus r state terms), the divisor and y (2), dy . y (dv), the score
// gradient g . v + gd (dv + 1), the sums over T rows and the r or dv terms of the state's
// share, the feature map's chain rule (d, or m for the random maps' projection); each appears
// at most twice on a chain (the chunked order re-associates the same terms, which the
// recursive-sum bound covers): 2 (2 T + 2 r + 2 dv + d + 16). Features add their own relative
// error twice (query and key side): a few ulps for Identity, ELU + 1 (exp, 2 ulp) and L2 (d
// terms of the norm); for the random maps every exponent p - |x'|^2 / 2 (or the log-scale l)
// is a sum of d + 2 rounded terms of size up to P + X2 / 2 (|p| <= P, tau |x|^2 <= X2), so
// exp() carries (d + 2) (P + X2 / 2) u relative error, and a weight combines two features and
// two key log-scales: 3 (d + 2) (2 P + X2) (as tests/random_features_test.cpp derives it).
double rounding_units(MapKind kind, Index T, Index r, Index dv, Index d, double P, double X2) {
  const double chains = 2.0 * static_cast<double>(2 * T + 2 * r + 2 * dv + d + 16);
  double features = 8;
  if (kind == MapKind::l2) features = 2.0 * static_cast<double>(d + 4);
  if (is_random(kind)) features = 3.0 * static_cast<double>(d + 2) * (2 * P + X2);
  return chains + features;
}

// P = max |p| = sqrt(tau) max|w_i| max|x| and X2 = tau max |x|^2 over Q and K (random maps).
template <class R>
std::pair<double, double> exponent_sizes(const RefMap<R>& map, const MatrixXdR& Q,
                                         const MatrixXdR& K) {
  if (!is_random(map.kind)) return {0.0, 0.0};
  const double norm = std::max(Q.rowwise().norm().maxCoeff(), K.rowwise().norm().maxCoeff());
  return {std::sqrt(map.tau) * map.W.rowwise().norm().maxCoeff() * norm,
          map.tau * norm * norm};
}

// max |actual - expected| / (units u (scale magnitude + tiny)) over all entries; <= 1 passes.
// `tiny` is the smallest normal number of the actual's precision: a rounding whose result is
// subnormal errs by up to u tiny in absolute terms (gradual underflow), not u relative to it.
// `scale` multiplies expected and magnitude (exp(M) for stored-state gradients).
template <class M>
double worst_ratio(const M& actual, const MatrixXdR& expected, const MatrixXdR& magnitude,
                   double units, double u, double scale = 1.0) {
  const double tiny = std::numeric_limits<typename M::Scalar>::min();
  REQUIRE(actual.rows() == expected.rows());
  REQUIRE(actual.cols() == expected.cols());
  double worst = 0;
  Index wi = 0, wc = 0;
  for (Index i = 0; i < expected.rows(); ++i)
    for (Index c = 0; c < expected.cols(); ++c) {
      const double allowed = units * u * (scale * magnitude(i, c) + tiny) + 1e-300;
      const double err = std::abs(static_cast<double>(actual(i, c)) - scale * expected(i, c));
      if (err / allowed > worst) { wi = i; wc = c; }
      worst = std::max(worst, err / allowed);
    }
  if (worst > 1)
    UNSCOPED_INFO("worst entry (" << wi << ", " << wc << "): " << double(actual(wi, wc))
                                  << " against " << scale * expected(wi, wc) << ", magnitude "
                                  << scale * magnitude(wi, wc));
  return worst;
}

// ---- inputs ------------------------------------------------------------------------------------

// Inputs of a scale every map reads well: N(0, 1) for ELU + 1; |N(0, 1)| + 0.1 for Identity and
// L2 (positive scores, so strict denominators are positive); N(0, 0.25) for the positive random
// maps and N(0, 0.0625) for trig (cos(w . (q' - k')) near 1, positive denominators).
double input_sigma(MapKind kind) {
  if (kind == MapKind::trig) return 0.25;
  if (is_random(kind)) return 0.5;
  return 1.0;
}

MatrixXdR map_inputs(MapKind kind, Index rows, Index d, std::uint64_t seed) {
  MatrixXdR X = random_matrix<double>(rows, d, seed, input_sigma(kind));
  if (kind == MapKind::identity || kind == MapKind::l2) X = X.cwiseAbs().array() + 0.1;
  return X;
}

// An eps inside the widest gap between the denominators (sorted), so that some rows clamp and
// some do not, none within half the gap of eps; with one row, twice its denominator (clamped).
double clamp_epsilon(std::vector<double> den) {
  std::sort(den.begin(), den.end());
  if (den.size() < 2) return 2 * std::abs(den.front()) + 1e-3;
  std::size_t best = 0;
  for (std::size_t i = 0; i + 1 < den.size(); ++i)
    if (den[i + 1] - den[i] > den[best + 1] - den[best]) best = i;
  const double eps = (den[best] + den[best + 1]) / 2;
  return eps > 0 ? eps : den.back() / 2;  // eps must be positive: then only the largest row
}

template <class Scalar>
RowMatrix<Scalar> as(const MatrixXdR& X) {
  return X.cast<Scalar>();
}

MatrixXdR as_double(const auto& X) { return X.template cast<double>(); }

// ---- one case: library and reference side by side ---------------------------------------------

enum class NormKind { strict, clamped, shifted, unnormalized };
constexpr NormKind kAllNorms[] = {NormKind::strict, NormKind::clamped, NormKind::shifted,
                                  NormKind::unnormalized};
const char* norm_name(NormKind kind) {
  switch (kind) {
    case NormKind::strict: return "strict";
    case NormKind::clamped: return "clamped";
    case NormKind::shifted: return "shifted";
    case NormKind::unnormalized: return "unnormalized";
  }
  return "";
}

struct CaseSpec {
  MapKind map = MapKind::elu;
  NormKind norm = NormKind::strict;
  Mask mask = Mask::causal;
  Index T = 7, Tk = 7, d = 4, dv = 3, chunk = 3;
  Index prefix = 0;     // tokens the initial state absorbs first (0: empty state)
  bool final = false;   // a gradient of the final state too
  std::uint64_t seed = 1;
};

// Everything a case needs, in double: inputs, the initial state as the library holds it, the
// final-state gradient, and the Normalization (eps chosen from the denominators).
struct CaseData {
  MatrixXdR Q, K, V, dY, prefix_Q, prefix_K, prefix_V, dS_T, dz_T;
  Normalization norm{};
};

template <class R, class Phi>
CaseData make_case(const CaseSpec& spec, const Phi& phi) {
  CaseData c;
  const std::uint64_t s = spec.seed * 100;
  c.Q = map_inputs(spec.map, spec.T, spec.d, s + 1);
  c.K = map_inputs(spec.map, spec.Tk, spec.d, s + 2);
  c.V = random_matrix<double>(spec.Tk, spec.dv, s + 3);
  c.dY = random_matrix<double>(spec.T, spec.dv, s + 4);
  c.prefix_Q = map_inputs(spec.map, spec.prefix, spec.d, s + 5);
  c.prefix_K = map_inputs(spec.map, spec.prefix, spec.d, s + 6);
  c.prefix_V = random_matrix<double>(spec.prefix, spec.dv, s + 7);
  const Index r = phi.feature_dim(spec.d);
  if (spec.final) {
    c.dS_T = random_matrix<double>(r, spec.dv, s + 8);
    c.dz_T = random_matrix<double>(r, 1, s + 9);
  }
  // Denominators of the read (strict, with the prefix's state) decide the epsilons.
  Problem p;
  p.Q = c.Q;
  p.K = c.K;
  p.V = c.V;
  p.dY = c.dY;
  p.causal = spec.mask == Mask::causal;
  if (spec.prefix > 0) {
    Problem pre;
    pre.Q = c.prefix_Q;
    pre.K = c.prefix_K;
    pre.V = c.prefix_V;
    pre.dY = MatrixXdR::Zero(spec.prefix, spec.dv);
    const auto pre_ref = reference_backward<R>(ref_map<R>(spec.map, phi), pre);
    p.S0 = pre_ref.first.S_T;
    p.z0 = pre_ref.first.z_T;
  }
  const auto ref = reference_backward<R>(ref_map<R>(spec.map, phi), p);
  std::vector<double> den = ref.first.den;
  std::vector<double> sorted = den;
  std::sort(sorted.begin(), sorted.end());
  switch (spec.norm) {
    case NormKind::strict: c.norm = Normalization::strict(); break;
    case NormKind::clamped: c.norm = Normalization::clamped(clamp_epsilon(den)); break;
    case NormKind::shifted:
      c.norm = Normalization::shifted(std::max(0.5 * sorted[sorted.size() / 2], 1e-3));
      break;
    case NormKind::unnormalized: c.norm = Normalization::unnormalized(); break;
  }
  return c;
}

// The library's state after the case's prefix (empty without one).
template <class Attn>
auto initial_state(const Attn& attn, const CaseSpec& spec, const CaseData& c) {
  using Scalar = typename Attn::scalar_type;
  auto state = attn.make_state(spec.d, spec.dv);
  if (spec.prefix > 0)
    static_cast<void>(carried_forward(attn, state, as<Scalar>(c.prefix_Q), as<Scalar>(c.prefix_K),
                                      as<Scalar>(c.prefix_V)));
  return state;
}

// The library's gradients for the case (stored-state convention for the state gradients).
template <class Attn, class State>
auto library_gradients(const Attn& attn, const State& state, const CaseSpec& spec,
                       const CaseData& c) {
  using Scalar = typename Attn::scalar_type;
  const auto Q = as<Scalar>(c.Q), K = as<Scalar>(c.K), V = as<Scalar>(c.V), dY = as<Scalar>(c.dY);
  if (spec.mask == Mask::none || (spec.prefix == 0 && !spec.final))
    return parallel_backward(attn, Q, K, V, spec.mask, dY);
  StateGradient<Scalar> final_gradient{as<Scalar>(c.dS_T), as<Scalar>(c.dz_T).col(0)};
  return prefill_backward(attn, state, Q, K, V, dY, spec.final ? &final_gradient : nullptr);
}

// The reference problem of the case: the library's stored state and final gradient turned into
// true quantities (S0 = exp(M0) S(), dS_T true = exp(-M_T) dS_T stored).
template <class Attn, class State>
Problem reference_problem(const Attn& attn, const State& state, const CaseSpec& spec,
                          const CaseData& c, double& M0, double& M_T) {
  using Scalar = typename Attn::scalar_type;
  Problem p;
  p.Q = as_double(as<Scalar>(c.Q));
  p.K = as_double(as<Scalar>(c.K));
  p.V = as_double(as<Scalar>(c.V));
  p.dY = as_double(as<Scalar>(c.dY));
  p.causal = spec.mask == Mask::causal;
  p.norm = c.norm;
  M0 = M_T = 0;
  if (spec.mask == Mask::causal) {
    M0 = static_cast<double>(state.log_scale());
    auto after = state;
    static_cast<void>(carried_forward(attn, after, as<Scalar>(c.Q), as<Scalar>(c.K), as<Scalar>(c.V)));
    M_T = static_cast<double>(after.log_scale());
  }
  if (spec.prefix > 0) {
    p.S0 = std::exp(M0) * as_double(state.S());
    p.z0 = std::exp(M0) * as_double(state.z());
  }
  if (spec.final) {
    p.dS_T = std::exp(-M_T) * as_double(as<Scalar>(c.dS_T));
    p.dz_T = std::exp(-M_T) * as_double(as<Scalar>(c.dz_T));
  }
  return p;
}

// The library's gradients of a case against the quadratic reference in precision R, within
// `units` u of each entry's magnitude (state gradients in the stored convention, exp(M) times
// the true ones).
template <class R, class Attn>
void check_against_reference(const Attn& attn, const CaseSpec& spec, const CaseData& c) {
  using Scalar = typename Attn::scalar_type;
  const auto state = initial_state(attn, spec, c);
  const auto g = library_gradients(attn, state, spec, c);
  double M0 = 0, M_T = 0;
  const Problem p = reference_problem(attn, state, spec, c, M0, M_T);
  const RefMap<R> map = ref_map<R>(spec.map, attn.feature_map());
  const auto ref = reference_backward<R>(map, p);
  MatrixXdR all_inputs(c.Q.rows() + c.K.rows() + c.prefix_Q.rows() + c.prefix_K.rows(), spec.d);
  all_inputs << c.Q, c.K, c.prefix_Q, c.prefix_K;
  const auto sizes = exponent_sizes(map, all_inputs, all_inputs);
  const Index r = attn.feature_dim(spec.d);
  const double units = rounding_units(spec.map, spec.T + spec.prefix, r, spec.dv, spec.d,
                                      sizes.first, sizes.second);
  const double u = unit_roundoff<Scalar>();
  CAPTURE(map_name(spec.map), norm_name(spec.norm), spec.mask == Mask::causal, spec.T, spec.Tk,
          spec.d, spec.dv, spec.chunk, spec.prefix, spec.final, units);
  CHECK(g.Q.allFinite());
  CHECK(g.K.allFinite());
  CHECK(g.V.allFinite());
  CHECK(worst_ratio(g.Q, ref.first.dQ, ref.second.dQ, units, u) <= 1);
  CHECK(worst_ratio(g.K, ref.first.dK, ref.second.dK, units, u) <= 1);
  CHECK(worst_ratio(g.V, ref.first.dV, ref.second.dV, units, u) <= 1);
  if (spec.mask == Mask::causal) {
    const double to_stored = std::exp(M0);  // 0 for the empty state of a log-scaled map
    CHECK(worst_ratio(g.initial.S, ref.first.dS0, ref.second.dS0, units, u, to_stored) <= 1);
    CHECK(worst_ratio(g.initial.z, ref.first.dz0, ref.second.dz0, units, u, to_stored) <= 1);
  } else {
    CHECK(g.initial.S.size() == 0);
    CHECK(g.initial.z.size() == 0);
  }
}

template <class Scalar, class F>
void for_case(const CaseSpec& spec, F&& f) {
  with_map<Scalar>(spec.map, spec.d, kProjections, [&](const auto& phi) {
    using Phi = std::decay_t<decltype(phi)>;
    const CaseData c = make_case<double>(spec, phi);
    const LinearAttention<Phi, Scalar> attn(phi, Options{c.norm, spec.chunk});
    f(attn, c);
  });
}

// Central differences of a loss along every entry of X, against the analytic gradient.
// Step and tolerance from the scale of the inputs: with h = 2^k near u^(1/3) max(|x|, s)
// (s the RMS of X; a power of two so that x +- h is exact),
//   D(h) = (L(x + h) - L(x - h)) / (2h) = L'(x) + h^2 L3 / 6 + e / h,  |e| <= eps_L,
// with L3 the third derivative somewhere in [x - h, x + h] and eps_L = units u Lmag bounding the
// rounding of one evaluation of L (rounding_units; Lmag the magnitude sum of L's terms). The
// truncation term is measured rather than assumed: D(2h) - D(h) = 3 h^2 L3 / 6 plus rounding of
// at most 1.5 eps_L / h, so
//   |L'(x) - D(h)| <= |D(2h) - D(h)| + 3 eps_L / h.
// h near u^(1/3) balances the two terms for inputs of scale s (h^2 / s^2 ~ u s / h), leaving
// an error of order u^(2/3) of the gradient's scale.
// `largest_tolerance` collects the tolerances so the caller can check the test stays sharp.
template <class Analytic, class LossAt>
void check_entries(const char* what, const MatrixXdR& X, const Analytic& analytic,
                   const LossAt& loss_at, double eps_L, double& largest_tolerance,
                   double& largest_gradient) {
  const double u = unit_roundoff<double>();
  const double s =
      std::max(std::sqrt(X.squaredNorm() / std::max(1.0, static_cast<double>(X.size()))), 1e-3);
  for (Index i = 0; i < X.rows(); ++i)
    for (Index c = 0; c < X.cols(); ++c) {
      const double h =
          std::exp2(std::round(std::log2(std::cbrt(u) * std::max(std::abs(X(i, c)), s))));
      MatrixXdR Xp = X;
      const auto D = [&](double step) {
        Xp(i, c) = X(i, c) + step;
        const double up = loss_at(Xp);
        Xp(i, c) = X(i, c) - step;
        const double down = loss_at(Xp);
        return (up - down) / (2 * step);
      };
      const double d1 = D(h), d2 = D(2 * h);
      const double tolerance = std::abs(d2 - d1) + 3 * eps_L / h;
      const double a = static_cast<double>(analytic(i, c));
      CAPTURE(what, i, c, a, d1, d2, tolerance);
      CHECK(std::abs(a - d1) <= tolerance);
      largest_tolerance = std::max(largest_tolerance, tolerance);
      largest_gradient = std::max(largest_gradient, std::abs(d1));
    }
}

// Finite differences in double on every input of a case: Q, K, V and, with a prefix, the stored
// S0 and z0 of the initial state. The loss is sum(dY * Y), plus, with a final gradient,
// exp(M_T - M_ref) (sum(dS_T * S_T) + dz_T . z_T) with M_ref the base point's M_T: a function of
// the true final sums, as a next segment's loss would be (M = 0 for ordinary maps).
template <class Phi>
void check_finite_differences(const CaseSpec& spec, const Phi& phi) {
  const CaseData c = make_case<double>(spec, phi);
  const LinearAttention<Phi, double> attn(phi, Options{c.norm, spec.chunk});
  const auto state = initial_state(attn, spec, c);
  const auto g = library_gradients(attn, state, spec, c);
  double M0 = 0, M_T = 0;
  const Problem p = reference_problem(attn, state, spec, c, M0, M_T);
  const RefMap<double> map = ref_map<double>(spec.map, phi);
  const auto ref = reference_backward<double>(map, p);
  double L_mag = c.dY.cwiseAbs().cwiseProduct(ref.second.Y).sum();
  if (spec.final)
    L_mag += std::exp(-M_T) * (c.dS_T.cwiseAbs().cwiseProduct(ref.second.S_T).sum() +
                               c.dz_T.cwiseAbs().cwiseProduct(ref.second.z_T).sum());
  MatrixXdR all_inputs(c.Q.rows() + c.K.rows() + c.prefix_Q.rows() + c.prefix_K.rows(), spec.d);
  all_inputs << c.Q, c.K, c.prefix_Q, c.prefix_K;
  const auto sizes = exponent_sizes(map, all_inputs, all_inputs);
  const double units = rounding_units(spec.map, spec.T + spec.prefix, attn.feature_dim(spec.d),
                                      spec.dv, spec.d, sizes.first, sizes.second);
  const double eps_L = units * unit_roundoff<double>() * L_mag;
  CAPTURE(map_name(spec.map), norm_name(spec.norm), spec.mask == Mask::causal, spec.T, spec.Tk,
          spec.chunk, spec.prefix, spec.final, c.norm.epsilon(), L_mag);

  using State = std::decay_t<decltype(state)>;
  const auto loss = [&](const MatrixXdR& Q, const MatrixXdR& K, const MatrixXdR& V,
                        const State& from) {
    if (spec.mask == Mask::none) return (attn.parallel(Q, K, V, Mask::none).array() * c.dY.array()).sum();
    State st = from;
    const MatrixXdR Y = carried_forward(attn, st, Q, K, V);
    double L = (Y.array() * c.dY.array()).sum();
    if (spec.final)
      L += std::exp(st.log_scale() - M_T) *
           ((st.S().array() * c.dS_T.array()).sum() + st.z().dot(c.dz_T.col(0)));
    return L;
  };
  double largest_tolerance = 0, largest_gradient = 0;
  check_entries("dQ", c.Q, g.Q, [&](const MatrixXdR& X) { return loss(X, c.K, c.V, state); },
                eps_L, largest_tolerance, largest_gradient);
  check_entries("dK", c.K, g.K, [&](const MatrixXdR& X) { return loss(c.Q, X, c.V, state); },
                eps_L, largest_tolerance, largest_gradient);
  check_entries("dV", c.V, g.V, [&](const MatrixXdR& X) { return loss(c.Q, c.K, X, state); },
                eps_L, largest_tolerance, largest_gradient);
  if (spec.prefix > 0) {
    const auto with_S = [&](const MatrixXdR& S) {
      State st = state;
      st.assign(S, st.z(), st.tokens(), st.log_scale());
      return loss(c.Q, c.K, c.V, st);
    };
    const auto with_z = [&](const MatrixXdR& z) {
      State st = state;
      st.assign(st.S(), z.col(0), st.tokens(), st.log_scale());
      return loss(c.Q, c.K, c.V, st);
    };
    check_entries("dS0", state.S(), g.initial.S, with_S, eps_L, largest_tolerance,
                  largest_gradient);
    check_entries("dz0", MatrixXdR(state.z()), g.initial.z, with_z, eps_L, largest_tolerance,
                  largest_gradient);
  }
  // The test stays sharp: an error of 1e-5 of the largest gradient would fail it.
  CHECK(largest_tolerance <= 1e-5 * largest_gradient);
}

}  // namespace

// ---- feature maps ------------------------------------------------------------------------------

namespace {
struct NoDerivative {  // a feature map without backward()
  static constexpr bool strictly_positive = true;
  Index feature_dim(Index d) const { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const { out = x.array().exp().matrix(); }
};
}  // namespace

static_assert(DifferentiableFeatureMap<Identity>);
static_assert(DifferentiableFeatureMap<EluPlusOne, double>);
static_assert(DifferentiableFeatureMap<L2Normalize>);
static_assert(DifferentiableFeatureMap<TaylorExp, double>);
static_assert(DifferentiableFeatureMap<PositiveRandomFeatures<float>, float>);
static_assert(DifferentiableFeatureMap<TrigRandomFeatures<double>, double>);
static_assert(FeatureMap<NoDerivative> && !DifferentiableFeatureMap<NoDerivative>);
static_assert(!DifferentiableFeatureMap<PositiveRandomFeatures<double>, float>);

TEST_CASE("every feature map's backward is J^T d_features (central differences)", "[maps]") {
  const Index T = 5, d = 4;
  for (MapKind kind : kAllMaps) {
    with_map<double>(kind, d, 6, [&](const auto& phi) {
      const Index r = phi.feature_dim(d);
      const MatrixXdR X = map_inputs(kind, T, d, 31) - 0.3 * MatrixXdR::Ones(T, d);
      const MatrixXdR dF = random_matrix<double>(T, r, 32);
      RowMatrix<double> F(T, r), dX(T, d);
      Eigen::Ref<RowMatrix<double>> f_ref(F), dx_ref(dX);
      phi.apply(X, f_ref);
      phi.backward(X, F, dF, dx_ref);
      // L(x) = sum(dF * phi(x)); its gradient is J^T dF. Rounding of L: (r + 8) u per term of
      // sum |dF| |phi| (exp and the projection's d terms within that for these small inputs).
      const auto loss = [&](const MatrixXdR& Xp) {
        RowMatrix<double> Fp(T, r);
        Eigen::Ref<RowMatrix<double>> ref(Fp);
        phi.apply(Xp, ref);
        return (Fp.array() * dF.array()).sum();
      };
      const double eps_L = static_cast<double>(r + d + 8) * unit_roundoff<double>() *
                           (F.array().abs() * dF.array().abs()).sum();
      double largest_tolerance = 0, largest_gradient = 0;
      CAPTURE(map_name(kind));
      check_entries("dX", X, dX, loss, eps_L, largest_tolerance, largest_gradient);
      CHECK(largest_tolerance <= 1e-6 * largest_gradient);
    });
  }
}

TEST_CASE("random maps' backward takes scaled features: the shifts cancel", "[maps]") {
  // backward(x, f, exp(l) dphi) = backward(x, phi, dphi) for the scaled features f of
  // apply_scaled: both are sums of the same products d_phi * phi, rounded differently; bound
  // (2 (r + d) + 3 (d + 2)(2 P + X2)) u relative to the magnitude of those products.
  const Index T = 6, d = 5, m = 7;
  for (MapKind kind : {MapKind::positive, MapKind::hyperbolic, MapKind::trig}) {
    with_map<double>(kind, d, m, [&](const auto& phi) {
      if constexpr (LogScaledFeatureMap<std::decay_t<decltype(phi)>, double>) {
      const Index r = phi.feature_dim(d);
      const MatrixXdR X = random_matrix<double>(T, d, 41, 0.7);
      const MatrixXdR dPhi = random_matrix<double>(T, r, 42);
      RowMatrix<double> F(T, r), Fs(T, r), plain(T, d), scaled(T, d);
      ColVector<double> l(T);
      Eigen::Ref<RowMatrix<double>> f_ref(F), fs_ref(Fs), plain_ref(plain), scaled_ref(scaled);
      phi.apply(X, f_ref);
      phi.apply_scaled(X, fs_ref, l);
      const MatrixXdR dF_scaled = l.array().exp().matrix().asDiagonal() * dPhi;
      phi.backward(X, F, dPhi, plain_ref);
      phi.backward(X, Fs, dF_scaled, scaled_ref);
      const RefMap<double> map = ref_map<double>(kind, phi);
      const auto sizes = exponent_sizes(map, X, X);
      const double units = 2.0 * static_cast<double>(r + d) +
                           3.0 * static_cast<double>(d + 2) * (2 * sizes.first + sizes.second);
      for (Index t = 0; t < T; ++t) {
        std::vector<double> x(X.row(t).data(), X.row(t).data() + d), f, g(dPhi.row(t).data(), dPhi.row(t).data() + r);
        f = map.features(x);
        for (double& v : f) v = std::abs(v);
        for (double& v : g) v = std::abs(v);
        const std::vector<double> mag = map.chain(x, f, g, true);
        for (Index n = 0; n < d; ++n) {
          CAPTURE(map_name(kind), t, n, plain(t, n), scaled(t, n), mag[n]);
          CHECK(std::abs(plain(t, n) - scaled(t, n)) <= units * unit_roundoff<double>() * mag[n]);
        }
      }
      }
    });
  }
}

TEST_CASE("L2Normalize's backward: zero rows give zero, NaN rows NaN, tiny rows finite",
          "[maps]") {
  const L2Normalize phi;
  RowMatrix<double> X(3, 3);
  X << 0, 0, 0, std::nan(""), 1, 2, 1e-300, -2e-300, 3e-300;
  RowMatrix<double> F(3, 3), dX(3, 3);
  Eigen::Ref<RowMatrix<double>> f_ref(F), dx_ref(dX);
  phi.apply(X, f_ref);
  const RowMatrix<double> dF = RowMatrix<double>::Ones(3, 3);
  phi.backward(X, F, dF, dx_ref);
  CHECK(dX.row(0).isZero());
  CHECK(dX.row(1).array().isNaN().all());
  // Row 2: (dF - f (f . dF)) / |x|, with |x| = 1e-300 sqrt(14), computed after rescaling.
  const double norm = 1e-300 * std::sqrt(14.0);
  for (Index n = 0; n < 3; ++n) {
    const double expected = (1 - F(2, n) * F.row(2).sum()) / norm;
    CHECK(std::abs(dX(2, n) - expected) <= 16 * unit_roundoff<double>() * std::abs(1 / norm) * 4);
  }
}

// ---- attention gradients ------------------------------------------------------------------------

TEST_CASE("gradients match central differences for every map, normalization and mask",
          "[gradients][finite-differences]") {
  struct Shape {
    Mask mask;
    Index T, Tk, prefix;
    bool final;
  };
  // Chunks of 3: T = 7 is not a multiple; T = 1; full reads with Tq != Tk and with one row;
  // a carried state (S0, z0 from 4 earlier tokens) and a final-state gradient.
  const Shape shapes[] = {{Mask::none, 5, 7, 0, false},  {Mask::none, 1, 1, 0, false},
                          {Mask::causal, 7, 7, 0, false}, {Mask::causal, 1, 1, 0, false},
                          {Mask::causal, 7, 7, 4, true},  {Mask::causal, 1, 1, 4, true}};
  for (MapKind map : kAllMaps)
    for (NormKind norm : kAllNorms)
      for (const Shape& shape : shapes) {
        CaseSpec spec;
        spec.map = map;
        spec.norm = norm;
        spec.mask = shape.mask;
        spec.T = shape.T;
        spec.Tk = shape.Tk;
        spec.prefix = shape.prefix;
        spec.final = shape.final;
        spec.seed = 7 + static_cast<std::uint64_t>(shape.T);
        with_map<double>(map, spec.d, kProjections,
                         [&](const auto& phi) { check_finite_differences(spec, phi); });
      }
}

TEST_CASE("chunked backward equals the quadratic reference for every chunk size",
          "[gradients][chunked]") {
  // T = 50 is a multiple of none of the chunk sizes but 1, 2, 5 and 25; 64 > T. dk = dv = 8
  // run the register kernel's products (r and dv multiples of the packet width), dk = 5, dv = 3
  // Eigen's. A carried state of 9 tokens and a final-state gradient are included.
  struct Dims {
    Index d, dv;
  };
  for (const Dims dims : {Dims{8, 8}, Dims{5, 3}})
    for (MapKind map : kAllMaps)
      for (NormKind norm : kAllNorms) {
        if (norm != NormKind::strict && map != MapKind::elu && map != MapKind::positive) continue;
        for (Index chunk : {1, 2, 3, 7, 16, 25, 32, 64}) {
          CaseSpec spec;
          spec.map = map;
          spec.norm = norm;
          spec.T = spec.Tk = 50;
          spec.d = dims.d;
          spec.dv = dims.dv;
          spec.chunk = chunk;
          spec.prefix = 9;
          spec.final = true;
          spec.seed = 21;
          for_case<double>(spec, [&](const auto& attn, const CaseData& c) {
            check_against_reference<double>(attn, spec, c);
          });
        }
        CaseSpec full;  // and the full read, Tq != Tk
        full.map = map;
        full.norm = norm;
        full.mask = Mask::none;
        full.T = 23;
        full.Tk = 50;
        full.d = dims.d;
        full.dv = dims.dv;
        full.seed = 22;
        for_case<double>(full, [&](const auto& attn, const CaseData& c) {
          check_against_reference<double>(attn, full, c);
        });
      }
}

TEMPLATE_TEST_CASE("float and double gradients agree within the derived bound",
                   "[gradients][precision]", float, double) {
  // Each precision is within rounding_units u of the reference (in long double, so its own
  // error is below both), hence float and double within the sum of their bounds.
  for (MapKind map : {MapKind::elu, MapKind::positive, MapKind::hyperbolic, MapKind::trig})
    for (NormKind norm : {NormKind::strict, NormKind::shifted})
      for (Mask mask : {Mask(Mask::causal), Mask(Mask::none)}) {
        CaseSpec spec;
        spec.map = map;
        spec.norm = norm;
        spec.mask = mask;
        spec.T = 40;
        spec.Tk = mask == Mask::causal ? 40 : 33;
        spec.d = 8;
        spec.dv = 8;
        spec.chunk = 16;
        spec.prefix = mask == Mask::causal ? 5 : 0;
        spec.final = mask == Mask::causal;
        spec.seed = 31;
        for_case<TestType>(spec, [&](const auto& attn, const CaseData& c) {
          check_against_reference<LD>(attn, spec, c);
        });
      }
  // Directly: float against double on the same inputs, within the sum of the two bounds.
  CaseSpec spec;
  spec.T = spec.Tk = 40;
  spec.d = spec.dv = 8;
  spec.chunk = 16;
  spec.prefix = 5;
  spec.final = true;
  {
    const EluPlusOne phi;
    const CaseData c = make_case<double>(spec, phi);
    const LinearAttention<EluPlusOne, float> attn_f(phi, Options{c.norm, spec.chunk});
    const LinearAttention<EluPlusOne, double> attn_d(phi, Options{c.norm, spec.chunk});
    const auto state_f = initial_state(attn_f, spec, c);
    const auto state_d = initial_state(attn_d, spec, c);
    const auto gf = library_gradients(attn_f, state_f, spec, c);
    const auto gd = library_gradients(attn_d, state_d, spec, c);
    double M0 = 0, M_T = 0;
    const Problem p = reference_problem(attn_f, state_f, spec, c, M0, M_T);
    const auto ref = reference_backward<LD>(ref_map<LD>(MapKind::elu, phi), p);
    const double units = rounding_units(MapKind::elu, spec.T + spec.prefix, spec.d, spec.dv,
                                        spec.d, 0, 0);
    const double both = units * (unit_roundoff<float>() + unit_roundoff<double>());
    CHECK(worst_ratio(gf.Q, as_double(gd.Q), ref.second.dQ, both, 1.0) <= 1);
    CHECK(worst_ratio(gf.K, as_double(gd.K), ref.second.dK, both, 1.0) <= 1);
    CHECK(worst_ratio(gf.V, as_double(gd.V), ref.second.dV, both, 1.0) <= 1);
    CHECK(worst_ratio(gf.initial.S, as_double(gd.initial.S), ref.second.dS0, both, 1.0) <= 1);
    // ...and they do differ (float really is float): by more than double rounding somewhere.
    CHECK((as_double(gf.Q) - gd.Q).cwiseAbs().maxCoeff() > 1e-12);
  }
}

TEMPLATE_TEST_CASE("training in segments gives the whole sequence's gradients",
                   "[gradients][segments]", float, double) {
  // Forward over the segments carrying the state, then backward from the last segment to the
  // first, each taking the next one's initial-state gradient as its final-state gradient.
  // Both the whole call and the pieces are within rounding_units u of the reference; they are
  // compared to each other at twice that.
  using Scalar = TestType;
  const Index cuts[] = {0, 23, 40, 41, 70};  // pieces of 23, 17, 1 and 29 tokens, chunk 8
  for (MapKind map : {MapKind::elu, MapKind::positive, MapKind::trig, MapKind::identity}) {
    CaseSpec spec;
    spec.map = map;
    spec.T = spec.Tk = 70;
    spec.d = spec.dv = 8;
    spec.chunk = 8;
    spec.prefix = 6;
    spec.final = true;
    spec.seed = 41;
    for_case<Scalar>(spec, [&](const auto& attn, const CaseData& c) {
      const auto Q = as<Scalar>(c.Q), K = as<Scalar>(c.K), V = as<Scalar>(c.V),
                 dY = as<Scalar>(c.dY);
      const StateGradient<Scalar> final_gradient{as<Scalar>(c.dS_T), as<Scalar>(c.dz_T).col(0)};
      const auto start = initial_state(attn, spec, c);
      const auto whole = prefill_backward(attn, start, Q, K, V, dY, &final_gradient);

      std::vector<std::decay_t<decltype(start)>> states{start};
      for (std::size_t s = 0; s + 2 < std::size(cuts); ++s) {
        auto next = states.back();
        const Index a = cuts[s], n = cuts[s + 1] - a;
        static_cast<void>(carried_forward(attn, next, Q.middleRows(a, n), K.middleRows(a, n),
                                          V.middleRows(a, n)));
        states.push_back(next);
      }
      RowMatrix<Scalar> dQ(70, spec.d), dK(70, spec.d), dV(70, spec.dv);
      StateGradient<Scalar> carried = final_gradient;
      for (std::size_t s = std::size(cuts) - 1; s-- > 0;) {
        const Index a = cuts[s], n = cuts[s + 1] - a;
        const auto piece = prefill_backward(attn, states[s], Q.middleRows(a, n), K.middleRows(a, n),
                                            V.middleRows(a, n), dY.middleRows(a, n), &carried);
        dQ.middleRows(a, n) = piece.Q;
        dK.middleRows(a, n) = piece.K;
        dV.middleRows(a, n) = piece.V;
        carried = piece.initial;
      }
      double M0 = 0, M_T = 0;
      const Problem p = reference_problem(attn, start, spec, c, M0, M_T);
      const RefMap<LD> rmap = ref_map<LD>(map, attn.feature_map());
      const auto ref = reference_backward<LD>(rmap, p);
      const auto sizes = exponent_sizes(rmap, p.Q, p.K);
      const double units = 2 * rounding_units(map, 76, attn.feature_dim(spec.d), spec.dv,
                                              spec.d, sizes.first, sizes.second);
      const double u = unit_roundoff<Scalar>();
      CAPTURE(map_name(map), units);
      CHECK(worst_ratio(dQ, as_double(whole.Q), ref.second.dQ, units, u) <= 1);
      CHECK(worst_ratio(dK, as_double(whole.K), ref.second.dK, units, u) <= 1);
      CHECK(worst_ratio(dV, as_double(whole.V), ref.second.dV, units, u) <= 1);
      const double to_stored = std::exp(M0);
      const MatrixXdR dS0_magnitude = to_stored * ref.second.dS0;
      const MatrixXdR dz0_magnitude = to_stored * ref.second.dz0;
      CHECK(worst_ratio(carried.S, as_double(whole.initial.S), dS0_magnitude, units, u) <= 1);
      CHECK(worst_ratio(carried.z, as_double(whole.initial.z), dz0_magnitude, units, u) <= 1);
      CHECK(worst_ratio(whole.initial.S, ref.first.dS0, ref.second.dS0, units / 2, u, to_stored) <= 1);
      // The whole call is itself right (not merely equal to the pieces).
      CHECK(worst_ratio(whole.Q, ref.first.dQ, ref.second.dQ, units / 2, u) <= 1);
    });
  }
}

namespace {

// Rows of norm up to `max_norm` in random directions (every third row at the maximum).
MatrixXdR spread_rows(Index T, Index d, std::uint64_t seed, double max_norm) {
  MatrixXdR X = random_matrix<double>(T, d, seed);
  const MatrixXdR lengths = random_matrix<double>(T, 1, seed + 1);
  for (Index t = 0; t < T; ++t) {
    const double len = t % 3 == 0 ? max_norm : max_norm * std::min(1.0, std::abs(lengths(t, 0)));
    X.row(t) *= len / X.row(t).norm();
  }
  return X;
}

// Rows of norm in [lo, hi] within about `spread` of one common direction.
MatrixXdR clustered_rows(Index T, Index d, std::uint64_t seed, double lo, double hi,
                         double spread, std::uint64_t variant) {
  const MatrixXdR base = random_matrix<double>(1, d, seed);
  MatrixXdR X = random_matrix<double>(T, d, seed + 1 + variant, spread * base.norm());
  const MatrixXdR lengths = random_matrix<double>(T, 1, seed + 100 + variant);
  for (Index t = 0; t < T; ++t) {
    X.row(t) += base;
    X.row(t) *= (lo + (hi - lo) * std::min(1.0, std::abs(lengths(t, 0)))) / X.row(t).norm();
  }
  return X;
}

}  // namespace

TEMPLATE_TEST_CASE("large-norm random-feature inputs give finite gradients equal to a "
                   "long-double reference", "[gradients][random-features]", float, double) {
  // |x| up to 30 at d = 16: |x'|^2 / 2 up to 112, so the plain features leave float's range and
  // the log-domain shifts are active (checked below). Bound: rounding_units with the exponent
  // sizes P, X2 of these inputs (the condition of exp at these arguments dominates).
  using Scalar = TestType;
  const Index T = 40, d = 16, dv = 5, m = 48;
  const MatrixXdR V = random_matrix<double>(T, dv, 503), dY = random_matrix<double>(T, dv, 504);
  struct Input {
    MapKind kind;
    MatrixXdR Q, K;
  };
  // Trig needs queries and keys in a narrow cone to keep its denominators positive at these
  // norms (its estimates spread like exp((|q'|^2 + |k'|^2) / 2); see random_features_test.cpp).
  const Input inputs[] = {
      {MapKind::positive, spread_rows(T, d, 511, 30), spread_rows(T, d, 512, 30)},
      {MapKind::hyperbolic, spread_rows(T, d, 513, 30), spread_rows(T, d, 514, 30)},
      {MapKind::trig, clustered_rows(T, d, 515, 28, 30, 0.01, 0),
       clustered_rows(T, d, 515, 28, 30, 0.01, 1)}};
  for (const Input& in : inputs)
    with_map<Scalar>(in.kind, d, m, [&](const auto& phi) {
      using Phi = std::decay_t<decltype(phi)>;
      if constexpr (LogScaledFeatureMap<Phi, Scalar>) {
        const RefMap<LD> map = ref_map<LD>(in.kind, phi);
        const auto sizes = exponent_sizes(map, in.Q, in.K);
        const double units = rounding_units(in.kind, T, phi.feature_dim(d), dv, d, sizes.first,
                                            sizes.second);
        // The stabiliser is active: some plain score exp(lq_i + lk_j) f_i . f_j is out of
        // float's range (exp(88.7) overflows, exp(-103.3) is below its smallest subnormal).
        RowMatrix<Scalar> f(T, phi.feature_dim(d));
        ColVector<Scalar> lq(T), lk(T);
        Eigen::Ref<RowMatrix<Scalar>> f_ref(f);
        phi.apply_scaled(as<Scalar>(in.Q), f_ref, lq);
        phi.apply_scaled(as<Scalar>(in.K), f_ref, lk);
        const double widest = std::max(std::abs(double(lq.maxCoeff() + lk.maxCoeff())),
                                       std::abs(double(lq.minCoeff() + lk.minCoeff())));
        CHECK(widest > 104);
        for (Mask mask : {Mask(Mask::causal), Mask(Mask::none)})
          for (Index chunk : {7, 16}) {
            const LinearAttention<Phi, Scalar> attn(phi, Options{{}, chunk});
            const auto g = parallel_backward(attn, as<Scalar>(in.Q), as<Scalar>(in.K),
                                             as<Scalar>(V), mask, as<Scalar>(dY));
            Problem p;
            p.Q = in.Q;
            p.K = in.K;
            p.V = V;
            p.dY = dY;
            p.causal = mask == Mask::causal;
            const auto ref = reference_backward<LD>(map, p);
            const double u = unit_roundoff<Scalar>();
            CAPTURE(map_name(in.kind), mask == Mask::causal, chunk, units);
            CHECK(g.Q.allFinite());
            CHECK(g.K.allFinite());
            CHECK(g.V.allFinite());
            CHECK(worst_ratio(g.Q, ref.first.dQ, ref.second.dQ, units, u) <= 1);
            CHECK(worst_ratio(g.K, ref.first.dK, ref.second.dK, units, u) <= 1);
            CHECK(worst_ratio(g.V, ref.first.dV, ref.second.dV, units, u) <= 1);
          }
      }
    });
}

TEST_CASE("a carried log-scaled state: gradients at large norms through segments",
          "[gradients][random-features][segments]") {
  // A first segment of small keys, then keys whose log-scales exceed it by more than float's
  // range: the state's M jumps, and the gradient of the first segment's final state must still
  // flow back (scaled by exp(M_before - M_after), here underflowing to 0 in float) as the whole
  // sequence's does.
  using Scalar = float;
  const Index d = 4, m = 32, dv = 3, T = 24, cut = 10;
  const PositiveRandomFeatures<Scalar> phi(d, m, 21);
  MatrixXdR Q = clustered_rows(T, d, 601, 30, 30, 10.0, 0);
  MatrixXdR K = clustered_rows(T, d, 602, 30, 30, 10.0, 0);
  K.row(cut + 2) = phi.projection().row(0).cast<double>() / std::sqrt(phi.scale());
  {  // the running maximum jumps by more than float's range at that key
    RowMatrix<Scalar> f(T, m);
    ColVector<Scalar> lk(T);
    Eigen::Ref<RowMatrix<Scalar>> f_ref(f);
    phi.apply_scaled(as<Scalar>(K), f_ref, lk);
    CHECK(lk(cut + 2) - lk.head(cut).maxCoeff() > 104);
  }
  const MatrixXdR V = random_matrix<double>(T, dv, 603), dY = random_matrix<double>(T, dv, 604);
  const LinearAttention<PositiveRandomFeatures<Scalar>, Scalar> attn(phi, Options{{}, 8});
  const auto Qs = as<Scalar>(Q), Ks = as<Scalar>(K), Vs = as<Scalar>(V), dYs = as<Scalar>(dY);
  const auto whole = parallel_backward(attn, Qs, Ks, Vs, Mask::causal, dYs);
  auto state = attn.make_state(d, dv);
  const auto empty = state;
  static_cast<void>(carried_forward(attn, state, Qs.topRows(cut), Ks.topRows(cut), Vs.topRows(cut)));
  const auto second = prefill_backward(attn, state, Qs.bottomRows(T - cut), Ks.bottomRows(T - cut),
                                       Vs.bottomRows(T - cut), dYs.bottomRows(T - cut));
  const auto first = prefill_backward(attn, empty, Qs.topRows(cut), Ks.topRows(cut),
                                      Vs.topRows(cut), dYs.topRows(cut), &second.initial);
  Problem p;
  p.Q = Q;
  p.K = K;
  p.V = V;
  p.dY = dY;
  const RefMap<LD> map = ref_map<LD>(MapKind::positive, phi);
  const auto ref = reference_backward<LD>(map, p);
  const auto sizes = exponent_sizes(map, Q, K);
  const double units = 2 * rounding_units(MapKind::positive, T, m, dv, d, sizes.first, sizes.second);
  const double u = unit_roundoff<Scalar>();
  RowMatrix<Scalar> dQ(T, d), dK(T, d), dV(T, dv);
  dQ << first.Q, second.Q;
  dK << first.K, second.K;
  dV << first.V, second.V;
  CHECK(dQ.allFinite());
  CHECK(dK.allFinite());
  CHECK(worst_ratio(whole.Q, ref.first.dQ, ref.second.dQ, units / 2, u) <= 1);
  CHECK(worst_ratio(whole.K, ref.first.dK, ref.second.dK, units / 2, u) <= 1);
  CHECK(worst_ratio(dQ, ref.first.dQ, ref.second.dQ, units, u) <= 1);
  CHECK(worst_ratio(dK, ref.first.dK, ref.second.dK, units, u) <= 1);
  CHECK(worst_ratio(dV, ref.first.dV, ref.second.dV, units, u) <= 1);
}

TEST_CASE("bad shapes throw ShapeError naming them", "[gradients][errors]") {
  const LinearAttention<EluPlusOne, double> attn;
  const RowMatrix<double> Q = random_matrix<double>(7, 4, 1), K = random_matrix<double>(7, 4, 2),
                          V = random_matrix<double>(7, 3, 3), dY = random_matrix<double>(7, 3, 4);
  using Catch::Matchers::Contains;
  CHECK_THROWS_MATCHES(parallel_backward(attn, Q, K, V, Mask::causal, RowMatrix<double>(7, 2)),
                       ShapeError, Catch::Message("linattn: output gradient dY is 7x2, expected 7x3 (Q rows x V cols)"));
  CHECK_THROWS_MATCHES(parallel_backward(attn, Q, K, V, Mask::none, RowMatrix<double>(6, 3)),
                       ShapeError, Catch::Message("linattn: output gradient dY is 6x3, expected 7x3 (Q rows x V cols)"));
  CHECK_THROWS_WITH(parallel_backward(attn, Q, K.leftCols(3), V, Mask::none, dY),
                    Contains("got Q 7x4 and K 7x3"));
  CHECK_THROWS_WITH(parallel_backward(attn, Q, K, V.topRows(6), Mask::none, dY),
                    Contains("got K 7x4 and V 6x3"));
  CHECK_THROWS_WITH(parallel_backward(attn, Q.topRows(5), K, V, Mask::causal, dY.topRows(5)),
                    Contains("got Q 5x4 and K 7x4"));
  auto state = attn.make_state(4, 3);
  CHECK_THROWS_AS(prefill_backward(attn, attn.make_state(4, 2), Q, K, V, dY), ShapeError);
  CHECK_THROWS_WITH(prefill_backward(attn, attn.make_state(5, 3), Q, K, V, dY),
                    Contains("state has r=5 dk=5 dv=3 but the inputs need r=4 dk=4 dv=3"));
  StateGradient<double> wrong{RowMatrix<double>::Zero(4, 2), ColVector<double>::Zero(4)};
  CHECK_THROWS_MATCHES(prefill_backward(attn, state, Q, K, V, dY, &wrong), ShapeError,
                       Catch::Message("linattn: final state gradient has S 4x2 and z of length 4, "
                                      "expected S 4x3 and z of length 4"));
  wrong = {RowMatrix<double>::Zero(4, 3), ColVector<double>::Zero(3)};
  CHECK_THROWS_AS(prefill_backward(attn, state, Q, K, V, dY, &wrong), ShapeError);
  // A state made for another kind of map.
  const LinearAttention<PositiveRandomFeatures<double>, double> rf(PositiveRandomFeatures<double>(4, 4, 1));
  CHECK_THROWS_AS(prefill_backward(attn, rf.make_state(4, 3), Q, K, V, dY), StateMismatchError);
  CHECK_THROWS_WITH(prefill_backward(attn, rf.make_state(4, 3), Q, K, V, dY),
                    Contains("the state was made for feature map positive_random_features"));
  // Inputs of the wrong dimension for a random map's projection.
  const LinearAttention<PositiveRandomFeatures<double>, double> rf5(PositiveRandomFeatures<double>(5, 4, 1));
  CHECK_THROWS_AS(parallel_backward(rf5, Q, K, V, Mask::causal, dY), ShapeError);
  // Zero tokens: empty gradients, and the final gradient passes through to the initial state.
  const StateGradient<double> final_gradient{RowMatrix<double>::Ones(4, 3), ColVector<double>::Ones(4)};
  const auto none = prefill_backward(attn, state, Q.topRows(0), K.topRows(0), V.topRows(0),
                                     dY.topRows(0), &final_gradient);
  CHECK(none.Q.rows() == 0);
  CHECK(none.initial.S == final_gradient.S);
  CHECK(none.initial.z == final_gradient.z);
}

TEST_CASE("a rejected denominator throws DenominatorError as the forward does",
          "[gradients][errors]") {
  // Identity features with q . k = -1: the strict read is undefined at row 0.
  RowMatrix<double> Q(2, 2), K(2, 2), V(2, 1), dY(2, 1);
  Q << 1, 0, 1, 0;
  K << -1, 0, 2, 0;
  V << 1, 2;
  dY << 1, 1;
  const LinearAttention<Identity, double> attn;
  CHECK_THROWS_AS(attn.parallel(Q, K, V, Mask::causal), DenominatorError);
  CHECK_THROWS_AS(parallel_backward(attn, Q, K, V, Mask::causal, dY), DenominatorError);
  CHECK_THROWS_AS(parallel_backward(attn, Q, K.topRows(1), V.topRows(1), Mask::none,
                                    dY), DenominatorError);
  // The clamped policy accepts it (and the gradient through den is zero there: the
  // finite-difference test covers clamped rows).
  const LinearAttention<Identity, double> clamped(Identity{}, Options{Normalization::clamped(0.5)});
  CHECK(parallel_backward(clamped, Q, K, V, Mask::causal, dY).Q.allFinite());
}

TEST_CASE("inputs in any layout give the same gradients", "[gradients][layout]") {
  // Column-major matrices and strided blocks (V and dY then go through the row copies).
  const Index T = 37, d = 8, dv = 8;
  const LinearAttention<EluPlusOne, float> attn(EluPlusOne{}, Options{{}, 16});
  const RowMatrix<float> Q = random_matrix<float>(T, d, 1), K = random_matrix<float>(T, d, 2),
                         V = random_matrix<float>(T, dv, 3), dY = random_matrix<float>(T, dv, 4);
  const auto row_major = parallel_backward(attn, Q, K, V, Mask::causal, dY);
  const Eigen::MatrixXf Qc = Q, Kc = K, Vc = V, dYc = dY;
  const auto col_major = parallel_backward(attn, Qc, Kc, Vc, Mask::causal, dYc);
  RowMatrix<float> wide(T, 3 * dv);
  wide.middleCols(dv, dv) = V;
  RowMatrix<float> wide_dy(T, 2 * dv);
  wide_dy.rightCols(dv) = dY;
  const auto strided = parallel_backward(attn, Q, K, wide.middleCols(dv, dv), Mask::causal,
                                         wide_dy.rightCols(dv));
  const auto expression = parallel_backward(attn, Q * 1.0f, K, V + RowMatrix<float>::Zero(T, dv),
                                            Mask::causal, dY);
  // The chunk's products read the same values in the same order whatever the source layout,
  // and the feature maps give the same bits for any layout: the gradients are equal exactly.
  for (const auto* other : {&col_major, &strided, &expression}) {
    CHECK(other->Q == row_major.Q);
    CHECK(other->K == row_major.K);
    CHECK(other->V == row_major.V);
    CHECK(other->initial.S == row_major.initial.S);
  }
}

TEST_CASE("the backward's memory: 2 scalars per token plus per-call buffers",
          "[gradients][memory]") {
  for (bool log_scaled : {false, true})
    for (Index chunk : {1, 16, 32, 100})
      for (Index T : {0, 1, 50, 1000}) {
        const detail::BackwardScratch<float> w(T, chunk, 24, 16, log_scaled, true, false);
        CHECK(w.bytes() == detail::BackwardScratch<float>::bytes_for(T, chunk, 24, 16, log_scaled,
                                                                    true, false));
        const detail::BackwardScratch<double> wd(T, chunk, 8, 12, log_scaled, false, true);
        CHECK(wd.bytes() == detail::BackwardScratch<double>::bytes_for(T, chunk, 8, 12,
                                                                      log_scaled, false, true));
      }
  // The figure docs/gradients.md quotes: T = 65,536, r = dv = 128, C = 32, float, one head.
  // The chunk is set explicitly: kAuto depends on the running machine's L1 size.
  Options chunk32;
  chunk32.chunk_size = 32;
  const LinearAttention<EluPlusOne, float> attn(EluPlusOne{}, chunk32);
  const std::size_t bytes = causal_backward_bytes(attn, 65536, 128, 128);
  const std::size_t per_token = 2 * sizeof(float);
  CHECK(bytes >= per_token * 65536);
  CHECK(bytes < per_token * 65536 + (std::size_t{1} << 20));  // per-call part under 1 MiB
  CHECK(bytes < (std::size_t{1} << 20) + 65536 * 8);
  // Exactly, from bytes_for's sum with C = P = 32 (every packet width divides 32): per call
  // 2 C r + 3 r P + 2 dv P + 4 C P + 2 C r + C dv + 2 r dv + 2 r + 3 C = 78,176 floats, and
  // 2 floats per token: (78,176 + 131,072) * 4 = 836,992 bytes.
  CHECK(bytes == 836992);
  // Under kAuto the same sum with the backward's chunk: 32 rows, a multiple of the chunk this
  // machine's forward chooses (16 or 32).
  const LinearAttention<EluPlusOne, float> automatic;
  CHECK(detail::backward_chunk_size(automatic, 128, 128) == 32);
  CHECK(detail::backward_chunk_size(automatic, 128, 128) % automatic.chunk_size(128, 128) == 0);
  CHECK(detail::backward_chunk_size(attn, 128, 128) == 32);
  CHECK(causal_backward_bytes(automatic, 65536, 128, 128) ==
        detail::BackwardScratch<float>::bytes_for(65536, 32, 128, 128, false, false, false));
}

TEST_CASE("the backward queues the next chunk's input rows for prefetching, clipped at both ends",
          "[gradients][prefetch]") {
  // Hints change no result, so what can go wrong is the rows: the chunk after the last one (or
  // before the first, in the reverse sweep) must queue nothing, a short chunk only its rows,
  // and a view that is not row-major nothing. Rows of 20 floats (80 bytes: lines at +0 and
  // +64) lying 32 floats apart, as one head's columns of a [T, 2 x 16]-wide buffer would.
  constexpr Index kT = 11, kCols = 20, kStride = 32;
  std::vector<float> q(std::size_t(kT * kStride)), k(q.size()), v(q.size()), dy(q.size());
  using Strided = Eigen::Map<const RowMatrix<float>, 0, Eigen::OuterStride<>>;
  const auto view = [&](const std::vector<float>& m) {
    return Strided(m.data(), kT, kCols, Eigen::OuterStride<>(kStride));
  };
  const Eigen::MatrixXf column_major = Eigen::MatrixXf::Zero(kT, kCols);
  detail::BackwardScratch<float> w(kT, 4, kCols, kCols, false, true, false);
  const auto queued = [&] {
    std::vector<const char*> seen;
    while (!w.prefetch.empty())
      w.prefetch.visit(3, [&](const char* line) { seen.push_back(line); });
    return seen;
  };
  const auto lines = [&](std::initializer_list<const std::vector<float>*> ms, Index first,
                         Index last) {
    std::vector<const char*> expected;
    for (const auto* m : ms)
      for (Index i = first; i < last; ++i)
        for (Index byte : {0, 64})
          expected.push_back(reinterpret_cast<const char*>(m->data() + i * kStride) + byte);
    return expected;
  };
  // A full chunk, in load_chunk's order: Q, K, V, dY.
  CHECK(detail::prefetch_chunk_rows(w.prefetch, view(q), view(k), view(v), view(dy), 4, 4));
  CHECK(queued() == lines({&q, &k, &v, &dy}, 4, 8));
  // The short last chunk [8, 11): rows past T are not touched.
  detail::prefetch_chunk_rows(w.prefetch, view(q), view(k), view(v), view(dy), 8, 4);
  CHECK(queued() == lines({&q, &k, &v, &dy}, 8, kT));
  // The forward sweep's call at its last chunk (first + C >= T, n <= 0) and the reverse
  // sweep's at its first (first - C < 0, n = 0): nothing.
  CHECK_FALSE(detail::prefetch_chunk_rows(w.prefetch, view(q), view(k), view(v), view(dy), 12, -1));
  CHECK(queued().empty());
  CHECK_FALSE(detail::prefetch_chunk_rows(w.prefetch, view(q), view(k), view(v), view(dy), -4, 0));
  CHECK(queued().empty());
  // A column-major V is copied row by row in the backward, not prefetched; the others are.
  detail::prefetch_chunk_rows(w.prefetch, view(q), view(k), column_major, view(dy), 0, 4);
  CHECK(queued() == lines({&q, &k, &dy}, 0, 4));
  // What a call leaves queued is issued by the next one (prefetch_chunk_rows finishes first).
  detail::prefetch_chunk_rows(w.prefetch, view(q), view(k), view(v), view(dy), 0, 4);
  CHECK_FALSE(w.prefetch.empty());
  detail::prefetch_chunk_rows(w.prefetch, view(q), view(k), view(v), view(dy), 4, 0);
  CHECK(w.prefetch.empty());
}

TEST_CASE("the _into calls write strided head views and equal the allocating calls",
          "[gradients][into]") {
  // Two heads laid out as [T, 2 d]; head 1's gradients written into its columns of [T, 2 d]
  // buffers, the other columns untouched. Same kernels, same order: equal bits.
  const Index T = 29, d = 8, heads = 2;
  const LinearAttention<EluPlusOne, float> attn(EluPlusOne{}, Options{{}, 8});
  const RowMatrix<float> Q = random_matrix<float>(T, heads * d, 1),
                         K = random_matrix<float>(T, heads * d, 2),
                         V = random_matrix<float>(T, heads * d, 3),
                         dY = random_matrix<float>(T, heads * d, 4);
  RowMatrix<float> dQ = RowMatrix<float>::Constant(T, heads * d, 7.0f), dK = dQ, dV = dQ;
  for (Mask mask : {Mask(Mask::causal), Mask(Mask::none)}) {
    const auto expected = parallel_backward(attn, Q.rightCols(d), K.rightCols(d), V.rightCols(d),
                                            mask, dY.rightCols(d));
    StateGradient<float> initial;
    parallel_backward_into(attn, Q.rightCols(d), K.rightCols(d), V.rightCols(d), mask,
                           dY.rightCols(d), {dQ.rightCols(d), dK.rightCols(d), dV.rightCols(d)},
                           &initial);
    CHECK(dQ.rightCols(d) == expected.Q);
    CHECK(dK.rightCols(d) == expected.K);
    CHECK(dV.rightCols(d) == expected.V);
    CHECK((dQ.leftCols(d).array() == 7.0f).all());
    if (mask == Mask::causal) CHECK(initial.S == expected.initial.S);
  }
  auto state = attn.make_state(d, d);
  static_cast<void>(carried_forward(attn, state, Q.leftCols(d), K.leftCols(d), V.leftCols(d)));
  const StateGradient<float> final_gradient{random_matrix<float>(d, d, 5),
                                            random_matrix<float>(d, 1, 6).col(0)};
  const auto expected = prefill_backward(attn, state, Q.rightCols(d), K.rightCols(d),
                                         V.rightCols(d), dY.rightCols(d), &final_gradient);
  StateGradient<float> initial;
  prefill_backward_into(attn, state, Q.rightCols(d), K.rightCols(d), V.rightCols(d),
                        dY.rightCols(d), &final_gradient,
                        {dQ.rightCols(d), dK.rightCols(d), dV.rightCols(d)}, initial);
  CHECK(dQ.rightCols(d) == expected.Q);
  CHECK(dK.rightCols(d) == expected.K);
  CHECK(dV.rightCols(d) == expected.V);
  CHECK(initial.S == expected.initial.S);
  CHECK(initial.z == expected.initial.z);
  // Outputs of the wrong shape are named.
  RowMatrix<float> small(T - 1, d);
  CHECK_THROWS_MATCHES(
      parallel_backward_into(attn, Q.rightCols(d), K.rightCols(d), V.rightCols(d), Mask::causal,
                             dY.rightCols(d), {small, dK.rightCols(d), dV.rightCols(d)}),
      ShapeError,
      Catch::Message("linattn: gradient outputs are dQ 28x8, dK 29x8 and dV 29x8, expected "
                     "29x8, 29x8 and 29x8"));
}

}  // namespace gradients_test
