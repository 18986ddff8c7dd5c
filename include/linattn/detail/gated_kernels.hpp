#pragma once
// Kernels of the decayed and gated write rules (Decay; Gated with one gate per token or one per
// feature channel), on the additive path's register kernel and packet sweep:
//
//   S_t = diag(g_t) S_{t-1} + kf_t^T v_t,   z_t = g_t .* z_{t-1} + kf_t,   y_t = qf_t S_t / den
//
// Chunked (ScalarGatedChunk, ChannelGatedChunk): prepare() the key side of a chunk once, read()
// it for every query head that shares the state, absorb() it into (S, z). Recurrent:
// GatedRecurrence sweeps S once per two tokens with the additive sweep's arithmetic (S kept
// scaled by the gates' running product); gated_token (decode) scales each row as it loads it,
// updates and reads in one sweep; gated_absorb updates without a read for grouped decode, whose
// heads then read with the additive read-only sweep (recurrent_sweep.hpp).
//
// Cost per token next to Additive's (r features, dv values, chunk C, float; flops, and bytes
// of S moved between cache and registers; all of them also read the token's q, k, v rows and
// write its output, as Additive does, plus the gates: 4 bytes, or 4 r per channel):
//   Additive chunk        4 r dv + C (r + dv)                        12 r dv / C
//   scalar-gated chunk    + 3 C / 2 (decays D, the mask) + r dv / C  20 r dv / C (S scaled)
//                         + about 6 r; 1 exp
//   per-channel chunk     + c r / 2 (diagonal c x c sub-blocks, c =  20 r dv / C
//                         16) + r dv / C + about 20 r; r exps
//   Additive recurrent    4 r dv                                     4 r dv (S loaded and
//                                                                    stored once per 2 tokens)
//   gated recurrent       4 r dv (+ r dv when settling) + 6 to 12 r  4 r dv
//   gated_token (decode)  5 r dv                                     8 r dv (Additive's fused
//                                                                    step: 4 r dv, 8 r dv)
//
// Every decay is a product of gates g = exp(log_g) <= 1 (each within one rounding,
// gates_from_logs) multiplied one by one, as the recurrent path forms it: the only exponentials
// are of the log-gates, and nothing is a quotient of cumulative products, so nothing overflows
// for any gate strength (products underflow to 0 only where the true weight is below the
// smallest normal number). The weight of token j at row i carries the rounding of its m = i - j
// gates and at most m multiplications, the recurrent path's error.

#include <linattn/detail/chunked.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace linattn::detail {

/// Rows per sub-chunk of the per-channel gated chunk: 16, or the register kernel's packet width
/// if wider (the score columns of a sub-chunk row are whole packets). The diagonal sub-blocks
/// cost about 3 c r / 2 flops per token; the products of the others do not depend on c, but
/// their row tiles do (8 rows ran no faster at d = 64 and slower at d = 128 on Zen 3).
template <class Scalar>
inline constexpr Index gate_subchunk = std::max<Index>(16, GemmTile<Scalar>::lanes);

// ---- recurrent -------------------------------------------------------------------------------

/// One token of a gated kernel: features (length r), value and output (length dv), and the
/// gates: per channel (length r), or one `gate` for every channel when `gates` is null.
template <class Scalar>
struct GatedToken {
  const Scalar* qf = nullptr;
  const Scalar* kf = nullptr;
  const Scalar* v = nullptr;
  const Scalar* gates = nullptr;
  Scalar gate = 1;
  Scalar* y = nullptr;
};

/// One sweep of the gated kernels over S. For each row i and each of `Steps` tokens u in order:
///   S_i = s_u S_i + k_u[i] (w_scale[u] w_u)   (s_u = scale[u], or row_scale[u][i]; only for
///                                              the first ScaledSteps steps, else no multiply)
///   acc_u += x_u[i] S_i                        (with Read: the row after token u)
/// and each read is stored as out_u = read_scale[u] acc_u, divided by divisor[u] if `divide`.
/// k, x: length r; w, out: length dv, contiguous.
template <class Scalar>
struct GatedSweep {
  const Scalar* row_scale[2] = {nullptr, nullptr};
  Scalar scale[2] = {1, 1};
  const Scalar* k[2] = {nullptr, nullptr};
  const Scalar* w[2] = {nullptr, nullptr};
  Scalar w_scale[2] = {1, 1};
  const Scalar* x[2] = {nullptr, nullptr};
  Scalar* out[2] = {nullptr, nullptr};
  Scalar read_scale[2] = {1, 1};
  Scalar divisor[2] = {1, 1};
  bool divide = false;
};

/// One column pass of gated_sweep.
template <int Steps, RowScale Scale, int ScaledSteps, bool Read, class Scalar>
struct GatedPass {
  Scalar* S;
  Index ld, r;
  const GatedSweep<Scalar>* sweep;
  bool chunks_reversed;

