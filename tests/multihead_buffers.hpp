#pragma once
// Multi-head test buffers: flat [B, T, H, d] or [B, H, T, d] vectors, addressed by an index
// formula written out independently of TensorView, so the tests check the library's views
// against it (shared by multihead_test.cpp and multihead_gradients_test.cpp).

#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>

#include "test_support.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace linattn_test {

using linattn::Index;
using linattn::RowMatrix;
using linattn::TensorView;

enum class Layout { batch_first, head_first };

// Flat offset of element (b, t, h, c) of a row-major [B, T, H, d] or [B, H, T, d] buffer,
// written out independently of TensorView.
Index flat(Layout l, Index b, Index t, Index h, Index c, Index T, Index H, Index d) {
  return l == Layout::batch_first ? ((b * T + t) * H + h) * d + c : ((b * H + h) * T + t) * d + c;
}

template <class Scalar>
std::vector<Scalar> random_buffer(Index n, std::uint64_t seed) {
  const auto m = linattn_test::random_matrix<Scalar>(1, n, seed);
  return {m.data(), m.data() + n};
}

template <class Scalar>
TensorView<Scalar> view(Layout l, Scalar* p, Index B, Index T, Index H, Index d) {
  return l == Layout::batch_first ? TensorView<Scalar>::batch_first(p, B, T, H, d)
                                  : TensorView<Scalar>::head_first(p, B, H, T, d);
}

// Rows [first, first + n) of head h of entry b, copied into a contiguous matrix.
template <class Scalar>
RowMatrix<Scalar> cut(const std::vector<Scalar>& buf, Layout l, Index b, Index h, Index first,
                      Index n, Index T, Index H, Index d) {
  RowMatrix<Scalar> m(n, d);
  for (Index t = 0; t < n; ++t)
    for (Index c = 0; c < d; ++c)
      m(t, c) = buf[static_cast<std::size_t>(flat(l, b, first + t, h, c, T, H, d))];
  return m;
}

}  // namespace linattn_test
