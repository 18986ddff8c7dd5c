#pragma once
// Software prefetches for the streaming paths: the next block's input rows (read) and the next
// output rows (write). Hints only: they change no result, and compile to nothing where the
// compiler has no __builtin_prefetch.

#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>

namespace linattn::detail {

/// Asks for rows [first, first + n) of a row-major matrix or view (clipped to its rows) to be
/// brought towards the core (into L2), for reading. One head's rows in a model's [T, H d]
/// buffer lie H d apart, a stride the hardware prefetchers follow poorly across pages, so
/// without this each row of the next block is fetched from L3 or memory one line at a time
/// when the feature map reaches it. Does nothing for other storage orders.
template <class M>
void prefetch_rows(const M& m, Index first, Index n) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if constexpr (bool(M::IsRowMajor) && (int(Eigen::internal::traits<M>::Flags) & Eigen::DirectAccessBit) &&
                M::InnerStrideAtCompileTime == 1) {
    constexpr Index kLine = 64;
    const Index last = std::min(first + n, Index(m.rows()));
    const Index bytes = Index(m.cols()) * Index(sizeof(typename M::Scalar));
    for (Index i = first; i < last; ++i) {
      const char* row = reinterpret_cast<const char*>(m.data() + i * Index(m.outerStride()));
      for (Index b = 0; b < bytes; b += kLine) __builtin_prefetch(row + b, 0, 2);
    }
  } else {
    static_cast<void>(m);
    static_cast<void>(first);
    static_cast<void>(n);
  }
#else
  static_cast<void>(m);
  static_cast<void>(first);
  static_cast<void>(n);
#endif
}

/// Asks for the cache lines of [p, p + n) in a writable state, so that the output stores at the
/// end of a sweep do not wait for them: an output row that is not in cache (the next row of a
/// large [T, H*dv] buffer, say) otherwise holds up every store after it until its lines arrive,
/// since stores leave the store buffer in order, and the next token's sweep stalls behind them.
template <class Scalar>
void prefetch_for_write(Scalar* p, Index n) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  constexpr Index kLine = 64;
  char* const bytes = reinterpret_cast<char*>(p);
  const Index size = n * static_cast<Index>(sizeof(Scalar));
  for (Index b = 0; b < size; b += kLine) __builtin_prefetch(bytes + b, 1, 3);
#else
  static_cast<void>(p);
  static_cast<void>(n);
#endif
}

}  // namespace linattn::detail
