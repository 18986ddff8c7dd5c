#pragma once
/// \file random_features.hpp
/// Random feature maps whose kernel phi(q)^T phi(k) is, in expectation over the draw, the
/// softmax kernel exp(tau q^T k) (Choromanski et al. 2021, "Rethinking Attention with
/// Performers", FAVOR+). tau defaults to 1/sqrt(d), the scale of softmax attention.
///
/// With x' = sqrt(tau) x and m projection vectors w_i (rows of the m x d matrix W):
///   PositiveRandomFeatures:  phi(x)_i = exp(w_i^T x' - |x'|^2 / 2) / sqrt(m)          (r = m)
///     hyperbolic variant:    [exp(w_i^T x'), exp(-w_i^T x')] exp(-|x'|^2 / 2) / sqrt(2m)  (r = 2m)
///   TrigRandomFeatures:      [sin(w_i^T x'), cos(w_i^T x')] exp(|x'|^2 / 2) / sqrt(m)  (r = 2m)
/// For w_i ~ N(0, I_d), E[phi(q)^T phi(k)] = exp(q'^T k') = exp(tau q^T k) exactly. A fixed
/// draw defines its own kernel, and LinearAttention is exact for that kernel; the distance to
/// softmax attention is the estimator's error, which falls like 1/sqrt(m) (docs/random_features.md).
///
/// W is drawn from the library's own generator (detail/random.hpp): the same (d, m, seed,
/// options) gives the same bits on every compiler and platform. Orthogonal draws (the default)
/// take blocks of d exactly orthogonal directions (Gram-Schmidt of a Gaussian matrix, i.e. a
/// Haar-random rotation) and give each row the length of an independent N(0, I_d) vector, so
/// every row is still N(0, I_d) and the estimator stays unbiased.
///
/// Both maps are LogScaledFeatureMap: LinearAttention keeps the state as exp(M) (S, z) with M
/// the running maximum of key log-scales, so |x| far beyond exp's range (|x| = 30 at d = 16 has
/// |x'|^2 / 2 = 112) gives finite outputs that are causal in every path. apply() gives the
/// unscaled features, which do overflow or underflow for such inputs.

#include <linattn/detail/bytes.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/feature_backward.hpp>
#include <linattn/detail/random.hpp>
#include <linattn/errors.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <sstream>
#include <stdexcept>

namespace linattn {

/// How the projection vectors w_i are drawn.
enum class Projection {
  orthogonal,  ///< blocks of d orthogonal directions with chi(d) lengths (lower variance, usually)
  iid          ///< independent N(0, I_d) rows
};

/// Options of a random feature map; the defaults are FAVOR+ with orthogonal rows.
struct RandomFeatureOptions {
  Projection projection = Projection::orthogonal;
  /// tau in the kernel exp(tau q^T k); NaN (the default) means 1/sqrt(d). Must be > 0.
  double scale = std::numeric_limits<double>::quiet_NaN();
  /// PositiveRandomFeatures only: the hyperbolic variant, r = 2m features.
  bool hyperbolic = false;
};

namespace detail {

/// The shared part of the random maps: the m x d projection matrix, its draw and the GEMM.
template <class Scalar>
class RandomProjection {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");

 public:
  /// Input dimension d.
  [[nodiscard]] Index input_dim() const noexcept { return W_.cols(); }
  /// Number of projection vectors m (rows of W).
  [[nodiscard]] Index projections() const noexcept { return W_.rows(); }
  /// tau of the kernel exp(tau q^T k).
  [[nodiscard]] double scale() const noexcept { return scale_; }
  [[nodiscard]] const RandomFeatureOptions& options() const noexcept { return options_; }
  /// The seed of the last draw (unchanged by set_projection).
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }

