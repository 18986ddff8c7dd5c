#pragma once
// Kernels of the delta write rules (Delta: alpha = 1; GatedDelta), on the additive path's
// register kernel and packet sweep. In the S (r x dv) orientation, with p_t = kf_t S_{t-1}:
//
//   u_t = beta_t (v_t - alpha_t p_t),   S_t = alpha_t S_{t-1} + kf_t^T u_t,   y_t = qf_t S_t
//       = alpha_t (qf_t S_{t-1}) + (qf_t . kf_t) u_t
//
// Chunked (DeltaChunk): the WY / UT form, prepare() (the corrected values of a chunk by a
// blocked unit-lower-triangular solve, which needs S), read() per query head, absorb().
// Recurrent: DeltaRecurrence sweeps S once per two tokens: each sweep applies the previous
// pair's update as it loads a row (S = a S + kf_0^T w_0 + kf_1^T w_1) and reads kf S and qf S for
// both tokens of the next pair, whose corrected values follow from those reads and the pair's
// dot products. delta_token (decode) reads kf S and qf S in one read-only sweep, then updates in
// one read-modify-write sweep; delta_absorb does the same without qf for grouped decode, whose
// heads read with the additive read-only sweep (recurrent_sweep.hpp).
// GatedDelta with one gate per feature channel (Kimi Delta Attention), S_t = diag(a_t) S_{t-1}
// + kf_t^T u_t with u_t = beta_t (v_t - kf_t diag(a_t) S_{t-1}): ChannelDeltaChunk (the
// per-channel gated chunk's decayed products with DeltaChunk's substitution),
// ChannelDeltaRecurrence (one token per sweep) and channel_delta_token / channel_delta_absorb
// (decode); costs in docs/write_rules.md.
//
// Cost per token next to Additive's (r features, dv values, chunk C, float; flops, and bytes
// of S moved between cache and registers; besides, each reads the token's q, k, v rows, beta
// and alpha, and writes its output):
//   Additive chunk        4 r dv + C (r + dv)                         12 r dv / C
//   delta chunk           6 r dv (kf S, qf S, the update)             16 r dv / C
//                         + 2 C (r + dv) (scores, kf kf^T, the solve,  (24 with GatedDelta's
//                         scores x U) + 3 C / 2 + r dv / C (GatedDelta) scaling)
//   Additive recurrent    4 r dv                                      4 r dv
//   delta recurrent       6 r dv (6.5 GatedDelta): per element per    4 r dv
//                         pair, two FMAs of the carried update (and a
//                         multiply), four reads
//   delta_token (decode)  6 r dv (7 GatedDelta)                       12 r dv (S loaded twice,
//                                                                     stored once)
//
// Numerics: alpha = exp(log_alpha) <= 1 and the decays D(i, j) = alpha_{j+1} ... alpha_i are
// products multiplied one by one, as in gated_kernels.hpp; with unit keys and beta in [0, 2]
// every step map has 2-norm <= 1, so errors made at earlier steps do not grow.

#include <linattn/detail/gated_kernels.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

