#pragma once
// The tuned chunked causal kernel (REFERENCES.md section 2): register-blocked products on
// buffers allocated once per call (detail/small_gemm.hpp), with an Eigen-GEMM form for the
// scalar types and value widths the register kernel does not cover.

#include <linattn/detail/chunk_observer.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/prefetch.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <utility>

namespace linattn::detail {

/// The row scale that divides an output row by `divisor` inside a product: 1 / divisor, or,
/// where that reciprocal overflows (a subnormal divisor), 1 with the divisor kept in `late` (0
/// otherwise) for divide_late_rows() after the product. So every chunked read divides by the
/// divisor it accepted, as the recurrent and full paths do, and returns their finite result.
template <class Scalar>
Scalar reciprocal_or_late(Scalar divisor, Scalar& late) noexcept {
  const Scalar inverse = Scalar(1) / divisor;
  late = std::isfinite(inverse) ? Scalar(0) : divisor;
  return late != Scalar(0) ? Scalar(1) : inverse;
}

/// Divides the rows i < n of `out` (row stride ld, dv columns) whose late[i] is not 0 by it.
template <class Scalar>
void divide_late_rows(Scalar* out, Index ld, Index n, Index dv, const Scalar* late) noexcept {
  for (Index i = 0; i < n; ++i)
    if (late[i] != Scalar(0))
      for (Index c = 0; c < dv; ++c) out[i * ld + c] /= late[i];
}

/// Chunked causal linear attention of T tokens continuing from (S, z), on Eigen's GEMM: the
/// form for scalar types Eigen does not vectorize and value widths that are not a multiple of
/// the packet width (causal_chunked below dispatches). S, z and `tokens` absorb the tokens.
/// `group` query heads read the one state: query(g) is head g's T x dk queries (direct
/// access), output(g) its T x dv output (binds to Eigen::Ref<RowMatrix<Scalar>>); one head
/// for LinearAttention::parallel_into, the query heads of a key/value head for a grouped
/// prefill. Per chunk the keys' features and the state update are computed once, the reads
/// once per head, each exactly as a single-head call would.
/// For each chunk of n <= C rows with features qf = phi(Q_c), kf = phi(K_c):
///   A = [qf | tril(qf kf^T)]   (n x (r + n)),   B = [S ; V_c]   ((r + n) x dv),
///   out_c = A B = qf S + tril(qf kf^T) V_c      (one GEMM instead of two),
///   den_c = qf z + rowsum(tril(qf kf^T)),  then  S += kf^T V_c,  z += colsum(kf).
/// S lives in the top rows of B during the call, so the state read and the within-chunk part
/// are one product with inner dimension r + n; it is copied back when the call ends or throws.
/// Rows are normalized before the state absorbs their chunk: after a DenominatorError the state
/// holds exactly the chunks before the failing one (and `tokens` counts them); heads before
/// the failing one have written that chunk's rows, later heads have not.
///
/// Cost per chunk: 2 n (r + n) dv + 2 n^2 r + 2 n r dv flops, i.e. per token 4 r dv + 2 n (r + dv)
/// (the masked half of the score block is computed and multiplied as zeros: at the chunk sizes
/// that run fastest, a full small GEMM beats a triangular one). Memory: O(C (r + C) + r dv),
/// never T x T. Allocates once per call, not per chunk.
template <class Scalar, class Phi, class QueryAt, class DK, class DV, class OutputAt,
          class BeforeChunk = NoChunkObserver>
void causal_chunked_eigen(const Phi& phi, Index group, const QueryAt& query, const DK& K,
                          const DV& V, RowMatrix<Scalar>& S, ColVector<Scalar>& z, Index& tokens,
                          Index chunk_size, const Normalization& norm, const OutputAt& output,
                          const BeforeChunk& before_chunk = {}) {
  const Index T = K.rows(), r = S.rows(), dv = S.cols();
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
    before_chunk(first, B.topRows(r), z);
    {
      Eigen::Ref<RowMatrix<Scalar>> kf_view(kf.topRows(n));
      phi.apply(K.middleRows(first, n), kf_view);
    }
    const auto kfc = kf.topRows(n);
    auto v_chunk = B.middleRows(r, n);
    v_chunk = V.middleRows(first, n);
    for (Index g = 0; g < group; ++g) {
      {
        Eigen::Ref<RowMatrix<Scalar>> qf_view(A.topLeftCorner(n, r));
        phi.apply(query(g).middleRows(first, n), qf_view);
      }
      const auto qf = A.topLeftCorner(n, r);
      auto scores = A.block(0, r, n, n);
      scores.noalias() = qf * kfc.transpose();
      scores.template triangularView<Eigen::StrictlyUpper>().setZero();

      Eigen::Ref<RowMatrix<Scalar>> out = output(g);
      auto o = out.middleRows(first, n);
      product_into<false>(o, A.topLeftCorner(n, r + n), B.topRows(r + n));
      if (norm.divides()) {
        auto d = den.head(n);
        d.noalias() = qf * z;
        d += scores.rowwise().sum();
        for (Index i = 0; i < n; ++i) o.row(i) /= norm.divisor(d(i), first + i);
      }
    }
    B.topRows(r).noalias() += kfc.transpose() * v_chunk;
    z += kfc.colwise().sum().transpose();
    tokens += n;
  }
}