  /// A 64-bit FNV-1a hash of everything that defines the features: W's bits, tau and the
  /// options. A saved state records it, so it is never restored under another draw.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    const double fields[3] = {scale_, options_.hyperbolic ? 1.0 : 0.0,
                              static_cast<double>(options_.projection)};
    std::uint64_t h = fnv1a64(std::as_bytes(std::span<const double>(fields)));
    const auto w = std::as_bytes(std::span<const Scalar>(W_.data(), static_cast<std::size_t>(W_.size())));
    return h ^ (fnv1a64(w) * 0x100000001b3ull);
  }

  /// W, m x d, one projection vector per row (not multiplied by sqrt(tau)).
  [[nodiscard]] const RowMatrix<Scalar>& projection() const noexcept { return W_; }

  /// Replaces W by a saved or trained m x d matrix; throws ShapeError for another shape.
  /// Copies into the existing storage (no allocation).
  template <class D>
  void set_projection(const Eigen::MatrixBase<D>& W) {
    if (W.rows() != W_.rows() || W.cols() != W_.cols())
      throw_shape_error("projection matrix is ", shape_of(W), ", expected ", W_.rows(), "x",
                        W_.cols(), " (m x d)");
    W_ = W.template cast<Scalar>();
  }

  /// Draws W again from `seed` in place (no allocation). O(m d^2) for orthogonal rows,
  /// O(m d) for iid rows.
  void redraw(std::uint64_t seed) {
    seed_ = seed;
    GaussianStream gauss(seed);
    const Index d = W_.cols(), m = W_.rows();
    if (options_.projection == Projection::iid) {
      fill_gaussian(gauss, W_);
      return;
    }
    // Per block of up to d rows: the Gaussian directions (rows x d, row-major), then for each
    // row the d deviates of its chi(d) length. This order is part of the reproducibility spec.
    for (Index first = 0; first < m; first += d) {
      const Index rows = std::min(d, m - first);
      auto G = block_.topRows(rows);
      fill_gaussian(gauss, G);
      orthonormalize_rows(block_, rows);
      for (Index i = 0; i < rows; ++i) {
        const double length = chi_length(gauss, d);
        for (Index k = 0; k < d; ++k)
          W_(first + i, k) = static_cast<Scalar>(rounded(block_(i, k) * length));
      }
    }
  }

 protected:
  RandomProjection(Index d, Index m, std::uint64_t seed, const RandomFeatureOptions& options)
      : options_(options) {
    if (d < 1 || m < 1)
      throw_shape_error("random features need d >= 1 and m >= 1, got d=", d, " m=", m);
    scale_ = std::isnan(options.scale) ? 1.0 / std::sqrt(static_cast<double>(d)) : options.scale;
    if (!(scale_ > 0) || !std::isfinite(scale_)) {
      std::ostringstream os;
      os << "linattn: random feature scale tau must be positive and finite, got " << scale_;
      throw std::invalid_argument(os.str());
    }
    W_.resize(m, d);
    if (options.projection == Projection::orthogonal) block_.resize(d, d);
    redraw(seed);
  }

  void check_input_dim(Index d) const {
    if (d != W_.cols())
      throw_shape_error("random features were drawn for d = ", W_.cols(),
                        ", got inputs with d = ", d);
  }

  template <class In, class Out>
  void check_shapes(const In& x, const Out& out, Index r) const {
    check_input_dim(x.cols());
    if (out.rows() != x.rows() || out.cols() != r)
      throw_shape_error("feature output is ", shape_of(out), ", expected ", x.rows(), "x", r);
  }

  /// P = sqrt(tau) x W^T into the first m columns of `out`: the one GEMM of the feature map.
  /// sqrt(tau) is applied to the result, not folded into x: for a single row Eigen would copy
  /// the scaled row into a heap temporary before its GEMV, and decode steps must not allocate.
  template <class In, class Out>
  void project(const In& x, Out& out) const {
    auto P = out.leftCols(W_.rows());
    P.noalias() = x * W_.transpose();
    P *= static_cast<Scalar>(std::sqrt(scale_));
  }

  /// tau |x|^2 / 2 + shift for a contiguous row x (detail::for_each_contiguous_row: the sum
  /// of squares then runs in one order whatever the caller's storage order), the per-row term
  /// of every variant, rounded once: an explicit fma, because a product and a sum written
  /// apart may be fused by the compiler in one instantiation of the caller's view types and
  /// not in another, and the bits would then follow the caller's types.
  template <class Row>
  Scalar half_sq_norm_plus(const Row& x, Scalar shift) const {
    return std::fma(static_cast<Scalar>(scale_ / 2), x.squaredNorm(), shift);
  }

 private:
  RandomFeatureOptions options_;
  double scale_ = 0;
  std::uint64_t seed_ = 0;
  RowMatrix<Scalar> W_;
  RowMatrix<double> block_;  // d x d Gram-Schmidt scratch, kept so redraw() never allocates
};

}  // namespace detail