  template <class Packet, int Packets>
  void operator()(Index c0) const noexcept {
    namespace ei = Eigen::internal;
    constexpr int N = packet_size<Packet>;
    // Local copies: stores through S may alias anything, so fields read through `sweep` would
    // be reloaded after every store.
    const Scalar* k[Steps];
    const Scalar* x[Steps];
    const Scalar* row_scale[Steps];
    Packet w[Steps][Packets], scale[Steps], acc[Steps][Packets];
    Packet chunk_sum[sweep_chunks][Steps][Packets];
#pragma GCC unroll 2
    for (int u = 0; u < Steps; ++u) {
      k[u] = sweep->k[u];
      x[u] = sweep->x[u];
      row_scale[u] = sweep->row_scale[u];
      scale[u] = ei::pset1<Packet>(sweep->scale[u]);
      const Packet ws = ei::pset1<Packet>(sweep->w_scale[u]);
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p)
        w[u][p] = ei::pmul(ws, ei::ploadu<Packet>(sweep->w[u] + c0 + p * N));
    }
    Scalar* const base = S + c0;
    const Index stride = ld;
    const auto rows = [&](Index begin, Index end) {
      if constexpr (Read) {
#pragma GCC unroll 2
        for (int u = 0; u < Steps; ++u)
#pragma GCC unroll 8
          for (int p = 0; p < Packets; ++p) acc[u][p] = ei::pset1<Packet>(Scalar(0));
      }
      Scalar* s_row = base + begin * stride;
      for (Index i = begin; i < end; ++i, s_row += stride) {
        Packet s[Packets];
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) s[p] = ei::ploadu<Packet>(s_row + p * N);
#pragma GCC unroll 2
        for (int u = 0; u < Steps; ++u) {
          const Packet ku = ei::pset1<Packet>(k[u][i]);
          if (u < ScaledSteps) {
            const Packet su = Scale == RowScale::per_row ? ei::pset1<Packet>(row_scale[u][i])
                                                         : scale[u];
#pragma GCC unroll 8
            for (int p = 0; p < Packets; ++p) s[p] = ei::pmadd(ku, w[u][p], ei::pmul(su, s[p]));
          } else {
#pragma GCC unroll 8
            for (int p = 0; p < Packets; ++p) s[p] = ei::pmadd(ku, w[u][p], s[p]);
          }
          if constexpr (Read) {
            const Packet xu = ei::pset1<Packet>(x[u][i]);
#pragma GCC unroll 8
            for (int p = 0; p < Packets; ++p) acc[u][p] = ei::pmadd(xu, s[p], acc[u][p]);
          }
        }
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) ei::pstoreu(s_row + p * N, s[p]);
      }
    };
    const Index rows_total = r;
    const bool backwards = chunks_reversed;
    for (int n = 0; n < sweep_chunks; ++n) {
      const int c = backwards ? sweep_chunks - 1 - n : n;
      rows(sweep_chunk_begin(rows_total, c), sweep_chunk_begin(rows_total, c + 1));
      if constexpr (Read) {
#pragma GCC unroll 2
        for (int u = 0; u < Steps; ++u)
#pragma GCC unroll 8
          for (int p = 0; p < Packets; ++p) chunk_sum[c][u][p] = acc[u][p];
      }
    }
    if constexpr (Read) {
#pragma GCC unroll 2
      for (int u = 0; u < Steps; ++u) {
        const Packet read_scale = ei::pset1<Packet>(sweep->read_scale[u]);
        const Packet divisor = ei::pset1<Packet>(sweep->divisor[u]);
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) {
          Packet sum = chunk_sum[0][u][p];
          for (int c = 1; c < sweep_chunks; ++c) sum = ei::padd(sum, chunk_sum[c][u][p]);
          sum = ei::pmul(read_scale, sum);
          ei::pstoreu(sweep->out[u] + c0 + p * N, sweep->divide ? ei::pdiv(sum, divisor) : sum);
        }
      }
    }
  }
};

/// One sweep over S (r x dv, row stride ld) as GatedSweep describes: each element loaded and
/// stored once whatever the number of tokens; reads summed by row chunks in chunk order (as
/// sweep_tokens), so the direction (`reverse`, alternated between sweeps so that one starts
/// where the last ended, in L1) changes no bit. Per token 2 r dv flops for the update, r dv
/// more if scaled, 2 r dv for the read. No allocation.
template <int Steps, RowScale Scale, int ScaledSteps, bool Read, class Scalar>
void gated_sweep(Scalar* S, Index ld, Index r, Index dv, const GatedSweep<Scalar>& sweep,
                 bool reverse) noexcept {
  constexpr int P = sweep_packets<Steps>;
  column_passes<P, Scalar>(dv, reverse,
                           GatedPass<Steps, Scale, ScaledSteps, Read, Scalar>{S, ld, r, &sweep,
                                                                             reverse});
}

/// gated_sweep with the scaled steps (0 to Steps) and the kind of scale chosen at run time.
template <int Steps, bool Read, class Scalar>
void gated_sweep_with(int scaled_steps, bool per_row, Scalar* S, Index ld, Index r, Index dv,
                      const GatedSweep<Scalar>& sweep, bool reverse) noexcept {
  const auto with = [&]<int Scaled>() {
    if (per_row)
      gated_sweep<Steps, RowScale::per_row, Scaled, Read>(S, ld, r, dv, sweep, reverse);
    else
      gated_sweep<Steps, RowScale::uniform, Scaled, Read>(S, ld, r, dv, sweep, reverse);
  };
  if (scaled_steps <= 0)
    with.template operator()<0>();
  else if (scaled_steps == 1 || Steps == 1)
    with.template operator()<1>();
  else
    with.template operator()<Steps>();
}