/// True when X's rows can be read in place through a pointer and a row stride.
template <class X>
constexpr bool has_row_major_storage() {
  return (X::Flags & Eigen::DirectAccessBit) != 0 && (X::Flags & Eigen::RowMajorBit) != 0 &&
         X::InnerStrideAtCompileTime == 1;
}

/// Rows [first, first + n) of V as a row-major pointer and row stride: V's own storage when its
/// rows are contiguous, else a copy in `buffer` (at least n rows).
template <class DV, class Scalar>
std::pair<const Scalar*, Index> row_major_rows(const DV& V, Index first, Index n,
                                               RowMatrix<Scalar>& buffer) {
  if constexpr (has_row_major_storage<DV>()) {
    return {V.data() + first * V.outerStride(), V.outerStride()};
  } else {
    buffer.topRows(n) = V.middleRows(first, n);
    return {buffer.data(), buffer.cols()};
  }
}

/// The same chunked recurrence on the register kernel, for Scalar types Eigen vectorizes and
/// dv a multiple of the packet width (the common head sizes); otherwise causal_chunked_eigen.
/// `group`, query(g) and output(g) as there: the key features, their transpose and the update
/// of S are per chunk, the rest below per query head.
/// Per chunk of n <= C rows with qf = phi(Q_c), kf = phi(K_c), P = tril(qf kf^T) (diagonal
/// included):
///   z_i = z + kf_0 + ... + kf_i,  den_i = qf_i . z_i      checked before anything is written
///   out_c = (qf S + P V_c) / den                  two products into the output rows, the
///                                                 division folded into the second one's store
///   S += kf^T V_c,  z = z_(n-1)
/// The denominators are the recurrent path's (a running z, one dot product per row), which is
/// cheaper here than a product plus masked row sums of P. The products skip the zero half of
/// P: scores are computed only up to each row tile's diagonal, and P V_c stops each row tile's
/// inner loop there. S is updated in place and the output written in place through its row
/// stride; nothing is re-packed. Per token: 4 r dv + about C (r + dv) flops (the triangle
/// rounded up to whole tiles) + 3 r for the denominator; memory O(C (r + C) + C dv), never
/// T x T. Allocates once per call, not per chunk. After a DenominatorError the state holds
/// exactly the chunks before the failing one. A group of G heads costs G reads (2 r dv + about
/// C (r + dv) flops per token each) and one update (2 r dv), against G of each for G calls.
template <class Scalar, class Phi, class QueryAt, class DK, class DV, class OutputAt,
          class BeforeChunk = NoChunkObserver>