/// FAVOR+ positive random features for the softmax kernel exp(tau q^T k).
///
///   phi(x)_i = exp(w_i^T x' - |x'|^2 / 2) / sqrt(m),  x' = sqrt(tau) x,  r = m;
///   hyperbolic: [exp(w_i^T x'), exp(-w_i^T x')] exp(-|x'|^2 / 2) / sqrt(2m),  r = 2m.
/// Every feature is positive, so every denominator is positive (up to underflow of the scaled
/// features in float, see docs/random_features.md); E[phi(q)^T phi(k)] = exp(tau q^T k).
/// Cost per T x d input: one T x d by d x m GEMM and T r exp (vectorized); no allocation
/// (for a column-major or strided x with d > 256: one row buffer per call).
/// Throws ShapeError when inputs do not have d columns, std::invalid_argument for a bad scale.
template <class Scalar = float>
class PositiveRandomFeatures : public detail::RandomProjection<Scalar> {
  using Base = detail::RandomProjection<Scalar>;

 public:
  static constexpr bool strictly_positive = true;
  static constexpr bool log_scaled = true;
  static constexpr const char* name = "positive_random_features";
  using scalar_type = Scalar;

  /// Draws m projection vectors for inputs of dimension d from `seed`. O(m d^2) (orthogonal).
  PositiveRandomFeatures(Index d, Index m, std::uint64_t seed, RandomFeatureOptions options = {})
      : Base(d, m, seed, options) {}

  [[nodiscard]] bool hyperbolic() const noexcept { return this->options().hyperbolic; }

  /// r = m, or 2m for the hyperbolic variant; throws ShapeError unless d is the drawn d.
  [[nodiscard]] Index feature_dim(Index d) const {
    this->check_input_dim(d);
    return hyperbolic() ? 2 * this->projections() : this->projections();
  }

  /// out (T x r) = phi of each row of x (T x d). Unscaled: underflows for large |x|.
  template <class In, class Out>
    requires std::same_as<typename In::Scalar, Scalar>
  void apply(const In& x, Out& out) const {
    const Index m = this->projections();
    this->check_shapes(x, out, feature_dim(x.cols()));
    this->project(x, out);
    // The exponents first (a subtraction rounds the same in every form), then one exp over
    // `out` with detail::map_rows_uniformly: the same bits wherever `out` lies.
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) {
      const Scalar c = this->half_sq_norm_plus(row, log_norm());
      auto p = out.row(t).head(m);
      if (hyperbolic()) out.row(t).tail(m) = (-p.array() - c).matrix();
      p.array() -= c;
    });
    exponentiate(out);
  }

  /// phi(x_t) = exp(log_scale_t) out_t with max_i out_ti = 1: out_t = exp(p_t - max p_t) for the
  /// projections p (and -p when hyperbolic), log_scale_t = max p_t - tau |x_t|^2 / 2 - log sqrt(r).
  /// The |x'|^2 term cancels inside out_t, so out_t never loses precision to it.
  template <class In, class Out>
    requires std::same_as<typename In::Scalar, Scalar>
  void apply_scaled(const In& x, Out& out, Eigen::Ref<ColVector<Scalar>> log_scale) const {
    const Index m = this->projections();
    this->check_shapes(x, out, feature_dim(x.cols()));
    if (log_scale.size() != x.rows())
      detail::throw_shape_error("log_scale has length ", log_scale.size(), ", expected ",
                                x.rows());
    this->project(x, out);
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) {
      auto p = out.row(t).head(m);
      Scalar top;
      if (hyperbolic()) {
        top = p.cwiseAbs().maxCoeff();
        out.row(t).tail(m) = (-p.array() - top).matrix();
      } else {
        top = p.maxCoeff();
      }
      p.array() -= top;
      log_scale(t) = top - this->half_sq_norm_plus(row, log_norm());
    });
    exponentiate(out);  // as in apply()
  }

  /// d_x = J^T d_features per row: with G = d_features * features elementwise,
  /// d_x_t = sqrt(tau) sum_i (G_ti - G_t,m+i) w_i - tau x_t sum_j G_tj (the G_t,m+i term only
  /// when hyperbolic). Only the products G enter, so the scaled features of apply_scaled() with
  /// d_features times exp(log_scale) give the same d_x: its shifts cancel. O(T m d).
  template <class In, class F, class DF, class DX>
    requires std::same_as<typename In::Scalar, Scalar>
  void backward(const In& x, const F& features, const DF& d_features, DX& d_x) const {
    this->check_input_dim(x.cols());
    detail::positive_features_backward(this->projection(), this->scale(), hyperbolic(), x,
                                       features, d_features, d_x);
  }

 private:
  // out = exp(out), every element in Eigen's packet form (see apply()).
  template <class Out>
  static void exponentiate(Out& out) {
    detail::map_rows_uniformly(out, out, [](const auto& v) { return v.exp(); });
  }

  Scalar log_norm() const {
    return static_cast<Scalar>(
        0.5 * std::log(static_cast<double>(hyperbolic() ? 2 * this->projections()
                                                        : this->projections())));
  }
};

