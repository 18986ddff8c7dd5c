#pragma once
// Non-temporal (streaming) copies for data written once and read much later: the saved
// forward's chunk states (saved_forward.hpp, delta_backward.hpp, rule_saved.hpp) and the
// sequence-parallel prefill's head-major copies (head_major_stage.hpp). A streaming store
// writes whole cache lines to memory without first reading them (no read for ownership) and
// without displacing what the cache holds.

#include <linattn/types.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace linattn::detail {

/// The alignment, in bytes, that stream_copy's streaming stores need (1: the build has none).
#if defined(__AVX__)
inline constexpr std::size_t kStreamAlign = 32;
#elif defined(__SSE2__)
inline constexpr std::size_t kStreamAlign = 16;
#else
inline constexpr std::size_t kStreamAlign = 1;
#endif

/// dst[0, n) = src[0, n), with streaming stores where the build has them (AVX or SSE2, float
/// and double) from the first packet-aligned element of dst on (the elements before it and the
/// tail after the last whole packet are copied plainly), a plain copy otherwise. Call
/// stream_fence() before another thread reads dst. O(n).
template <class Scalar>
void stream_copy(const Scalar* src, Index n, Scalar* dst) noexcept {
  Index i = 0;
#if defined(__SSE2__)
  if constexpr (std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>) {
    // Plain copies up to the first aligned element (none when dst is not even aligned to the
    // scalar, which the streaming loop then never reaches).
    const auto misalignment = reinterpret_cast<std::uintptr_t>(dst) % kStreamAlign;
    if (misalignment % sizeof(Scalar) == 0 && misalignment != 0) {
      const auto lead = static_cast<Index>((kStreamAlign - misalignment) / sizeof(Scalar));
      for (; i < lead && i < n; ++i) dst[i] = src[i];
    }
    if (reinterpret_cast<std::uintptr_t>(dst + i) % kStreamAlign == 0) {
      if constexpr (std::is_same_v<Scalar, float>) {
#if defined(__AVX__)
        for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#else
        for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
#endif
      } else {
#if defined(__AVX__)
        for (; i + 4 <= n; i += 4) _mm256_stream_pd(dst + i, _mm256_loadu_pd(src + i));
#else
        for (; i + 2 <= n; i += 2) _mm_stream_pd(dst + i, _mm_loadu_pd(src + i));
#endif
      }
    }
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

/// Orders the streaming stores of stream_copy before later stores (a no-op without SSE2).
inline void stream_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace linattn::detail
