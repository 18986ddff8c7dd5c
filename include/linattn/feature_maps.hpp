#pragma once
/// \file feature_maps.hpp
/// Feature-map policies phi: R^d -> R^r and the FeatureMap concept that checks them: Identity,
/// EluPlusOne, L2Normalize and TaylorExp here; the random features in random_features.hpp.
///
/// A feature map is a small value type. Linear attention scores a query q against a key k by
/// phi(q)^T phi(k); the map defines that kernel, and results are exact for that kernel only.
///
/// To write your own, provide (see examples/custom_feature_map.cpp):
///   static constexpr bool strictly_positive;           // every feature > 0 for finite input?
///   Index feature_dim(Index d) const;                  // r for input dimension d
///   template <class In, class Out>
///   void apply(const In& x, Out& out) const;           // out (T x r) = phi of each row of x (T x d)
/// `In` is any Eigen expression with T rows; `out` is already sized T x r (an Eigen::Ref to
/// row-major storage), so apply must not resize it.
///
/// To train through the map (linattn/gradients.hpp), also provide its derivative:
///   template <class In, class F, class DF, class DX>
///   void backward(const In& x, const F& features, const DF& d_features, DX& d_x) const;
/// d_x (T x d, pre-sized, row-major Ref) = J_t^T d_features_t for each row t, J_t = d phi / d x
/// at x_t; `features` are phi(x) as apply() gave them. DifferentiableFeatureMap checks it.

#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/elu_kernel.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace linattn {

/// A feature-map policy usable with LinearAttention<Phi, Scalar>.
template <class Phi, class Scalar = float>
concept FeatureMap =
    std::copy_constructible<Phi> &&
    requires(const Phi& phi, Index d, const RowMatrix<Scalar>& x,
             Eigen::Ref<RowMatrix<Scalar>> out) {
      { std::bool_constant<Phi::strictly_positive>::value } -> std::convertible_to<bool>;
      { phi.feature_dim(d) } -> std::convertible_to<Index>;
      phi.apply(x, out);
    };

/// phi(x) = x. The plain dot-product kernel q^T k; features can be negative or cancel, so the
/// normalized read can meet a zero or negative denominator (which is then an error).
/// Cost: one copy, T*d.
struct Identity {
  static constexpr bool strictly_positive = false;
  static constexpr const char* name = "identity";
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    out = x;
  }
  /// d_x = d_features (J = I).
  template <class In, class F, class DF, class DX>
  void backward(const In& /*x*/, const F& /*features*/, const DF& d_features, DX& d_x) const {
    d_x = d_features;
  }
};