/// Trigonometric random features (random Fourier features) for the softmax kernel:
///   phi(x) = [sin(w_i^T x'), cos(w_i^T x')] exp(|x'|^2 / 2) / sqrt(m),  r = 2m,
/// so phi(q)^T phi(k) = (1/m) sum_i cos(w_i^T (q' - k')) exp((|q'|^2 + |k'|^2) / 2), unbiased
/// for exp(tau q^T k). Features and kernel values CAN BE NEGATIVE: a denominator phi(q)^T z
/// can be zero or negative for any m, and the default strict Normalization then throws
/// DenominatorError (clamped/shifted policies opt out). Its variance grows like
/// exp(|x'|^2 + |y'|^2), much faster than the positive map's for large inputs.
/// Cost per T x d input: one GEMM and T m sin + T m cos; no allocation (for a column-major
/// or strided x with d > 256: one row buffer per call).
template <class Scalar = float>
class TrigRandomFeatures : public detail::RandomProjection<Scalar> {
  using Base = detail::RandomProjection<Scalar>;

 public:
  static constexpr bool strictly_positive = false;
  static constexpr bool log_scaled = true;
  static constexpr const char* name = "trig_random_features";
  using scalar_type = Scalar;

  /// As PositiveRandomFeatures; options.hyperbolic must be false (std::invalid_argument).
  TrigRandomFeatures(Index d, Index m, std::uint64_t seed, RandomFeatureOptions options = {})
      : Base(d, m, seed, checked(options)) {}

  /// r = 2m; throws ShapeError unless d is the drawn d.
  [[nodiscard]] Index feature_dim(Index d) const {
    this->check_input_dim(d);
    return 2 * this->projections();
  }

  /// out (T x 2m) = phi of each row of x. Unscaled: overflows for large |x|.
  template <class In, class Out>
    requires std::same_as<typename In::Scalar, Scalar>
  void apply(const In& x, Out& out) const {
    this->check_shapes(x, out, feature_dim(x.cols()));
    trig(x, out);
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) { out.row(t) *= std::exp(row_log_scale(row)); });
  }

  /// phi(x_t) = exp(log_scale_t) out_t with out_t = [sin p_t, cos p_t] and
  /// log_scale_t = tau |x_t|^2 / 2 - log sqrt(m).
  template <class In, class Out>
    requires std::same_as<typename In::Scalar, Scalar>
  void apply_scaled(const In& x, Out& out, Eigen::Ref<ColVector<Scalar>> log_scale) const {
    this->check_shapes(x, out, feature_dim(x.cols()));
    if (log_scale.size() != x.rows())
      detail::throw_shape_error("log_scale has length ", log_scale.size(), ", expected ",
                                x.rows());
    trig(x, out);
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) { log_scale(t) = row_log_scale(row); });
  }

  /// d_x = J^T d_features per row: with features [s, c] and d_features [d_s, d_c],
  /// d_x_t = sqrt(tau) sum_i (d_s_ti c_ti - d_c_ti s_ti) w_i + tau x_t (d_features_t . features_t).
  /// Products only, so the scaled features of apply_scaled() serve as well. O(T m d).
  template <class In, class F, class DF, class DX>
    requires std::same_as<typename In::Scalar, Scalar>
  void backward(const In& x, const F& features, const DF& d_features, DX& d_x) const {
    this->check_input_dim(x.cols());
    detail::trig_features_backward(this->projection(), this->scale(), x, features, d_features,
                                   d_x);
  }

 private:
  static RandomFeatureOptions checked(const RandomFeatureOptions& options) {
    if (options.hyperbolic)
      throw std::invalid_argument("linattn: TrigRandomFeatures has no hyperbolic variant");
    return options;
  }

  template <class In, class Out>
  void trig(const In& x, Out& out) const {
    const Index m = this->projections();
    this->project(x, out);
    for (Index t = 0; t < x.rows(); ++t) {
      auto p = out.row(t).head(m);  // (map_row_uniformly: the same bits wherever `out` lies)
      detail::map_row_uniformly(p, out.row(t).tail(m), [](const auto& v) { return v.cos(); });
      detail::map_row_uniformly(p, p, [](const auto& v) { return v.sin(); });
    }
  }

  template <class Row>
  Scalar row_log_scale(const Row& x) const {
    return this->half_sq_norm_plus(
        x, -static_cast<Scalar>(0.5 * std::log(static_cast<double>(this->projections()))));
  }
};

}  // namespace linattn
