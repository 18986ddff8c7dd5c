#pragma once
// Pieces shared by the write-rule kernels (gated_kernels.hpp, delta_kernels.hpp): per-token
// inputs read in place through a stride, the chunk products on the register kernel of
// small_gemm.hpp with a plain fallback, and the column passes of a packet sweep over S.

#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

namespace linattn::detail {

/// One value per token, read in place: token t's value is data[t * stride]. A model's [B, T, H]
/// buffer read for head h has data = &x[b][0][h] and stride H; stride 0 gives every token the
/// same value (a fixed decay).
template <class Scalar>
struct TokenValues {
  const Scalar* data = nullptr;
  Index stride = 1;
  [[nodiscard]] Scalar operator[](Index t) const noexcept { return data[t * stride]; }
  /// The values from token `first` on.
  [[nodiscard]] TokenValues from(Index first) const noexcept {
    return {data + first * stride, stride};
  }
};

/// r values per token, read in place: token t's r values are contiguous from data + t * stride
/// (a [B, T, H, r] buffer read for head h: stride H r).
template <class Scalar>
struct TokenRows {
  const Scalar* data = nullptr;
  Index stride = 0;
  [[nodiscard]] const Scalar* operator[](Index t) const noexcept { return data + t * stride; }
  [[nodiscard]] TokenRows from(Index first) const noexcept {
    return {data + first * stride, stride};
  }
};

/// exp(x) for x in [-200, 0] (smaller x are taken as -200, whose exp underflows in float) with
/// relative error below 2^-32: exp(x) = 2^k exp(t), |t| <= ln 2 / 2, exp(t) by its Taylor
/// polynomial of degree 8 (truncation below 2^-32 relative), in double. For accurate gates.
template <class Packet>
Packet exp_nonpositive_double(Packet x) noexcept {
  namespace ei = Eigen::internal;
  x = ei::pmax(x, ei::pset1<Packet>(-200.0));
  const Packet k = ei::pfloor(ei::pmadd(x, ei::pset1<Packet>(1.4426950408889634), ei::pset1<Packet>(0.5)));
  const Packet t = ei::psub(x, ei::pmul(k, ei::pset1<Packet>(0.6931471805599453)));
  Packet q = ei::pset1<Packet>(1.0 / 40320);
  for (const double c : {1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0})
    q = ei::pmadd(q, t, ei::pset1<Packet>(c));
  // 2^k, k in [-289, 0]: the low bits of k + 2^52 + 1023 are k + 1023, shifted into the exponent.
  const Packet biased = ei::padd(k, ei::pset1<Packet>(4503599627371519.0));  // 2^52 + 1023
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (sizeof(Packet) == 64)  // __m512d
    return ei::pmul(q, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(biased), 52)));
#endif
#if defined(EIGEN_VECTORIZE_AVX2)
  if constexpr (sizeof(Packet) == 32)  // __m256d
    return ei::pmul(q, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(biased), 52)));
#endif
#if defined(EIGEN_VECTORIZE_SSE2)
  if constexpr (sizeof(Packet) == 16)  // __m128d
    return ei::pmul(q, _mm_castsi128_pd(_mm_slli_epi64(_mm_castpd_si128(biased), 52)));
#endif
  static_cast<void>(biased);
  return ei::pldexp(q, k);
}

