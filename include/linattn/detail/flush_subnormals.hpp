#pragma once
// A scope in which the calling thread's floating-point unit flushes subnormal results to zero
// and reads subnormal inputs as zero (x86's MXCSR FTZ and DAZ bits), restoring the caller's
// mode when the scope ends, also by an exception.
//
// Why: the maps of the delta rules' slice summaries, A_p = prod_t alpha_t (I - beta_t kf_t kf_t^T),
// are products of thousands of contractions, so their entries fall steadily through the
// subnormal range (below 2^-126 in float) on their way to zero, and so do the decayed reads of
// the carried state. Intel cores take a microcode assist on every vector instruction that
// meets a subnormal: on a Xeon (Emerald Rapids) a 2-rank GatedDelta prefill whose ranks
// computed their summaries took 26.6 s with subnormals against 1.10 s without (Delta 4.08 s
// against 0.89 s); AMD Zen cores pay much less. What a flushed value contributes is below
// 2^-126 times the state it multiplies, under the rounding of any normal result it is added
// to, so the results agree to rounding with the unflushed computation (and, being
// deterministic, give the same bits on every run).
//
// Elsewhere than x86 the scope does nothing (kFlushesSubnormals is false there).

#if defined(__SSE2__) || defined(_M_X64)
#include <xmmintrin.h>
#define LINATTN_HAS_MXCSR 1
#else
#define LINATTN_HAS_MXCSR 0
#endif

namespace linattn::detail {

/// True where FlushSubnormalsScope changes the floating-point mode (x86 with SSE2).
inline constexpr bool kFlushesSubnormals = LINATTN_HAS_MXCSR != 0;

/// Subnormals flushed to zero (results) and read as zero (inputs) on this thread while the
/// object lives; the previous mode comes back with its destructor. Two register accesses.
class FlushSubnormalsScope {
 public:
  FlushSubnormalsScope() noexcept {
#if LINATTN_HAS_MXCSR
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero);
#endif
  }
  ~FlushSubnormalsScope() {
#if LINATTN_HAS_MXCSR
    _mm_setcsr(saved_);
#endif
  }
  FlushSubnormalsScope(const FlushSubnormalsScope&) = delete;
  FlushSubnormalsScope& operator=(const FlushSubnormalsScope&) = delete;

 private:
#if LINATTN_HAS_MXCSR
  static constexpr unsigned kFlushToZero = 0x8000u;      // MXCSR bit 15
  static constexpr unsigned kDenormalsAreZero = 0x0040u;  // MXCSR bit 6
  unsigned saved_ = 0;
#endif
};

}  // namespace linattn::detail

#undef LINATTN_HAS_MXCSR
