#pragma once
// Small Eigen helpers shared by the public headers.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

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

}  // namespace linattn::detail