/// out[i] = exp(log_gate[i * stride]) for i < n, each within one rounding of the exact value
/// (relative error <= u (1 + 2^-8)): the decays are products of gates, and the tests' bounds
/// count one rounding per gate and one per multiplication. Eigen's vectorized exp errs by up
/// to about 2.4 u, so float gates are computed in double (vectorized, exp_nonpositive_double)
/// and rounded once, and double gates by std::exp. log_gate <= 0.
template <class Scalar>
void gates_from_logs(const Scalar* log_gate, Index stride, Scalar* out, Index n) noexcept {
  if constexpr (std::is_same_v<Scalar, float>) {
    constexpr Index B = 64;
    float buffer[B];
    for (Index i0 = 0; i0 < n; i0 += B) {
      const Index m = std::min(B, n - i0);
      const float* x = log_gate + i0 * stride;
      if (stride != 1) {
        for (Index j = 0; j < m; ++j) buffer[j] = x[j * stride];
        x = buffer;
      }
      float* y = out + i0;
      Index j = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
      for (; j + 8 <= m; j += 8)
        _mm256_storeu_ps(y + j, _mm512_cvtpd_ps(exp_nonpositive_double(
                                    _mm512_cvtps_pd(_mm256_loadu_ps(x + j)))));
#elif defined(EIGEN_VECTORIZE_AVX)
      for (; j + 4 <= m; j += 4)
        _mm_storeu_ps(y + j, _mm256_cvtpd_ps(exp_nonpositive_double(
                                 _mm256_cvtps_pd(_mm_loadu_ps(x + j)))));
#elif defined(EIGEN_VECTORIZE_SSE2)
      for (; j + 4 <= m; j += 4) {
        const __m128 v = _mm_loadu_ps(x + j);
        const __m128d lo = exp_nonpositive_double(_mm_cvtps_pd(v));
        const __m128d hi = exp_nonpositive_double(_mm_cvtps_pd(_mm_movehl_ps(v, v)));
        _mm_storeu_ps(y + j, _mm_movelh_ps(_mm_cvtpd_ps(lo), _mm_cvtpd_ps(hi)));
      }
#endif
      for (; j < m; ++j) y[j] = static_cast<float>(std::exp(static_cast<double>(x[j])));
    }
  } else {
    for (Index i = 0; i < n; ++i) out[i] = std::exp(log_gate[i * stride]);
  }
}

/// n rounded up to whole packets of the register kernel (the width of score and transposed-key
/// buffers, whose padding columns feed results that are never read).
template <class Scalar>
constexpr Index padded_columns(Index n) noexcept {
  constexpr Index lanes = GemmTile<Scalar>::lanes;
  return (n + lanes - 1) / lanes * lanes;
}

/// C (m x n) = (Accumulate ? C : 0) + A (m x depth) B (depth x n), then row i times
/// row_scale[i] when row_scale is not null; row-major operands with leading dimensions lda,
/// ldb, ldc. With Triangle::lower_lhs the caller guarantees A(i, k) = 0 for k > i within the
/// row tile; with Triangle::lower_result only C(i, j), j <= i, is wanted (small_gemm.hpp).
/// On the register kernel when n is a whole number of packets, otherwise by rows of axpys in
/// the same k order (value widths that are not a multiple of the packet width). No
/// allocation. `prefetch` as small_gemm's (the plain fallback does not advance it).
/// 2 m n depth flops (about half with a triangle).
template <class Scalar, bool Accumulate>
void rule_gemm(Index m, Index n, Index depth, const Scalar* A, Index lda, const Scalar* B,
               Index ldb, Scalar* C, Index ldc, Triangle triangle = Triangle::none,
               const Scalar* row_scale = nullptr, SpreadPrefetch* prefetch = nullptr) noexcept {
  if constexpr (has_gemm_kernel<Scalar>) {
    if (n % GemmTile<Scalar>::lanes == 0) {
      small_gemm<Scalar, Accumulate>(m, n, depth, A, lda, B, ldb, C, ldc, triangle, row_scale,
                                     prefetch);
      return;
    }
  }
  using Row = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  for (Index i = 0; i < m; ++i) {
    const Index inner = triangle == Triangle::lower_lhs ? std::min(depth, i + 1) : depth;
    const Index cols = triangle == Triangle::lower_result ? std::min(n, i + 1) : n;
    Row c(C + i * ldc, cols);
    if (!Accumulate) c.setZero();
    for (Index k = 0; k < inner; ++k) c += A[i * lda + k] * ConstRow(B + k * ldb, cols);
    if (row_scale != nullptr) c *= row_scale[i];
  }
}

