#pragma once
// Shared helpers for the tests: seeded random inputs and an independent double-precision
// reference written directly from the formulas, with its own error-bound bookkeeping.

#include <linattn/detail/random.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

namespace linattn_test {

using linattn::Index;
using MatrixXdR = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

#ifndef LINATTN_TEST_SANITIZED
#define LINATTN_TEST_SANITIZED 0
#endif
/// Whether this is the sanitizer build (-O0 with ASan + UBSan, scripts/test.sh --sanitize),
/// where a few tests run their longest shapes shorter: the same code paths, and the g++
/// Release build runs them in full.
inline constexpr bool kSanitizedBuild = LINATTN_TEST_SANITIZED != 0;

/// Unit roundoff u of Scalar: 2^-24 for float, 2^-53 for double.
template <class Scalar>
constexpr double unit_roundoff() {
  return std::numeric_limits<Scalar>::epsilon() / 2;
}

/// Whether a and b (any Eigen matrices or views, strided ones included) have the same shape and
/// the same bits in every coefficient: NaN matches NaN of the same payload, -0 does not match +0.
template <class A, class B>
bool same_bits(const Eigen::DenseBase<A>& a, const Eigen::DenseBase<B>& b) {
  static_assert(std::is_same_v<typename A::Scalar, typename B::Scalar>, "compare one scalar type");
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j) {
      const typename A::Scalar x = a(i, j), y = b(i, j);
      if (std::memcmp(&x, &y, sizeof(x)) != 0) return false;
    }
  return true;
}

/// T x d matrix with iid N(0, sigma^2) entries from a fixed seed, drawn from the library's own
/// reproducible Gaussian stream (detail/random.hpp), so a failing seed gives the same inputs
/// with any standard library.
template <class Scalar>
linattn::RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::uint64_t seed,
                                         double sigma = 1.0) {
  linattn::detail::GaussianStream normal(seed);
  linattn::RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<Scalar>(sigma * normal.next());
  return m;
}

/// rows x cols matrix with iid entries uniform on [lo, hi) from a fixed seed (the library's
/// xoshiro256** generator: reproducible on any standard library).
template <class Scalar>
linattn::RowMatrix<Scalar> uniform_matrix(Index rows, Index cols, std::uint64_t seed, double lo,
                                          double hi) {
  linattn::detail::Xoshiro256StarStar gen(seed);
  linattn::RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) {
      const double u = static_cast<double>(gen.next() >> 11) * 0x1.0p-53;  // [0, 1)
      m(i, j) = static_cast<Scalar>(lo + (hi - lo) * u);
    }
  return m;
}

/// Units of u allowed for a normalized read over T keys with r features: the dot product over r
/// features (r u), the sums over at most T keys (T u), the feature map and the division (4 u),
/// doubled for the ratio of two such sums (numerator and denominator).
inline double bound_units(Index r, Index T) { return 2.0 * static_cast<double>(r + T + 4); }

// The lengths the BackwardWorkspace tests run one workspace through, in chunks of 4: a short
// last chunk, growth, a longer buffer reused, another chunk shape (T = 3: C = 3) and back.
inline constexpr Index kWorkspaceLengths[] = {9, 14, 9, 3, 9};

// A workspace's bytes along a list of call lengths: from the longest call on, every call (a
// shorter one, shorter than the chunk too) must hold exactly what the longest left (grown,
// never shrunk, and served by the longest's buffers).
struct WorkspaceGrowth {
  explicit WorkspaceGrowth(Index longest_length) : longest(longest_length) {}
  Index longest;
  std::size_t after_longest = 0;
  // Whether `bytes`, held after the call of length T, keeps that.
  bool holds(Index T, std::size_t bytes) {
    if (T == longest && after_longest == 0) after_longest = bytes;
    const bool ok = after_longest == 0 || bytes == after_longest;
    return ok && bytes > 0;
  }
};

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

/// Largest |actual(i, c) - y(i, c)| / (u allowed_units(i, c) + tiny) over all elements (<= 1
/// passes; a non-finite actual value fails), tiny (the smallest normal Scalar) guarding exact
/// zeros. The one comparison every reference of the tests goes through.
template <class Scalar, class M, class AllowedUnits>
double worst_ratio_of(const M& actual, const MatrixXdR& y, const AllowedUnits& allowed_units) {
  const double u = unit_roundoff<Scalar>();
  double worst = 0;
  for (Index i = 0; i < y.rows(); ++i)
    for (Index c = 0; c < y.cols(); ++c) {
      const double a = static_cast<double>(actual(i, c));
      if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
      const double allowed = u * allowed_units(i, c) + std::numeric_limits<Scalar>::min();
      worst = std::max(worst, std::abs(a - y(i, c)) / allowed);
    }
  return worst;
}

/// worst_ratio_of with allowed = bound_units * magnitude (a Reference of naive_attention).
template <class Scalar, class M>
double worst_error_ratio(const M& actual, const Reference& ref, double bound_units) {
  return worst_ratio_of<Scalar>(actual, ref.y, [&](Index i, Index c) { return bound_units * ref.magnitude(i, c); });
}

}  // namespace linattn_test