namespace linattn::detail {

/// Rows per block of the chunk's blocked triangular solve: the rows of a block against all
/// earlier blocks are one register-kernel product, the block itself a row-by-row substitution.
inline constexpr Index delta_solve_block = 16;

// ---- recurrent -------------------------------------------------------------------------------

/// The write of one delta token once its corrected value u (length dv) is known: one
/// read-modify-write sweep S = alpha S + kf^T u (no multiply when alpha = 1). 2 r dv flops
/// (3 with alpha < 1). No allocation.
template <class Scalar>
void delta_write(RowMatrix<Scalar>& S, const Scalar* kf, const Scalar* u, Scalar alpha,
                 bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  RankSweep<Scalar> update;
  update.scale = alpha;
  update.k[0] = kf;
  update.w[0] = u;
  rank_sweep_with<0>(1, alpha != Scalar(1) ? RowScale::uniform : RowScale::none, S.data(), dv, r,
                     dv, update, reverse);
}

/// One decode token of the (gated) delta rule: one read-only sweep gives p = kf S and
/// w = qf S (into `prediction` and y), then u = beta (v - alpha p) (in `prediction`),
/// y = alpha w + (qf . kf) u, and one read-modify-write sweep S = alpha S + kf^T u, in the
/// opposite direction (it starts where the read ended). qf, kf (length r), v, y, prediction
/// (length dv) contiguous; y must not overlap the others. 6 r dv flops (7 with alpha < 1). No
/// allocation.
template <class Scalar>
void delta_token(RowMatrix<Scalar>& S, Scalar* prediction, const Scalar* qf, const Scalar* kf,
                 const Scalar* v, Scalar beta, Scalar alpha, Scalar* y, bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  RankSweep<Scalar> read;
  read.x[0] = kf;
  read.x[1] = qf;
  read.out[0] = prediction;
  read.out[1] = y;
  rank_sweep<0, 2, RowScale::none>(S.data(), dv, r, dv, read, reverse);
  using Vec = Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
  using ConstVec = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
  Vec u(prediction, dv), out(y, dv);
  u = beta * (ConstVec(v, dv) - alpha * u);
  out = alpha * out + ordered_dot(qf, kf, r) * u;
  delta_write(S, kf, prediction, alpha, !reverse);
}

/// Absorb one token without a read (grouped decode: then every query head reads S with the
/// read-only sweep): p = kf S, u = beta (v - alpha p), S = alpha S + kf^T u. `prediction` is dv
/// scratch. 4 r dv flops. No allocation.
template <class Scalar>
void delta_absorb(RowMatrix<Scalar>& S, Scalar* prediction, const Scalar* kf, const Scalar* v,
                  Scalar beta, Scalar alpha, bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  RankSweep<Scalar> read;
  read.x[0] = kf;
  read.out[0] = prediction;
  rank_sweep<0, 1, RowScale::none>(S.data(), dv, r, dv, read, reverse);
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> u(prediction, dv);
  u = beta * (Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(v, dv) - alpha * u);
  delta_write(S, kf, prediction, alpha, !reverse);
}

/// The write of one token of GatedDelta with per-channel gates a once its corrected value u
/// (length dv) is known: one read-modify-write sweep S = diag(a) S + kf^T u. 3 r dv flops. No
/// allocation.
template <class Scalar>
void channel_delta_write(RowMatrix<Scalar>& S, const Scalar* kf, const Scalar* gates,
                         const Scalar* u, bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  RankSweep<Scalar> write;
  write.row_scale = gates;
  write.k[0] = kf;
  write.w[0] = u;
  rank_sweep_with<0>(1, RowScale::per_row, S.data(), dv, r, dv, write, reverse);
}

/// One decode token of GatedDelta with per-channel gates a (Kimi Delta Attention): with
/// S' = diag(a) S, one read-only sweep gives p = (kf .* a) S = kf S' and w = (qf .* a) S =
/// qf S', then u = beta (v - p), y = w + (qf . kf) u, and one read-modify-write sweep
/// S = diag(a) S + kf^T u. `scaled` is r scratch for kf .* a; qf is scaled in place (it is the
/// caller's scratch). 7 r dv flops, as delta_token with a scalar alpha. No allocation.
template <class Scalar>
void channel_delta_token(RowMatrix<Scalar>& S, Scalar* prediction, Scalar* qf, const Scalar* kf,
                         const Scalar* gates, Scalar* scaled, const Scalar* v, Scalar beta,
                         Scalar* y, bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  using Vec = Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
  using ConstVec = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
  const Scalar qk = ordered_dot(qf, kf, r);
  Vec(scaled, r) = ConstVec(kf, r) * ConstVec(gates, r);
  Vec(qf, r) *= ConstVec(gates, r);
  RankSweep<Scalar> read;
  read.x[0] = scaled;
  read.x[1] = qf;
  read.out[0] = prediction;
  read.out[1] = y;
  rank_sweep<0, 2, RowScale::none>(S.data(), dv, r, dv, read, reverse);
  Vec u(prediction, dv), out(y, dv);
  u = beta * (ConstVec(v, dv) - u);
  out += qk * u;
  channel_delta_write(S, kf, gates, prediction, !reverse);
}

/// channel_delta_token without a read (grouped decode): p = (kf .* a) S, u = beta (v - p),
/// S = diag(a) S + kf^T u. `scaled` is r scratch. 5 r dv flops. No allocation.
template <class Scalar>
void channel_delta_absorb(RowMatrix<Scalar>& S, Scalar* prediction, const Scalar* kf,
                          const Scalar* gates, Scalar* scaled, const Scalar* v, Scalar beta,
                          bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  using ConstVec = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>(scaled, r) =
      ConstVec(kf, r) * ConstVec(gates, r);
  RankSweep<Scalar> read;
  read.x[0] = scaled;
  read.out[0] = prediction;
  rank_sweep<0, 1, RowScale::none>(S.data(), dv, r, dv, read, reverse);
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> u(prediction, dv);
  u = beta * (ConstVec(v, dv) - u);
  channel_delta_write(S, kf, gates, prediction, !reverse);
}

/// The end of the delta recurrence's pair sweep (a RankPass Finish): from the four reads of a
/// column packet, kf_t S', kf_{t+1} S', qf_t S', qf_{t+1} S', the pair's corrected values and
/// outputs (formulas at DeltaRecurrence), stored as y and as the next sweep's pending values.
template <class Scalar>
struct DeltaPairFinish {
  Scalar beta[2], alpha[2], q0k0, k1k0, q1k0, q1k1;
  const Scalar* v[2];
  Scalar* y[2];
  Scalar* pending[2];  // alpha_{t+1} u_t and u_{t+1}