/// z_out = g .* z + kf (the token's gates) and returns qf . z_out (the denominator of the
/// token's read) by ordered_dot, or 0 without qf. z_out must not overlap the inputs.
template <class Scalar>
Scalar gate_keys_and_dot(const Scalar* z, const GatedToken<Scalar>& token, Scalar* z_out,
                         Index r) noexcept {
  using Vec = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> out(z_out, r);
  if (token.gates != nullptr)
    out = Vec(token.gates, r) * Vec(z, r) + Vec(token.kf, r);
  else
    out = token.gate * Vec(z, r) + Vec(token.kf, r);
  return token.qf != nullptr ? ordered_dot(token.qf, z_out, r) : Scalar(0);
}

/// The GatedSweep of one token's exact write S = diag(g) S + kf^T v (and y = qf S, divided).
template <class Scalar>
GatedSweep<Scalar> gated_write(const GatedToken<Scalar>& token) noexcept {
  GatedSweep<Scalar> sweep;
  sweep.scale[0] = token.gate;
  sweep.row_scale[0] = token.gates;
  sweep.k[0] = token.kf;
  sweep.w[0] = token.v;
  sweep.x[0] = token.qf;
  sweep.out[0] = token.y;
  return sweep;
}

/// One decode token on the exact state: z_next = g .* z + kf and the divisor from qf . z_next,
/// checked before anything changes (a DenominatorError leaves S, z and `tokens` as they were);
/// then one sweep S = diag(g) S + kf^T v that reads y = qf S / divisor from each updated row.
/// 5 r dv flops, S loaded and stored once. `z_next` is r scratch; y must not overlap the
/// inputs. The sweep direction alternates with `tokens`.
template <class Scalar>
void gated_token(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                 const GatedToken<Scalar>& token, const Normalization& norm, Index row,
                 Index& tokens) {
  const Index r = S.rows(), dv = S.cols();
  GatedSweep<Scalar> sweep = gated_write(token);
  sweep.divisor[0] = norm.divisor(gate_keys_and_dot(z.data(), token, z_next.data(), r), row);
  sweep.divide = norm.divides();
  gated_sweep_with<1, true>(1, token.gates != nullptr, S.data(), dv, r, dv, sweep,
                            tokens % 2 != 0);
  z.swap(z_next);
  ++tokens;
}

/// Absorb only: S = diag(g) S + kf^T v and z = g .* z + kf (z may be empty: no normalizer), one
/// sweep that loads and stores S once and reads nothing; 3 r dv flops. For grouped decode:
/// absorb a token once, then read it per query head with the read-only sweep
/// (sweep_tokens<1, Scalar, false>, recurrent_sweep.hpp). `z_next` is r scratch.
template <class Scalar>
void gated_absorb(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                  GatedToken<Scalar> token, bool reverse) noexcept {
  const Index r = S.rows(), dv = S.cols();
  if (z.size() == r) {
    token.qf = nullptr;
    gate_keys_and_dot(z.data(), token, z_next.data(), r);
    z.swap(z_next);
  }
  gated_sweep_with<1, false>(1, token.gates != nullptr, S.data(), dv, r, dv, gated_write(token),
                             reverse);
}

/// The recurrent gated rule over a sequence, two tokens per sweep of S and, most of the time,
/// no multiply by the gates in the sweep: the additive pair sweep's arithmetic. S is kept
/// scaled, the true state being diag(c) S with c the product of the gates since the state was
/// last settled (one number for gates shared by all channels, else one per channel). For
/// tokens t, t+1 with gates g, h and c_t = g .* c, c_{t+1} = h .* c_t:
///   S += (kf_t ./ c_t)^T v_t,      y_t     = ((qf_t .* c_t) . S) / den_t
///   S += (kf_{t+1} ./ c_{t+1})^T v_{t+1},  y_{t+1} = ((qf_{t+1} .* c_{t+1}) . S) / den_{t+1}
/// in one sweep, exactly the additive sweep with scaled keys and queries (with one gate per
/// token, 1 / c scales the values and c the reads instead). c only decreases; before it falls
/// below `settle_below` the sweep first multiplies each row by c and starts again from c = 1
/// (one multiply per element in that sweep), and if the pair's own gates are below it too the
/// sweep applies them exactly (S = g S + ..., S = h S + ...). So S never holds more than
/// 1 / settle_below times the true state: with 2^-16 (2^-64 in double) nothing overflows unless
/// the true state is within 2^16 of the largest finite number, and 1 / c never overflows.
/// Every weight is still a product of gates (c_{t+1} / c_j = the gates in between), so the
/// results carry the recurrent path's rounding, plus a division and two multiplications. z is
/// kept exactly (r values). With `settle` the state is exact after the call; finish() settles
/// it otherwise. Per token 4 r dv flops in the sweep and about 6 r outside it. Allocates at
/// construction only; `dv` is accepted for symmetry with DeltaRecurrence.
template <class Scalar>
class GatedRecurrence {
 public:
  static constexpr Scalar settle_below = std::is_same_v<Scalar, float> ? Scalar(0x1p-16)
                                                                       : Scalar(0x1p-64);

  GatedRecurrence(Index r, Index dv)
      : c_(Array::Ones(r)), settle_scale_(Array::Ones(r)), next_{Array::Ones(r), Array::Ones(r)},
        x_{Array::Zero(r), Array::Zero(r)}, k_{Array::Zero(r), Array::Zero(r)}, z_mid_(r),
        z_next_(r) {
    static_cast<void>(dv);
  }

