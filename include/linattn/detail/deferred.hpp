#pragma once
// The deferred decode step: a state collects up to B tokens beside S and folds them into S
// together, so that a decode token reads S instead of rewriting it.
//
// Why: a fused step (recurrent_sweep.hpp) loads and stores all of S per token. At
// r = dv = 128 in float S is 64 KiB, more than L1, and the stores' write-backs halve what the
// cache delivers. Read-only, S is loaded once per token; the fold of B tokens is one rank-B
// product that loads and stores S once for all of them, at GEMM-like arithmetic intensity.
// The flops stay 4 r dv per token (2 in the read, 2 in the fold) plus 2 B' (r + dv) for the
// B' <= B pending tokens a read adds. This is the chunked form of the first article (the
// within-chunk part as scores times values, the earlier chunks through S), run one query at a
// time.

#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>

namespace linattn::detail {

/// Tokens absorbed into a state but not yet added to S: their key features, stored transposed
/// (r x B, so that the scores of one query against all of them are r packet FMAs), and their
/// values (B x dv). A capacity of 0 means the state folds every token into S at once.
template <class Scalar>
struct PendingTokens {
  PendingTokens() = default;
  /// Room for `capacity` tokens of feature dim r and value dim dv; capacity <= 1 keeps none.
  PendingTokens(Index capacity, Index r, Index dv)
      : keys_t(capacity > 1 ? r : 0, padded(capacity > 1 ? capacity : 0)),
        values(capacity > 1 ? capacity : 0, dv),
        scores(padded(capacity > 1 ? capacity : 0)),
        capacity(capacity > 1 ? capacity : 0) {
    // Columns past `count` are read by the score packets (and discarded): keep them finite.
    keys_t.setZero();
  }

  /// Column stride rounded up to whole SIMD packets.
  static Index padded(Index n) {
    constexpr Index lanes = sweep_packet_size<Scalar>;
    return (n + lanes - 1) / lanes * lanes;
  }

  RowMatrix<Scalar> keys_t;  // r x padded(capacity): column j = features of pending token j
  RowMatrix<Scalar> values;  // capacity x dv: row j = value of pending token j
  RowVector<Scalar> scores;  // scratch: qf . kf_j of the token being read
  Index capacity = 0;
  Index count = 0;
};

/// S += K_pending^T V_pending for the pending tokens; then none is pending. 2 count r dv flops, S loaded and stored once. No allocation.
template <class Scalar>
void fold_pending(RowMatrix<Scalar>& S, PendingTokens<Scalar>& pending) noexcept {
  const Index n = pending.count, r = S.rows(), dv = S.cols();
  if (n == 0) return;
  if constexpr (has_gemm_kernel<Scalar>) {
    if (dv % GemmTile<Scalar>::lanes == 0) {
      small_gemm<Scalar, true>(r, dv, n, pending.keys_t.data(), pending.keys_t.cols(),
                               pending.values.data(), dv, S.data(), dv);
      pending.count = 0;
      return;
    }
  }
  // Any width: a coefficient-wise product, which allocates nothing.
  S.noalias() += pending.keys_t.leftCols(n).lazyProduct(pending.values.topRows(n));
  pending.count = 0;
}

/// scores[j] = qf . keys_t(:, j) for the pending tokens, a packet of tokens at a time with
/// four partial sums over the rows (added in a fixed order), so the result does not depend on
/// where the vectors lie.
template <class Scalar>
void pending_scores(const Scalar* qf, PendingTokens<Scalar>& pending) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr Index N = sweep_packet_size<Scalar>;
  const Index r = pending.keys_t.rows(), ld = pending.keys_t.cols();
  const Scalar* keys = pending.keys_t.data();
  for (Index j0 = 0; j0 < pending.count; j0 += N) {
    Packet acc[4];
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a) acc[a] = ei::pset1<Packet>(Scalar(0));
    Index i = 0;
    for (; i + 4 <= r; i += 4) {
#pragma GCC unroll 4
      for (int a = 0; a < 4; ++a)
        acc[a] = ei::pmadd(ei::pset1<Packet>(qf[i + a]), ei::ploadu<Packet>(keys + (i + a) * ld + j0),
                           acc[a]);
    }
    for (; i < r; ++i)
      acc[0] = ei::pmadd(ei::pset1<Packet>(qf[i]), ei::ploadu<Packet>(keys + i * ld + j0), acc[0]);
    ei::pstoreu(pending.scores.data() + j0,
                ei::padd(ei::padd(acc[0], acc[1]), ei::padd(acc[2], acc[3])));
  }
}

/// One deferred recurrent token on features: z_next = z + kf and the divisor from
/// qf . z_next (checked before anything changes, so a DenominatorError leaves S, z, the
/// pending block and `tokens` as they were); then the token joins the pending block, y reads
/// qf S plus the pending tokens (itself included), and a full block is folded into S.
/// `qf`, `kf` (length r), `v`, `y` (length dv) contiguous; y must not overlap v. No
/// allocation.
template <class Scalar>
void deferred_token(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                    PendingTokens<Scalar>& pending, const Scalar* qf, const Scalar* kf,
                    const Scalar* v, Scalar* y, const Normalization& norm, Index row,
                    Index& tokens) {
  const Index r = S.rows(), dv = S.cols();
  const Scalar den = add_keys_and_dot(z.data(), kf, qf, z_next.data(), r);
  SweepToken<Scalar> token{qf, nullptr, nullptr, y, norm.divisor(den, row)};
  const Index j = pending.count;
  const Index ld = pending.keys_t.cols();
  for (Index i = 0; i < r; ++i) pending.keys_t.data()[i * ld + j] = kf[i];
  std::copy_n(v, dv, pending.values.row(j).data());
  pending.count = j + 1;
  pending_scores(qf, pending);
  token.pending_scores = pending.scores.data();
  token.pending_values = pending.values.data();
  token.pending_ld = dv;
  token.pending_count = pending.count;
  // Alternate per token as the fused sweep does; reading changes nothing, so any order gives
  // the same bits (see sweep_chunks).
  sweep_tokens<1, Scalar, false>(S.data(), dv, r, dv, &token, norm.divides(), tokens % 2 != 0);
  z.swap(z_next);
  ++tokens;
  if (pending.count == pending.capacity) fold_pending(S, pending);
}

}  // namespace linattn::detail
