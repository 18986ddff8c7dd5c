#pragma once
// Software prefetches for the streaming paths: the next block's input rows (read) and the next
// output rows (write). Hints only: they change no result, and compile to nothing where the
// compiler has no __builtin_prefetch.

#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>

namespace linattn::detail {

#if defined(__GNUC__) || defined(__clang__)
/// Called in every loop whose body is only prefetches, so that the loop is kept: g++ 12 at -O1
/// and above deletes such a loop as dead code, prefetches and all (clang keeps it), which left
/// prefetch_rows compiled to nothing in every g++ 12 build until this was added, and
/// prefetch_for_write in some callers (the write rules' recurrent passes). An empty volatile
/// asm is a side effect the compiler must keep; it emits no instruction and, with no memory
/// clobber, does not stop the compiler keeping values in registers across it.
inline void keep_prefetch_loop() noexcept { asm volatile(""); }
#endif

/// Whether M's rows lie contiguous in memory at a fixed stride (row-major, direct access, unit
/// inner stride): the matrices and views whose rows the prefetches below can address.
template <class M>
inline constexpr bool has_addressable_rows =
    bool(M::IsRowMajor) && (int(Eigen::internal::traits<M>::Flags) & Eigen::DirectAccessBit) &&
    M::InnerStrideAtCompileTime == 1;

/// Asks for rows [first, first + n) of a row-major matrix or view (clipped to its rows) to be
/// brought towards the core (into L2), for reading. One head's rows in a model's [T, H d]
/// buffer lie H d apart, a stride the hardware prefetchers follow poorly across pages, so
/// without this each row of the next block is fetched from L3 or memory one line at a time
/// when the feature map reaches it. Does nothing for other storage orders.
template <class M>
void prefetch_rows(const M& m, Index first, Index n) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if constexpr (has_addressable_rows<M>) {
    constexpr Index kLine = 64;
    const Index last = std::min(first + n, Index(m.rows()));
    const Index bytes = Index(m.cols()) * Index(sizeof(typename M::Scalar));
    for (Index i = first; i < last; ++i) {
      const char* row = reinterpret_cast<const char*>(m.data() + i * Index(m.outerStride()));
      for (Index b = 0; b < bytes; b += kLine) {
        __builtin_prefetch(row + b, 0, 2);
        keep_prefetch_loop();
      }
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

/// Asks for the line holding *p (one token's scalar input of a strided [T, H] buffer, the next
/// block's) to be brought towards the core, as prefetch_rows does for rows.
template <class Scalar>
void prefetch_value(const Scalar* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);
#else
  static_cast<void>(p);
#endif
}

/// Rows to prefetch a few cache lines at a time while other work runs: the next chunk's input
/// rows, spread over this chunk's register tiles (small_gemm advances it after each tile).
/// Issued all at once (prefetch_rows), a chunk's rows (3 C d floats: 1536 lines at C = 64,
/// d = 128) overflow the core's queue of outstanding misses, and the core stalls on the
/// prefetch instructions until most lines have arrived: the fetch then overlaps no compute.
/// A few lines per tile keep the queue short and the fetch runs behind the products. Measured
/// on a Zen 5 VM (one core, the chunked prefill of 8 heads x 32768 tokens at d = 128, or 65536
/// at d = 64, each head its own contiguous inputs from memory; the variants interleaved in one
/// process): d = 128 0.187 s without prefetches, 0.168 s with the burst, 0.147 s spread, and
/// 0.136 s with the inputs in cache; d = 64 0.143, 0.111, 0.095 and 0.090 s. Spread, the
/// prefetches cost nothing measurable when the rows are already in cache. Hints only: no result
/// changes.
class SpreadPrefetch {
 public:
  /// Lines a register tile advances the plan by. A chunk's products run about 30 to 100 tiles
  /// (C = 16 to 64, d = 64 or 128), each hundreds of cycles or more; 16 lines a tile cover the
  /// next chunk's 3 C d floats in all these cases but C = 64 at d = 64 (704 of 768 lines;
  /// finish() issues the rest).
  static constexpr Index kLinesPerTile = 16;

  /// Queues rows [first, first + n) of a row-major matrix or view (clipped to its rows); other
  /// storage orders are skipped. Past kMaxRanges ranges, the rows are prefetched at once.
  template <class M>
  void add(const M& m, Index first, Index n) noexcept {
    if constexpr (has_addressable_rows<M>) {
      const Index last = std::min(first + n, Index(m.rows()));
      if (last <= first) return;
      if (empty()) count_ = current_ = 0;  // every earlier range visited: reuse the slots
      if (count_ == kMaxRanges) {
        prefetch_rows(m, first, n);
        return;
      }
      constexpr Index size = Index(sizeof(typename M::Scalar));
      const Index stride = Index(m.outerStride());
      ranges_[std::size_t(count_++)] = {reinterpret_cast<const char*>(m.data() + first * stride),
                                        last - first, Index(m.cols()) * size, stride * size};
    } else {
      static_cast<void>(m);
      static_cast<void>(first);
      static_cast<void>(n);
    }
  }

  /// Prefetches the next `lines` queued lines.
  void advance(Index lines) noexcept {
    visit(lines, [](const char* line) noexcept {
#if defined(__GNUC__) || defined(__clang__)
      __builtin_prefetch(line, 0, 2);
#else
      static_cast<void>(line);
#endif
    });
  }

  /// Calls touch(address) for the next `lines` queued lines (at most), in queue order: the
  /// walk advance() prefetches along (tests check it with a recording touch).
  template <class Touch>
  void visit(Index lines, Touch&& touch) noexcept {
    while (lines > 0 && current_ < count_) {
      const Rows& rows = ranges_[std::size_t(current_)];
      const char* row = rows.first + row_ * rows.stride;
      const Index end = std::min(rows.row_bytes, byte_ + lines * kLine);
      for (Index b = byte_; b < end; b += kLine) touch(row + b);
      lines -= (end - byte_ + kLine - 1) / kLine;
      byte_ = end;
      if (byte_ < rows.row_bytes) continue;
      byte_ = 0;
      if (++row_ < rows.rows) continue;
      row_ = 0;
      ++current_;
    }
  }

  /// Whether every queued line has been visited.
  [[nodiscard]] bool empty() const noexcept { return current_ == count_; }

  /// Prefetches what is still queued (the next add() then starts an empty queue).
  void finish() noexcept {
    while (!empty()) advance(kLinesPerTile);
  }

 private:
  static constexpr Index kLine = 64;
  static constexpr int kMaxRanges = 16;
  struct Rows {
    const char* first;
    Index rows, row_bytes, stride;
  };
  std::array<Rows, kMaxRanges> ranges_{};
  int count_ = 0, current_ = 0;
  Index row_ = 0, byte_ = 0;
};

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
  for (Index b = 0; b < size; b += kLine) {
    __builtin_prefetch(bytes + b, 1, 3);
    keep_prefetch_loop();
  }
#else
  static_cast<void>(p);
  static_cast<void>(n);
#endif
}

/// Requests, for writing, the output rows of the write rules' recurrent sweeps two and three
/// pairs after the pair at row t (rows t + 4 to t + 7 of `out`, clipped to its rows; dv values
/// each). Called once per pair, so each row is requested twice, a pair apart. A sweep stores
/// its two output rows at its end, and a store whose line has not arrived holds up the stores
/// behind it. The additive recurrent pass requests the next pair's rows only (t + 2, t + 3).
/// With the prefetch loops kept (keep_prefetch_loop), the two leads measure the same within the
/// noise for both passes (Zen 5 VM, H = 8, d = 64, 2026-12-04); the figures once given here for
/// the longer lead came from g++ 12 builds that had dropped these loops.
template <class Out>
void prefetch_rule_output_rows(Out& out, Index t, Index dv) noexcept {
  const Index end = std::min<Index>(t + 8, Index(out.rows()));
  for (Index ahead = t + 4; ahead < end; ++ahead) prefetch_for_write(out.row(ahead).data(), dv);
}

}  // namespace linattn::detail
