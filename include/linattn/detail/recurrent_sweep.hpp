#pragma once
// The tuned recurrent kernels: one sweep over S applies the state updates of one or two tokens
// and accumulates their reads (the fused sweep), or only reads S (the read of a deferred
// decode step, detail/deferred.hpp), with the accumulators held in SIMD registers.

#include <linattn/errors.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <linattn/detail/prefetch.hpp>

#include <algorithm>

namespace linattn::detail {

/// Eigen's widest SIMD packet for Scalar in this build (SSE, AVX or AVX-512 as compiled), or
/// Scalar itself for a type Eigen does not vectorize (then every "packet" is one scalar and the
/// kernels below are plain loops).
template <class Scalar>
using SweepPacket = typename Eigen::internal::packet_traits<Scalar>::type;

template <class Scalar>
inline constexpr int sweep_packet_size = Eigen::internal::unpacket_traits<SweepPacket<Scalar>>::size;

/// Packets of columns per pass of a sweep that carries `Tokens` tokens. Each pass holds, per
/// packet, one row value plus one value slice and one accumulator per token, plus two
/// broadcasts per token: 4 packets need 14 registers for one token and 24 for two, which fits
/// the 32 of AVX-512; with 16 registers (SSE, AVX) two tokens take 2 packets. Four
/// accumulators also give four independent FMA chains, which hides most of the FMA latency.
template <int Tokens>
inline constexpr int sweep_packets =
    (Tokens == 1 || EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32) ? 4 : 2;

/// Columns of S per pass of a one-token sweep (64 floats with AVX-512). Value widths that are
/// not a multiple of it are covered by a narrower pass of whole packets and, for the last
/// dv % packet size columns, a scalar pass.
template <class Scalar>
inline constexpr int sweep_width = sweep_packet_size<Scalar> * sweep_packets<1>;

/// What a sweep needs of one token: features (length r), value and output (length dv), all
/// contiguous, and the divisor of the read (used when the sweep is asked to divide).
/// A read may also add tokens that S does not hold yet (a deferred decode step's pending
/// block): y += sum over j < pending_count of pending_scores[j] * (row j of pending_values,
/// row stride pending_ld), after the sum over S, in order of j.
template <class Scalar>
struct SweepToken {
  const Scalar* qf;
  const Scalar* kf;
  const Scalar* v;
  Scalar* y;
  Scalar divisor;
  const Scalar* pending_scores = nullptr;
  const Scalar* pending_values = nullptr;
  Index pending_ld = 0;
  Index pending_count = 0;
};

/// A sweep splits the rows of S into this many chunks of consecutive rows. The read of a
/// column is summed upwards within each chunk, and the chunk sums are added in chunk order at
/// the end: the result does not depend on the order in which a sweep visits the chunks, so
/// sweeps can alternate their order freely (see sweep_tokens) and every path gives the same
/// bits. Four chunks per column pass make the reversed order close enough to an exact
/// reverse for L1 reuse: a one-token sweep over r = dv = 128 floats ran about 1.2x faster
/// than with two chunks (decode rows of bench_paths on a 48 KiB-L1 Sapphire Rapids VM);
/// eight gained nothing more.
inline constexpr int sweep_chunks = 4;

/// First row of chunk `c` (0 <= c <= sweep_chunks) of r rows.
constexpr Index sweep_chunk_begin(Index r, int c) noexcept { return r * c / sweep_chunks; }

/// One pass over columns [c0, c0 + Packets * packet size) of all rows of S, for `Tokens`
/// tokens in order: for each row i, S_i += kf_i v (token 0), acc_0 += qf_i S_i, S_i += kf_i v
/// (token 1), acc_1 += qf_i S_i. Each token reads the state including itself, exactly as
/// one token per sweep would, and each row is loaded and stored once for all tokens. Without
/// `Update` the pass only reads (acc += qf_i S_i; S is neither changed nor stored, kf and v
/// are not used). The register arrays are indexed by compile-time constants only (loops fully
/// unrolled), so the compiler keeps them in registers. `chunks_reversed` visits the row chunks
/// last to first (rows within a chunk always go upwards).
template <int Tokens, int Packets, bool Update, class Scalar>
void sweep_packet_columns(Scalar* S, Index ld, Index r, Index c0, const SweepToken<Scalar>* tokens,
                          bool divide, bool chunks_reversed) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  // Local copies: Eigen's unaligned stores may alias anything, so fields read through
  // `tokens` would be reloaded after every store.
  const Scalar* kf[Tokens];
  const Scalar* qf[Tokens];
  Packet v[Tokens][Packets], acc[Tokens][Packets];
  Packet chunk_sum[sweep_chunks][Tokens][Packets];  // per chunk, in memory: used once at the end
#pragma GCC unroll 4
  for (int j = 0; j < Tokens; ++j) {
    kf[j] = tokens[j].kf;
    qf[j] = tokens[j].qf;
    if constexpr (Update) {
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p) v[j][p] = ei::ploadu<Packet>(tokens[j].v + c0 + p * N);
    }
  }
  const auto rows = [&](Index begin, Index end) {
#pragma GCC unroll 4
    for (int j = 0; j < Tokens; ++j) {
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p) acc[j][p] = ei::pset1<Packet>(Scalar(0));
    }
    for (Index i = begin; i < end; ++i) {
      Scalar* s_row = S + i * ld + c0;
      Packet s[Packets];
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p) s[p] = ei::ploadu<Packet>(s_row + p * N);
#pragma GCC unroll 4
      for (int j = 0; j < Tokens; ++j) {
        const Packet q = ei::pset1<Packet>(qf[j][i]);
        if constexpr (Update) {
          const Packet k = ei::pset1<Packet>(kf[j][i]);
#pragma GCC unroll 8
          for (int p = 0; p < Packets; ++p) s[p] = ei::pmadd(k, v[j][p], s[p]);
        }
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) acc[j][p] = ei::pmadd(q, s[p], acc[j][p]);
      }
      if constexpr (Update) {
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) ei::pstoreu(s_row + p * N, s[p]);
      }
    }
  };
  for (int n = 0; n < sweep_chunks; ++n) {
    const int c = chunks_reversed ? sweep_chunks - 1 - n : n;
    rows(sweep_chunk_begin(r, c), sweep_chunk_begin(r, c + 1));
#pragma GCC unroll 4
    for (int j = 0; j < Tokens; ++j) {
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p) chunk_sum[c][j][p] = acc[j][p];
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < Tokens; ++j) {
    Packet sum[Packets];
#pragma GCC unroll 8
    for (int p = 0; p < Packets; ++p) {
      sum[p] = chunk_sum[0][j][p];
      for (int c = 1; c < sweep_chunks; ++c) sum[p] = ei::padd(sum[p], chunk_sum[c][j][p]);
    }
    // Pending tokens outside, packets inside: Packets independent FMA chains.
    for (Index m = 0; m < tokens[j].pending_count; ++m) {
      const Packet score = ei::pset1<Packet>(tokens[j].pending_scores[m]);
      const Scalar* value = tokens[j].pending_values + m * tokens[j].pending_ld + c0;
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p)
        sum[p] = ei::pmadd(score, ei::ploadu<Packet>(value + p * N), sum[p]);
    }
    const Packet divisor = ei::pset1<Packet>(tokens[j].divisor);
