#pragma once
// Helpers shared by the MPI test files (mpi_test.cpp, mpi_pipeline_test.cpp,
// mpi_gradients_test.cpp): this rank and its slice, digests and bit comparisons across ranks,
// [B, T, H, d] buffers in either layout, and the check that every rank threw the same exception.

#include <catch2/catch.hpp>

#include <linattn/mpi.hpp>
#include <linattn/tensor_view.hpp>

#include <mpi.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace linattn_test {

using linattn::Index;
using linattn::RowMatrix;
using linattn::TensorView;

struct World {
  int rank = 0, size = 1;
};
inline World world() {
  World w;
  MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  return w;
}

// This rank's rows [offset, offset + length) of a sequence split at `lengths`.
struct Slice {
  Index offset = 0, length = 0;
};
inline Slice slice_of(const std::vector<Index>& lengths, int rank) {
  Slice s;
  for (int p = 0; p < rank; ++p) s.offset += lengths[std::size_t(p)];
  s.length = lengths[std::size_t(rank)];
  return s;
}

inline std::uint64_t fnv1a(const void* data, std::size_t bytes, std::uint64_t h = 1469598103934665603ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}
template <class M>
std::uint64_t digest(const M& m, std::uint64_t h = 1469598103934665603ULL) {
  return fnv1a(m.data(), sizeof(typename M::Scalar) * std::size_t(m.size()), h);
}
// same_bits: test_support.hpp.

// Every rank's value, in rank order.
inline std::vector<std::uint64_t> gather(std::uint64_t mine) {
  std::vector<std::uint64_t> all(std::size_t(world().size));
  MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  return all;
}
inline bool same_on_every_rank(std::uint64_t mine) {
  for (std::uint64_t x : gather(mine))
    if (x != mine) return false;
  return true;
}
inline bool same_on_every_rank(const std::string& text) { return same_on_every_rank(fnv1a(text.data(), text.size())); }

// The rules' per-token inputs cut to rows [first, first + n).
template <class... In>
auto rows_of(Index first, Index n, const In&... in) {
  static_cast<void>(first);
  static_cast<void>(n);
  return std::make_tuple(RowMatrix<typename In::Scalar>(in.middleRows(first, n))...);
}

enum class Layout { batch_first, head_first };

// A [B, T, H, d] buffer in `layout`.
template <class Scalar>
struct Buffer {
  std::vector<Scalar> data;
  Index B = 0, T = 0, H = 0, d = 0;
  Layout layout = Layout::batch_first;

  Buffer(Layout l, Index B_, Index T_, Index H_, Index d_, const RowMatrix<Scalar>& values)
      : data(values.data(), values.data() + values.size()), B(B_), T(T_), H(H_), d(d_), layout(l) {}
  template <class E>
  TensorView<E> view(E* p) const {
    return layout == Layout::batch_first ? TensorView<E>::batch_first(p, B, T, H, d)
                                         : TensorView<E>::head_first(p, B, H, T, d);
  }
  // Rows [t0, t0 + n) of every entry, with the full buffer's strides.
  TensorView<const Scalar> rows(Index t0, Index n) const {
    const auto full = view<const Scalar>(data.data());
    return TensorView<const Scalar>(n == 0 ? data.data() : &full(0, t0, 0, 0), {B, n, H, d}, full.strides());
  }
  TensorView<Scalar> out_rows(Index t0, Index n) {
    const auto full = view<Scalar>(data.data());
    return TensorView<Scalar>(n == 0 ? data.data() : &full(0, t0, 0, 0), {B, n, H, d}, full.strides());
  }
  // Rows [first, first + n) of head h of entry b, as a contiguous matrix.
  RowMatrix<Scalar> cut(Index b, Index h, Index first, Index n) const {
    const auto full = view<const Scalar>(data.data());
    RowMatrix<Scalar> m(n, d);
    for (Index t = 0; t < n; ++t)
      for (Index c = 0; c < d; ++c) m(t, c) = full(b, first + t, h, c);
    return m;
  }
};

struct InputSpec {
  bool per_channel;
  double lo, hi;
};

// Calls `call`, which must throw E on this rank; checks that every rank threw the same message
// and returns it. Every rank reaching the check proves no rank is left inside the call.
template <class E, class F>
std::string every_rank_throws(F&& call) {
  std::string message = "(nothing was thrown)";
  bool caught = false;
  try {
    call();
  } catch (const E& e) {
    message = e.what();
    caught = true;
  }
  CHECK(caught);
  CHECK(same_on_every_rank(message));
  return message;
}

}  // namespace linattn_test