  /// Tokens t, t+1 (rows `row`, row + 1; positions tokens, tokens + 1), both with per-channel
  /// gates or both with one gate. Both denominators are checked before anything changes; if
  /// only the second is rejected the first is absorbed alone (y written, `tokens` advanced)
  /// and the DenominatorError propagates.
  void pair(RowMatrix<Scalar>& S, ColVector<Scalar>& z, const GatedToken<Scalar> token[2],
            const Normalization& norm, Index row, Index& tokens, bool settle) {
    const Index r = S.rows(), dv = S.cols();
    GatedSweep<Scalar> sweep;
    sweep.divisor[0] = norm.divisor(gate_keys_and_dot(z.data(), token[0], z_mid_.data(), r), row);
    try {
      sweep.divisor[1] =
          norm.divisor(gate_keys_and_dot(z_mid_.data(), token[1], z_next_.data(), r), row + 1);
    } catch (const DenominatorError&) {
      single(S, z, token[0], norm, row, tokens, true);
      throw;
    }
    sweep.divide = norm.divides();
    const int scaled = prepare<2>(token, sweep, settle);
    gated_sweep_with<2, true>(scaled, token[0].gates != nullptr, S.data(), dv, r, dv, sweep,
                              (tokens / 2) % 2 != 0);
    z.swap(z_next_);
    tokens += 2;
  }

  /// One token (row `row`, position `tokens`), as pair() for one.
  void single(RowMatrix<Scalar>& S, ColVector<Scalar>& z, const GatedToken<Scalar>& token,
              const Normalization& norm, Index row, Index& tokens, bool settle) {
    const Index r = S.rows(), dv = S.cols();
    GatedSweep<Scalar> sweep;
    sweep.divisor[0] = norm.divisor(gate_keys_and_dot(z.data(), token, z_next_.data(), r), row);
    sweep.divide = norm.divides();
    const int scaled = prepare<1>(&token, sweep, settle);
    gated_sweep_with<1, true>(scaled, token.gates != nullptr, S.data(), dv, r, dv, sweep,
                              (tokens / 2) % 2 != 0);
    z.swap(z_next_);
    ++tokens;
  }

  /// Multiplies S by its pending scale, so that S is the exact state. One sweep if needed.
  void finish(RowMatrix<Scalar>& S) noexcept {
    if (settled_) return;
    const Index r = S.rows(), dv = S.cols();
    RankSweep<Scalar> sweep;
    sweep.row_scale = c_.data();
    rank_sweep<0, 0, RowScale::per_row>(S.data(), dv, r, dv, sweep, false);
    c_.setOnes();
    settled_ = true;
  }

 private:
  using Array = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  using ConstArray = Eigen::Map<const Array>;

  // Fills the sweep's keys, values, reads and scales for `Steps` tokens and updates c; returns
  // how many leading steps multiply the rows (0: none; 1: settle c first; Steps: exact gates).
  template <int Steps>
  int prepare(const GatedToken<Scalar>* token, GatedSweep<Scalar>& sweep, bool settle) {
    const Index r = c_.size();
    const bool per_channel = token[0].gates != nullptr;
    for (int u = 0; u < Steps; ++u) {
      sweep.k[u] = token[u].kf;
      sweep.w[u] = token[u].v;
      sweep.x[u] = token[u].qf;
      sweep.out[u] = token[u].y;
    }
    // The scales after each step from c, and from 1 (c settled first).
    const auto gates = [&](int u) { return ConstArray(token[u].gates, r); };
    Scalar low_kept = 1, low_fresh = 1;
    if (per_channel) {
      next_[0] = gates(0) * c_;
      x_[0] = gates(0);  // scratch: the scales from 1
      for (int u = 1; u < Steps; ++u) {
        next_[u] = gates(u) * next_[u - 1];
        x_[u] = gates(u) * x_[u - 1];
      }
      low_kept = next_[Steps - 1].minCoeff();
      low_fresh = x_[Steps - 1].minCoeff();
    } else {
      Scalar kept = token[0].gate * c_(0), fresh = token[0].gate;
      for (int u = 1; u < Steps; ++u) {
        kept *= token[u].gate;
        fresh *= token[u].gate;
      }
      low_kept = kept;
      low_fresh = fresh;
    }
    int scaled = 0;
    if (settle || low_fresh < settle_below) {
      // Exact: S = g S + kf v^T per step, starting from the true state (c folded into the
      // first step's gates); c is 1 afterwards.
      scaled = Steps;
      for (int u = 0; u < Steps; ++u) {
        if (per_channel) {
          if (u == 0)
            next_[0] = gates(0) * c_;
          else
            next_[u] = gates(u);
          sweep.row_scale[u] = next_[u].data();
        } else {
          sweep.scale[u] = u == 0 ? token[0].gate * c_(0) : token[u].gate;
        }
      }
      c_.setOnes();
      settled_ = true;
      return scaled;
    }
    if (low_kept < settle_below) {
      // Settle first: the first step multiplies the rows by c, then the scales start from 1.
      scaled = 1;
      if (per_channel) {
        settle_scale_ = c_;
        sweep.row_scale[0] = settle_scale_.data();
        for (int u = 0; u < Steps; ++u) next_[u] = x_[u];
      } else {
        sweep.scale[0] = c_(0);
      }
      c_.setOnes();
    }
    // Scaled keys (per channel) or values (one gate), scaled reads; c becomes the last scale.
    if (per_channel) {
      for (int u = 0; u < Steps; ++u) {
        k_[u] = ConstArray(token[u].kf, r) / next_[u];
        x_[u] = ConstArray(token[u].qf, r) * next_[u];
        sweep.k[u] = k_[u].data();
        sweep.x[u] = x_[u].data();
      }
      c_ = next_[Steps - 1];
    } else {
      Scalar scale = c_(0);
      for (int u = 0; u < Steps; ++u) {
        scale *= token[u].gate;
        sweep.w_scale[u] = Scalar(1) / scale;
        sweep.read_scale[u] = scale;
      }
      c_.setConstant(scale);
    }
    settled_ = false;
    return scaled;
  }