  template <class Packet, int R>
  void operator()(Index column, const Packet (&read)[R], Scalar* const (&)[R]) const noexcept {
    static_assert(R == 4, "the pair sweep reads kf_t, kf_{t+1}, qf_t and qf_{t+1}");
    namespace ei = Eigen::internal;
    const auto c = [](Scalar x) { return ei::pset1<Packet>(x); };
    const Packet a0 = c(alpha[0]), a1 = c(alpha[1]);
    const Packet u0 = ei::pmul(c(beta[0]), ei::psub(ei::ploadu<Packet>(v[0] + column),
                                                    ei::pmul(a0, read[0])));
    const Packet y0 = ei::padd(ei::pmul(a0, read[2]), ei::pmul(c(q0k0), u0));
    const Packet p1 = ei::padd(ei::pmul(a0, read[1]), ei::pmul(c(k1k0), u0));
    const Packet u1 = ei::pmul(c(beta[1]), ei::psub(ei::ploadu<Packet>(v[1] + column),
                                                    ei::pmul(a1, p1)));
    const Packet w1 = ei::padd(ei::pmul(a0, read[3]), ei::pmul(c(q1k0), u0));
    const Packet y1 = ei::padd(ei::pmul(a1, w1), ei::pmul(c(q1k1), u1));
    ei::pstoreu(y[0] + column, y0);
    ei::pstoreu(y[1] + column, y1);
    ei::pstoreu(pending[0] + column, ei::pmul(a1, u0));
    ei::pstoreu(pending[1] + column, u1);
  }
};

/// The end of a one-token sweep of the delta recurrence: from kf S' and qf S',
/// u = beta (v - alpha kf S') (stored as the pending value) and y = alpha qf S' + (qf . kf) u.
template <class Scalar>
struct DeltaSingleFinish {
  Scalar beta, alpha, qk;
  const Scalar* v;
  Scalar* y;
  Scalar* pending;

  template <class Packet, int R>
  void operator()(Index column, const Packet (&read)[R], Scalar* const (&)[R]) const noexcept {
    static_assert(R == 2, "the single sweep reads kf_t and qf_t");
    namespace ei = Eigen::internal;
    const Packet a = ei::pset1<Packet>(alpha);
    const Packet u = ei::pmul(ei::pset1<Packet>(beta),
                              ei::psub(ei::ploadu<Packet>(v + column), ei::pmul(a, read[0])));
    ei::pstoreu(y + column, ei::padd(ei::pmul(a, read[1]), ei::pmul(ei::pset1<Packet>(qk), u)));
    ei::pstoreu(pending + column, u);
  }
};

/// The recurrent delta rule over a sequence, two tokens per sweep of S. The update of the
/// tokens already seen is carried (pending) into the next sweep, which applies it to each row
/// as it loads it, so S in memory lags behind until finish(). For tokens t, t+1 after S' =
/// S_{t-1} (pending applied), one sweep gives kf_t S', kf_{t+1} S', qf_t S', qf_{t+1} S', and,
/// as it stores each column packet (DeltaPairFinish),
///   u_t     = beta_t (v_t - alpha_t kf_t S')
///   y_t     = alpha_t qf_t S' + (qf_t . kf_t) u_t
///   u_{t+1} = beta_{t+1} (v_{t+1} - alpha_{t+1} (alpha_t kf_{t+1} S' + (kf_{t+1} . kf_t) u_t))
///   y_{t+1} = alpha_{t+1} (alpha_t qf_{t+1} S' + (qf_{t+1} . kf_t) u_t)
///             + (qf_{t+1} . kf_{t+1}) u_{t+1}
///   pending: S_{t+1} = alpha_t alpha_{t+1} S' + kf_t^T (alpha_{t+1} u_t) + kf_{t+1}^T u_{t+1}.
/// (A column's pending values are loaded at the start of its pass, so the pass may overwrite
/// them at its end.) Per pair: 13 r dv flops (12 for Delta), S loaded and stored once.
/// Allocates at construction only.
template <class Scalar>
class DeltaRecurrence {
 public:
  DeltaRecurrence(Index r, Index dv) : keys_(2, r), values_(2, dv) {}