/// x .*= g, then returns x . k (length n): one pass, packets from index 0 into one accumulator,
/// then the scalar tail. The decayed query of a diagonal sub-block, one earlier key at a time.
template <class Scalar>
Scalar scale_then_dot(Scalar* x, const Scalar* g, const Scalar* k, Index n) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  Packet acc0 = ei::pset1<Packet>(Scalar(0)), acc1 = acc0;
  Index i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const Packet x0 = ei::pmul(ei::ploadu<Packet>(x + i), ei::ploadu<Packet>(g + i));
    const Packet x1 = ei::pmul(ei::ploadu<Packet>(x + i + N), ei::ploadu<Packet>(g + i + N));
    ei::pstoreu(x + i, x0);
    ei::pstoreu(x + i + N, x1);
    acc0 = ei::pmadd(x0, ei::ploadu<Packet>(k + i), acc0);
    acc1 = ei::pmadd(x1, ei::ploadu<Packet>(k + i + N), acc1);
  }
  if (i + N <= n) {
    const Packet x0 = ei::pmul(ei::ploadu<Packet>(x + i), ei::ploadu<Packet>(g + i));
    ei::pstoreu(x + i, x0);
    acc0 = ei::pmadd(x0, ei::ploadu<Packet>(k + i), acc0);
    i += N;
  }
  Scalar sum = ei::predux(ei::padd(acc0, acc1));
  for (; i < n; ++i) {
    x[i] *= g[i];
    sum += x[i] * k[i];
  }
  return sum;
}

/// The packets of a row the row kernels below keep in registers: 8 (the row, two accumulators
/// and a load fit in AVX2's 16 vector registers). Wider rows go through memory.
inline constexpr int kHeldRowPackets = 8;

/// Calls f(std::integral_constant<int, P>{}) and returns true when n values are P whole
/// packets, 1 <= P <= kHeldRowPackets (a row kernel with the row in P registers); returns
/// false otherwise.
template <class Scalar, class F>
bool with_held_packets(Index n, F&& f) {
  constexpr int N = sweep_packet_size<Scalar>;
  if (n % N != 0 || n < N || n / N > kHeldRowPackets) return false;
  const int packets = static_cast<int>(n / N);
  // The one P + 1 equal to packets: the fold stops at the first true.
  [&]<int... P>(std::integer_sequence<int, P...>) {
    static_cast<void>(
        ((packets == P + 1 && (f(std::integral_constant<int, P + 1>{}), true)) || ...));
  }(std::make_integer_sequence<int, kHeldRowPackets>{});
  return true;
}

template <class Scalar, int P>
void decayed_row_scores_held(const Scalar* q, const Scalar* g, Index ld_g, const Scalar* k,
                             Index ld_k, Index j0, Index i, Scalar* out) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  Packet x[P];
  {
    // The diagonal element: ordered_dot's order (the same as below without the gates).
    const Scalar* key = k + i * ld_k;
    Packet acc0 = ei::pset1<Packet>(Scalar(0)), acc1 = acc0;
    for (int p = 0; p < P; ++p) {
      x[p] = ei::ploadu<Packet>(q + p * N);
      if (p % 2 == 0)
        acc0 = ei::pmadd(x[p], ei::ploadu<Packet>(key + p * N), acc0);
      else
        acc1 = ei::pmadd(x[p], ei::ploadu<Packet>(key + p * N), acc1);
    }
    out[i] = ei::predux(ei::padd(acc0, acc1));
  }
  for (Index j = i - 1; j >= j0; --j) {
    const Scalar* gate = g + (j + 1) * ld_g;
    const Scalar* key = k + j * ld_k;
    Packet acc0 = ei::pset1<Packet>(Scalar(0)), acc1 = acc0;
    // scale_then_dot's order: even packets into acc0, odd ones into acc1 (an odd count's last
    // packet is even).
    for (int p = 0; p < P; ++p) {
      x[p] = ei::pmul(x[p], ei::ploadu<Packet>(gate + p * N));
      if (p % 2 == 0)
        acc0 = ei::pmadd(x[p], ei::ploadu<Packet>(key + p * N), acc0);
      else
        acc1 = ei::pmadd(x[p], ei::ploadu<Packet>(key + p * N), acc1);
    }
    out[j] = ei::predux(ei::padd(acc0, acc1));
  }
}

