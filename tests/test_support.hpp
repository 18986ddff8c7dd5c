#pragma once
// Shared helpers for the tests: seeded random inputs and an independent double-precision
// reference written directly from the formulas, with its own error-bound bookkeeping.

#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

namespace linattn_test {

using linattn::Index;
using MatrixXdR = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Unit roundoff u of Scalar: 2^-24 for float, 2^-53 for double.
template <class Scalar>
constexpr double unit_roundoff() {
  return std::numeric_limits<Scalar>::epsilon() / 2;
}

/// T x d matrix with iid N(0, sigma^2) entries from a fixed seed.
template <class Scalar>
linattn::RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::uint64_t seed,
                                         double sigma = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, sigma);
  linattn::RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<Scalar>(normal(gen));
  return m;
}

/// Q (T x dk), K (T x dk), V (T x dv) from seeds seed, seed + 1, seed + 2, as three
/// random_matrix calls would give them.
template <class Scalar>
struct QKV {
  linattn::RowMatrix<Scalar> Q, K, V;
};
template <class Scalar>
QKV<Scalar> random_qkv(Index T, Index dk, Index dv, std::uint64_t seed) {
  return {random_matrix<Scalar>(T, dk, seed), random_matrix<Scalar>(T, dk, seed + 1),
          random_matrix<Scalar>(T, dv, seed + 2)};
}

/// ELU(x) + 1 in double, written from its definition (not from the library).
inline double elu_plus_one(double x) { return x > 0 ? x + 1 : std::exp(x); }
inline double identity(double x) { return x; }

/// Result of the reference: the outputs and, per element, the scale that rounding errors of a
/// weighted sum are proportional to: sum_j |w_ij| |v_jc| / |den_i| (or without den when
/// unnormalized), where w_ij = phi(q_i)^T phi(k_j) and |w_ij| is computed from |features|.
struct Reference {
  MatrixXdR y;
  MatrixXdR magnitude;
};

/// y_i = sum_{j in keys(i)} w_ij v_j / sum_j w_ij in double, by plain loops from the formula.
/// keys(i) = all keys (causal = false) or j <= i (causal = true). `phi` is a scalar function
/// applied elementwise (r = dk). Throws nothing: a zero denominator gives Inf/NaN.
template <class MQ, class MK, class MV>
Reference naive_attention(const MQ& Q, const MK& K, const MV& V, bool causal,
                          const std::function<double(double)>& phi, bool normalize = true) {
  const Index Tq = Q.rows(), Tk = K.rows(), dk = Q.cols(), dv = V.cols();
  Reference ref{MatrixXdR::Zero(Tq, dv), MatrixXdR::Zero(Tq, dv)};
  std::vector<double> qf(dk), kf(dk);
  for (Index i = 0; i < Tq; ++i) {
    for (Index n = 0; n < dk; ++n) qf[n] = phi(static_cast<double>(Q(i, n)));
    double den = 0;
    const Index last = causal ? i + 1 : Tk;
    for (Index j = 0; j < last; ++j) {
      double w = 0, w_abs = 0;
      for (Index n = 0; n < dk; ++n) {
        kf[n] = phi(static_cast<double>(K(j, n)));
        w += qf[n] * kf[n];
        w_abs += std::abs(qf[n] * kf[n]);
      }
      den += w;
      for (Index c = 0; c < dv; ++c) {
        ref.y(i, c) += w * static_cast<double>(V(j, c));
        ref.magnitude(i, c) += w_abs * std::abs(static_cast<double>(V(j, c)));
      }
    }
    if (normalize) {
      ref.y.row(i) /= den;
      ref.magnitude.row(i) /= std::abs(den);
    }
  }
  return ref;
}

/// Largest |actual - expected| / allowed over all elements (<= 1 passes), where
/// allowed = bound_units * u * magnitude + tiny, tiny guarding exact zeros.
template <class Scalar, class M>
double worst_error_ratio(const M& actual, const Reference& ref, double bound_units) {
  const double u = unit_roundoff<Scalar>();
  double worst = 0;
  for (Index i = 0; i < ref.y.rows(); ++i)
    for (Index c = 0; c < ref.y.cols(); ++c) {
      const double allowed =
          bound_units * u * ref.magnitude(i, c) + std::numeric_limits<Scalar>::min();
      const double err = std::abs(static_cast<double>(actual(i, c)) - ref.y(i, c));
      worst = std::max(worst, err / allowed);
    }
  return worst;
}

}  // namespace linattn_test
