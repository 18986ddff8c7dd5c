#pragma once
// ELU(x) + 1 over a contiguous float row with AVX-512: exp by range reduction, a polynomial and
// VSCALEFPS, which scales by 2^n with one rounding, subnormal results included. About half the
// instructions of the portable form (Eigen's exp, whose input is clamped above the subnormal
// range, taken at x / 2 and squared): the feature map is a fifth of a decode token at d = 64.
//
// exp(m) for m <= 0: n = round(m log2(e)), r = m - n ln2 in two steps (Cody and Waite: ln2 =
// 355/512 + ln2_lo, and n * 355/512 is exact for |n| < 2^15), |r| <= ln2 / 2; exp(r) by its
// Taylor polynomial of degree 7 (the first omitted term, r^8 / 8!, is below 6e-9 relative, a
// tenth of a float ulp); result = exp(r) * 2^n. Inputs below -104 are clamped there: exp(-104)
// is below half the smallest subnormal, so the result is 0 either way. Every element, the tail
// included, goes through the same instructions (masked loads and stores), so an element's
// result does not depend on its column or on the row's alignment.

#include <linattn/types.hpp>

#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace linattn::detail {

#if defined(__AVX512F__)
inline constexpr bool has_elu_kernel = true;

/// y[j] = x[j] + 1 for x[j] > 0, exp(x[j]) otherwise, j < n; NaN stays NaN. y may equal x.
inline void elu_plus_one_row(const float* x, float* y, Index n) noexcept {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 lowest = _mm512_set1_ps(-104.0f);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896340736f);
  const __m512 ln2_hi = _mm512_set1_ps(355.0f / 512.0f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440054690583e-4f);  // ln 2 - 355/512
  // 1/k! for k = 7 down to 2.
  const __m512 c7 = _mm512_set1_ps(1.0f / 5040.0f), c6 = _mm512_set1_ps(1.0f / 720.0f);
  const __m512 c5 = _mm512_set1_ps(1.0f / 120.0f), c4 = _mm512_set1_ps(1.0f / 24.0f);
  const __m512 c3 = _mm512_set1_ps(1.0f / 6.0f), c2 = _mm512_set1_ps(0.5f);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (Index j = 0; j < n; j += 16) {
    const Index left = n - j;
    const __mmask16 lanes =
        left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(lanes, x + j);
    // MINPS/MAXPS return their second operand when either is NaN: v goes second, so NaN
    // propagates through every step.
    const __m512 m = _mm512_max_ps(lowest, _mm512_min_ps(zero, v));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(m, log2e),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, ln2_hi, m);
    r = _mm512_fnmadd_ps(k, ln2_lo, r);
    __m512 p = _mm512_fmadd_ps(c7, r, c6);
    p = _mm512_fmadd_ps(p, r, c5);
    p = _mm512_fmadd_ps(p, r, c4);
    p = _mm512_fmadd_ps(p, r, c3);
    p = _mm512_fmadd_ps(p, r, c2);
    p = _mm512_fmadd_ps(p, r, one);
    p = _mm512_fmadd_ps(p, r, one);
    const __m512 e = _mm512_scalef_ps(p, k);
    _mm512_mask_storeu_ps(y + j, lanes, _mm512_add_ps(_mm512_max_ps(zero, v), e));
  }
}
#else
inline constexpr bool has_elu_kernel = false;
// Callers name it only in a discarded `if constexpr (has_elu_kernel)` branch, but a compiler
// may still resolve the call there (clang does), so it exists: a plain loop, never used.
inline void elu_plus_one_row(const float* x, float* y, Index n) noexcept {
  for (Index j = 0; j < n; ++j) y[j] = x[j] > 0.0f ? x[j] + 1.0f : std::exp(x[j]);
}
#endif

}  // namespace linattn::detail
