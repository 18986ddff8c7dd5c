// Compiled to assembly by ctest (static.prefetch_loops_are_kept): passes when the output has a
// prefetch instruction. prefetch_rows is a loop of prefetches and nothing else, which g++ 12
// deleted as dead code at -O1 and above (prefetches and all) until detail::keep_prefetch_loop
// was added: this file then compiled to a function without one.
#include <linattn/detail/prefetch.hpp>

using Rows = Eigen::Map<const linattn::RowMatrix<float>, 0, Eigen::OuterStride<>>;

void probe_prefetch_rows(const Rows& rows, linattn::Index first, linattn::Index n) {
  linattn::detail::prefetch_rows(rows, first, n);
}