  Array c_, settle_scale_;
  Array next_[2], x_[2], k_[2];
  ColVector<Scalar> z_mid_, z_next_;
  bool settled_ = true;
};

// ---- chunked ---------------------------------------------------------------------------------

/// A causal chunk with one gate per token (Decay, scalar Gated). With D(i, j) = g_{j+1} ...
/// g_i (the decay from token j to token i, 1 for j = i) and D(i, -1) = g_0 ... g_i:
///   out_i = (D(i, -1) qf_i S + sum_{j<=i} D(i, j) (qf_i . kf_j) v_j) / divisor(qf_i . z_i)
///   S <- D(n-1, -1) S + sum_j D(n-1, j) kf_j^T v_j,   z likewise (z_i the running normalizer).
/// The scores qf kf^T come from the register kernel up to each row tile's diagonal and are
/// masked by D in one pass; D(i, -1) is the row scale of the state read. Per token: the
/// additive chunk's flops plus about 3 C / 2 (D and the mask) and r dv / C (S scaled once per
/// chunk); one exp. D is built once per call for a fixed decay; with per-token gates each read
/// forms its rows one after the other in a row buffer as it masks (C / 2 more flops per token
/// and head, no C x C matrix written and read back), and each row's running normalizer and
/// denominator take one pass over r (gate_add_dot).
///
/// Use: construct once per call for chunk size C; per chunk prepare(), then read() per query
/// head (each head gets a single-head call's bits), then absorb(). Pointers given to prepare()
/// must stay valid until absorb(). No allocation after construction.
template <class Scalar>
class ScalarGatedChunk {
 public:
  /// The next chunk's rows, advanced by the chunk's products (null: none; see SpreadPrefetch).
  SpreadPrefetch* prefetch = nullptr;

  ScalarGatedChunk(Index C, Index r, Index dv)
      : r_(r), dv_(dv), ld_(padded_columns<Scalar>(C)),
        kf_t_(RowMatrix<Scalar>::Zero(r, ld_)), kw_t_(r, ld_),
        decay_(RowMatrix<Scalar>::Zero(C, ld_)), scores_(RowMatrix<Scalar>::Zero(C, ld_)),
        decay_row_(RowVector<Scalar>::Zero(ld_)), gate_(C), decay_in_(C), weight_out_(C),
        inverse_(C), late_(C), z_run_(r) {}

  /// Whether this kernel serves a call that would construct one for `C` rows, r features and
  /// dv values (a BackwardWorkspace keeps it): the same C, or a larger one when the call is a
  /// single chunk of C rows (C <= the kernel's rows; every operation reads n and its padded
  /// width only, the buffers' width being a leading dimension). If so, what the constructor
  /// zeroed is zeroed again. O(C (r + C)); no allocation.
  [[nodiscard]] bool reuse(Index C, Index r, Index dv, bool one_chunk) {
    if (r != r_ || dv != dv_ || !(C == chunk_rows() || (one_chunk && C < chunk_rows()))) return false;
    for (auto* m : {&kf_t_, &decay_, &scores_}) m->setZero();
    decay_row_.setZero();
    built_rows_ = 0;
    return true;
  }
  /// The rows of a chunk this kernel takes.
  [[nodiscard]] Index chunk_rows() const noexcept { return gate_.size(); }

  /// The key side of n tokens: kf (n x r, row stride ld_kf), v (n x dv, row stride ld_v) and
  /// the chunk's log-gates (log_gate[t] for t < n; stride 0 for a fixed decay).
  void prepare(Index n, const Scalar* kf, Index ld_kf, const Scalar* v, Index ld_v,
               TokenValues<Scalar> log_gate) {
    n_ = n;
    kf_ = kf;
    ld_kf_ = ld_kf;
    v_ = v;
    ld_v_ = ld_v;
    if (n == 0) return;
    const bool fixed = log_gate.stride == 0;
    if (fixed)
      gate_.head(n).setConstant(std::exp(log_gate[0]));
    else
      for (Index t = 0; t < n; ++t) gate_(t) = std::exp(log_gate[t]);
    decay_in_(0) = gate_(0);
    for (Index i = 1; i < n; ++i) decay_in_(i) = decay_in_(i - 1) * gate_(i);
    weight_out_(n - 1) = 1;
    for (Index j = n - 2; j >= 0; --j) weight_out_(j) = weight_out_(j + 1) * gate_(j + 1);
    // D row by row: D(i, j) = D(i - 1, j) g_i. A fixed decay gives the same top-left block in
    // every chunk, so it is built once; per-token gates get each row as read() masks with it.
    fixed_ = fixed;
    if (fixed && !(built_rows_ >= n && built_gate_ == gate_(0))) {
      decay_(0, 0) = 1;
      for (Index i = 1; i < n; ++i) {
        decay_.row(i).head(i) = decay_.row(i - 1).head(i) * gate_(i);
        decay_(i, i) = 1;
      }
      built_rows_ = n;
      built_gate_ = gate_(0);
    }
    transpose_into(n, r_, kf, ld_kf, kf_t_.data(), ld_);
    for (Index m = 0; m < r_; ++m)
      kw_t_.row(m).head(n) = kf_t_.row(m).head(n).cwiseProduct(weight_out_.head(n).transpose());
  }