/// phi(x) = ELU(x) + 1, elementwise: x + 1 for x > 0, exp(x) for x <= 0 (Katharopoulos et al.
/// 2020, section 3.2). Positive for finite input, so the denominator is positive in exact
/// arithmetic; exp(x) underflows to 0 below about -87 (float) or -708 (double).
/// Cost: T*d exponentials, vectorized (float with AVX-512: detail::elu_plus_one_row, within
/// 0.92 ulp of exp over [-105, 0] as measured; elsewhere Eigen's exp, within 4 ulp).
struct EluPlusOne {
  static constexpr bool strictly_positive = true;
  static constexpr const char* name = "elu_plus_one";
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    // max(x, 0) + exp(min(x, 0)) is x + 1 for x > 0 (exp(0) = 1 exactly) and exp(x) otherwise,
    // the definition without a branch: every operation has a SIMD packet form (Eigen's select()
    // has none, which made this map one scalar expf call per element, the main cost of a
    // token). exp(m) is taken as exp(m / 2)^2 because Eigen's vectorized exp clamps its input
    // (at about -88 in float, -708 in double) and so never returns 0 or a subnormal: halving
    // keeps the input in range down to twice that, and the square then underflows to the
    // subnormal or 0 that std::exp would give. Cost: one extra multiply; error about 2 ulp
    // (exp's ~1 ulp, doubled by the square, plus one rounding). NaN propagates (Eigen's max and
    // min return the NaN operand, as std::max does).
    // Eigen's SIMD exp and the scalar std::exp differ in the last bit, and Eigen's own loop
    // picks one per element by the destination's address; detail::map_rows_uniformly gives
    // every element the packet form, so the result is the same whatever the layout and
    // placement of x and out.
    // With AVX-512 and float, detail::elu_plus_one_row does the same per row in about half the
    // instructions (exp with an exact power-of-two scaling, so no halving and squaring), and
    // the same way for every element of a row.
    using Scalar = typename Out::Scalar;
    if constexpr (detail::has_elu_kernel && std::is_same_v<Scalar, float> &&
                  detail::has_contiguous_rows<Out>()) {
      if constexpr (detail::has_contiguous_rows<In>() &&
                    std::is_same_v<typename In::Scalar, float>) {
        for (Index i = 0; i < x.rows(); ++i)
          detail::elu_plus_one_row(x.row(i).data(), out.row(i).data(), x.cols());
      } else {
        out = x;
        for (Index i = 0; i < out.rows(); ++i)
          detail::elu_plus_one_row(out.row(i).data(), out.row(i).data(), out.cols());
      }
      return;
    }
    const auto f = [](const auto& v) {
      return v.max(Scalar(0)) + (v.min(Scalar(0)) * Scalar(0.5)).exp().square();
    };
    detail::map_rows_uniformly(x, out, f);
  }
  /// d_x = d_features * phi'(x) elementwise: phi'(x) = 1 for x > 0, exp(x) = phi(x) otherwise,
  /// i.e. min(phi(x), 1) (phi = x + 1 > 1 for x > 0, exp(x) <= 1 otherwise), which needs no
  /// branch and vectorizes (a select() is a scalar, mispredicted branch per element). NaN
  /// propagates (Eigen's min returns its NaN first operand). Cost: 2 T*d flops.
  template <class In, class F, class DF, class DX>
  void backward(const In& /*x*/, const F& features, const DF& d_features, DX& d_x) const {
    using Scalar = typename F::Scalar;
    d_x = (d_features.array() * features.array().min(Scalar(1))).matrix();
  }
};

/// phi(x) = x / |x|_2 per row (a zero row stays zero; NaN or Inf in a row gives NaN). The usual
/// key/query map of the delta rule: with |phi(k)| = 1 and beta in [0, 2], I - beta phi(k)
/// phi(k)^T has 2-norm 1 (eigenvalues 1 and 1 - beta). Signed features, so only for unnormalized reads. A row whose
/// squared norm would leave the normal range is first divided by its largest |entry|.
/// Cost: about 3 T*d flops (5 T*d for rescaled rows); a column-major or strided x is read a
/// row at a time into a buffer (stack up to d = 256, else one per call), so that the norms
/// have the bits of a row-major x.
struct L2Normalize {
  static constexpr bool strictly_positive = false;
  static constexpr const char* name = "l2_normalize";
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    using Real = typename Eigen::NumTraits<typename In::Scalar>::Real;
    // Below this the sum of squares may hold subnormal terms that lose relative accuracy.
    const Real low = std::sqrt(std::numeric_limits<Real>::min() / std::numeric_limits<Real>::epsilon());
    // Each row's norm is summed over contiguous scalars, so its bits do not follow x's storage
    // order (a column-major or strided x is read a row at a time into a buffer, on the stack
    // up to d = 256).
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) {
      const Real norm = row.norm();
      if (norm >= low && norm <= std::numeric_limits<Real>::max()) {
        out.row(t) = row / norm;
        return;
      }
      const Real largest = row.cwiseAbs().maxCoeff();
      if (std::isnan(norm) || !std::isfinite(largest)) {
        out.row(t).setConstant(std::numeric_limits<Real>::quiet_NaN());
      } else if (largest == 0) {
        out.row(t).setZero();
      } else {
        // Entries in [-1, 1], the largest exactly +-1: the sum of squares neither over- nor
        // underflows.
        out.row(t) = (row / largest) / (row / largest).norm();
      }
    });
  }
  /// d_x = (d_f - phi (phi . d_f)) / |x| per row, the Jacobian (I - phi phi^T) / |x| of x / |x|
  /// applied to d_f = d_features. A zero row (where x / |x| has no derivative) gets d_x = 0, a
  /// row with NaN or Inf gets NaN; |x| is formed as apply() forms it, rescaled where needed.
  /// Cost: about 5 T*d flops.
  template <class In, class F, class DF, class DX>
  void backward(const In& x, const F& features, const DF& d_features, DX& d_x) const {
    using Real = typename Eigen::NumTraits<typename In::Scalar>::Real;
    const Real low = std::sqrt(std::numeric_limits<Real>::min() / std::numeric_limits<Real>::epsilon());
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) {
      Real norm = row.norm();
      if (!(norm >= low && norm <= std::numeric_limits<Real>::max())) {
        const Real largest = row.cwiseAbs().maxCoeff();
        if (std::isnan(norm) || !std::isfinite(largest)) {
          d_x.row(t).setConstant(std::numeric_limits<Real>::quiet_NaN());
          return;
        }
        if (largest == 0) {
          d_x.row(t).setZero();
          return;
        }
        norm = largest * (row / largest).norm();
      }
      const Real along = features.row(t).dot(d_features.row(t));
      d_x.row(t) = (d_features.row(t) - along * features.row(t)) / norm;
    });
  }
};