void causal_chunked(const Phi& phi, Index group, const QueryAt& query, const DK& K, const DV& V,
                    RowMatrix<Scalar>& S, ColVector<Scalar>& z, Index& tokens, Index chunk_size,
                    const Normalization& norm, const OutputAt& output,
                    const BeforeChunk& before_chunk = {}) {
  const Index T = K.rows(), r = S.rows(), dv = S.cols();
  if constexpr (!has_gemm_kernel<Scalar>) {
    causal_chunked_eigen<Scalar>(phi, group, query, K, V, S, z, tokens, chunk_size, norm, output,
                                 before_chunk);
  } else {
    constexpr Index lanes = GemmTile<Scalar>::lanes;
    if (dv % lanes != 0) {
      causal_chunked_eigen<Scalar>(phi, group, query, K, V, S, z, tokens, chunk_size, norm,
                                   output, before_chunk);
      return;
    }
    if (T == 0) return;
    const Index C = std::min(chunk_size, T);
    const Index padded = (C + lanes - 1) / lanes * lanes;  // P and kf^T columns, whole packets
    // Zero-filled once: the padding columns of kf^T feed score columns that are never read,
    // and must hold finite values.
    RowMatrix<Scalar> qf(C, r), kf(C, r), kf_t = RowMatrix<Scalar>::Zero(r, padded),
                      scores = RowMatrix<Scalar>::Zero(C, padded),
                      v_buffer(has_row_major_storage<DV>() ? 0 : C, dv);
    RowVector<Scalar> running_z(r);
    // Row scales of the read: 1 / divisor, or 1 where that reciprocal overflows (a subnormal
    // divisor); those rows are divided after the product instead (late_divisor, 0 elsewhere).
    ColVector<Scalar> inverse(C), late_divisor(C);
    SpreadPrefetch next_rows;
    for (Index first = 0; first < T; first += C) {
      const Index n = std::min(C, T - first);
      const Index n_padded = (n + lanes - 1) / lanes * lanes;
      before_chunk(first, S, z);
      // The next chunk's inputs stream in while this one's products run, a few lines per
      // register tile (see SpreadPrefetch), in the order the next chunk reads them.
      next_rows.add(K, first + C, C);
      next_rows.add(V, first + C, C);
      for (Index g = 0; g < group; ++g) next_rows.add(query(g), first + C, C);
      {
        Eigen::Ref<RowMatrix<Scalar>> kf_view(kf.topRows(n));
        phi.apply(K.middleRows(first, n), kf_view);
      }
      transpose_into(n, r, kf.data(), r, kf_t.data(), padded);
      const auto [v_chunk, ld_v] = row_major_rows(V, first, n, v_buffer);
      for (Index g = 0; g < group; ++g) {
        {
          Eigen::Ref<RowMatrix<Scalar>> qf_view(qf.topRows(n));
          phi.apply(query(g).middleRows(first, n), qf_view);
        }
        // Each query head runs the same sum (a few r adds per row), so every head's
        // denominators have the bits of a single-head call.
        running_z = z.transpose();
        for (Index i = 0; i < n; ++i) {
          running_z += kf.row(i);
          if (norm.divides())
            inverse(i) = reciprocal_or_late(norm.divisor(qf.row(i).dot(running_z), first + i),
                                            late_divisor(i));
        }
        small_gemm<Scalar, false>(n, n_padded, r, qf.data(), r, kf_t.data(), padded,
                                  scores.data(), padded, Triangle::lower_result, nullptr,
                                  &next_rows);
        // The read below walks P up to each row tile's diagonal: the entries right of the
        // diagonal inside that range must be zero (they hold q_i . k_j for j > i).
        for (Index i = 0; i + 1 < n; ++i) scores.row(i).segment(i + 1, n - i - 1).setZero();

        Eigen::Ref<RowMatrix<Scalar>> out = output(g);
        const Index ld_out = out.outerStride();
        Scalar* o = out.data() + first * ld_out;
        small_gemm<Scalar, false>(n, dv, r, qf.data(), r, S.data(), dv, o, ld_out,
                                  Triangle::none, nullptr, &next_rows);
        small_gemm<Scalar, true>(n, dv, n, scores.data(), padded, v_chunk, ld_v, o, ld_out,
                                 Triangle::lower_lhs, norm.divides() ? inverse.data() : nullptr,
                                 &next_rows);
        if (norm.divides()) divide_late_rows(o, ld_out, n, dv, late_divisor.data());
      }
      small_gemm<Scalar, true>(r, dv, n, kf_t.data(), padded, v_chunk, ld_v, S.data(), dv,
                               Triangle::none, nullptr, &next_rows);
      next_rows.finish();
      z = running_z.transpose();
      tokens += n;
    }
  }
}

}  // namespace linattn::detail
