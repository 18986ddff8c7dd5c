#pragma once
// Pieces shared by the write-rule kernels (gated_kernels.hpp, delta_kernels.hpp): per-token
// inputs read in place through a stride, the chunk products on the register kernel of
// small_gemm.hpp with a plain fallback, and the column passes of a packet sweep over S.

#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>

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
/// allocation. 2 m n depth flops (about half with a triangle).
template <class Scalar, bool Accumulate>
void rule_gemm(Index m, Index n, Index depth, const Scalar* A, Index lda, const Scalar* B,
               Index ldb, Scalar* C, Index ldc, Triangle triangle = Triangle::none,
               const Scalar* row_scale = nullptr) noexcept {
  if constexpr (has_gemm_kernel<Scalar>) {
    if (n % GemmTile<Scalar>::lanes == 0) {
      small_gemm<Scalar, Accumulate>(m, n, depth, A, lda, B, ldb, C, ldc, triangle, row_scale);
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

/// The size in scalars of Packet (1 for a scalar).
template <class Packet>
inline constexpr int packet_size = Eigen::internal::unpacket_traits<Packet>::size;

}  // namespace linattn::detail
