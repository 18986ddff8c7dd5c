#pragma once
// The tuned recurrent kernel: one token's state update and read in a single sweep over S.

#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <type_traits>

namespace linattn::detail {

/// Columns of S handled per pass: 256 bytes, i.e. four AVX-512 or eight AVX2 registers of
/// accumulators, plus as many for the matching slice of v. Wide enough that the read's
/// accumulation chains (one per register) hide the FMA latency, narrow enough to stay in
/// registers next to the loaded row slice.
template <class Scalar>
inline constexpr int sweep_width = static_cast<int>(256 / sizeof(Scalar));

/// Columns [c0, c0 + w) of the sweep. W > 0: a full slice of compile-time width W (w == W).
/// W == 0: the remainder, w < sweep_width, held in fixed-capacity arrays so nothing is
/// allocated.
/// Rows go upwards or downwards (`reverse`); see update_and_read for why.
template <int W, class Scalar>
void sweep_columns(Scalar* S, Index ld, Index r, Index c0, Index w, const Scalar* qf,
                   const Scalar* kf, const Scalar* v, Scalar* y, bool reverse) noexcept {
  constexpr bool fixed = W > 0;
  constexpr int Cap = fixed ? W : sweep_width<Scalar>;
  using Slice = std::conditional_t<fixed, Eigen::Array<Scalar, Cap, 1>,
                                   Eigen::Array<Scalar, Eigen::Dynamic, 1, Eigen::ColMajor, Cap, 1>>;
  using SliceMap = Eigen::Map<Slice>;
  using ConstSliceMap = Eigen::Map<const Slice>;
  const ConstSliceMap vmap(v + c0, w);
  const Slice vs = vmap;
  Slice acc = Slice::Zero(w);
  const auto row = [&](Index i) {
    SliceMap s(S + i * ld + c0, w);
    s += kf[i] * vs;   // S_i <- S_i + phi(k)_i v
    acc += qf[i] * s;  // y += phi(q)_i S_i, reading the updated row while it is in registers
  };
  if (reverse) {
    for (Index i = r - 1; i >= 0; --i) row(i);
  } else {
    for (Index i = 0; i < r; ++i) row(i);
  }
  SliceMap(y + c0, w) = acc;
}

/// S += kf^T v and y = qf S (the updated S) in one pass: each element of S is loaded once,
/// updated, stored, and used for the read while still in a register. 4 r dv flops; S (r x dv,
/// row stride ld) is read and written once. All pointers address contiguous rows.
///
/// `reverse` walks the sweep backwards. Alternating it between tokens makes the start of one
/// sweep reuse what the end of the previous sweep left in L1: when S is larger than L1 (r = dv
/// = 128 in float is 64 KiB), a same-direction sweep misses L1 on every line (LRU evicts each
/// line just before it is needed again), while alternating keeps most of L1 useful. It changes
/// only the order of the read's sum, so results agree to rounding either way.
template <class Scalar>
void update_and_read(Scalar* S, Index ld, Index r, Index dv, const Scalar* qf, const Scalar* kf,
                     const Scalar* v, Scalar* y, bool reverse) noexcept {
  constexpr int W = sweep_width<Scalar>;
  const Index full = dv - dv % W;
  if (!reverse) {
    for (Index c0 = 0; c0 < full; c0 += W) sweep_columns<W>(S, ld, r, c0, W, qf, kf, v, y, false);
    if (full < dv) sweep_columns<0>(S, ld, r, full, dv - full, qf, kf, v, y, false);
  } else {
    if (full < dv) sweep_columns<0>(S, ld, r, full, dv - full, qf, kf, v, y, true);
    for (Index c0 = full - W; c0 >= 0; c0 -= W) sweep_columns<W>(S, ld, r, c0, W, qf, kf, v, y, true);
  }
}

/// Pointer to the elements of vector `x` if they are contiguous, else to a copy in the 1 x n
/// row `scratch` (a row of a column-major matrix, say). The copy is n scalars, no allocation.
template <class X, class Scalar>
const Scalar* contiguous_data(const X& x, RowMatrix<Scalar>& scratch) {
  if constexpr (X::InnerStrideAtCompileTime == 1) {
    return x.data();
  } else {
    scratch = x;
    return scratch.data();
  }
}

/// One recurrent token on features, tuned: z_next = z + kf, divisor from qf . z_next (checked
/// before anything changes, so a DenominatorError leaves S and z as they were), then the fused
/// sweep, then y /= divisor. `qf`, `kf` (length r), `v`, `y` (length dv) are contiguous.
/// `z_next` is r scratch. No allocation.
template <class Scalar>
void recurrent_token_fused(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                           const Scalar* qf, const Scalar* kf, const Scalar* v, Scalar* y,
                           const Normalization& norm, Index row, bool reverse) {
  const Index r = S.rows(), dv = S.cols();
  const Eigen::Map<const ColVector<Scalar>> q(qf, r), k(kf, r);
  z_next = z + k;
  const Scalar divisor = norm.divisor(static_cast<Scalar>(q.dot(z_next)), row);
  update_and_read(S.data(), dv, r, dv, qf, kf, v, y, reverse);
  z.swap(z_next);
  if (norm.divides()) Eigen::Map<RowVector<Scalar>>(y, dv) /= divisor;
}

}  // namespace linattn::detail