#pragma GCC unroll 8
    for (int p = 0; p < Packets; ++p)
      ei::pstoreu(tokens[j].y + c0 + p * N, divide ? ei::pdiv(sum[p], divisor) : sum[p]);
  }
}

/// The same for the last w < packet size columns, one scalar at a time (capacity fixed, so
/// nothing is allocated). Scalar arithmetic in the same order as the packet pass.
template <int Tokens, bool Update, class Scalar>
void sweep_scalar_columns(Scalar* S, Index ld, Index r, Index c0, Index w,
                          const SweepToken<Scalar>* tokens, bool divide,
                          bool chunks_reversed) noexcept {
  namespace ei = Eigen::internal;
  constexpr int Cap = std::max(1, sweep_packet_size<Scalar> - 1);
  Scalar v[Tokens][Cap]{}, acc[Tokens][Cap]{}, chunk_sum[sweep_chunks][Tokens][Cap]{};
  if constexpr (Update)
    for (int j = 0; j < Tokens; ++j)
      for (Index c = 0; c < w; ++c) v[j][c] = tokens[j].v[c0 + c];
  const auto rows = [&](Index begin, Index end) {
    for (int j = 0; j < Tokens; ++j)
      for (Index c = 0; c < w; ++c) acc[j][c] = Scalar(0);
    for (Index i = begin; i < end; ++i) {
      Scalar* s_row = S + i * ld + c0;
      for (Index c = 0; c < w; ++c) {
        Scalar s = s_row[c];
        for (int j = 0; j < Tokens; ++j) {
          if constexpr (Update) s = ei::pmadd(tokens[j].kf[i], v[j][c], s);
          acc[j][c] = ei::pmadd(tokens[j].qf[i], s, acc[j][c]);
        }
        if constexpr (Update) s_row[c] = s;
      }
    }
  };
  for (int n = 0; n < sweep_chunks; ++n) {
    const int k = chunks_reversed ? sweep_chunks - 1 - n : n;
    rows(sweep_chunk_begin(r, k), sweep_chunk_begin(r, k + 1));
    for (int j = 0; j < Tokens; ++j)
      for (Index c = 0; c < w; ++c) chunk_sum[k][j][c] = acc[j][c];
  }
  for (int j = 0; j < Tokens; ++j)
    for (Index c = 0; c < w; ++c) {
      Scalar sum = chunk_sum[0][j][c];
      for (int k = 1; k < sweep_chunks; ++k) sum += chunk_sum[k][j][c];
      for (Index m = 0; m < tokens[j].pending_count; ++m)
        sum = ei::pmadd(tokens[j].pending_scores[m],
                        tokens[j].pending_values[m * tokens[j].pending_ld + c0 + c], sum);
      tokens[j].y[c0 + c] = divide ? sum / tokens[j].divisor : sum;
    }
}

