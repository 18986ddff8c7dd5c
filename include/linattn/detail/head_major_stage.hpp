#pragma once
// Head-major copies of a rank's token-major slices for the sequence-parallel prefill
// (linattn/mpi.hpp, Carry::stage_token_major).
//
// A model's [B, T, H, d] buffers hold one head's rows H d apart: with H d scalars of 4 KiB or
// more every row of a head lies on a page of its own, so a call that runs one head over all its
// rows (each item of the pipeline and summaries schedules does) touches a new page per row
// and input and spends its time in page walks and line-by-line fetches the hardware
// prefetchers do not start across pages. The single-process layer avoids that by running
// blocks of tokens outer and heads inner (MultiHeadAttention::prefill_block); the
// sequence-parallel schedules cannot, since the pipeline must finish item 0 before item 1 to
// hand its state on. So the rank copies its slice once, head-major (every page visited once),
// runs the items on contiguous rows, and copies the outputs back. Measured on a Zen 5 VM (one
// core, T = 32768, H = 8, d = 128, float): one head at a time on the token-major rows 0.31 s,
// on head-major copies 0.18 s.
//
// The copies walk the token-major buffers row by row, each row's pieces in address order (one
// sequential read per buffer, which the hardware prefetchers follow), and write with streaming
// stores where the copy is larger than the caches would keep (no read of the destination before
// it is overwritten, nothing useful evicted). Measured on the Zen 5 VM, both ranks copying at
// once (T = 32768, H = 8, d = 128, float, Q, K and V): 0.030 s in blocks of 64 rows per head
// with plain stores, 0.018 s row by row with streaming stores. The arithmetic reads the same
// values in the same order: same bits.

#include <linattn/detail/huge_pages.hpp>
#include <linattn/detail/slice_runner.hpp>
#include <linattn/detail/stream_store.hpp>
#include <linattn/types.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>
#include <vector>

namespace linattn::detail {

/// Copies of more bytes than this stream (stream_copy); smaller ones use plain stores, so the
/// items find their rows, and the caller its outputs, in the cache (16 MiB: more than a core's
/// share of the last-level cache on the machines measured).
inline constexpr std::size_t kStreamStageBytes = std::size_t(16) << 20;

/// Memory for the staged copies: grown when a slice is larger than any before, never shrunk,
/// cache-line aligned (streaming stores want whole, aligned lines). A block of 4 MiB or more is
/// aligned to 2 MiB, asks for transparent huge pages and has its pages faulted in by one call
/// (advise_huge_pages, prefault_pages) before the copies write it: a fresh block's first call
/// otherwise takes a page fault per 4 KiB, which is most of that call's time under a
/// hypervisor. Measured on the Zen 5 VM of docs/distributed.md (2 ranks, T = 65536, H = 8,
/// d = 128, float, 512 MiB of copies per rank): the first call 2.4 to 3.3 s with 4 KiB pages
/// faulted one at a time, 0.30 to 0.69 s (once 1.3 s) with huge pages faulted in advance; the
/// calls after it the same (0.17 to 0.23 s either way).
template <class Scalar>
class StageBuffer {
 public:
  /// Room for `scalars` elements from the returned pointer on, which is 64-byte aligned. O(1)
  /// when the buffer is large enough; otherwise allocates and faults in the new block.
  Scalar* reserve(Index scalars) {
    const std::size_t bytes = static_cast<std::size_t>(scalars) * sizeof(Scalar);
    if (bytes > capacity_) {
      // aligned_alloc wants a size that is a multiple of the alignment.
      const std::size_t align = bytes >= kHugePageAdviceBytes ? std::size_t(2) << 20 : 64;
      const std::size_t size = (bytes + align - 1) / align * align;
      memory_.reset();
      capacity_ = 0;
      memory_.reset(static_cast<Scalar*>(std::aligned_alloc(align, size)));
      if (!memory_) throw std::bad_alloc();
      capacity_ = size;
      advise_huge_pages(memory_.get(), size);
      prefault_pages(memory_.get(), size);
    }
    return memory_.get();
  }

  /// Bytes held now.
  [[nodiscard]] std::size_t bytes() const noexcept { return capacity_; }

  /// Frees the block; the next reserve allocates again.
  void release() noexcept {
    memory_.reset();
    capacity_ = 0;
  }

 private:
  struct Free {
    void operator()(Scalar* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<Scalar[], Free> memory_;
  std::size_t capacity_ = 0;
};

/// One piece of a row copy: `from` + row * from_stride to `to` + row * to_stride, `cols` long.
template <class Scalar>
struct RowCopy {
  const Scalar* from;
  Index from_stride;
  Scalar* to;
  Index to_stride, cols;
};

/// Runs pieces[begin, end) row by row for rows [0, T), each row's pieces in their order,
/// streaming when `stream` (the caller fences after its last streaming copy). O(T * sum of
/// cols).
template <class Scalar>
void copy_rows(const std::vector<RowCopy<Scalar>>& pieces, std::size_t begin, std::size_t end,
               Index T, bool stream) {
  for (Index row = 0; row < T; ++row)
    for (std::size_t i = begin; i < end; ++i) {
      const RowCopy<Scalar>& p = pieces[i];
      const Scalar* from = p.from + row * p.from_stride;
      Scalar* to = p.to + row * p.to_stride;
      if (stream)
        stream_copy(from, p.cols, to);
      else
        std::copy_n(from, p.cols, to);
    }
}

/// True when some item's rows are not contiguous and more than one item shares the buffers:
/// the case the copies are for.
template <class Scalar>
bool worth_staging(const std::vector<SliceItem<Scalar>>& items) {
  if (items.size() < 2) return false;
  for (const auto& item : items)
    if (item.keys.rows > 0 &&
        (item.keys.stride != item.keys.cols || item.values.stride != item.values.cols))
      return true;
  return false;
}

template <class Scalar>
struct HeadMajorStage;

/// The memory of the head-major copies (linattn::mpi::StageMemory): the inputs' block and the
/// outputs'. A stage that has one allocates nothing for a slice no larger than any before, so
/// objects that share one (calls one after the other, never at once) hold it once.
template <class Scalar>
class StageMemory {
 public:
  /// Bytes held now (0 until a call has staged).
  [[nodiscard]] std::size_t bytes() const noexcept { return inputs_.bytes() + outputs_.bytes(); }
  /// Frees both blocks; the next call that stages allocates them again.
  void release() noexcept {
    inputs_.release();
    outputs_.release();
  }

