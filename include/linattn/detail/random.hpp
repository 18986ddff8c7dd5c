#pragma once
// The library's own random numbers: a generator and a Gaussian transform whose output is fixed
// by this file, so that a seed gives the same random features on every compiler and platform.
//
// Why not <random>: std::normal_distribution is implementation-defined (libstdc++, libc++ and
// MSVC give different numbers for the same engine), and std::log may differ in the last bit
// between C libraries. Here every step is either integer arithmetic, an IEEE-754 operation
// that is correctly rounded everywhere (+, -, *, /, sqrt, frexp), or a polynomial made of
// those. Each rounded intermediate goes through `rounded()`, which stops a compiler from
// fusing a*b+c into one FMA (GCC contracts by default in gnu++ modes on FMA targets and would
// change the bits) and drops x87 excess precision.
//
// Assumption: IEEE-754 binary64 doubles with round-to-nearest (every mainstream platform).

#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>

namespace linattn::detail {

/// Rounds x to a double in memory; a volatile round trip that no optimizer may fuse or widen.
inline double rounded(double x) noexcept {
  volatile double v = x;
  return v;
}

/// SplitMix64 (Steele, Lea, Flood 2014): one step of the state, returns the mixed output.
/// Used only to expand a 64-bit seed into the xoshiro state.
constexpr std::uint64_t splitmix64_next(std::uint64_t& state) noexcept {
  state += 0x9e3779b97f4a7c15ULL;
  std::uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// xoshiro256** (Blackman, Vigna 2018): 256-bit state, period 2^256 - 1, 64-bit outputs.
class Xoshiro256StarStar {
 public:
  /// State = four consecutive SplitMix64 outputs from `seed` (never all zero).
  explicit constexpr Xoshiro256StarStar(std::uint64_t seed) noexcept { reseed(seed); }

  constexpr void reseed(std::uint64_t seed) noexcept {
    std::uint64_t sm = seed;
    for (auto& word : s_) word = splitmix64_next(sm);
  }

  constexpr std::uint64_t next() noexcept {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

 private:
  static constexpr std::uint64_t rotl(std::uint64_t x, int k) noexcept {
    return (x << k) | (x >> (64 - k));
  }
  std::uint64_t s_[4]{};
};

/// Natural logarithm of a positive finite x, written from IEEE operations only so that its
/// bits do not depend on the C library. x = f 2^e with f in [sqrt(1/2), sqrt(2)) (exact, by
/// frexp), ln f = 2 atanh(t) = 2 (t + t^3/3 + t^5/5 + ...) with t = (f - 1)/(f + 1), |t| <= 0.1716;
/// 13 terms leave a truncation error below 2^-62 relative. Accuracy: a few ulp.
inline double portable_log(double x) noexcept {
  int e = 0;
  double f = std::frexp(x, &e);  // f in [0.5, 1)
  if (f < 0.70710678118654752440) {
    f *= 2;  // exact
    --e;
  }
  const double t = rounded((f - 1.0) / rounded(f + 1.0));  // f - 1 is exact (Sterbenz)
  const double t2 = rounded(t * t);
  double poly = 1.0 / 25.0;
  for (int k = 11; k >= 0; --k) poly = rounded(1.0 / (2 * k + 1) + rounded(t2 * poly));
  constexpr double ln2_hi = 0x1.62e42fefa3800p-1;  // ln 2 with its low 11 bits cleared:
  constexpr double ln2_lo = 0x1.ef35793c76730p-45;  // e * ln2_hi is exact for |e| < 2^11
  const double de = static_cast<double>(e);
  return rounded(rounded(de * ln2_hi) + rounded(rounded(de * ln2_lo) + rounded(2.0 * rounded(t * poly))));
}

/// Standard normal deviates by Marsaglia's polar method on xoshiro256** uniforms. Each accepted
/// pair (u, v) in the unit disc gives two deviates u c and v c with c = sqrt(-2 ln s / s),
/// s = u^2 + v^2; the second is kept for the next call. Acceptance pi/4.
class GaussianStream {
 public:
  explicit GaussianStream(std::uint64_t seed) noexcept : gen_(seed) {}

  void reseed(std::uint64_t seed) noexcept {
    gen_.reseed(seed);
    has_spare_ = false;
  }

  double next() noexcept {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    for (;;) {
      const double u = uniform_pm1();
      const double v = uniform_pm1();
      const double s = rounded(rounded(u * u) + rounded(v * v));
      if (s >= 1.0 || s == 0.0) continue;
      const double c = std::sqrt(rounded(rounded(-2.0 * portable_log(s)) / s));
      spare_ = rounded(v * c);
      has_spare_ = true;
      return rounded(u * c);
    }
  }

  /// The underlying generator, for tests that pin its outputs.
  Xoshiro256StarStar& generator() noexcept { return gen_; }

 private:
  // k 2^-52 - 1 for the top 53 bits k: uniform on the 2^53 points of [-1, 1), exactly.
  double uniform_pm1() noexcept {
    return static_cast<double>(gen_.next() >> 11) * 0x1.0p-52 - 1.0;
  }

  Xoshiro256StarStar gen_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

/// Fills `out` (rows x cols, any layout) with N(0, 1) deviates in row-major order.
template <class Out>
void fill_gaussian(GaussianStream& gauss, Out& out) {
  for (Index i = 0; i < out.rows(); ++i)
    for (Index j = 0; j < out.cols(); ++j)
      out(i, j) = static_cast<typename Out::Scalar>(gauss.next());
}

/// Euclidean norm of n fresh N(0, 1) deviates: a chi(n) length. Fixed summation order.
inline double chi_length(GaussianStream& gauss, Index n) {
  double sum = 0.0;
  for (Index k = 0; k < n; ++k) {
    const double g = gauss.next();
    sum = rounded(sum + rounded(g * g));
  }
  return std::sqrt(sum);
}

/// Orthonormalizes the first `rows` rows of the row-major `block` (rows <= cols) in place by
/// modified Gram-Schmidt run twice ("twice is enough": orthogonal to a few cols*u). Gram-Schmidt
/// is the QR factorization with a positive diagonal of R, which is what makes Q Haar-distributed
/// for a Gaussian input (a Householder QR needs the sign(R_ii) correction to get the same).
/// Fixed operation order, every intermediate rounded: same bits everywhere. O(rows^2 cols).
inline void orthonormalize_rows(RowMatrix<double>& block, Index rows) {
  const Index n = block.cols();
  for (Index i = 0; i < rows; ++i) {
    double* wi = block.row(i).data();
    for (int pass = 0; pass < 2; ++pass) {
      for (Index j = 0; j < i; ++j) {
        const double* wj = block.row(j).data();
        double dot = 0.0;
        for (Index k = 0; k < n; ++k) dot = rounded(dot + rounded(wi[k] * wj[k]));
        for (Index k = 0; k < n; ++k) wi[k] = rounded(wi[k] - rounded(dot * wj[k]));
      }
    }
    double sq = 0.0;
    for (Index k = 0; k < n; ++k) sq = rounded(sq + rounded(wi[k] * wi[k]));
    const double norm = std::sqrt(sq);
    for (Index k = 0; k < n; ++k) wi[k] = rounded(wi[k] / norm);
  }
}

}  // namespace linattn::detail
