#pragma once
// Compute kernels behind LinearAttention: the single-token recurrent update+read and the
// chunked causal form. They work on features that are already computed.

#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

namespace linattn::detail {

/// One recurrent token on features: S += kf^T v, z += kf^T, y = (qf S) / divisor(qf z).
/// `qf`, `kf` are 1 x r rows, `v` a 1 x dv row, `y` a 1 x dv row; `z_next` is r scratch.
/// The denominator is checked before S or z change, so a throw leaves the state as it was.
/// Cost: 4 r dv flops, S read and written once (update and read fused in one sweep).
template <class Scalar, class Qf, class Kf, class V, class Y>
void recurrent_token(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                     const Qf& qf, const Kf& kf, const V& v, Y&& y, const Normalization& norm,
                     Index row) {
  z_next = z + kf.transpose();
  const Scalar divisor = norm.divisor(static_cast<Scalar>(qf.dot(z_next.transpose())), row);
  y.setZero();
  for (Index i = 0; i < S.rows(); ++i) {
    auto Si = S.row(i);
    Si += kf(i) * v;
    y += qf(i) * Si;
  }
  z.swap(z_next);
  if (norm.divides()) y /= divisor;
}

/// Causal attention of one chunk of n tokens against the incoming state, then the state
/// absorbs the chunk (REFERENCES.md section 2):
///   out = qf S + tril(qf kf^T) v,  den = qf z + rowsum(tril(qf kf^T)),
///   S += kf^T v,  z += colsum(kf).
/// `scores` and `den` are scratch of at least n x n and n. Rows are normalized before the
/// state is touched, so a DenominatorError leaves the state holding the earlier chunks.
/// Cost: 2 n^2 (r + dv) + 4 n r dv flops.
template <class Scalar, class Qf, class Kf, class V, class Out>
void causal_chunk(RowMatrix<Scalar>& S, ColVector<Scalar>& z, const Qf& qf, const Kf& kf,
                  const V& v, Out&& out, RowMatrix<Scalar>& scores, ColVector<Scalar>& den,
                  const Normalization& norm, Index first_row) {
  const Index n = qf.rows();
  auto s = scores.topLeftCorner(n, n);
  s.noalias() = qf * kf.transpose();
  s.template triangularView<Eigen::StrictlyUpper>().setZero();
  out.noalias() = qf * S;
  out.noalias() += s * v;
  if (norm.divides()) {
    auto d = den.head(n);
    d.noalias() = qf * z;
    d += s.rowwise().sum();
    for (Index i = 0; i < n; ++i) out.row(i) /= norm.divisor(d(i), first_row + i);
  }
  S.noalias() += kf.transpose() * v;
  z += kf.colwise().sum().transpose();
}

}  // namespace linattn::detail