/// One row i of a per-channel diagonal sub-block: out[i] = q . k_i, then for j = i - 1 down to
/// j0, x = x .* g_{j+1} with x starting as q (the query decayed back to key j: q .* g_{j+1}
/// ... g_i) and out[j] = x . k_j. Row t of the gates at g + t ld_g, of the keys at k + t ld_k;
/// n features. Bit for bit ordered_dot, then scale_then_dot key by key, with x held in
/// registers across the keys when n is a whole number of at most kHeldRowPackets packets (no
/// store and reload of x per key); otherwise those functions, x on `scratch` (n values).
/// 2 n + 3 n (i - j0) flops.
template <class Scalar>
void decayed_row_scores(const Scalar* q, const Scalar* g, Index ld_g, const Scalar* k,
                        Index ld_k, Index n, Index j0, Index i, Scalar* out,
                        Scalar* scratch) noexcept {
  if (with_held_packets<Scalar>(n, [&](auto packets) {
        decayed_row_scores_held<Scalar, decltype(packets)::value>(q, g, ld_g, k, ld_k, j0, i, out);
      }))
    return;
  out[i] = ordered_dot(q, k + i * ld_k, n);
  std::copy_n(q, n, scratch);
  for (Index j = i - 1; j >= j0; --j)
    out[j] = scale_then_dot(scratch, g + (j + 1) * ld_g, k + j * ld_k, n);
}

/// z = g .* z + kf with the gates at g[i * GateStride] (GateStride 0: one gate for every
/// element; 1: one per element), by Eigen's pmadd per element (a fused multiply-add, one
/// rounding, on targets with FMA: written out, so that the result does not depend on whether
/// the compiler contracts a multiply and an add, which g++ does by default and clang does not
/// across statements), then returns q . z in ordered_dot's order (recurrent_sweep.hpp), in one
/// pass over the n elements: a gated chunk's running normalizer and its row's denominator.
template <int GateStride, class Scalar>
Scalar gated_add_dot(Scalar* z, const Scalar* g, const Scalar* kf, const Scalar* q,
                     Index n) noexcept {
  static_assert(GateStride == 0 || GateStride == 1, "one gate, or one per element");
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  const auto gate = [g](Index i) {
    if constexpr (GateStride == 0)
      return ei::pset1<Packet>(g[0]);
    else
      return ei::ploadu<Packet>(g + i);
  };
  const auto step = [&](Index i) {
    const Packet next = ei::pmadd(ei::ploadu<Packet>(z + i), gate(i), ei::ploadu<Packet>(kf + i));
    ei::pstoreu(z + i, next);
    return next;
  };
  Packet acc0 = ei::pset1<Packet>(Scalar(0)), acc1 = acc0;
  Index i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    acc0 = ei::pmadd(ei::ploadu<Packet>(q + i), step(i), acc0);
    acc1 = ei::pmadd(ei::ploadu<Packet>(q + i + N), step(i + N), acc1);
  }
  if (i + N <= n) {
    acc0 = ei::pmadd(ei::ploadu<Packet>(q + i), step(i), acc0);
    i += N;
  }
  Scalar sum = ei::predux(ei::padd(acc0, acc1));
  for (; i < n; ++i) {
    z[i] = ei::pmadd(z[i], g[i * GateStride], kf[i]);
    sum = ei::pmadd(q[i], z[i], sum);
  }
  return sum;
}

/// gated_add_dot with one gate g for every element: a scalar-gated chunk's running normalizer.
template <class Scalar>
Scalar gate_add_dot(Scalar* z, Scalar g, const Scalar* kf, const Scalar* q, Index n) noexcept {
  return gated_add_dot<0>(z, &g, kf, q, n);
}

/// gated_add_dot with one gate per element: a per-channel gated chunk's running normalizer.
template <class Scalar>
Scalar gates_add_dot(Scalar* z, const Scalar* g, const Scalar* kf, const Scalar* q,
                     Index n) noexcept {
  return gated_add_dot<1>(z, g, kf, q, n);
}