  /// One query head: out (n x dv, row stride ld_out) from qf (n x r, row stride ld_qf) and the
  /// state before the chunk. Every denominator is checked (DenominatorError naming row
  /// first_row + i) before anything is written.
  void read(const Scalar* qf, Index ld_qf, const RowMatrix<Scalar>& S, const ColVector<Scalar>& z,
            Scalar* out, Index ld_out, const Normalization& norm, Index first_row) {
    const Index n = n_;
    if (n == 0) return;
    const bool divides = norm.divides();
    if (divides) {
      // z_i = g_i z_{i-1} + kf_i and qf_i . z_i in one pass per row (gate_add_dot).
      z_run_ = z;
      for (Index i = 0; i < n; ++i) {
        const Scalar den = gate_add_dot(z_run_.data(), gate_(i), kf_ + i * ld_kf_, qf + i * ld_qf, r_);
        inverse_[i] = reciprocal_or_late(norm.divisor(den, first_row + i), late_[i]);
      }
    }
    const Index n_padded = padded_columns<Scalar>(n);
    rule_gemm<Scalar, false>(n, n_padded, r_, qf, ld_qf, kf_t_.data(), ld_, scores_.data(), ld_,
                             Triangle::lower_result, nullptr, prefetch);
    // Scores times D(i, .) up to the diagonal, zero after it. Per-token gates: row i of D from
    // row i - 1 (decay_row_, the products D(i, j) = D(i - 1, j) g_i as prepare() forms them for
    // a fixed decay), one row at a time in L1 instead of a C x C matrix.
    for (Index i = 0; i < n; ++i) {
      const Scalar* decay_row = decay_.row(i).data();
      if (!fixed_) {
        Scalar* d = decay_row_.data();
        for (Index j = 0; j < i; ++j) d[j] *= gate_(i);
        d[i] = 1;
        decay_row = d;
      }
      scale_then_clear(scores_.row(i).data(), decay_row, i + 1, n);
    }
    rule_gemm<Scalar, false>(n, dv_, r_, qf, ld_qf, S.data(), dv_, out, ld_out, Triangle::none,
                             decay_in_.data(), prefetch);
    rule_gemm<Scalar, true>(n, dv_, n, scores_.data(), ld_, v_, ld_v_, out, ld_out,
                            Triangle::lower_lhs, divides ? inverse_.data() : nullptr, prefetch);
    if (divides) divide_late_rows(out, ld_out, n, dv_, late_.data());
  }

  /// The state absorbs the prepared chunk: S = D(n-1, -1) S + sum_j D(n-1, j) kf_j^T v_j and
  /// z = z_{n-1} (z may be empty).
  void absorb(RowMatrix<Scalar>& S, ColVector<Scalar>& z) {
    const Index n = n_;
    if (n == 0) return;
    S *= decay_in_(n - 1);
    rule_gemm<Scalar, true>(r_, dv_, n, kw_t_.data(), ld_, v_, ld_v_, S.data(), dv_,
                            Triangle::none, nullptr, prefetch);
    using Vec = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
    if (z.size() == r_)
      for (Index i = 0; i < n; ++i) z.array() = gate_(i) * z.array() + Vec(kf_ + i * ld_kf_, r_);
  }

 private:
  Index r_, dv_, ld_;
  RowMatrix<Scalar> kf_t_, kw_t_, decay_, scores_;
  RowVector<Scalar> decay_row_;
  ColVector<Scalar> gate_, decay_in_, weight_out_, inverse_, late_, z_run_;
  Index n_ = 0, ld_kf_ = 0, ld_v_ = 0, built_rows_ = 0;
  Scalar built_gate_ = 0;
  bool fixed_ = false;
  const Scalar* kf_ = nullptr;
  const Scalar* v_ = nullptr;
};

/// A causal chunk with one gate per feature channel (GLA-style), in sub-chunks of c =
/// gate_subchunk<Scalar> rows. The weight of token j at row i is sum_m qf_im kf_jm D_m(i, j) with
/// D_m(i, j) = g_{j+1,m} ... g_{i,m}. For i in sub-chunk I and j in an earlier sub-chunk J it
/// factors through the start of I:
///   (qf_i .* A_i) . (kf_j .* E_j .* T_{J+1} .* ... .* T_{I-1})
/// with A_i the gates of I up to i, E_j the gates of J after j, T_L the product of sub-chunk
/// L's gates: every factor <= 1, so one product per sub-chunk row I on the register kernel
/// covers all its earlier columns. The diagonal c x c sub-blocks decay the query once per
/// earlier key (c / 2 per token). The state is read with qf_i .* A_i .* T_0 .* ... .* T_{I-1}
/// and updated with the keys decayed to the chunk's end.
/// Per token: the additive chunk's flops plus about 3 c r / 2 (diagonal sub-blocks) and about
/// 10 r (decayed copies of Q and K); r exps. Use as ScalarGatedChunk.
template <class Scalar>
class ChannelGatedChunk {
 public:
  /// The next chunk's rows, advanced by the chunk's products (null: none; see SpreadPrefetch).
  SpreadPrefetch* prefetch = nullptr;

