#pragma once
// Asking Linux for transparent huge pages on the large blocks the library keeps: for the
// backward, the delta rules' rebuilt or saved forward data (DeltaSavedStates: 5 KiB per token
// at r = dv = 128 in float) and a SavedForward's chunk states; for the sequence-parallel
// prefill, the head-major copies of a rank's slices (head_major_stage.hpp, which also faults
// its blocks in at once with prefault_pages).
//
// Such a block is written once per call and read back once, a few hundred bytes per row, so
// with 4 KiB pages every pass over it takes a TLB miss per page, and a freshly allocated block
// faults in 4 KiB at a time. Where the kernel gives transparent huge pages only on request
// ("madvise" in /sys/kernel/mm/transparent_hugepage/enabled, the default of many
// distributions), madvise(MADV_HUGEPAGE) over the block's whole 2 MiB pages asks for them: the
// pages touched after the call are 2 MiB ones when the kernel has them. Measured on a Zen 5 VM
// (PVM hypervisor, huge pages on request), Delta's backward at r = dv = 128, T = 8192: 43 ms
// -> 25 ms with a BackwardWorkspace, 115 ms -> 30 ms without one (docs/gradients.md). A hint
// only: the results are the same bits, and nothing changes where the kernel refuses or gives
// huge pages anyway, on other systems, or for blocks under 4 MiB.

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace linattn::detail {

/// Blocks smaller than this are left alone: they span at most one whole huge page.
inline constexpr std::size_t kHugePageAdviceBytes = std::size_t(4) << 20;

#if defined(__linux__)
/// madvise(advice) over the whole `unit`-sized pages inside [data, data + bytes) (madvise wants
/// a page-aligned range), for blocks of kHugePageAdviceBytes or more; the result is ignored
/// (these are hints).
inline void advise_whole_pages(const void* data, std::size_t bytes, std::uintptr_t unit,
                               int advice) noexcept {
  if (data == nullptr || bytes < kHugePageAdviceBytes) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t first = (begin + unit - 1) & ~(unit - 1);
  const std::uintptr_t last = (begin + bytes) & ~(unit - 1);
  if (last > first) static_cast<void>(madvise(reinterpret_cast<void*>(first), last - first, advice));
}
#endif

/// Asks for transparent huge pages on the whole 2 MiB pages inside [data, data + bytes) (Linux;
/// a no-op elsewhere, for small blocks, or where the kernel refuses). Call it right after
/// allocating the block, before its first write, for the first touch to take huge pages.
inline void advise_huge_pages(const void* data, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  advise_whole_pages(data, bytes, std::uintptr_t(2) << 20, MADV_HUGEPAGE);
#else
  static_cast<void>(data);
  static_cast<void>(bytes);
#endif
}

/// Faults in the pages of [data, data + bytes) now, writable, in one call (Linux 5.14 and later:
/// madvise(MADV_POPULATE_WRITE)) instead of one page fault at each page's first write, for
/// blocks of kHugePageAdviceBytes or more that the caller is about to write in full. Call it
/// after advise_huge_pages. A no-op elsewhere, for small blocks, or where the kernel refuses
/// (the pages then fault in at first touch, as without it).
inline void prefault_pages(void* data, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  advise_whole_pages(data, bytes, 4096, MADV_POPULATE_WRITE);
#else
  static_cast<void>(data);
  static_cast<void>(bytes);
#endif
}

/// m.resize(rows, cols) for a dense Eigen matrix, with advise_huge_pages on the memory when the
/// resize allocated it (its size changed), before anything writes to it.
template <class Matrix, class Rows, class Cols>
void resize_with_huge_pages(Matrix& m, Rows rows, Cols cols) {
  const auto before = m.size();
  m.resize(rows, cols);
  if (m.size() != before)
    advise_huge_pages(m.data(), static_cast<std::size_t>(m.size()) * sizeof(*m.data()));
}

}  // namespace linattn::detail