template <class Scalar, int P>
void accumulate_rows_held(Scalar* y, const Scalar* a, const Scalar* x, Index ld_x,
                          Index m) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  Packet acc[P];
  for (int p = 0; p < P; ++p) acc[p] = ei::ploadu<Packet>(y + p * N);
  for (Index j = 0; j < m; ++j) {
    const Packet weight = ei::pset1<Packet>(a[j]);
    const Scalar* row = x + j * ld_x;
    for (int p = 0; p < P; ++p) acc[p] = ei::pmadd(weight, ei::ploadu<Packet>(row + p * N), acc[p]);
  }
  for (int p = 0; p < P; ++p) ei::pstoreu(y + p * N, acc[p]);
}

/// y += a_0 x_0 + a_1 x_1 + ... + a_{m-1} x_{m-1}, term by term in that order, one pmadd per
/// element and term (rows x_j at x + j ld_x, n values each): a row of a triangular solve
/// against the rows before it. y is held in registers across the terms when n is a whole
/// number of at most kHeldRowPackets packets (no store and reload of y per term); otherwise
/// term by term through memory, with the same arithmetic. 2 m n flops.
template <class Scalar>
void accumulate_rows(Scalar* y, const Scalar* a, const Scalar* x, Index ld_x, Index m,
                     Index n) noexcept {
  if (with_held_packets<Scalar>(n, [&](auto packets) {
        accumulate_rows_held<Scalar, decltype(packets)::value>(y, a, x, ld_x, m);
      }))
    return;
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  for (Index j = 0; j < m; ++j) {
    const Scalar* row = x + j * ld_x;
    const Packet weight = ei::pset1<Packet>(a[j]);
    Index k = 0;
    for (; k + N <= n; k += N)
      ei::pstoreu(y + k, ei::pmadd(weight, ei::ploadu<Packet>(row + k), ei::ploadu<Packet>(y + k)));
    for (; k < n; ++k) y[k] = ei::pmadd(a[j], row[k], y[k]);
  }
}

template <class Scalar, int P>
void gated_horner_held(Scalar* out, const Scalar* c, Index ld_c, const Scalar* x, Index ld_x,
                       const Scalar* g, Index ld_g, Index m) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  Packet acc[P];
  const Packet c0 = ei::pset1<Packet>(c[0]);
  for (int p = 0; p < P; ++p) acc[p] = ei::pmul(c0, ei::ploadu<Packet>(x + p * N));
  for (Index t = 1; t < m; ++t) {
    const Packet ct = ei::pset1<Packet>(c[t * ld_c]);
    const Scalar* row = x + t * ld_x;
    const Scalar* gate = g + (t - 1) * ld_g;
    for (int p = 0; p < P; ++p)
      acc[p] = ei::pmadd(acc[p], ei::ploadu<Packet>(gate + p * N),
                         ei::pmul(ct, ei::ploadu<Packet>(row + p * N)));
  }
  for (int p = 0; p < P; ++p)
    ei::pstoreu(out + p * N, ei::padd(ei::ploadu<Packet>(out + p * N), acc[p]));
}

/// out += acc, acc by Horner's rule over m >= 1 terms: acc = c_0 x_0, then for t = 1 ... m - 1
/// acc = acc .* g_t + c_t x_t (a pmadd: one rounding where the target has FMA), elementwise
/// over n values. So out gains sum_t c_t x_t .* g_{t+1} .* ... .* g_{m-1}: a per-channel gated
/// chunk's in-block gradient terms, each earlier row decayed through the gates after it.
/// Term t's coefficient is c[t ld_c], its row x + t ld_x, its gate row g + (t - 1) ld_g
/// (strides may be negative, for a sweep from the last row back; g is not read when m = 1, but
/// g + n must stay inside its buffer).
/// acc is held in registers, kHeldRowPackets packets at a time (each element's recurrence is
/// independent of the others', so blocks of columns give the same bits as one pass), the tail
/// of fewer than a packet by scalars. 3 n (m - 1) + 2 n flops.
template <class Scalar>
void gated_horner(Scalar* out, const Scalar* c, Index ld_c, const Scalar* x, Index ld_x,
                  const Scalar* g, Index ld_g, Index m, Index n) noexcept {
  namespace ei = Eigen::internal;
  constexpr int N = sweep_packet_size<Scalar>;
  constexpr Index block = Index(kHeldRowPackets) * N;
  Index k = 0;
  for (; k + block <= n; k += block)
    gated_horner_held<Scalar, kHeldRowPackets>(out + k, c, ld_c, x + k, ld_x, g + k, ld_g, m);
  const Index whole = (n - k) / N * N;
  with_held_packets<Scalar>(whole, [&](auto packets) {
    gated_horner_held<Scalar, decltype(packets)::value>(out + k, c, ld_c, x + k, ld_x, g + k,
                                                         ld_g, m);
  });
  for (k += whole; k < n; ++k) {
    Scalar acc = c[0] * x[k];
    for (Index t = 1; t < m; ++t)
      acc = ei::pmadd(acc, g[(t - 1) * ld_g + k], c[t * ld_c] * x[t * ld_x + k]);
    out[k] += acc;
  }
}