  ChannelGatedChunk(Index C, Index r, Index dv)
      : r_(r), dv_(dv), ld_(padded_columns<Scalar>(std::max<Index>(C, gate_subchunk<Scalar>))),
        blocks_((C + gate_subchunk<Scalar> - 1) / gate_subchunk<Scalar>),
        gates_(C, r), prefix_(C, r), state_decay_(C, r), kend_(C, r), qs_(C, r), qt_(C, r),
        w_(RowMatrix<Scalar>::Zero(std::max<Index>(blocks_ - 1, 0) * r, ld_)),
        kw_t_(RowMatrix<Scalar>::Zero(r, ld_)), scores_(RowMatrix<Scalar>::Zero(C, ld_)),
        totals_(blocks_, r), pre_(blocks_, r), chunk_total_(r), inverse_(C), late_(C), z_run_(r),
        qdec_(r) {}

  /// As ScalarGatedChunk::reuse.
  [[nodiscard]] bool reuse(Index C, Index r, Index dv, bool one_chunk) {
    if (r != r_ || dv != dv_ || !(C == chunk_rows() || (one_chunk && C < chunk_rows()))) return false;
    for (auto* m : {&w_, &kw_t_, &scores_}) m->setZero();
    return true;
  }
  /// The rows of a chunk this kernel takes.
  [[nodiscard]] Index chunk_rows() const noexcept { return gates_.rows(); }
  /// Scalars the constructor allocates for chunks of C rows: 6 C r + (blocks - 1) r L + r L
  /// + C L + 2 blocks r + 3 r + 2 C (blocks = ceil(C / c), L the padded max(C, c)).
  [[nodiscard]] static Index scalars_for(Index C, Index r, Index) noexcept {
    const Index c = gate_subchunk<Scalar>, L = padded_columns<Scalar>(std::max<Index>(C, c));
    const Index blocks = (C + c - 1) / c;
    return 6 * C * r + std::max<Index>(blocks - 1, 0) * r * L + r * L + C * L + 2 * blocks * r +
           3 * r + 2 * C;
  }
  /// Scalars held by its buffers.
  [[nodiscard]] Index scalars() const noexcept {
    Index n = chunk_total_.size() + inverse_.size() + late_.size() + z_run_.size() + qdec_.size();
    for (const auto* m : {&gates_, &prefix_, &state_decay_, &kend_, &qs_, &qt_, &w_, &kw_t_,
                          &scores_, &totals_, &pre_})
      n += m->size();
    return n;
  }

  /// The key side of n tokens: kf (n x r, row stride ld_kf), v (n x dv, row stride ld_v) and
  /// the chunk's log-gates, r per token (log_gate[t], t < n).
  void prepare(Index n, const Scalar* kf, Index ld_kf, const Scalar* v, Index ld_v,
               TokenRows<Scalar> log_gate) {
    n_ = n;
    kf_ = kf;
    ld_kf_ = ld_kf;
    v_ = v;
    ld_v_ = ld_v;
    if (n == 0) return;
    using Vec = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    const Index c = gate_subchunk<Scalar>, r = r_, nb = (n + c - 1) / c;
    // One pass forward per sub-chunk, each row used while it is in cache: the gates, their
    // running product from the sub-chunk's start (A_i) and the state's decay (A_i .* pre(I)).
    // The gates row by row whatever the stride: a vectorized exponential's last bit depends on
    // where its packets begin, and a head's result must not depend on the buffer's layout (a
    // model's [B, T, H, r] gates against a contiguous copy).
    using Out = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    for (Index I = 0; I < nb; ++I) {
      const Index i0 = I * c, end = std::min(n, i0 + c);
      if (I == 0)
        pre_.row(0).setOnes();
      else
        pre_.row(I) = pre_.row(I - 1).cwiseProduct(totals_.row(I - 1));
      const Vec pre(pre_.row(I).data(), r);
      for (Index i = i0; i < end; ++i) {
        Scalar* gates = gates_.row(i).data();
        gates_from_logs(log_gate[i], 1, gates, r);
        Out prefix(prefix_.row(i).data(), r);
        if (i == i0)
          prefix = Vec(gates, r);
        else
          prefix = Vec(prefix_.row(i - 1).data(), r) * Vec(gates, r);
        Out(state_decay_.row(i).data(), r) = prefix * pre;
      }
      totals_.row(I) = prefix_.row(end - 1);
      // Keys decayed to the end of their sub-chunk: kend_j = kf_j .* E_j.
      qdec_.setOnes();
      for (Index j = end - 1; j >= i0; --j) {
        kend_.row(j).array() = Vec(kf + j * ld_kf, r) * qdec_.array();
        qdec_ = qdec_.cwiseProduct(gates_.row(j));
      }
    }
    chunk_total_ = pre_.row(nb - 1).cwiseProduct(totals_.row(nb - 1));
    // Key side of sub-chunk row I (columns of the earlier sub-chunks), transposed: W(I) =
    // [W(I-1) .* T_{I-1}, kend of I-1]; W(nb) (keys decayed to the chunk's end) is kw_t_.
    // Row by row (channel m scales by T_{I-1}(m)), the newest keys transposed in place.
    using Row = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    for (Index I = 1; I <= nb; ++I) {
      const Index j0 = (I - 1) * c, len = std::min(c, n - j0);
      Scalar* dst = I < nb ? w_block(I) : kw_t_.data();
      if (I > 1)
        for (Index m = 0; m < r; ++m)
          Row(dst + m * ld_, j0) = Row(w_block(I - 1) + m * ld_, j0) * totals_(I - 1, m);
      transpose_into(len, r, kend_.data() + j0 * r, r, dst + j0, ld_);
    }
  }