 private:
  friend struct HeadMajorStage<Scalar>;
  StageBuffer<Scalar> inputs_, outputs_;
};

/// The copies' plan for one call, and the memory they live in (its own unless the caller gave
/// one to share), kept by the caller from call to call so a repeated shape touches no new memory.
template <class Scalar>
struct HeadMajorStage {
  /// Consecutive items with the same number of rows (all of them in the batch layout; the
  /// state heads of one sequence in a packed one): their pieces are copy_in[in_begin, in_end)
  /// and copy_out[out_begin, out_end), `rows` rows each.
  struct Group {
    std::size_t in_begin, in_end, out_begin, out_end;
    Index rows;
  };
  std::shared_ptr<StageMemory<Scalar>> memory = std::make_shared<StageMemory<Scalar>>();
  std::vector<RowCopy<Scalar>> copy_in, copy_out;  // copy_out: the staged outputs back
  std::vector<Group> groups;
  bool active = false, stream_out = false;

  HeadMajorStage() = default;
  // Not copyable: a copy would share the memory, which two objects may share only by the
  // caller's choice. A move takes the memory (and any sharing) along; the moved-from stage makes
  // new memory if it stages again.
  HeadMajorStage(const HeadMajorStage&) = delete;
  HeadMajorStage& operator=(const HeadMajorStage&) = delete;
  HeadMajorStage(HeadMajorStage&&) noexcept = default;
  HeadMajorStage& operator=(HeadMajorStage&&) noexcept = default;
  ~HeadMajorStage() = default;

  /// Points every item's queries, keys, values and outputs at head-major copies (inputs copied
  /// now, outputs written by the call and copied back by finish()). Allocates when the
  /// slice is larger than any before. Items without rows are left alone.
  void stage(std::vector<SliceItem<Scalar>>& items) {
    active = false;
    copy_in.clear();
    copy_out.clear();
    groups.clear();
    if (!worth_staging(items)) return;
    if (!memory) memory = std::make_shared<StageMemory<Scalar>>();
    Index in_size = 0, out_size = 0;
    for (const auto& item : items) {
      for (const auto& q : item.queries) in_size += q.rows * q.cols;
      in_size += item.keys.rows * item.keys.cols + item.values.rows * item.values.cols;
      for (const auto& o : item.outputs) out_size += o.rows * o.cols;
    }
    // Each copy: its rows back to back, one after the other in the order of the items (queries,
    // keys, values; then the outputs); every copy starts on a cache line where cols *
    // sizeof(Scalar) is a multiple of one, as for d = 16, 32, ... in float.
    Scalar* in_at = memory->inputs_.reserve(in_size);
    Scalar* out_at = memory->outputs_.reserve(out_size);
    const auto stage_input = [&](RowsSpec<const Scalar>& s) {
      copy_in.push_back({s.data, s.stride, in_at, s.cols, s.cols});
      s = {in_at, s.rows, s.cols, s.cols};
      in_at += s.rows * s.cols;
    };
    for (std::size_t i = 0; i < items.size();) {
      const Index rows = items[i].keys.rows;
      std::size_t end = i + 1;
      while (end < items.size() && items[end].keys.rows == rows) ++end;
      if (rows > 0) {
        Group group{copy_in.size(), 0, copy_out.size(), 0, rows};
        for (std::size_t j = i; j < end; ++j) {
          for (auto& q : items[j].queries) stage_input(q);
          stage_input(items[j].keys);
          stage_input(items[j].values);
          for (auto& o : items[j].outputs) {
            copy_out.push_back({out_at, o.cols, o.data, o.stride, o.cols});
            o = {out_at, o.rows, o.cols, o.cols};
            out_at += o.rows * o.cols;
          }
        }
        group.in_end = copy_in.size();
        group.out_end = copy_out.size();
        // Each row's pieces in address order of the token-major side: read (inputs) or
        // written (outputs) sequentially.
        std::sort(copy_in.begin() + std::ptrdiff_t(group.in_begin), copy_in.end(),
                  [](const auto& a, const auto& b) { return std::less<const Scalar*>()(a.from, b.from); });
        std::sort(copy_out.begin() + std::ptrdiff_t(group.out_begin), copy_out.end(),
                  [](const auto& a, const auto& b) { return std::less<const Scalar*>()(a.to, b.to); });
        groups.push_back(group);
      }
      i = end;
    }
    const bool stream_in = std::size_t(in_size) * sizeof(Scalar) > kStreamStageBytes;
    for (const Group& g : groups)
      copy_rows(copy_in, g.in_begin, g.in_end, g.rows, stream_in);
    if (stream_in) stream_fence();
    stream_out = std::size_t(out_size) * sizeof(Scalar) > kStreamStageBytes;
    active = true;
  }

  /// Copies the staged outputs to the caller's buffers.
  void finish() {
    if (!active) return;
    active = false;
    for (const Group& g : groups)
      copy_rows(copy_out, g.out_begin, g.out_end, g.rows, stream_out);
    if (stream_out) stream_fence();
  }
};

}  // namespace linattn::detail
