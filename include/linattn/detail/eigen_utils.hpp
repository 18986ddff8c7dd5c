#pragma once
// Small Eigen helpers shared by the public headers.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn::detail {

/// A view of `x` when it already has storage (matrix, Map, Block, Ref), otherwise its value.
/// Lets later code take middleRows() of a product expression without re-evaluating it per
/// block, while never copying an input that can be read in place.
template <class Derived>
decltype(auto) materialize(const Eigen::MatrixBase<Derived>& x) {
  if constexpr ((Derived::Flags & Eigen::DirectAccessBit) != 0) {
    return (x.derived());
  } else {
    return typename Derived::PlainObject(x);
  }
}

/// out = f(in) for two rows of n scalars (vectors, any strides; `out` may be `in`), where f
/// builds an elementwise Eigen array expression whose packet and scalar forms may round
/// differently (Eigen's exp, sin, cos against std::exp, ...): every element takes the packet
/// form, wherever the rows lie. Eigen's own loop would start its packets at the destination's
/// first aligned element and take the elements before it and the tail one by one, so an
/// element's bits would follow its address (docs/design.md, "Same bits"). The whole packets of
/// a destination that starts on a packet boundary are written directly (in and out
/// contiguous); everything else is evaluated in an aligned stack buffer padded to whole packets
/// (256 scalars at a time) and copied out. No allocation; cost: f, plus two copies of what goes
/// through the buffer.
template <class InRow, class OutRow, class F>
void map_row_uniformly(const InRow& in, OutRow&& out, const F& f) {
  using Out = std::remove_cvref_t<OutRow>;
  using Scalar = typename Out::Scalar;
  using Row = Eigen::Array<Scalar, 1, Eigen::Dynamic>;
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr Index kPacket = Index(sizeof(Packet) / sizeof(Scalar));
  constexpr Index kSegment = 256;
  static_assert(kSegment % kPacket == 0);
  const Index n = out.size();
  Index done = 0;
  if constexpr (Out::InnerStrideAtCompileTime == 1 && InRow::InnerStrideAtCompileTime == 1 &&
                (Out::Flags & Eigen::DirectAccessBit) != 0 &&
                (InRow::Flags & Eigen::DirectAccessBit) != 0) {
    if (reinterpret_cast<std::uintptr_t>(out.data()) % sizeof(Packet) == 0) {
      done = n / kPacket * kPacket;
      Eigen::Map<Row>(out.data(), done) = f(Eigen::Map<const Row>(in.data(), done));
    }
  }
  alignas(64) Scalar buffer[kSegment];
  for (Index start = done; start < n; start += kSegment) {
    const Index length = std::min(kSegment, n - start);
    const Index padded = (length + kPacket - 1) / kPacket * kPacket;
    Eigen::Map<Row> segment(buffer, padded);
    segment.head(length) = in.segment(start, length).array();
    segment.tail(padded - length).setZero();  // evaluated and dropped
    segment = f(segment);  // elementwise: reading and writing one buffer is safe
    out.segment(start, length) = segment.head(length).matrix();
  }
}

/// Whether every row of X lies contiguously in memory: storage (direct access), row-major (or
/// a row vector), inner stride 1.
template <class X>
constexpr bool has_contiguous_rows() {
  if constexpr ((X::Flags & Eigen::DirectAccessBit) != 0)
    return bool(X::IsRowMajor) && X::InnerStrideAtCompileTime == 1;
  else
    return false;
}

/// out = f(x) elementwise for T x n matrices (any layouts; `out` may be `x`) with
/// map_row_uniformly's guarantee: every element in the packet form, wherever the matrices lie.
/// When `out` is one contiguous row-major block it is mapped as one vector of T n scalars (x
/// copied into it first unless x is such a block too), so short rows pay no per-row overhead.
template <class In, class Out, class F>
void map_rows_uniformly(const In& x, Out& out, const F& f) {
  using Scalar = typename Out::Scalar;
  using Flat = Eigen::Map<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>;
  using ConstFlat = Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>;
  constexpr bool x_direct = (In::Flags & Eigen::DirectAccessBit) != 0;
  constexpr auto row_block = [](const auto& m) {
    if constexpr (has_contiguous_rows<std::remove_cvref_t<decltype(m)>>())
      return m.outerStride() == m.cols() || m.rows() <= 1;
    else
      return false;
  };
  if (row_block(out)) {
    const Index size = out.rows() * out.cols();
    if constexpr (x_direct && std::is_same_v<typename In::Scalar, Scalar>) {
      if (row_block(x)) {
        map_row_uniformly(ConstFlat(x.data(), size), Flat(out.data(), size), f);
        return;
      }
    }
    out = x;
    map_row_uniformly(Flat(out.data(), size), Flat(out.data(), size), f);
    return;
  }
  if constexpr (x_direct) {
    for (Index i = 0; i < x.rows(); ++i) map_row_uniformly(x.row(i), out.row(i), f);
  } else {
    out = x;  // an expression, evaluated once
    for (Index i = 0; i < out.rows(); ++i) map_row_uniformly(out.row(i), out.row(i), f);
  }
}