  /// One query head, as ScalarGatedChunk::read.
  void read(const Scalar* qf, Index ld_qf, const RowMatrix<Scalar>& S, const ColVector<Scalar>& z,
            Scalar* out, Index ld_out, const Normalization& norm, Index first_row) {
    const Index n = n_, r = r_;
    if (n == 0) return;
    const bool divides = norm.divides();
    if (divides) {
      // The running normalizer z_i = g_i .* z_{i-1} + kf_i from z_{-1} = z and the row's
      // divisor from qf_i . z_i, one pass per row; inverse(i) = 1 / divisor (DenominatorError
      // naming row first_row + i), or 1 with late(i) the divisor where that reciprocal
      // overflows (reciprocal_or_late).
      z_run_ = z;
      for (Index i = 0; i < n; ++i) {
        const Scalar den = gates_add_dot(z_run_.data(), gates_.row(i).data(), kf_ + i * ld_kf_,
                                         qf + i * ld_qf, r);
        inverse_(i) = reciprocal_or_late(norm.divisor(den, first_row + i), late_(i));
      }
    }
    score(qf, ld_qf);
    rule_gemm<Scalar, false>(n, dv_, r, qs_.data(), r, S.data(), dv_, out, ld_out, Triangle::none,
                             nullptr, prefetch);
    rule_gemm<Scalar, true>(n, dv_, n, scores_.data(), ld_, v_, ld_v_, out, ld_out,
                            Triangle::lower_lhs, divides ? inverse_.data() : nullptr, prefetch);
    if (divides) divide_late_rows(out, ld_out, n, dv_, late_.data());
  }

  /// The decayed scores of the prepared chunk's keys for the rows x (n x r, row stride ld_x):
  /// scores(i, j) = sum_m x_im kf_jm D_m(i, j) for j <= i, 0 after (scores(), row stride
  /// score_stride()), and the rows decayed for the state read, x_i .* D_m(i, -1) (state_rows(),
  /// n x r, contiguous). read() calls it with the queries; the delta rule's per-channel chunk
  /// also with the keys.
  void score(const Scalar* x, Index ld_x) {
    const Index n = n_, r = r_, c = gate_subchunk<Scalar>;
    using Vec = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    for (Index i = 0; i < n; ++i) {
      const Vec q(x + i * ld_x, r);
      qs_.row(i).array() = q * state_decay_.row(i).array();
      qt_.row(i).array() = q * prefix_.row(i).array();
    }
    const Index nb = (n + c - 1) / c;
    for (Index I = 0; I < nb; ++I) {
      const Index i0 = I * c, end = std::min(n, i0 + c);
      if (I > 0)
        rule_gemm<Scalar, false>(end - i0, i0, r, qt_.data() + i0 * r, r, w_block(I), ld_,
                                 scores_.data() + i0 * ld_, ld_, Triangle::none, nullptr, prefetch);
      for (Index i = i0; i < end; ++i) {
        const Scalar* q = x + i * ld_x;
        decayed_row_scores(q, gates_.data(), r, kf_, ld_kf_, r, i0, i, &scores_(i, 0),
                           qdec_.data());
        scores_.row(i).segment(i + 1, n - i - 1).setZero();
      }
    }
  }
  [[nodiscard]] const Scalar* scores() const noexcept { return scores_.data(); }
  [[nodiscard]] Index score_stride() const noexcept { return ld_; }
  [[nodiscard]] const Scalar* state_rows() const noexcept { return qs_.data(); }

  /// The state absorbs the prepared chunk: S = diag(prod of the chunk's gates) S + sum_j
  /// (kf_j decayed to the chunk's end)^T v_j, z = z_{n-1} (z may be empty).
  void absorb(RowMatrix<Scalar>& S, ColVector<Scalar>& z) {
    const Index n = n_;
    if (n == 0) return;
    for (Index m = 0; m < r_; ++m) S.row(m) *= chunk_total_(m);
    rule_gemm<Scalar, true>(r_, dv_, n, kw_t_.data(), ld_, v_, ld_v_, S.data(), dv_,
                            Triangle::none, nullptr, prefetch);
    using Vec = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
    if (z.size() == r_)
      for (Index i = 0; i < n; ++i)
        z.array() = gates_.row(i).array().transpose() * z.array() + Vec(kf_ + i * ld_kf_, r_);
  }

 private:
  Scalar* w_block(Index I) noexcept { return w_.data() + (I - 1) * r_ * ld_; }

  Index r_, dv_, ld_, blocks_;
  RowMatrix<Scalar> gates_, prefix_, state_decay_, kend_, qs_, qt_, w_, kw_t_, scores_;
  RowMatrix<Scalar> totals_, pre_;
  RowVector<Scalar> chunk_total_;
  ColVector<Scalar> inverse_, late_, z_run_;
  RowVector<Scalar> qdec_;
  Index n_ = 0, ld_kf_ = 0, ld_v_ = 0;
  const Scalar* kf_ = nullptr;
  const Scalar* v_ = nullptr;
};

}  // namespace linattn::detail