  /// Tokens t, t+1 (features qf, kf of length r, values v of length dv, outputs y of length
  /// dv, contiguous; y must not overlap the inputs). `reverse` sets the sweep's direction.
  void pair(RowMatrix<Scalar>& S, const Scalar* const qf[2], const Scalar* const kf[2],
            const Scalar* const v[2], const Scalar beta[2], const Scalar alpha[2],
            Scalar* const y[2], bool reverse) {
    const Index r = S.rows(), dv = S.cols();
    RankSweep<Scalar> sweep = pending_sweep();
    const Scalar* reads[4] = {kf[0], kf[1], qf[0], qf[1]};
    for (int m = 0; m < 4; ++m) sweep.x[m] = reads[m];
    DeltaPairFinish<Scalar> finish{{beta[0], beta[1]},
                                   {alpha[0], alpha[1]},
                                   ordered_dot(qf[0], kf[0], r),
                                   ordered_dot(kf[1], kf[0], r),
                                   ordered_dot(qf[1], kf[0], r),
                                   ordered_dot(qf[1], kf[1], r),
                                   {v[0], v[1]},
                                   {y[0], y[1]},
                                   {values_.row(0).data(), values_.row(1).data()}};
    rank_sweep_with<4>(pending_, pending_scale(), S.data(), dv, r, dv, sweep, reverse, finish);
    std::copy_n(kf[0], r, keys_.row(0).data());
    std::copy_n(kf[1], r, keys_.row(1).data());
    scale_ = alpha[0] * alpha[1];
    pending_ = 2;
  }

  /// One token (the last of an odd count), as pair() for one token.
  void single(RowMatrix<Scalar>& S, const Scalar* qf, const Scalar* kf, const Scalar* v,
              Scalar beta, Scalar alpha, Scalar* y, bool reverse) {
    const Index r = S.rows(), dv = S.cols();
    RankSweep<Scalar> sweep = pending_sweep();
    sweep.x[0] = kf;
    sweep.x[1] = qf;
    // The new pending value overwrites row 0 column by column: each column pass loads its
    // part of the old pending values before it stores anything.
    const DeltaSingleFinish<Scalar> finish{beta, alpha, ordered_dot(qf, kf, r), v, y,
                                           values_.row(0).data()};
    rank_sweep_with<2>(pending_, pending_scale(), S.data(), dv, r, dv, sweep, reverse, finish);
    std::copy_n(kf, r, keys_.row(0).data());
    scale_ = alpha;
    pending_ = 1;
  }

  /// Applies the pending update, so that S holds every token seen. One sweep if any is pending.
  void finish(RowMatrix<Scalar>& S, bool reverse) noexcept {
    if (pending_ == 0) return;
    const Index r = S.rows(), dv = S.cols();
    rank_sweep_with<0>(pending_, pending_scale(), S.data(), dv, r, dv, pending_sweep(), reverse);
    pending_ = 0;
    scale_ = 1;
  }

 private:
  RowScale pending_scale() const noexcept {
    return scale_ != Scalar(1) ? RowScale::uniform : RowScale::none;
  }
  RankSweep<Scalar> pending_sweep() const noexcept {
    RankSweep<Scalar> sweep;
    sweep.scale = scale_;
    for (int u = 0; u < 2; ++u) {
      sweep.k[u] = keys_.row(u).data();
      sweep.w[u] = values_.row(u).data();
    }
    return sweep;
  }

  RowMatrix<Scalar> keys_, values_;
  int pending_ = 0;
  Scalar scale_ = 1;
};

/// The recurrent GatedDelta with per-channel gates a_t (Kimi Delta Attention), one token per
/// sweep of S with the update carried: for token t, after S' = diag(a_t) S_{t-1},
///   u_t = beta_t (v_t - kf_t S'),   y_t = qf_t S' + (qf_t . kf_t) u_t,   S_t = S' + kf_t^T u_t.
/// A sweep applies the previous token's update to each row as it loads it (scaling the row by
/// that token's gate, then the rank-one update) and reads (kf_t .* a_t) S and (qf_t .* a_t) S
/// from the updated row (DeltaSingleFinish with alpha 1). Pairing two tokens, as DeltaRecurrence
/// does, would need both tokens' gates per row in the carried update. 7 r dv flops per token,
/// S loaded and stored once per token. Allocates at construction only.
template <class Scalar>
class ChannelDeltaRecurrence {
 public:
  ChannelDeltaRecurrence(Index r, Index dv) : key_(r), value_(dv), gates_(r), scaled_(2, r) {}