/// phi(x) = [1, x / d^(1/4), then for i = 1 .. d: x_i^2 / sqrt(2 d) and x_i x_j / sqrt(d) for
/// j = i + 1 .. d] (the upper triangle of x x^T row by row) for rows x of dimension d, so that phi(q)^T phi(k) = 1 + s + s^2 / 2 with s = q^T k / sqrt(d):
/// the second-order Taylor expansion of the softmax kernel exp(s), exact for that kernel (Based,
/// Arora et al. 2024). r = 1 + d + d (d + 1) / 2: each product x_i x_j once (half of x (x) x's
/// d^2, the same kernel). 1 + s + s^2 / 2 = ((1 + s)^2 + 1) / 2 >= 1/2 for every s, so each key
/// adds at least 1/2 to the normalized read's denominator phi(q)^T z, which is positive in exact
/// arithmetic for any inputs, although single features can be negative (strictly_positive is
/// false). The state is r x dv, so keep d small (Based projects q and k to d = 16: r = 153).
/// Cost: about r multiplies per row; the backward about 2 r.
struct TaylorExp {
  static constexpr bool strictly_positive = false;
  static constexpr const char* name = "taylor_exp";
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return 1 + d + d * (d + 1) / 2; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    using Real = typename Eigen::NumTraits<typename In::Scalar>::Real;
    const Index d = x.cols();
    const Scalars<Real> c(d);
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) {
      auto f = out.row(t);
      f(0) = Real(1);
      f.segment(1, d) = row * c.linear;
      Index at = 1 + d;
      for (Index i = 0; i < d; ++i) {
        f(at) = row(i) * row(i) * c.square;
        const Index after = d - i - 1;
        f.segment(at + 1, after) = (row(i) * c.cross) * row.segment(i + 1, after);
        at += 1 + after;
      }
    });
  }
  /// d_x = d_lin / d^(1/4) + M x / sqrt(d) per row, where d_lin are the d_features of the linear
  /// features and M is the symmetric d x d matrix of the product features' d_features (M_ij =
  /// M_ji for the feature x_i x_j, M_ii sqrt(2) times that of x_i^2). Cost: about 2 r flops per row.
  template <class In, class F, class DF, class DX>
  void backward(const In& x, const F& /*features*/, const DF& d_features, DX& d_x) const {
    using Real = typename Eigen::NumTraits<typename In::Scalar>::Real;
    const Index d = x.cols();
    const Scalars<Real> c(d);
    const Real square_slope = Real(2) * c.square;  // d(x_i^2 / sqrt(2 d)) / d x_i = 2 x_i / sqrt(2 d)
    detail::for_each_contiguous_row(x, [&](Index t, const auto& row) {
      const auto g = d_features.row(t);
      auto dx = d_x.row(t);
      dx = g.segment(1, d) * c.linear;
      Index at = 1 + d;
      for (Index i = 0; i < d; ++i) {
        const Index after = d - i - 1;
        const auto pairs = g.segment(at + 1, after);
        dx(i) += square_slope * row(i) * g(at) + c.cross * pairs.dot(row.segment(i + 1, after));
        dx.segment(i + 1, after) += (c.cross * row(i)) * pairs;
        at += 1 + after;
      }
    });
  }

 private:
  /// The constants for inputs of dimension d: 1 / d^(1/4), 1 / sqrt(2 d), 1 / sqrt(d).
  template <class Real>
  struct Scalars {
    explicit Scalars(Index d)
        : linear(Real(1) / std::sqrt(std::sqrt(static_cast<Real>(d)))),
          square(Real(1) / std::sqrt(Real(2) * static_cast<Real>(d))),
          cross(Real(1) / std::sqrt(static_cast<Real>(d))) {}
    Real linear, square, cross;
  };
};

