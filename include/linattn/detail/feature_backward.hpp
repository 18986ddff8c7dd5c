#pragma once
// The derivatives of the random feature maps (linattn/random_features.hpp): d_x = J^T d_phi per
// row, written with the products d_phi * phi only, so the scaled features of apply_scaled()
// with d_phi times exp(log_scale) give the same d_x without ever forming a feature that
// overflows (the DifferentiableFeatureMap requirement for a LogScaledFeatureMap).

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cmath>

namespace linattn::detail {

/// Shapes of a feature map's backward(): x T x d, features and d_features T x r, d_x T x d.
template <class In, class F, class DF, class DX>
void check_feature_backward(const In& x, const F& features, const DF& d_features, const DX& d_x,
                            Index r) {
  if (features.rows() != x.rows() || features.cols() != r || d_features.rows() != x.rows() ||
      d_features.cols() != r || d_x.rows() != x.rows() || d_x.cols() != x.cols())
    throw_shape_error("feature backward got x ", shape_of(x), ", features ", shape_of(features),
                      ", d_features ", shape_of(d_features), " and d_x ", shape_of(d_x),
                      "; expected features and d_features ", x.rows(), "x", r, " and d_x ",
                      x.rows(), "x", x.cols());
}

/// Row t of the chain rule through a projection W (m x d) and a radial term:
///   d_x_t = sqrt(tau) sum_i g(i) w_i + radial x_t.
/// Axpy over the rows of W: a GEMM on the expression g would first copy it into a temporary,
/// and the attention backward calls this once per chunk, where nothing may allocate.
template <class Scalar, class In, class G, class DX>
void chain_through_projection(const RowMatrix<Scalar>& W, double tau, const In& x, Index t,
                              const G& g, Scalar radial, DX& d_x) {
  auto dx = d_x.row(t);
  dx.setZero();
  for (Index i = 0; i < W.rows(); ++i) dx += g(i) * W.row(i);
  dx *= static_cast<Scalar>(std::sqrt(tau));
  dx += radial * x.row(t);
}

/// Positive random features: feature i is exp(w_i^T x' - |x'|^2 / 2) / sqrt(m), x' = sqrt(tau)
/// x (and exp(-w_i^T x' - |x'|^2 / 2) / sqrt(2m) as feature m + i when hyperbolic), so with
/// G = d_features * features elementwise
///   d_x_t = sqrt(tau) sum_i (G_ti - G_t,m+i) w_i - tau x_t sum_j G_tj
/// (no G_t,m+i term unless hyperbolic). Cost: about 2 T m d flops; allocates nothing.
template <class Scalar, class In, class F, class DF, class DX>
void positive_features_backward(const RowMatrix<Scalar>& W, double tau, bool hyperbolic,
                                const In& x, const F& features, const DF& d_features, DX& d_x) {
  const Index m = W.rows();
  check_feature_backward(x, features, d_features, d_x, hyperbolic ? 2 * m : m);
  for (Index t = 0; t < x.rows(); ++t) {
    const auto G = d_features.row(t).cwiseProduct(features.row(t));
    const auto g = [&](Index i) { return hyperbolic ? Scalar(G(i) - G(m + i)) : Scalar(G(i)); };
    chain_through_projection<Scalar>(W, tau, x, t, g, static_cast<Scalar>(-tau) * G.sum(), d_x);
  }
}

/// Trigonometric random features [sin p_i, cos p_i] exp(|x'|^2 / 2) / sqrt(m), p = W x': with
/// s, c the two halves of a row of features (either scale) and d_s, d_c those of d_features,
/// d sin p_i = cos p_i w_i^T dx', d cos p_i = -sin p_i w_i^T dx' and the common factor brings
/// tau x, so
///   d_x_t = sqrt(tau) sum_i (d_s_ti c_ti - d_c_ti s_ti) w_i + tau x_t (d_features_t . features_t).
/// Cost: about 2 T m d flops; allocates nothing.
template <class Scalar, class In, class F, class DF, class DX>
void trig_features_backward(const RowMatrix<Scalar>& W, double tau, const In& x,
                            const F& features, const DF& d_features, DX& d_x) {
  const Index m = W.rows();
  check_feature_backward(x, features, d_features, d_x, 2 * m);
  for (Index t = 0; t < x.rows(); ++t) {
    const auto f = features.row(t);
    const auto df = d_features.row(t);
    const auto g = [&](Index i) { return Scalar(df(i) * f(m + i) - df(m + i) * f(i)); };
    chain_through_projection<Scalar>(W, tau, x, t, g, static_cast<Scalar>(tau) * df.dot(f), d_x);
  }
}

}  // namespace linattn::detail
