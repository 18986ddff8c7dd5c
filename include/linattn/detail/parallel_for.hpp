#pragma once
// The one place linattn may use threads: a loop over independent work items (sequence, head
// pairs), split with OpenMP when the translation unit is compiled with it, serial otherwise.

#include <linattn/types.hpp>

#include <algorithm>
#include <exception>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linattn::detail {

/// True when this translation unit was compiled with OpenMP (-fopenmp).
inline constexpr bool openmp_enabled =
#ifdef _OPENMP
    true;
#else
    false;
#endif

/// Threads a loop over n items will use for a requested count (0 = the OpenMP default).
inline int team_size(Index n, int requested) {
#ifdef _OPENMP
  const int wanted = requested > 0 ? requested : omp_get_max_threads();
  return static_cast<int>(std::max<Index>(1, std::min<Index>(n, wanted)));
#else
  static_cast<void>(n);
  static_cast<void>(requested);
  return 1;
#endif
}

/// Calls f(i) for i in [0, n), each item on exactly one thread. Results are bit-identical for
/// any thread count because an item is computed start to finish by one thread with the same
/// operations; the schedule only decides which thread.
///
/// Every item runs even if another throws; afterwards the exception of the lowest failing
/// index is rethrown, so what is thrown and which items completed do not depend on threads.
///
/// Threads: with a team of one (requested == 1, or n <= 1) no thread is created. Inside our
/// team each thread sets its own nthreads-var to 1 (a per-task setting in OpenMP) so that
/// Eigen's GEMM, which opens an OpenMP region of its own when it is not already inside a team
/// of more than one, stays on the calling thread instead of spawning more.
template <class F>
void parallel_for(Index n, int requested_threads, F&& f) {
  std::exception_ptr first_error;
  Index first_index = n;
  auto run = [&](Index i) {
    try {
      f(i);
    } catch (...) {
#ifdef _OPENMP
#pragma omp critical(linattn_parallel_for_error)
#endif
      if (i < first_index) {
        first_index = i;
        first_error = std::current_exception();
      }
    }
  };
#ifdef _OPENMP
  const int team = team_size(n, requested_threads);
#pragma omp parallel num_threads(team)
  {
    omp_set_num_threads(1);
#pragma omp for schedule(dynamic, 1)
    for (Index i = 0; i < n; ++i) run(i);
  }
#else
  static_cast<void>(requested_threads);
  for (Index i = 0; i < n; ++i) run(i);
#endif
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace linattn::detail
