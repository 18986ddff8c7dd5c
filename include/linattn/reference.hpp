#pragma once
/// \file reference.hpp
/// Quadratic reference implementations, for tests and comparisons only: they form the full
/// Tq x Tk score matrix (O(Tq Tk (dk + dv)) time and O(Tq Tk) memory).

#include <linattn/detail/checks.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/errors.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cmath>
#include <limits>

namespace linattn {

/// Softmax attention, the comparison baseline: y_i = sum_j softmax_j(scale q_i^T k_j) v_j over
/// all keys (Mask::none) or keys j <= i (Mask::causal). Numerically stable: the row maximum is
/// subtracted before exp. `scale` defaults to 1/sqrt(dk); pass 1 for raw dot-product scores.
/// O(Tq Tk (dk + dv)) time, O(Tq Tk) memory.
template <class DQ, class DK, class DV>
[[nodiscard]] RowMatrix<typename DQ::Scalar> softmax_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Mask mask,
    double scale = std::numeric_limits<double>::quiet_NaN()) {
  using Scalar = typename DQ::Scalar;
  detail::check_qkv_pairing(Q, K, V, mask == Mask::causal);
  if (std::isnan(scale)) scale = 1.0 / std::sqrt(static_cast<double>(std::max<Index>(Q.cols(), 1)));
  RowMatrix<Scalar> scores = (Q * K.transpose()) * static_cast<Scalar>(scale);
  for (Index i = 0; i < scores.rows(); ++i) {
    const Index visible = mask == Mask::causal ? i + 1 : scores.cols();
    auto row = scores.row(i);
    if (visible < scores.cols()) row.tail(scores.cols() - visible).setZero();
    auto live = row.head(visible);
    if (visible == 0) continue;
    live = (live.array() - live.maxCoeff()).exp().matrix();
    live /= live.sum();
  }
  return scores * V;
}

/// Linear attention by its quadratic definition: scores phi(Q) phi(K)^T (masked for causal),
/// y = scores V, each row divided by the row's score sum under `norm`. The test oracle for
/// LinearAttention and a baseline for benchmarks. O(Tq Tk (r + dv)) time, O(Tq Tk) memory.
template <class Phi, class DQ, class DK, class DV>
[[nodiscard]] RowMatrix<typename DQ::Scalar> quadratic_attention(
    const Phi& phi, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Mask mask, Normalization norm = {}) {
  using Scalar = typename DQ::Scalar;
  detail::check_qkv_pairing(Q, K, V, mask == Mask::causal);
  const Index r = phi.feature_dim(Q.cols());
  RowMatrix<Scalar> qf(Q.rows(), r), kf(K.rows(), r);
  {
    Eigen::Ref<RowMatrix<Scalar>> q_ref(qf), k_ref(kf);
    phi.apply(detail::materialize(Q), q_ref);
    phi.apply(detail::materialize(K), k_ref);
  }
  RowMatrix<Scalar> scores = qf * kf.transpose();
  if (mask == Mask::causal) scores.template triangularView<Eigen::StrictlyUpper>().setZero();
  RowMatrix<Scalar> out = scores * V;
  if (norm.divides()) {
    const ColVector<Scalar> den = scores.rowwise().sum();
    for (Index i = 0; i < out.rows(); ++i) out.row(i) /= norm.divisor(den(i), i);
  }
  return out;
}

}  // namespace linattn
