#pragma once
// Register-blocked products of small row-major matrices, for the chunked causal kernel.
//
// Why not Eigen's GEMM: the chunked path multiplies matrices of a few dozen rows, and Eigen
// packs both operands into panels on every call, which at these sizes costs about as much as
// the multiply. Here the operands are already laid out for the micro-kernel: the right-hand
// side is row-major (each step of the inner dimension loads contiguous packets of a row) and
// the left-hand side is read one broadcast scalar at a time. Nothing is packed or allocated.
// Vectorised through Eigen's packet layer, so the same code uses SSE, AVX or AVX-512 registers
// as the build allows.

#include <linattn/detail/prefetch.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <utility>

namespace linattn::detail {

/// The tile the micro-kernel keeps in registers: `rows` x `packets` accumulators, plus one
/// packet of the right-hand side per column packet and one broadcast, within the register
/// file (6 x 4 + 4 + 1 = 29 of 32 with AVX-512; 6 x 2 + 2 + 1 = 15 of 16 with SSE or AVX).
template <class Scalar>
struct GemmTile {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  static constexpr int lanes = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr int rows = 6;
  static constexpr int packets = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 4 : 2;
  static constexpr int width = packets * lanes;  // columns of one panel
};

/// True when the register kernel applies to Scalar (Eigen vectorizes it in this build).
template <class Scalar>
inline constexpr bool has_gemm_kernel =
    Eigen::internal::packet_traits<Scalar>::Vectorizable && GemmTile<Scalar>::lanes > 1;

/// One register tile: C[0, MR) x [0, NP lanes) = (Accumulate ? C : 0) + A B over `depth`,
/// then, if `row_scale` is given, row i times row_scale[i]. The k loop runs in order, so the
/// result depends only on the operands, never on the tiling.
template <class Scalar, int MR, int NP, bool Accumulate>
void gemm_tile(Index depth, const Scalar* a, Index lda, const Scalar* b, Index ldb, Scalar* c,
               Index ldc, const Scalar* row_scale) noexcept {
  using namespace Eigen::internal;
  using Packet = typename GemmTile<Scalar>::Packet;
  constexpr int L = GemmTile<Scalar>::lanes;
  Packet acc[MR][NP];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      acc[i][p] = Accumulate ? ploadu<Packet>(c + i * ldc + p * L) : pset1<Packet>(Scalar(0));
  for (Index k = 0; k < depth; ++k) {
    Packet bk[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) bk[p] = ploadu<Packet>(b + k * ldb + p * L);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Packet ai = pset1<Packet>(a[i * lda + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[i][p] = pmadd(ai, bk[p], acc[i][p]);
    }
  }
  if (row_scale != nullptr) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Packet s = pset1<Packet>(row_scale[i]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[i][p] = pmul(acc[i][p], s);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) pstoreu(c + i * ldc + p * L, acc[i][p]);
}

template <class Scalar>
using GemmTileFn = void (*)(Index, const Scalar*, Index, const Scalar*, Index, Scalar*, Index,
                            const Scalar*) noexcept;

/// gemm_tile for every (rows, packets) up to the full tile: entry (mr - 1) * packets + np - 1.
template <class Scalar, bool Accumulate, int... I>
constexpr auto gemm_tile_table(std::integer_sequence<int, I...>) {
  constexpr int NP = GemmTile<Scalar>::packets;
  return std::array<GemmTileFn<Scalar>, sizeof...(I)>{
      &gemm_tile<Scalar, I / NP + 1, I % NP + 1, Accumulate>...};
}

/// How the left-hand side or the result is triangular, so that tiles skip known zeros.
enum class Triangle {
  none,
  /// A(i, k) = 0 for k > i: the tile of rows [i0, i0 + mr) stops the inner loop at i0 + mr.
  lower_lhs,
  /// Only C(i, j) with j <= i is wanted: a tile computes columns up to its last row (rounded up
  /// to whole packets); the others are left unwritten.
  lower_result,
};

/// C (m x n) = (Accumulate ? C : 0) + A (m x depth) B (depth x n), each row then scaled by
/// row_scale[i] when row_scale is not null. A, B, C row-major with leading dimensions lda, ldb,
/// ldc; n must be a multiple of GemmTile<Scalar>::lanes. Panels of `width` columns outside,
/// row tiles inside, so a panel of B (depth x width) stays in L1 while the rows of A stream.
/// When `prefetch` is given, each tile advances it by SpreadPrefetch::kLinesPerTile lines.
/// Cost: 2 m n depth flops (about half that with a triangle), no allocation.
template <class Scalar, bool Accumulate>
void small_gemm(Index m, Index n, Index depth, const Scalar* A, Index lda, const Scalar* B,
                Index ldb, Scalar* C, Index ldc, Triangle triangle = Triangle::none,
                const Scalar* row_scale = nullptr, SpreadPrefetch* prefetch = nullptr) noexcept {
  using Tile = GemmTile<Scalar>;
  static constexpr auto table =
      gemm_tile_table<Scalar, Accumulate>(std::make_integer_sequence<int, Tile::rows * Tile::packets>{});
  for (Index c0 = 0; c0 < n; c0 += Tile::width) {
    const Index panel = std::min<Index>(Tile::width, n - c0);
    for (Index i0 = 0; i0 < m; i0 += Tile::rows) {
      const Index mr = std::min<Index>(Tile::rows, m - i0);
      Index cols = panel, inner = depth;
      if (triangle == Triangle::lower_result) {
        const Index last_col = i0 + mr;  // columns [0, i0 + mr) hold the wanted entries
        if (last_col <= c0) continue;
        const Index wanted = (last_col - c0 + Tile::lanes - 1) / Tile::lanes * Tile::lanes;
        cols = std::min(panel, wanted);
      } else if (triangle == Triangle::lower_lhs) {
        inner = std::min(depth, i0 + mr);
      }
      const auto tile = table[static_cast<std::size_t>((mr - 1) * Tile::packets + cols / Tile::lanes - 1)];
      tile(inner, A + i0 * lda, lda, B + c0, ldb, C + i0 * ldc + c0, ldc,
           row_scale != nullptr ? row_scale + i0 : nullptr);
      if (prefetch != nullptr) prefetch->advance(SpreadPrefetch::kLinesPerTile);
    }
  }
}

/// dst (cols x rows, row stride ldd) = src^T for src (rows x cols, row stride lds), both
/// row-major: square blocks of lanes x lanes are transposed in registers (Eigen's ptranspose),
/// the edges element by element. A plain transposed copy moves one scalar per strided store,
/// which cost the chunked kernel a tenth of its time.
// PacketBlock<Packet, N> drops the vector type's alignment attribute, as it does in Eigen's own
// kernels; harmless here (the block lives in registers) but g++ warns about it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
template <class Scalar>
void transpose_into(Index rows, Index cols, const Scalar* src, Index lds, Scalar* dst,
                    Index ldd) noexcept {
  using namespace Eigen::internal;
  using Packet = typename GemmTile<Scalar>::Packet;
  constexpr Index L = GemmTile<Scalar>::lanes;
  const Index full_rows = rows - rows % L, full_cols = cols - cols % L;
  for (Index i0 = 0; i0 < full_rows; i0 += L) {
    for (Index j0 = 0; j0 < full_cols; j0 += L) {
      PacketBlock<Packet, static_cast<int>(L)> block;
      for (Index i = 0; i < L; ++i) block.packet[i] = ploadu<Packet>(src + (i0 + i) * lds + j0);
      ptranspose(block);
      for (Index j = 0; j < L; ++j) pstoreu(dst + (j0 + j) * ldd + i0, block.packet[j]);
    }
  }
  for (Index i = 0; i < rows; ++i) {
    const Index j_start = i < full_rows ? full_cols : 0;
    for (Index j = j_start; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace linattn::detail