/// Optional extension of the protocol: features reported in a shifted log domain, for maps
/// whose features are exponentials that would overflow or underflow (random features, see
/// linattn/random_features.hpp). Such a map also provides
///   static constexpr bool log_scaled = true;
///   template <class In, class Out>
///   void apply_scaled(const In& x, Out& out, Eigen::Ref<ColVector<Scalar>> log_scale) const;
/// writing, for each row t, out_t and log_scale_t with phi(x_t) = exp(log_scale_t) * out_t and
/// out_t of order one (largest |entry| about 1). LinearAttention detects it and keeps S and z in
/// a log-scaled form (AttentionState::log_scale()); other maps compile to the plain path.
template <class Phi, class Scalar = float>
concept LogScaledFeatureMap =
    FeatureMap<Phi, Scalar> && requires { requires Phi::log_scaled; } &&
    requires(const Phi& phi, const RowMatrix<Scalar>& x, Eigen::Ref<RowMatrix<Scalar>> out,
             Eigen::Ref<ColVector<Scalar>> log_scale) { phi.apply_scaled(x, out, log_scale); };

/// A feature map with a derivative: `backward(x, features, d_features, d_x)` as described at
/// the top of this file, so gradients flow through it to the inputs (linattn/gradients.hpp).
/// A LogScaledFeatureMap's backward must give the same d_x when a row's features are
/// multiplied by c > 0 and its d_features divided by c: the log-domain kernels pass the scaled
/// features f_t (phi(x_t) = exp(l_t) f_t) with exp(l_t) d_phi_t, which never overflow. For
/// features exp(l(x)) f(x) that holds when d_x is written with the products of features and
/// d_features, since J^T d_phi = exp(l) (Jf^T d_phi + (f . d_phi) grad l).
template <class Phi, class Scalar = float>
concept DifferentiableFeatureMap =
    FeatureMap<Phi, Scalar> &&
    requires(const Phi& phi, const RowMatrix<Scalar>& x, const RowMatrix<Scalar>& features,
             const RowMatrix<Scalar>& d_features, Eigen::Ref<RowMatrix<Scalar>> d_x) {
      phi.backward(x, features, d_features, d_x);
    };

namespace detail {

/// The feature map's name if it declares one, for messages and a state's identity.
template <class Phi>
constexpr const char* feature_map_name() {
  if constexpr (requires { Phi::name; }) {
    return Phi::name;
  } else {
    return "user";
  }
}

/// The map's fingerprint if it has one (maps with parameters: the random draw), else 0. A
/// user map with parameters should provide `std::uint64_t fingerprint() const` that changes
/// whenever they do, so that a state made with other parameters is refused.
template <class Phi>
std::uint64_t feature_map_fingerprint(const Phi& phi) {
  if constexpr (requires {
                  { phi.fingerprint() } -> std::convertible_to<std::uint64_t>;
                }) {
    return static_cast<std::uint64_t>(phi.fingerprint());
  } else {
    static_cast<void>(phi);
    return 0;
  }
}

}  // namespace detail
}  // namespace linattn
