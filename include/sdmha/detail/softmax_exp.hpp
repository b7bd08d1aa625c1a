// sdmha/detail/softmax_exp.hpp — the softmax's exponentials of one row, in place, and their sum;
// and the row's maximum they are shifted by.
//
//   math:  x[s] ← exp(x[s] − shift), then 0 wherever that is below the smallest normal number;
//          returns Σ_s x[s] (NaN if any x[s] − shift is NaN: a NaN entry, or shift +∞ or NaN).
//          row_maximum: max_s x[s] over the entries that are not NaN, −∞ if there is none
//   pre:   x holds n scalars; shift ≥ every x[s] that is not NaN (the row's maximum)
//   cost:  one pass over x: per 16 floats a range reduction, a degree-6 polynomial and a scale;
//          row_maximum one more pass, one max per 16 floats
//
// The masked softmax and the online softmax of the fused attention both run their rows through
// this, so both give the same probabilities. Flushing below the smallest normal is what makes a
// blocked key (−∞) contribute exactly 0 (Eigen's exp clamps its argument: its exp(−∞) is a
// denormal), so that a zero probability never meets a NaN in a blocked value row; the only genuine
// probabilities it zeroes are below e⁻⁸⁷ (float) or e⁻⁷⁰⁸ (double) of the row's largest, far below
// the sum's precision.
//
// float with AVX-512F: one pass, exp(y) = 2ⁿ·e^f with n = round(y·log₂e) and f = y − n·ln 2 in
// two parts (Cody–Waite: n·ln2_hi is exact for |n| < 2¹⁵), so |f| ≤ ln 2 / 2 and e^f by a
// polynomial of degree 6, 1 + (f + f²·q(f)) so that the last rounding is that of adding 1, with
// q the weighted-minimax fit of (e^f − 1 − f)/f² (relative error of e^f below 4·10⁻⁹ with the
// coefficients rounded to float, against 5.2·10⁻⁹ for the Taylor polynomial of degree 7, one
// multiply-add more); 2ⁿ is applied by vscalefps, zeroing the lanes whose argument is below
// −87.3365402 (the float just above ln FLT_MIN, so exactly those whose exp is below FLT_MIN) in
// the same instruction. Arguments below −104 are clamped to −104 first, keeping NaN, so that −∞
// reduces without an invalid operation (∞ − ∞). Everywhere else (double, no AVX-512): Eigen's
// vectorised exp, a loop the compiler vectorises for the flush, and Eigen's sum. Relative to
// exp, the AVX-512 exp errs by less than 1·ε (0.72 ε at most over every float argument, +0.003 ε
// on average), Eigen 3.4's float exp by up to 3ε and upwards on average, so the AVX-512 path is
// the more accurate too (the bounds tests/stages/test_masked_softmax.cpp holds them to).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "sdmha/config.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sdmha::detail {

template <typename Scalar>
Scalar exponentiate_shifted_portable(Scalar* x, Index n, Scalar shift) {
  constexpr Scalar smallest_normal = std::numeric_limits<Scalar>::min();
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> row(x, n);
  row = (row - shift).exp();
  for (Index s = 0; s < n; ++s) x[s] = x[s] < smallest_normal ? Scalar(0) : x[s];
  return row.sum();
}

