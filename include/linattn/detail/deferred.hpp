#pragma once
// The deferred decode step: a state collects up to B tokens beside S and folds them into S
// together, so that a decode token reads S instead of rewriting it.
//
// Why: a fused step (recurrent_sweep.hpp) loads and stores all of S per token. At
// r = dv = 128 in float S is 64 KiB, more than L1, and the stores' write-backs halve what the
// cache delivers. Read-only, S is loaded once per token; the fold of B tokens is one rank-B
// product that loads and stores S once for all of them, at GEMM-like arithmetic intensity.
// The flops stay 4 r dv per token (2 in the read, 2 in the fold) plus 2 B' (r + dv) for the
// B' <= B pending tokens a read adds. This is the chunked form of linear attention
// (Katharopoulos et al. 2020; the within-chunk part as scores times values, the earlier chunks
// through S), run one query at a time.

#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>

namespace linattn::detail {

/// Tokens absorbed into a state but not yet added to S: their key features (B x r) and values
/// (B x dv), one contiguous row per token, so that appending one is two row copies. (A
/// transposed key block made each append touch r cache lines, which cost a decode token at
/// r = 128 more than the scores it saved.) A capacity of 0 means the state folds every token
/// into S at once.
template <class Scalar>
struct PendingTokens {
  PendingTokens() = default;
  /// Room for `capacity` tokens of feature dim r and value dim dv; capacity <= 1 keeps none.
  PendingTokens(Index capacity, Index r, Index dv)
      : keys(kept(capacity), r),
        values(kept(capacity), dv),
        keys_t(r, kept(capacity)),
        scores(kept(capacity)),
        capacity(kept(capacity)) {}

  static Index kept(Index capacity) { return capacity > 1 ? capacity : 0; }

  RowMatrix<Scalar> keys;    // capacity x r: row j = features of pending token j
  RowMatrix<Scalar> values;  // capacity x dv: row j = value of pending token j
  RowMatrix<Scalar> keys_t;  // scratch of the fold: keys transposed
  RowVector<Scalar> scores;  // scratch of a read: qf . kf_j
  Index capacity = 0;
  Index count = 0;
};

/// S += K_pending^T V_pending for the pending tokens; then none is pending. 2 count r dv flops,
/// S loaded and stored once. No allocation.
template <class Scalar>
void fold_pending(RowMatrix<Scalar>& S, PendingTokens<Scalar>& pending) noexcept {
  const Index n = pending.count, r = S.rows(), dv = S.cols();
  if (n == 0) return;
  if constexpr (has_gemm_kernel<Scalar>) {
    if (dv % GemmTile<Scalar>::lanes == 0) {
      const Index ld = pending.keys_t.cols();
      transpose_into(n, r, pending.keys.data(), r, pending.keys_t.data(), ld);
      small_gemm<Scalar, true>(r, dv, n, pending.keys_t.data(), ld, pending.values.data(), dv,
                               S.data(), dv);
      pending.count = 0;
      return;
    }
  }
  // Any width: a coefficient-wise product, which allocates nothing.
  S.noalias() += pending.keys.topRows(n).transpose().lazyProduct(pending.values.topRows(n));
  pending.count = 0;
}

/// scores[j] = qf . (features of pending token j), each by ordered_dot: the result depends on
/// the values only, not on where they lie.
template <class Scalar>
void pending_scores(const Scalar* qf, const PendingTokens<Scalar>& pending, Scalar* scores) noexcept {
  const Index r = pending.keys.cols();
  for (Index j = 0; j < pending.count; ++j)
    scores[j] = ordered_dot(qf, pending.keys.data() + j * r, r);
}

/// y = (qf S + sum over the pending tokens j of (qf . kf_j) v_j) / divisor (if `divide`),
/// reading S and the block only. `scores` is room for the pending count. 2 r dv flops plus
/// 2 p (r + dv) for p pending tokens.
template <class Scalar>
void read_with_pending(const RowMatrix<Scalar>& S, const PendingTokens<Scalar>& pending,
                       const Scalar* qf, Scalar* y, Scalar* scores, Scalar divisor, bool divide,
                       bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  pending_scores(qf, pending, scores);
  SweepToken<Scalar> token{qf, nullptr, nullptr, y, divisor};
  token.pending_scores = scores;
  token.pending_values = pending.values.data();
  token.pending_ld = dv;
  token.pending_count = pending.count;
  // A read-only sweep never writes through the pointer (sweep_tokens<..., false>).
  sweep_tokens<1, Scalar, false>(const_cast<Scalar*>(S.data()), dv, r, dv, &token, divide,
                                 reverse);
}

/// Adds a token to the pending block (kf length r, v length dv), folding a full block into S
/// first. Folding only when the next token arrives (not when the block fills) keeps the last
/// token's read the same whether it comes from step() or from absorb() then read_into().
template <class Scalar>
void append_pending(RowMatrix<Scalar>& S, PendingTokens<Scalar>& pending, const Scalar* kf,
                    const Scalar* v) noexcept {
  if (pending.count == pending.capacity) fold_pending(S, pending);
  const Index j = pending.count;
  std::copy_n(kf, S.rows(), pending.keys.row(j).data());
  std::copy_n(v, S.cols(), pending.values.row(j).data());
  pending.count = j + 1;
}

/// One deferred recurrent token on features: z_next = z + kf and the divisor from
/// qf . z_next (checked before anything changes, so a DenominatorError leaves S, z, the
/// pending block and `tokens` as they were); then the token joins the pending block (a full
/// block is folded into S first) and y reads qf S plus the pending tokens, itself included.
/// `qf`, `kf` (length r), `v`, `y` (length dv) contiguous; y must not overlap v. No
/// allocation.
template <class Scalar>
void deferred_token(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                    PendingTokens<Scalar>& pending, const Scalar* qf, const Scalar* kf,
                    const Scalar* v, Scalar* y, const Normalization& norm, Index row,
                    Index& tokens) {
  const Index r = S.rows();
  const Scalar den = add_keys_and_dot(z.data(), kf, qf, z_next.data(), r);
  const Scalar divisor = norm.divisor(den, row);
  append_pending(S, pending, kf, v);
  // Alternate per token as the fused sweep does; reading changes nothing, so any order gives
  // the same bits (see sweep_chunks).
  read_with_pending(S, pending, qf, y, pending.scores.data(), divisor, norm.divides(),
                    tokens % 2 != 0);
  z.swap(z_next);
  ++tokens;
}

}  // namespace linattn::detail