  /// One token: features qf, kf and gates a (length r), value v and output y (length dv),
  /// contiguous; y must not overlap the inputs. `reverse` sets the sweep's direction.
  void token(RowMatrix<Scalar>& S, const Scalar* qf, const Scalar* kf, const Scalar* a,
             const Scalar* v, Scalar beta, Scalar* y, bool reverse) {
    const Index r = S.rows(), dv = S.cols();
    using ConstVec = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    scaled_.row(0).array() = ConstVec(kf, r) * ConstVec(a, r);
    scaled_.row(1).array() = ConstVec(qf, r) * ConstVec(a, r);
    RankSweep<Scalar> sweep = pending_sweep();
    sweep.x[0] = scaled_.row(0).data();
    sweep.x[1] = scaled_.row(1).data();
    // The new pending value overwrites the old column by column: each column pass loads its
    // part of the old one before it stores anything.
    const DeltaSingleFinish<Scalar> finish{beta, Scalar(1), ordered_dot(qf, kf, r), v, y,
                                           value_.data()};
    rank_sweep_with<2>(pending_ ? 1 : 0, pending_ ? RowScale::per_row : RowScale::none,
                       S.data(), dv, r, dv, sweep, reverse, finish);
    std::copy_n(kf, r, key_.data());
    std::copy_n(a, r, gates_.data());
    pending_ = true;
  }

  /// Applies the pending update, so that S holds every token seen. One sweep if one is pending.
  void finish(RowMatrix<Scalar>& S, bool reverse) noexcept {
    if (!pending_) return;
    const Index r = S.rows(), dv = S.cols();
    rank_sweep_with<0>(1, RowScale::per_row, S.data(), dv, r, dv, pending_sweep(), reverse);
    pending_ = false;
  }

 private:
  RankSweep<Scalar> pending_sweep() const noexcept {
    RankSweep<Scalar> sweep;
    sweep.row_scale = gates_.data();
    sweep.k[0] = key_.data();
    sweep.w[0] = value_.data();
    return sweep;
  }

  RowVector<Scalar> key_, value_, gates_;  // the pending token's kf, u and gates
  RowMatrix<Scalar> scaled_;               // kf .* a and qf .* a of the current token
  bool pending_ = false;
};

// ---- chunked ---------------------------------------------------------------------------------

/// The blocked forward substitution of a chunk's corrected values: u_i += sum_{j<i}
/// system(i, j) u_j for i < n, u the n x dv rows of `corrected` (contiguous, holding the
/// right-hand side), system's strictly lower part (row stride ld) read. Blocks of
/// delta_solve_block rows: a block against all earlier rows is one register-kernel product,
/// the block itself row by row. About n dv flops per row. No allocation.
template <class Scalar>
void substitute_corrected(Index n, Index dv, const Scalar* system, Index ld, Scalar* corrected,
                          SpreadPrefetch* prefetch) {
  for (Index b0 = 0; b0 < n; b0 += delta_solve_block) {
    const Index end = std::min(n, b0 + delta_solve_block);
    if (b0 > 0)
      rule_gemm<Scalar, true>(end - b0, dv, b0, system + b0 * ld, ld, corrected, dv,
                              corrected + b0 * dv, dv, Triangle::none, nullptr, prefetch);
    for (Index i = b0 + 1; i < end; ++i)
      accumulate_rows(corrected + i * dv, system + i * ld + b0, corrected + b0 * dv, dv, i - b0,
                      dv);
  }
}

/// A causal chunk of the (gated) delta rule by the WY / UT form (Yang et al. 2024). With
/// D(i, j) = alpha_{j+1} ... alpha_i, D(i, -1) = alpha_0 ... alpha_i (all 1 for Delta), the
/// corrected values u_i = beta_i (v_i - alpha_i kf_i S_{i-1}) solve the unit lower-triangular
/// system
///   u_i + beta_i sum_{j<i} D(i, j) (kf_i . kf_j) u_j = beta_i v_i - beta_i D(i, -1) kf_i S,
/// (the right-hand side beta_i (v_i - g_i) from the decayed state reads g_i = D(i, -1) kf_i S),
/// solved by blocks of delta_solve_block rows (a block against all earlier rows is one product
/// on the register kernel; inside a block, row by row). Then
///   out_i = D(i, -1) qf_i S + sum_{j<=i} D(i, j) (qf_i . kf_j) u_j,
///   S <- D(n-1, -1) S + sum_j D(n-1, j) kf_j^T u_j.
/// Per token: 6 r dv flops against S plus about C (r + dv) (scores and kf kf^T, masked halves
/// skipped) and about C dv (the solve); 1 exp (GatedDelta).
///
/// Use: construct once per call; per chunk prepare() (needs the state before the chunk), then
/// read() per query head (each gets a single-head call's bits), then absorb(). Pointers given to
/// prepare() must stay valid until absorb(). No allocation after construction.
template <class Scalar>
class DeltaChunk {
 public:
  /// The next chunk's rows, advanced by the chunk's products (null: none; see SpreadPrefetch).
  SpreadPrefetch* prefetch = nullptr;