/// Calls f(t, row) for each row t of x, each row as contiguous scalars: where x's rows are not
/// (a column-major or strided x, an expression), each is first copied into one buffer, on the
/// stack for rows of up to 256 scalars (so a decode step allocates nothing), else allocated
/// once per call. Why: Eigen sums a reduction over a contiguous row (norm, dot) in packets from
/// its first element and over a strided row one element at a time, so a row's norm would
/// follow the caller's storage order (docs/design.md, "Same bits").
template <class X, class F>
void for_each_contiguous_row(const X& x, const F& f) {
  if constexpr (has_contiguous_rows<X>()) {
    for (Index t = 0; t < x.rows(); ++t) f(t, x.row(t));
  } else {
    using Scalar = typename X::Scalar;
    constexpr Index kOnStack = 256;
    const Index n = x.cols();
    alignas(64) std::array<Scalar, kOnStack> on_stack;
    std::vector<Scalar> on_heap(n > kOnStack ? static_cast<std::size_t>(n) : 0);
    Eigen::Map<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>> row(n > kOnStack ? on_heap.data() : on_stack.data(), n);
    for (Index t = 0; t < x.rows(); ++t) {
      row = x.row(t);
      f(t, std::as_const(row));
    }
  }
}

/// Copies a row or column vector into the 1 x n row `dst`; throws ShapeError naming `what`
/// if `src` is not a vector of length n.
template <class Dst, class Src>
void copy_as_row(Dst& dst, const Eigen::MatrixBase<Src>& src, const char* what) {
  const Index n = dst.cols();
  if (!(src.rows() == 1 || src.cols() == 1) || src.size() != n)
    throw_shape_error(what, " must be a vector of length ", n, ", got ", shape_of(src));
  if (src.rows() == 1)
    dst = src;
  else
    dst = src.transpose();
}

/// True if the n values at p are all finite: x * 0 is (+-)0 for a finite x and NaN for NaN or
/// Inf, and a NaN term makes a sum NaN, so the sum of x * 0 in any order is 0 exactly when all
/// are finite. Four packet accumulators keep the adds independent (a state's check then runs
/// at load speed, not at the latency of one chain of adds).
template <class Scalar>
bool all_finite(const Scalar* p, Index n) noexcept {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<Scalar>::type;
  constexpr Index N = static_cast<Index>(sizeof(Packet) / sizeof(Scalar));  // Scalar: 1
  const Packet zero = ei::pset1<Packet>(Scalar(0));
  Packet a0 = zero, a1 = zero, a2 = zero, a3 = zero;
  Index i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    a0 = ei::padd(a0, ei::pmul(ei::ploadu<Packet>(p + i), zero));
    a1 = ei::padd(a1, ei::pmul(ei::ploadu<Packet>(p + i + N), zero));
    a2 = ei::padd(a2, ei::pmul(ei::ploadu<Packet>(p + i + 2 * N), zero));
    a3 = ei::padd(a3, ei::pmul(ei::ploadu<Packet>(p + i + 3 * N), zero));
  }
  for (; i + N <= n; i += N) a0 = ei::padd(a0, ei::pmul(ei::ploadu<Packet>(p + i), zero));
  Scalar sum = ei::predux(ei::padd(ei::padd(a0, a1), ei::padd(a2, a3)));
  for (; i < n; ++i) sum += p[i] * Scalar(0);
  return sum == Scalar(0);
}