/// row[0, m) .*= scale[0, m) over whole packets (up to m rounded up to a packet; the caller's
/// buffers hold that many), then row[m, end) = 0: a causal mask applied to one score row, m =
/// i + 1 weighted entries, the rest of the row up to `end` cleared.
template <class Scalar>
void scale_then_clear(Scalar* row, const Scalar* scale, Index m, Index end) noexcept {
  namespace ei = Eigen::internal;
  using Packet = SweepPacket<Scalar>;
  constexpr int N = sweep_packet_size<Scalar>;
  for (Index j = 0; j < m; j += N)
    ei::pstoreu(row + j, ei::pmul(ei::ploadu<Packet>(row + j), ei::ploadu<Packet>(scale + j)));
  std::fill(row + m, row + std::max(m, end), Scalar(0));
}

/// The size in scalars of Packet (1 for a scalar).
template <class Packet>
inline constexpr int packet_size = Eigen::internal::unpacket_traits<Packet>::size;

/// The column passes of a sweep over the dv columns of S, in the order of sweep_tokens
/// (recurrent_sweep.hpp): passes of P packets from the left, then one narrower pass of whole
/// packets, then the last dv % packet size columns one at a time; `reverse` walks them from
/// the right. `pass.template operator()<Packet, Packets>(c0)` covers columns
/// [c0, c0 + Packets * size of Packet); Packet is SweepPacket<Scalar> or Scalar itself (the
/// tail). Each column's arithmetic is the same however the columns are grouped, so a token
/// gives the same bits in any pass width.
template <int P, class Scalar, class Pass>
void column_passes(Index dv, bool reverse, Pass&& pass) {
  using Packet = SweepPacket<Scalar>;
  constexpr Index N = sweep_packet_size<Scalar>;
  constexpr Index W = N * P;
  const Index packet_columns = dv - dv % N;
  const Index full = packet_columns - packet_columns % W;
  const Index partial_packets = (packet_columns - full) / N;
  const auto partial = [&] {
    if constexpr (P > 1) {
      if (partial_packets == 1) pass.template operator()<Packet, 1>(full);
    }
    if constexpr (P > 2) {
      if (partial_packets == 2) pass.template operator()<Packet, 2>(full);
    }
    if constexpr (P > 3) {
      if (partial_packets == 3) pass.template operator()<Packet, 3>(full);
    }
    static_assert(P <= 4, "column_passes covers up to four packets per pass");
  };
  if (!reverse) {
    for (Index c0 = 0; c0 < full; c0 += W) pass.template operator()<Packet, P>(c0);
    partial();
    for (Index c = packet_columns; c < dv; ++c) pass.template operator()<Scalar, 1>(c);
  } else {
    for (Index c = dv - 1; c >= packet_columns; --c) pass.template operator()<Scalar, 1>(c);
    partial();
    for (Index c0 = full - W; c0 >= 0; c0 -= W) pass.template operator()<Packet, P>(c0);
  }
}


/// How a rank sweep scales each row of S before its rank-one updates.
enum class RowScale { none, uniform, per_row };