/// A pass of `packets` (1 <= packets <= Max) whole packets: dispatches to the unrolled kernel
/// of that width.
template <int Tokens, int Max, bool Update, class Scalar>
void sweep_packet_columns_upto(int packets, Scalar* S, Index ld, Index r, Index c0,
                               const SweepToken<Scalar>* tokens, bool divide,
                               bool chunks_reversed) noexcept {
  if constexpr (Max > 0) {
    if (packets == Max)
      sweep_packet_columns<Tokens, Max, Update>(S, ld, r, c0, tokens, divide, chunks_reversed);
    else
      sweep_packet_columns_upto<Tokens, Max - 1, Update>(packets, S, ld, r, c0, tokens, divide,
                                                         chunks_reversed);
  }
}

/// For each of `Tokens` tokens in order: S += kf^T v, then y = qf S with the updated S,
/// divided by the token's divisor if `divide`. S is r x dv with row stride ld. Each element of
/// S is loaded and stored once per sweep; 4 r dv flops per token.
///
/// `reverse` walks the sweep backwards: column passes from the right, row chunks from the
/// last. Alternating it between sweeps makes the start of one sweep reuse what the end of the
/// previous one left in L1: when S is larger than L1 (r = dv = 128 in float is 64 KiB), a
/// same-order sweep misses L1 on every line (LRU evicts each line just before it is needed
/// again), while alternating keeps most of L1 useful. The order changes no result (see
/// sweep_chunks), and each column's arithmetic is the same however the columns are grouped
/// into passes, so one token gives the same bits alone or paired. Without `Update` the sweep
/// reads S only (y = qf S plus the token's pending block), for one token: 2 r dv flops, S
/// loaded once and never stored.
template <int Tokens, class Scalar, bool Update = true>
void sweep_tokens(Scalar* S, Index ld, Index r, Index dv, const SweepToken<Scalar>* tokens,
                  bool divide, bool reverse) noexcept {
  constexpr int N = sweep_packet_size<Scalar>;
  constexpr int P = sweep_packets<Tokens>;
  constexpr Index W = Index{N} * P;
  const Index packet_columns = dv - dv % N;
  const Index full = packet_columns - packet_columns % W;  // end of the full-width passes
  const int partial_packets = static_cast<int>((packet_columns - full) / N);
  const auto partial = [&] {
    if (partial_packets > 0)
      sweep_packet_columns_upto<Tokens, P - 1, Update>(partial_packets, S, ld, r, full, tokens,
                                                       divide, reverse);
  };
  const auto tail = [&] {
    if (packet_columns < dv)
      sweep_scalar_columns<Tokens, Update>(S, ld, r, packet_columns, dv - packet_columns, tokens,
                                           divide, reverse);
  };
  if (!reverse) {
    for (Index c0 = 0; c0 < full; c0 += W)
      sweep_packet_columns<Tokens, P, Update>(S, ld, r, c0, tokens, divide, false);
    partial();
    tail();
  } else {
    tail();
    partial();
    for (Index c0 = full - W; c0 >= 0; c0 -= W)
      sweep_packet_columns<Tokens, P, Update>(S, ld, r, c0, tokens, divide, true);
  }
}

/// S += kf^T v and y = qf S (the updated S) in one pass, for one token; see sweep_tokens.
template <class Scalar>
void update_and_read(Scalar* S, Index ld, Index r, Index dv, const Scalar* qf, const Scalar* kf,
                     const Scalar* v, Scalar* y, bool reverse) noexcept {
  const SweepToken<Scalar> token{qf, kf, v, y, Scalar(1)};
  sweep_tokens<1>(S, ld, r, dv, &token, false, reverse);
}