  DeltaChunk(Index C, Index r, Index dv)
      : r_(r), dv_(dv), ld_(padded_columns<Scalar>(C)),
        kf_t_(RowMatrix<Scalar>::Zero(r, ld_)), kw_t_(r, ld_),
        decay_(RowMatrix<Scalar>::Zero(C, ld_)), system_(RowMatrix<Scalar>::Zero(C, ld_)),
        scores_(RowMatrix<Scalar>::Zero(C, ld_)), corrected_(C, dv), reads_(C, dv), gate_(C),
        decay_in_(C), weight_out_(C) {}

  /// As ScalarGatedChunk::reuse (gated_kernels.hpp).
  [[nodiscard]] bool reuse(Index C, Index r, Index dv, bool one_chunk) {
    if (r != r_ || dv != dv_ || !(C == chunk_rows() || (one_chunk && C < chunk_rows()))) return false;
    for (auto* m : {&kf_t_, &decay_, &system_, &scores_}) m->setZero();
    return true;
  }
  /// The rows of a chunk this kernel takes.
  [[nodiscard]] Index chunk_rows() const noexcept { return gate_.size(); }
  /// Scalars held by its buffers.
  [[nodiscard]] Index scalars() const noexcept {
    Index n = gate_.size() + decay_in_.size() + weight_out_.size();
    for (const auto* m : {&kf_t_, &kw_t_, &decay_, &system_, &scores_, &corrected_, &reads_})
      n += m->size();
    return n;
  }

  /// The key side of n tokens from state S: kf (n x r, row stride ld_kf), v (n x dv, row stride
  /// ld_v), beta[t] and, for GatedDelta, log_alpha[t] (t < n; log_alpha.data null for Delta).
  void prepare(Index n, const Scalar* kf, Index ld_kf, const Scalar* v, Index ld_v,
               TokenValues<Scalar> beta, TokenValues<Scalar> log_alpha,
               const RowMatrix<Scalar>& S) {
    n_ = n;
    gated_ = log_alpha.data != nullptr;
    if (n == 0) return;
    const Index r = r_, dv = dv_, n_padded = padded_columns<Scalar>(n);
    if (gated_) {
      for (Index t = 0; t < n; ++t) gate_(t) = std::exp(log_alpha[t]);
      decay_in_(0) = gate_(0);
      for (Index i = 1; i < n; ++i) decay_in_(i) = decay_in_(i - 1) * gate_(i);
      weight_out_(n - 1) = 1;
      for (Index j = n - 2; j >= 0; --j) weight_out_(j) = weight_out_(j + 1) * gate_(j + 1);
      decay_(0, 0) = 1;
      for (Index i = 1; i < n; ++i) {
        decay_.row(i).head(i) = decay_.row(i - 1).head(i) * gate_(i);
        decay_(i, i) = 1;
      }
    }
    transpose_into(n, r, kf, ld_kf, kf_t_.data(), ld_);
    // The system's strictly lower part, negated: system(i, j) = -beta_i D(i, j) (kf_i . kf_j).
    rule_gemm<Scalar, false>(n, n_padded, r, kf, ld_kf, kf_t_.data(), ld_, system_.data(), ld_,
                             Triangle::lower_result, nullptr, prefetch);
    for (Index i = 1; i < n; ++i) {
      auto row = system_.row(i).head(i).array();
      if (gated_) row *= decay_.row(i).head(i).array();
      row *= -beta[i];
    }
    // Right-hand side beta_i (v_i - g_i) with the decayed state reads g_i = D(i, -1) kf_i S (a
    // row-scaled product, kept: the backward reads them, see DeltaSavedStates).
    rule_gemm<Scalar, false>(n, dv, r, kf, ld_kf, S.data(), dv, reads_.data(), dv,
                             Triangle::none, gated_ ? decay_in_.data() : nullptr, prefetch);
    using Row = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    for (Index i = 0; i < n; ++i)
      corrected_.row(i).array() = beta[i] * (Row(v + i * ld_v, dv) - reads_.row(i).array());
    substitute_corrected(n, dv, system_.data(), ld_, corrected_.data(), prefetch);
    if (gated_)
      for (Index m = 0; m < r; ++m)
        kw_t_.row(m).head(n) = kf_t_.row(m).head(n).cwiseProduct(weight_out_.head(n).transpose());
  }