/// One sweep over S of the delta kernels. For each row i, in order:
///   S_i = s_i S_i + k_0[i] w_0 + ... + k_{U-1}[i] w_{U-1}  (s_i = scale or row_scale[i], or 1)
///   out_m += x_m[i] S_i                                  (the updated row)
/// x, k: length r; w, out: length dv, contiguous.
template <class Scalar>
struct RankSweep {
  Scalar scale = 1;
  const Scalar* row_scale = nullptr;
  const Scalar* k[2] = {nullptr, nullptr};
  const Scalar* w[2] = {nullptr, nullptr};
  const Scalar* x[4] = {nullptr, nullptr, nullptr, nullptr};
  Scalar* out[4] = {nullptr, nullptr, nullptr, nullptr};
};

/// The end of a rank sweep's column pass: stores each read, out_m[column ...] = sum_m. A
/// kernel may pass its own (the delta recurrence finishes its tokens there) with the same
/// call: finish(column, sums, out), sums[m] the packet of read m at `column`.
struct StoreReads {
  template <class Packet, int R, class Scalar>
  void operator()(Index column, const Packet (&sum)[R], Scalar* const (&out)[R]) const noexcept {
    for (int m = 0; m < R; ++m) Eigen::internal::pstoreu(out[m] + column, sum[m]);
  }
};

/// One column pass of rank_sweep.
template <int Updates, int Reads, RowScale Scale, class Scalar, class Finish = StoreReads>
struct RankPass {
  static constexpr bool stores = Updates > 0 || Scale != RowScale::none;
  Scalar* S;
  Index ld, r;
  const RankSweep<Scalar>* sweep;
  bool chunks_reversed;
  Finish finish;

  template <class Packet, int Packets>
  void operator()(Index c0) const noexcept {
    namespace ei = Eigen::internal;
    constexpr int N = packet_size<Packet>;
    constexpr int U = Updates > 0 ? Updates : 1, R = Reads > 0 ? Reads : 1;
    // Local copies: stores through S may alias anything, so fields read through `sweep` would
    // be reloaded after every store.
    const Scalar* k[U];
    const Scalar* x[R];
    const Scalar* row_scale = sweep->row_scale;
    Packet w[U][Packets], acc[R][Packets], chunk_sum[sweep_chunks][R][Packets];
    const Packet scale = ei::pset1<Packet>(sweep->scale);
#pragma GCC unroll 4
    for (int u = 0; u < Updates; ++u) {
      k[u] = sweep->k[u];
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p) w[u][p] = ei::ploadu<Packet>(sweep->w[u] + c0 + p * N);
    }
    Scalar* out[R] = {};
#pragma GCC unroll 4
    for (int m = 0; m < Reads; ++m) {
      x[m] = sweep->x[m];
      out[m] = sweep->out[m];
    }
    const auto read = [&](Index i, const Packet* s) {
#pragma GCC unroll 4
      for (int m = 0; m < Reads; ++m) {
        const Packet xm = ei::pset1<Packet>(x[m][i]);
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) acc[m][p] = ei::pmadd(xm, s[p], acc[m][p]);
      }
    };
    Scalar* const base = S + c0;
    const Index stride = ld;
    const auto rows = [&](Index begin, Index end) {
#pragma GCC unroll 4
      for (int m = 0; m < Reads; ++m)
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) acc[m][p] = ei::pset1<Packet>(Scalar(0));
      Scalar* s_row = base + begin * stride;
      for (Index i = begin; i < end; ++i, s_row += stride) {
        Packet s[Packets];
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) s[p] = ei::ploadu<Packet>(s_row + p * N);
        if constexpr (Scale != RowScale::none) {
          const Packet si = Scale == RowScale::per_row ? ei::pset1<Packet>(row_scale[i]) : scale;
#pragma GCC unroll 8
          for (int p = 0; p < Packets; ++p) s[p] = ei::pmul(si, s[p]);
        }