/// a . b in a fixed order: packets from index 0 into two accumulators, then the scalar tail.
/// The result depends on the values only, not on where the vectors lie in memory.
template <class Scalar>
Scalar ordered_dot(const Scalar* a, const Scalar* b, Index n) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  Packet acc0 = ei::pset1<Packet>(Scalar(0)), acc1 = acc0;
  Index i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    acc0 = ei::pmadd(ei::ploadu<Packet>(a + i), ei::ploadu<Packet>(b + i), acc0);
    acc1 = ei::pmadd(ei::ploadu<Packet>(a + i + N), ei::ploadu<Packet>(b + i + N), acc1);
  }
  if (i + N <= n) {
    acc0 = ei::pmadd(ei::ploadu<Packet>(a + i), ei::ploadu<Packet>(b + i), acc0);
    i += N;
  }
  Scalar sum = ei::predux(ei::padd(acc0, acc1));
  for (; i < n; ++i) sum = ei::pmadd(a[i], b[i], sum);
  return sum;
}

/// z_out = z + kf and returns qf . z_out (the denominator of the token's read) by ordered_dot,
/// so a read of the state after an absorb (LinearAttention::read_into) gets the same bits.
/// z_out must not overlap the inputs.
template <class Scalar>
Scalar add_keys_and_dot(const Scalar* z, const Scalar* kf, const Scalar* qf, Scalar* z_out,
                        Index r) noexcept {
  using Vec = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>(z_out, r) = Vec(z, r) + Vec(kf, r);
  return ordered_dot(qf, z_out, r);
}


/// One recurrent token on features: z_next = z + kf, divisor from qf . z_next (checked
/// before anything changes, so a DenominatorError leaves S, z and `tokens` as they were), then
/// the fused sweep, which also divides y. `qf`, `kf` (length r), `v`, `y` (length dv) are
/// contiguous; `z_next` is r scratch. The sweep direction follows `tokens`, the position of
/// this token. No allocation.
template <class Scalar>
void recurrent_token_fused(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                           const Scalar* qf, const Scalar* kf, const Scalar* v, Scalar* y,
                           const Normalization& norm, Index row, Index& tokens) {
  const Index r = S.rows(), dv = S.cols();
  const Scalar den = add_keys_and_dot(z.data(), kf, qf, z_next.data(), r);
  const SweepToken<Scalar> token{qf, kf, v, y, norm.divisor(den, row)};
  // Alternate per token (see sweep_tokens); the parity of the position keeps it reproducible.
  sweep_tokens<1>(S.data(), dv, r, dv, &token, norm.divides(), tokens % 2 != 0);
  z.swap(z_next);
  ++tokens;
}

/// Two consecutive recurrent tokens (rows `row` and row + 1, positions tokens and tokens + 1)
/// in one sweep over S, with the same results as two calls of recurrent_token_fused. Both
/// denominators are computed and checked before S or z change. If the first is rejected,
/// nothing changes; if only the second is, the first token is absorbed alone (its y written,
/// `tokens` advanced by one) and the second's DenominatorError propagates. `z_mid`, `z_next`
/// are r scratch each.
template <class Scalar>
void recurrent_token_pair(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_mid,
                          ColVector<Scalar>& z_next, const Scalar* const qf[2],
                          const Scalar* const kf[2], const Scalar* const v[2], Scalar* const y[2],
                          const Normalization& norm, Index row, Index& tokens) {
  const Index r = S.rows(), dv = S.cols();
  const Scalar den0 = add_keys_and_dot(z.data(), kf[0], qf[0], z_mid.data(), r);
  const Scalar den1 = add_keys_and_dot(z_mid.data(), kf[1], qf[1], z_next.data(), r);
  const bool divide = norm.divides();
  const bool reverse = (tokens / 2) % 2 != 0;  // alternate per pair sweep
  SweepToken<Scalar> pair[2] = {{qf[0], kf[0], v[0], y[0], norm.divisor(den0, row)},
                                {qf[1], kf[1], v[1], y[1], Scalar(1)}};
  try {
    pair[1].divisor = norm.divisor(den1, row + 1);
  } catch (const DenominatorError&) {
    sweep_tokens<1>(S.data(), dv, r, dv, &pair[0], divide, reverse);
    z.swap(z_mid);
    ++tokens;
    throw;
  }
  sweep_tokens<2>(S.data(), dv, r, dv, pair, divide, reverse);
  z.swap(z_next);
  tokens += 2;
}

}  // namespace linattn::detail