/// True if every coefficient of `x` is finite (no NaN, no Inf); true for an empty x. Storage
/// with unit inner stride (matrices, Maps, blocks, Refs) is read by the packet loop above, one
/// contiguous run per row (row-major) or column, or one run when there are no gaps; any other
/// expression by one Eigen reduction of x * 0. Eigen's allFinite() walks the coefficients one
/// by one with an early exit, 6 to 13 x slower on a 64 x 64 float state (checked per decode call).
template <class Derived>
bool all_finite(const Eigen::DenseBase<Derived>& x) {
  using Scalar = typename Derived::Scalar;
  if (x.size() == 0) return true;  // (its data pointer may be null: no offset from it)
  if constexpr ((Derived::Flags & Eigen::DirectAccessBit) != 0) {
    const Derived& d = x.derived();
    if (d.innerStride() == 1) {
      if (d.outerStride() == d.innerSize() || d.outerSize() <= 1)
        return all_finite(d.data(), d.size());
      for (Index o = 0; o < d.outerSize(); ++o)
        if (!all_finite(d.data() + o * d.outerStride(), d.innerSize())) return false;
      return true;
    }
  }
  return (x.derived().array() * Scalar(0)).sum() == Scalar(0);
}

/// True if the ranges [a, a + n) and [b, b + m) share an element.
template <class Scalar>
bool overlaps(const Scalar* a, Index n, const Scalar* b, Index m) noexcept {
  const auto begin_a = reinterpret_cast<std::uintptr_t>(a);
  const auto begin_b = reinterpret_cast<std::uintptr_t>(b);
  const auto end_a = begin_a + static_cast<std::uintptr_t>(n) * sizeof(Scalar);
  const auto end_b = begin_b + static_cast<std::uintptr_t>(m) * sizeof(Scalar);
  return n > 0 && m > 0 && begin_a < end_b && begin_b < end_a;
}

/// c = a b (or c += a b with Accumulate) with bits that do not depend on c's address. For
/// products this small (rows + columns + depth below EIGEN_GEMM_TO_COEFFBASED_THRESHOLD, 20)
/// Eigen computes coefficient by coefficient, in packets from each row's first aligned element
/// of c and one by one before it; a packet's multiply-add may be fused (FMA) where the scalar
/// form rounds twice, so the bits of c(i, j) would follow c's address (a caller's buffer, a
/// view into a batch). Here each coefficient is one plain sum over the depth in order, the same
/// wherever c sits. Larger products go to Eigen's GEMM, whose blocks start at c's first row and
/// column whatever the address. Cost: 2 m n depth flops either way.
template <bool Accumulate, class C, class A, class B>
void product_into(C&& c, const Eigen::MatrixBase<A>& a, const Eigen::MatrixBase<B>& b) {
  using Scalar = typename std::remove_cvref_t<C>::Scalar;
  const Index m = c.rows(), n = c.cols(), depth = a.cols();
  if (m + n + depth >= EIGEN_GEMM_TO_COEFFBASED_THRESHOLD || depth == 0) {
    if constexpr (Accumulate)
      c.noalias() += a * b;
    else
      c.noalias() = a * b;
    return;
  }
  for (Index i = 0; i < m; ++i)
    for (Index j = 0; j < n; ++j) {
      Scalar sum(0);
      for (Index k = 0; k < depth; ++k) sum += a.coeff(i, k) * b.coeff(k, j);
      if constexpr (Accumulate)
        c.coeffRef(i, j) += sum;
      else
        c.coeffRef(i, j) = sum;
    }
}

/// `x`, a row or column vector of length n = scratch.cols(), as a 1 x n row: a view of x's own
/// elements when they are adjacent in memory (a row of a row-major matrix, a VectorX, a
/// contiguous Map or Ref) and do not overlap `written` (the output the caller writes while it
/// still reads the view), otherwise a view of a copy in the 1 x n row `scratch`. Saves a
/// decode step three copies; nothing is allocated either way. Throws ShapeError as
/// copy_as_row.
template <class Scalar, class Src>
Eigen::Map<const RowMatrix<Scalar>> row_view(const Eigen::MatrixBase<Src>& x,
                                             RowMatrix<Scalar>& scratch, const char* what,
                                             const Scalar* written, Index written_size) {
  const Index n = scratch.cols();
  if constexpr (std::is_same_v<typename Src::Scalar, Scalar> &&
                (Src::Flags & Eigen::DirectAccessBit) != 0) {
    if ((x.rows() == 1 || x.cols() == 1) && x.size() == n) {
      // Distance between consecutive elements of the vector, whichever way it is laid out.
      const Index step = x.rows() == 1 ? x.derived().colStride() : x.derived().rowStride();
      const Scalar* data = x.derived().data();
      if ((step == 1 || n <= 1) && !overlaps(data, n, written, written_size))
        return Eigen::Map<const RowMatrix<Scalar>>(data, 1, n);
    }
  }
  copy_as_row(scratch, x, what);
  return Eigen::Map<const RowMatrix<Scalar>>(scratch.data(), 1, n);
}

}  // namespace linattn::detail
