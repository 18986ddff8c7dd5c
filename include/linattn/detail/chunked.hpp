#pragma once
// The tuned chunked causal kernel (REFERENCES.md section 2), built from Eigen GEMMs on buffers
// allocated once per call.

#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>

namespace linattn::detail {

/// Chunked causal linear attention of T tokens continuing from (S, z); S, z and `tokens`
/// absorb the tokens. For each chunk of n <= C rows with features qf = phi(Q_c), kf = phi(K_c):
///   A = [qf | tril(qf kf^T)]   (n x (r + n)),   B = [S ; V_c]   ((r + n) x dv),
///   out_c = A B = qf S + tril(qf kf^T) V_c      (one GEMM instead of two),
///   den_c = qf z + rowsum(tril(qf kf^T)),  then  S += kf^T V_c,  z += colsum(kf).
/// S lives in the top rows of B during the call, so the state read and the within-chunk part
/// are one product with inner dimension r + n; it is copied back when the call ends or throws.
/// Rows are normalized before the state absorbs their chunk: after a DenominatorError the state
/// holds exactly the chunks before the failing one (and `tokens` counts them).
///
/// Cost per chunk: 2 n (r + n) dv + 2 n^2 r + 2 n r dv flops, i.e. per token 4 r dv + 2 n (r + dv)
/// (the masked half of the score block is computed and multiplied as zeros: at the chunk sizes
/// that run fastest, a full small GEMM beats a triangular one). Memory: O(C (r + C) + r dv),
/// never T x T. Allocates once per call, not per chunk.
template <class Scalar, class Phi, class DQ, class DK, class DV>
void causal_chunked(const Phi& phi, const DQ& Q, const DK& K, const DV& V, RowMatrix<Scalar>& S,
                    ColVector<Scalar>& z, Index& tokens, Index chunk_size,
                    const Normalization& norm, Eigen::Ref<RowMatrix<Scalar>> out) {
  const Index T = Q.rows(), r = S.rows(), dv = S.cols();
  if (T == 0) return;
  const Index C = std::min(chunk_size, T);
  RowMatrix<Scalar> A(C, r + C), B(r + C, dv), kf(C, r);
  ColVector<Scalar> den(C);
  B.topRows(r) = S;

  // Copies the working S back into the state however the loop ends.
  struct WriteBack {
    RowMatrix<Scalar>& state;
    const RowMatrix<Scalar>& work;
    Index r;
    ~WriteBack() { state = work.topRows(r); }
  } write_back{S, B, r};

  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    {
      Eigen::Ref<RowMatrix<Scalar>> qf_view(A.topLeftCorner(n, r)), kf_view(kf.topRows(n));
      phi.apply(Q.middleRows(first, n), qf_view);
      phi.apply(K.middleRows(first, n), kf_view);
    }
    const auto qf = A.topLeftCorner(n, r);
    const auto kfc = kf.topRows(n);
    auto scores = A.block(0, r, n, n);
    scores.noalias() = qf * kfc.transpose();
    scores.template triangularView<Eigen::StrictlyUpper>().setZero();
    auto v_chunk = B.middleRows(r, n);
    v_chunk = V.middleRows(first, n);

    auto o = out.middleRows(first, n);
    o.noalias() = A.topLeftCorner(n, r + n) * B.topRows(r + n);
    if (norm.divides()) {
      auto d = den.head(n);
      d.noalias() = qf * z;
      d += scores.rowwise().sum();
      for (Index i = 0; i < n; ++i) o.row(i) /= norm.divisor(d(i), first + i);
    }
    B.topRows(r).noalias() += kfc.transpose() * v_chunk;
    z += kfc.colwise().sum().transpose();
    tokens += n;
  }
}

}  // namespace linattn::detail