#if defined(__AVX512F__)
// exp(y) for 16 lanes as described above, flushed below the smallest normal to 0.
inline __m512 exp_flushed_avx512(__m512 y) {
  // Kept: arguments whose exp is a normal number (from the float just above ln FLT_MIN: the one
  // below it has exp < FLT_MIN), and NaN (unordered compares true).
  const __mmask16 keep = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-87.3365402f), _CMP_NLT_UQ);
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-104.0f), y);  // 2nd operand: NaN kept
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  // e^f = 1 + (f + f²·q(f)), q(f) of degree 4 by Horner: the bracket is small (|·| < 0.42), so
  // its rounding errors are small against the result's ulp, and adding the 1 last rounds once.
  __m512 q = _mm512_set1_ps(1.381461276e-3f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(8.368710056e-3f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(4.166838899e-2f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.666652113e-1f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(4.999999404e-1f));
  const __m512 p = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(f, f), f), _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// max(a, b) lane by lane (b where either is NaN), under a full mask: GCC 12 warns about the
// plain form's undefined source once inlined, as for the shuffles below.
inline __m512 maximum16(__m512 a, __m512 b) { return _mm512_maskz_max_ps(0xFFFF, a, b); }

// The lanes' combinations horizontal_reduce takes: sums, and maxima.
struct AddLanes {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_add_ps(a, b); }
  float operator()(float a, float b) const { return a + b; }
};
struct MaxLanes {
  __m512 operator()(__m512 a, __m512 b) const { return maximum16(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_max_ps(a, b); }
  float operator()(float a, float b) const { return std::max(a, b); }
};

// The 16 lanes combined in the order of _mm512_reduce_add_ps (halves, quarters, then pairs),
// with shuffles and an extract under full masks: GCC 12 warns about the plain forms' undefined
// sources once inlined.
template <typename Combine>
inline float horizontal_reduce(__m512 x, Combine combine) {
  const __m512 halves = combine(x, _mm512_maskz_shuffle_f32x4(0xFFFF, x, x, 0x4E));
  const __m512 quarters = combine(halves, _mm512_maskz_shuffle_f32x4(0xFFFF, halves, halves, 0xB1));
  const __m128 quarter = _mm512_maskz_extractf32x4_ps(0xF, quarters, 0);
  const __m128 pairs = combine(quarter, _mm_movehl_ps(quarter, quarter));
  return combine(_mm_cvtss_f32(pairs), _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, 1)));
}

inline float exponentiate_shifted_avx512(float* x, Index n, float shift) {
  const __m512 shift_vector = _mm512_set1_ps(shift);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  Index s = 0;
  for (; s + 32 <= n; s += 32) {  // two independent chains hide the polynomial's latency
    const __m512 e0 = exp_flushed_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + s), shift_vector));
    const __m512 e1 = exp_flushed_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + s + 16), shift_vector));
    _mm512_storeu_ps(x + s, e0);
    _mm512_storeu_ps(x + s + 16, e1);
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
  }
  for (; s < n; s += 16) {
    const __mmask16 lanes = n - s >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - s)) - 1u);
    const __m512 e =
        exp_flushed_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + s), shift_vector));
    _mm512_mask_storeu_ps(x + s, lanes, e);
    sum0 = _mm512_add_ps(sum0, _mm512_maskz_mov_ps(lanes, e));
  }
  return horizontal_reduce(_mm512_add_ps(sum0, sum1), AddLanes{});
}
#endif

// The largest of x[0, n) that is not NaN, −∞ if there is none (n = 0, or every entry −∞ or
// NaN): what a row is shifted by. A NaN entry is skipped here and reaches the exponentials and
// their sum, which it makes NaN; a caller whose row maximum is −∞ checks the row for NaN itself.
// With AVX-512 (float) four independent max chains, so that the pass runs at the loads' rate
// rather than at one max per latency of a chain; vmaxps returns its second operand when either
// is NaN, so with the chain second a NaN entry never enters it.
template <typename Scalar>
Scalar row_maximum(const Scalar* x, Index n) {
  constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
#if defined(__AVX512F__)
  if constexpr (std::is_same<Scalar, float>::value) {
    const __m512 lowest = _mm512_set1_ps(minus_infinity);
    __m512 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
    Index s = 0;
    for (; s + 64 <= n; s += 64) {
      m0 = maximum16(_mm512_loadu_ps(x + s), m0);
      m1 = maximum16(_mm512_loadu_ps(x + s + 16), m1);
      m2 = maximum16(_mm512_loadu_ps(x + s + 32), m2);
      m3 = maximum16(_mm512_loadu_ps(x + s + 48), m3);
    }
    for (; s < n; s += 16) {
      const __mmask16 lanes = n - s >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - s)) - 1u);
      m0 = maximum16(_mm512_mask_loadu_ps(lowest, lanes, x + s), m0);
    }
    return horizontal_reduce(maximum16(maximum16(m0, m1), maximum16(m2, m3)), MaxLanes{});
  }
#endif
  if (n == 0) return minus_infinity;
  const Scalar maximum = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(x, n)
                             .template maxCoeff<Eigen::PropagateNumbers>();
  return std::isnan(maximum) ? minus_infinity : maximum;  // every entry NaN
}

// The contract at the top: the AVX-512 pass for float where compiled, else the portable one.
template <typename Scalar>
Scalar exponentiate_shifted(Scalar* x, Index n, Scalar shift) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<Scalar, float>::value) return exponentiate_shifted_avx512(x, n, shift);
#endif
  return exponentiate_shifted_portable(x, n, shift);
}

}  // namespace sdmha::detail