#pragma GCC unroll 4
        for (int u = 0; u < Updates; ++u) {
          const Packet ku = ei::pset1<Packet>(k[u][i]);
#pragma GCC unroll 8
          for (int p = 0; p < Packets; ++p) s[p] = ei::pmadd(ku, w[u][p], s[p]);
        }
        read(i, s);
        if constexpr (stores) {
#pragma GCC unroll 8
          for (int p = 0; p < Packets; ++p) ei::pstoreu(s_row + p * N, s[p]);
        }
      }
    };
    const Index rows_total = r;
    const bool backwards = chunks_reversed;
    for (int n = 0; n < sweep_chunks; ++n) {
      const int c = backwards ? sweep_chunks - 1 - n : n;
      rows(sweep_chunk_begin(rows_total, c), sweep_chunk_begin(rows_total, c + 1));
#pragma GCC unroll 4
      for (int m = 0; m < Reads; ++m)
#pragma GCC unroll 8
        for (int p = 0; p < Packets; ++p) chunk_sum[c][m][p] = acc[m][p];
    }
    if constexpr (Reads > 0) {
#pragma GCC unroll 8
      for (int p = 0; p < Packets; ++p) {
        Packet sum[Reads];
#pragma GCC unroll 4
        for (int m = 0; m < Reads; ++m) {
          sum[m] = chunk_sum[0][m][p];
          for (int c = 1; c < sweep_chunks; ++c) sum[m] = ei::padd(sum[m], chunk_sum[c][m][p]);
        }
        finish(c0 + p * N, sum, out);
      }
    }
  }
};

/// One sweep over S (r x dv, row stride ld) as RankSweep describes: each element loaded once
/// and stored once if anything changes it. Reads are summed by row chunks in chunk order (as
/// sweep_tokens), so the direction (`reverse`, alternated between sweeps so that one sweep
/// starts where the last one ended, in L1) changes no bit. 2 (Updates + Reads) r dv flops,
/// plus r dv with a scale. No allocation.
template <int Updates, int Reads, RowScale Scale, class Scalar, class Finish = StoreReads>
void rank_sweep(Scalar* S, Index ld, Index r, Index dv, const RankSweep<Scalar>& sweep,
                bool reverse, const Finish& finish = Finish{}) noexcept {
  // Per packet of columns a pass holds the row, Updates values and Reads accumulators (up to
  // 7 registers), plus a broadcast and the scale: with 32 registers 4 packets always (the
  // delta recurrence's pair sweep, 7 per packet, holds 28 plus two and g++ spills none); with
  // 16, 4 packets for up to 3, else 2. Four packets rather than three for the pair sweep: one
  // pass instead of two at dv = 64 (64 floats with AVX-512) and two instead of three at 128,
  // each pass with four independent chains per read; GatedDelta's recurrent rate rose 3 to 7%
  // (Zen 5 VM, bench_write_rules, H = 1 and 8, d = 64 and 128, binaries alternated), Delta's
  // did not move.
  constexpr int live = 1 + Updates + Reads;
  static_assert(live <= 7, "a rank sweep holds at most 2 updates and 4 reads per packet");
  constexpr int P = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 4 : (live <= 3 ? 4 : 2);
  column_passes<P, Scalar>(
      dv, reverse,
      RankPass<Updates, Reads, Scale, Scalar, Finish>{S, ld, r, &sweep, reverse, finish});
}

/// rank_sweep with the number of updates (0 to 2) and the row scale chosen at run time.
template <int Reads, class Scalar, class Finish = StoreReads>
void rank_sweep_with(int updates, RowScale scale, Scalar* S, Index ld, Index r, Index dv,
                     const RankSweep<Scalar>& sweep, bool reverse,
                     const Finish& finish = Finish{}) noexcept {
  const auto with_updates = [&]<int U>() {
    if (scale == RowScale::none)
      rank_sweep<U, Reads, RowScale::none>(S, ld, r, dv, sweep, reverse, finish);
    else if (scale == RowScale::uniform)
      rank_sweep<U, Reads, RowScale::uniform>(S, ld, r, dv, sweep, reverse, finish);
    else
      rank_sweep<U, Reads, RowScale::per_row>(S, ld, r, dv, sweep, reverse, finish);
  };
  if (updates == 0)
    with_updates.template operator()<0>();
  else if (updates == 1)
    with_updates.template operator()<1>();
  else
    with_updates.template operator()<2>();
}

}  // namespace linattn::detail