  /// One query head: out (n x dv, row stride ld_out) from qf (n x r, row stride ld_qf) and the
  /// state before the chunk (the S given to prepare()).
  void read(const Scalar* qf, Index ld_qf, const RowMatrix<Scalar>& S, Scalar* out,
            Index ld_out) {
    const Index n = n_;
    if (n == 0) return;
    rule_gemm<Scalar, false>(n, padded_columns<Scalar>(n), r_, qf, ld_qf, kf_t_.data(), ld_,
                             scores_.data(), ld_, Triangle::lower_result, nullptr, prefetch);
    for (Index i = 0; i < n; ++i) {
      if (gated_) scores_.row(i).head(i + 1).array() *= decay_.row(i).head(i + 1).array();
      scores_.row(i).segment(i + 1, n - i - 1).setZero();
    }
    rule_gemm<Scalar, false>(n, dv_, r_, qf, ld_qf, S.data(), dv_, out, ld_out, Triangle::none,
                             gated_ ? decay_in_.data() : nullptr, prefetch);
    rule_gemm<Scalar, true>(n, dv_, n, scores_.data(), ld_, corrected_.data(), dv_, out, ld_out,
                            Triangle::lower_lhs, nullptr, prefetch);
  }

  /// The prepared chunk's rows, its corrected values u_i (rows() x dv, row-major, contiguous)
  /// and its decayed state reads g_i = D(i, -1) kf_i S (likewise), valid until the next prepare().
  [[nodiscard]] Index rows() const noexcept { return n_; }
  [[nodiscard]] const Scalar* corrected() const noexcept { return corrected_.data(); }
  [[nodiscard]] const Scalar* state_reads() const noexcept { return reads_.data(); }

  /// The state absorbs the prepared chunk: S = D(n-1, -1) S + sum_j D(n-1, j) kf_j^T u_j.
  void absorb(RowMatrix<Scalar>& S) {
    const Index n = n_;
    if (n == 0) return;
    if (gated_) S *= decay_in_(n - 1);
    rule_gemm<Scalar, true>(r_, dv_, n, gated_ ? kw_t_.data() : kf_t_.data(), ld_,
                            corrected_.data(), dv_, S.data(), dv_, Triangle::none, nullptr,
                            prefetch);
  }

 private:
  Index r_, dv_, ld_;
  RowMatrix<Scalar> kf_t_, kw_t_, decay_, system_, scores_, corrected_, reads_;
  ColVector<Scalar> gate_, decay_in_, weight_out_;
  Index n_ = 0;
  bool gated_ = false;
};

/// A causal chunk of GatedDelta with per-channel gates (Kimi Delta Attention, Kimi Team 2025):
/// S_t = diag(a_t) S_{t-1} + kf_t^T u_t with u_t = beta_t (v_t - kf_t diag(a_t) S_{t-1}). With
/// D_m(i, j) = a_{j+1,m} ... a_{i,m} (1 for j = i) and D_m(i, -1) = a_{0,m} ... a_{i,m}, the
/// corrected values solve the unit lower-triangular system
///   u_i + beta_i sum_{j<i} (sum_m kf_im kf_jm D_m(i, j)) u_j = beta_i (v_i - (kf_i .* D(i, -1)) S)
/// and then, as for per-channel Gated with the values u,
///   out_i = (qf_i .* D(i, -1)) S + sum_{j<=i} (sum_m qf_im kf_jm D_m(i, j)) u_j,
///   S <- diag(D(n-1, -1)) S + sum_j (kf_j .* D(n-1, j))^T u_j.
/// The decayed pairwise products, for the keys (the system) as for the queries, come from
/// ChannelGatedChunk's sub-chunk form (every factor <= 1, nothing overflows); the solve is
/// DeltaChunk's. Per token: the per-channel gated chunk's cost twice for the scores (keys and
/// queries), the 6 r dv of DeltaChunk against S, and about C dv for the solve; r exps. Use as
/// DeltaChunk (prepare, read per head, absorb); no allocation after construction.
template <class Scalar>
class ChannelDeltaChunk {
 public:
  /// The next chunk's rows, advanced by the chunk's products (null: none; see SpreadPrefetch).
  SpreadPrefetch* prefetch = nullptr;

  ChannelDeltaChunk(Index C, Index r, Index dv)
      : gated_(C, r, dv), r_(r), dv_(dv), ld_(padded_columns<Scalar>(C)),
        system_(RowMatrix<Scalar>::Zero(C, ld_)), corrected_(C, dv) {}

  /// As DeltaChunk::reuse.
  [[nodiscard]] bool reuse(Index C, Index r, Index dv, bool one_chunk) {
    if (!gated_.reuse(C, r, dv, one_chunk)) return false;
    system_.setZero();
    return true;
  }
  /// The rows of a chunk this kernel takes.
  [[nodiscard]] Index chunk_rows() const noexcept { return corrected_.rows(); }
  /// Scalars held by its buffers.
  [[nodiscard]] Index scalars() const noexcept {
    return gated_.scalars() + system_.size() + corrected_.size();
  }
  /// Scalars the constructor allocates for chunks of C rows.
  [[nodiscard]] static Index scalars_for(Index C, Index r, Index dv) noexcept {
    return ChannelGatedChunk<Scalar>::scalars_for(C, r, dv) + C * padded_columns<Scalar>(C) +
           C * dv;
  }

  /// The key side of n tokens from state S: kf (n x r, row stride ld_kf), v (n x dv, row stride
  /// ld_v), beta[t] and the log-gates, r per token (log_alpha[t], t < n).
  void prepare(Index n, const Scalar* kf, Index ld_kf, const Scalar* v, Index ld_v,
               TokenValues<Scalar> beta, TokenRows<Scalar> log_alpha, const RowMatrix<Scalar>& S) {
    n_ = n;
    gated_.prefetch = prefetch;
    // The gated chunk's values are the corrected values, filled below before any read.
    gated_.prepare(n, kf, ld_kf, corrected_.data(), dv_, log_alpha);
    if (n == 0) return;
    // The keys against the earlier keys: system(i, j) = -beta_i (decayed kf_i . kf_j), j < i.
    gated_.score(kf, ld_kf);
    const Scalar* scores = gated_.scores();
    const Index ld_s = gated_.score_stride();
    using Row = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    for (Index i = 1; i < n; ++i)
      system_.row(i).head(i).array() = -beta[i] * Row(scores + i * ld_s, i);
    // Right-hand side beta_i (v_i - (kf_i .* D(i, -1)) S), the state reads formed in place.
    rule_gemm<Scalar, false>(n, dv_, r_, gated_.state_rows(), r_, S.data(), dv_,
                             corrected_.data(), dv_, Triangle::none, nullptr, prefetch);
    for (Index i = 0; i < n; ++i)
      corrected_.row(i).array() = beta[i] * (Row(v + i * ld_v, dv_) - corrected_.row(i).array());
    substitute_corrected(n, dv_, system_.data(), ld_, corrected_.data(), prefetch);
  }

  /// One query head: out (n x dv, row stride ld_out) from qf (n x r, row stride ld_qf) and the
  /// state before the chunk (the S given to prepare()).
  void read(const Scalar* qf, Index ld_qf, const RowMatrix<Scalar>& S, Scalar* out,
            Index ld_out) {
    gated_.read(qf, ld_qf, S, no_normalizer_, out, ld_out, Normalization::unnormalized(), 0);
  }

  /// The state absorbs the prepared chunk.
  void absorb(RowMatrix<Scalar>& S) { gated_.absorb(S, no_normalizer_); }

 private:
  ChannelGatedChunk<Scalar> gated_;
  Index r_, dv_, ld_;
  RowMatrix<Scalar> system_, corrected_;
  ColVector<Scalar> no_normalizer_;  // empty: the delta rules keep no z
  Index n_ = 0;
};

}  // namespace linattn::detail
